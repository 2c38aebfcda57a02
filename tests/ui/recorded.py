"""Recorded tiny campaigns logged into MLflow as the runs of an ablation, for the UI tests to look at curves that move
(a test-sized campaign learns nothing: its curves are flat at reward 0). The figures are the ones the campaigns
printed, kept in tests/data/health/ (per step: the health line; held-out pass@1 before and after RL: each file's
header); they are written through rstar2.core.tracking as the flows write theirs (campaign run -> one run per RL seed
-> its stage run with the per-step metrics; eval_pass1 at step 0 for the SFT model and at the last step after RL),
and the report run gets the ablation's plots from rstar2.evaluation.report, drawn from those runs' histories.

The two variants are two recorded configurations of the tiny preset: its own SFT ("full-sft", 3 RL seeds) and a
shorter one ("weak-sft", `--set sft.epochs=1.5`, 2 RL seeds)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from rstar2.core import tracking
from rstar2.evaluation import health, report

RECORDED = Path(__file__).parents[1] / "data" / "health"
# variant: (recorded file, the override that made it, SFT pass@1, each RL seed's pass@1), from the file's header
VARIANTS = {"full-sft": ("healthy-avx2-world0-seeds0-2.txt", "", 0.480, (0.775, 0.765, 0.751)),
            "weak-sft": ("collapse-avx2-weak-start-seeds0-1.txt", "sft.epochs=1.5", 0.242, (0.355, 0.266))}
KEYS = {label: key for label, key, _ in health._FIELDS}  # the health line's labels -> metric keys
FIELD = re.compile(r"([a-z-]+) ([\d.]+)")


def runs(path: Path) -> list[list[dict]]:
    """Each run's per-step metrics in a recorded file (a step 1 opens a run; "-" fields are left out)."""
    out: list[list[dict]] = []
    for line in path.read_text().splitlines():
        if line.startswith("#") or " | " not in line:
            continue
        head, *fields = line.split("] ", 1)[1].split(" | ")
        row = {"step": int(head.removeprefix("step "))}
        row.update({KEYS[m[1]]: float(m[2]) for f in fields if (m := FIELD.fullmatch(f))})
        if row["step"] == 1:
            out.append([])
        out[-1].append(row)
    return out


def log_ablation(out_dir: Path, experiment: str, name: str) -> dict:
    """The recorded variants as campaign runs `<name>-<variant>` and the report run `name` with its plots, in the
    SQLite store under `out_dir`. Returns {"experiment_id", "report", "campaigns": {variant: run id}, "figures":
    {variant: {"reward_mean": [(step, mean over seeds)], "eval_pass1": [(0, SFT), (last step, mean after RL)]}}}."""
    exp = tracking.setup(experiment, str(out_dir))
    campaigns, figures, curves = {}, {}, {}
    for variant, (file, override, sft, after) in VARIANTS.items():
        recorded = runs(RECORDED / file)
        assert len(recorded) == len(after), (file, len(recorded))
        camp = tracking.create_run(exp, f"{name}-{variant}", tags={"kind": "campaign", "ablation": variant})
        tracking.log_params(camp, {"preset": "tiny", "overrides": override or "none", "seeds": len(recorded)})
        curves[variant] = [_log_seed(exp, camp, f"{name}-{variant}", i, rows, sft, rl)
                           for i, (rows, rl) in enumerate(zip(recorded, after))]
        last = max(r["step"] for rows in recorded for r in rows)
        reward = [(s, statistics.fmean(r["reward_mean"] for rows in recorded for r in rows if r["step"] == s))
                  for s in range(1, last + 1)]
        for step, value in reward:
            tracking.log_metrics(camp, {"reward_mean": value}, step)
        pass1 = [(0, sft), (last, statistics.fmean(after))]
        for step, value in pass1:
            tracking.log_metrics(camp, {"eval_pass1": value}, step)
        tracking.end(camp)
        campaigns[variant], figures[variant] = camp, {"reward_mean": reward, "eval_pass1": pass1}
    report_run = tracking.create_run(exp, name, tags={"kind": "ablation-report"})
    tracking.log_params(report_run, {"variants": ",".join(VARIANTS), "preset": "tiny"})
    for png in report.comparison_plots(curves, str(out_dir / name / "plots"), f"tiny: {', '.join(VARIANTS)}"):
        tracking.client().log_artifact(report_run, png, "plots")
    tracking.end(report_run)
    return {"experiment_id": exp, "report": report_run, "campaigns": campaigns, "figures": figures}


def _log_seed(exp: str, camp: str, name: str, seed: int, rows: list[dict], sft: float, rl: float) -> dict:
    """One RL seed's run and its stage run with the recorded steps; returns its curves as the report reads them."""
    seed_run = tracking.create_run(exp, f"{name}-seed-{seed}", camp, {"kind": "seed", "rl_seed": seed})
    stage = tracking.create_run(exp, "stage1", seed_run, {"kind": "stage", "stage": "stage1"})
    for row in rows:
        tracking.log_metrics(stage, {k: v for k, v in row.items() if k != "step"}, row["step"])
        tracking.log_metrics(seed_run, {"reward_mean": row["reward_mean"]}, row["step"])
    tracking.log_metrics(seed_run, {"eval_pass1": sft}, 0)
    tracking.log_metrics(seed_run, {"eval_pass1": rl}, rows[-1]["step"])
    for run in (stage, seed_run):
        tracking.end(run)
    return tracking.stage_histories(exp, seed_run, list(report.CURVES))
