"""The checks of `rstar2 chaos` (rstar2.cli.chaos): a run's figures as the table compares them (`results`), what
differs from the reference (`differences`), and a row's verdict: the command's exit code rests on them."""

from __future__ import annotations

import hashlib
import json

import mlflow
import polars as pl

from rstar2.core import checkpoint
from rstar2.core.layout import KEPT, ROLLOUTS, RunLayout

# what a run must repeat to the digit. Not logprob_gap: the engine's log-probs of the same tokens move at the 1e-8
# level with how turns are batched together (one engine instead of two), so it is compared to the reference's within
# noise (GAP_NOISE)
FIGURES = ["reward_mean", "tool_error_rate", "format_violation_rate", "response_len_mean", "grad_norm", "loss",
           "entropy", "roc_kept"]
GAP_NOISE = 1e-5


def _digest(frame) -> str:
    """A table's rows, sorted by (problem, sample), as one hash."""
    return hashlib.sha256(frame.sort("problem_id", "sample_idx").write_json().encode()).hexdigest()


def results(layout: RunLayout, stage: str, tracking_uri: str) -> dict:
    """The figures and records a run left, as the checks compare them."""
    summary = json.loads(layout.summary.read_text()) if layout.summary.exists() else {}
    out: dict = {"pass1": summary.get("pass1_rl"), "steps": summary.get("steps"), "figures": {}, "mlflow_steps": {}}
    if summary.get("mlflow_run_id"):
        client = mlflow.MlflowClient(tracking_uri)
        exp = client.get_run(summary["mlflow_run_id"]).info.experiment_id
        stages = client.search_runs([exp], f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
        for r in stages:
            for m in FIGURES + ["logprob_gap"]:
                hist = sorted(client.get_metric_history(r.info.run_id, m), key=lambda h: h.step)
                out["figures"].setdefault(m, []).extend(h.value for h in hist)
                out["mlflow_steps"].setdefault(m, []).extend(h.step for h in hist)
    out["kept"], out["rollouts"] = [], []
    for kept in layout.step_tables(stage, KEPT):
        rows = pl.read_parquet(kept).select("problem_id", "sample_idx", "response_ids", "reward")
        out["kept"].append(_digest(rows))
    for rolled in layout.step_tables(stage, ROLLOUTS):
        keys = pl.read_parquet(rolled).select("problem_id", "sample_idx")
        out["rollouts"].append({"rows": keys.height, "unique": keys.unique().height, "keys": _digest(keys)})
    ckpts = layout.checkpoints(stage)
    out["checkpoints"] = [{"name": c.name, "committed": checkpoint.is_committed(c),
                           "optimizer_step": checkpoint.manifest(c).get("optimizer_step")
                           if checkpoint.is_committed(c) else None,
                           "committed_at": checkpoint.manifest(c).get("committed_at")
                           if checkpoint.is_committed(c) else None}
                          for c in sorted(ckpts.iterdir()) if c.is_dir()] if ckpts.is_dir() else []
    out["leftovers"] = sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".")) if ckpts.is_dir() else []
    return out


def differences(got: dict, ref: dict, committed_before: dict[str, str]) -> list[str]:
    """What differs from the reference run, or breaks a rule on its own, one line each (empty: nothing)."""
    diffs = []
    for m in FIGURES:
        if got["figures"].get(m) != ref["figures"].get(m):
            diffs.append(f"{m} per step {got['figures'].get(m)} != {ref['figures'].get(m)}")
    # against the reference's own gap, step by step: it is ~1e-7 with an fp32 trainer and ~1e-3 with a bf16 one, while
    # an engine one version behind moves it by ~1e-2
    gaps, ref_gaps = got["figures"].get("logprob_gap", []), ref["figures"].get("logprob_gap", [])
    if len(gaps) != len(ref_gaps) or any(abs(g - r) >= GAP_NOISE for g, r in zip(gaps, ref_gaps)):
        diffs.append(f"logprob_gap per step {gaps} against the reference's {ref_gaps}: {GAP_NOISE:g} or more apart "
                     "(the engines sampled from other weights)")
    if got["pass1"] != ref["pass1"]:
        diffs.append(f"held-out pass@1 {got['pass1']} != {ref['pass1']}")
    for m, steps in got["mlflow_steps"].items():
        if sorted(steps) != sorted(set(steps)) or len(steps) != len(ref["mlflow_steps"].get(m, [])):
            diffs.append(f"MLflow {m} steps {steps} (reference {ref['mlflow_steps'].get(m)})")
            break
    if got["kept"] != ref["kept"]:
        diffs.append(f"kept rollouts differ at steps "
                     f"{[i + 1 for i, (a, b) in enumerate(zip(got['kept'], ref['kept'])) if a != b] or 'count'}")
    for i, (a, b) in enumerate(zip(got["rollouts"], ref["rollouts"])):
        if a["rows"] != a["unique"]:
            diffs.append(f"step {i + 1}: {a['rows'] - a['unique']} rollouts counted twice")
        if a["keys"] != b["keys"]:
            diffs.append(f"step {i + 1}: the rollout table holds other (problem, sample) pairs ({a['unique']} of "
                         f"{b['unique']})")
    if len(got["rollouts"]) != len(ref["rollouts"]):
        diffs.append(f"{len(got['rollouts'])} rollout tables, reference {len(ref['rollouts'])}")
    half = [c["name"] for c in got["checkpoints"] if not c["committed"]] + got["leftovers"]
    if half:
        diffs.append(f"half-written checkpoints or leftovers: {half}")
    steps = [c["optimizer_step"] for c in got["checkpoints"] if c["committed"]]
    if steps != [c["optimizer_step"] for c in ref["checkpoints"] if c["committed"]]:
        diffs.append(f"optimizer steps at the checkpoints {steps} (reference "
                     f"{[c['optimizer_step'] for c in ref['checkpoints']]})")
    again = [c["name"] for c in got["checkpoints"] if c["name"] in committed_before
             and c["committed_at"] != committed_before[c["name"]]]
    if again:
        diffs.append(f"checkpoints written again after the retry: {again}")
    return diffs


def verdict(row: dict) -> str:
    if row["not_injected"] or any(s.startswith("could not") for s in row["struck"].values()):
        return "failed"
    if row["returncode"] != 0:
        return "failed"
    if row["differences"]:
        return "lost"
    return "recovered" if row["attempts"] == 1 else "retried"
