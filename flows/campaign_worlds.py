"""Campaigns over world seeds: the campaign (flows/campaign.py) once per world seed (cfg.seed, cfg.seed+1, ...), each
world with its own problems, SFT data, initial model and so its own SFT model, each with the same N RL seeds; the
gains of all K x N runs with their min, mean and intervals (rstar2.evaluation.report.world_aggregate).

Why: the SFT model is a draw. Floats differ with the CPU's instruction set, so on another host the same command makes
another SFT model and another RL run; one world's figures are one draw of what users see, K worlds show the spread.

Each world is an ordinary campaign in `<run>-world-<seed>/` (resumed as one when the command runs again); MLflow: a
`<run>-worlds` run holding the aggregate, whose children are the worlds' campaign runs.
"""

from __future__ import annotations

import json
import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from rstar2.core import config
from rstar2.evaluation import report
from rstar2.flows.campaign import CampaignParams, campaign
from rstar2.run import runstate
from rstar2.tasks import track


@flow(name="campaign-worlds", flow_run_name="{params.preset}-{world_seeds}-worlds")
def campaign_worlds(params: CampaignParams, world_seeds: int) -> dict:
    if world_seeds < 1:
        raise ValueError(f"world_seeds must be at least 1, got {world_seeds}")
    if params.sft_checkpoint:
        raise ValueError("world seeds each train their own SFT model: sft_checkpoint cannot be given with them")
    t0 = time.perf_counter()
    cfg = config.load(params.preset, params.overrides)
    name = f"{params.run_name or cfg.name}-worlds"
    run = runstate.layout(cfg, name)
    run.top.mkdir(parents=True, exist_ok=True)
    exp_id, run_id = track.open_run(track.RunSpec(experiment=cfg.experiment, out_dir=cfg.out_dir, name=name,
                                                  key=str(run.top), tags={"preset": params.preset, "kind": "worlds"},
                                                  set_tags={"world_seeds": world_seeds, "seeds": params.seeds}))
    with track.ending(run_id):
        worlds = {w: campaign(params.model_copy(update={
            "overrides": [*params.overrides, f"seed={w}"], "run_name": f"{params.run_name or cfg.name}-world-{w}",
            "parent_mlflow_run_id": run_id})) for w in range(cfg.seed, cfg.seed + world_seeds)}
        summary = {**report.world_aggregate(worlds), "seeds": params.seeds, "run_dir": str(run.top),
                   "mlflow_run_id": run_id, "eval_split": worlds[cfg.seed]["eval_split"],
                   "eval_samples": worlds[cfg.seed]["eval_samples"], "eval_problems": worlds[cfg.seed]["eval_problems"],
                   "world_run_dirs": {str(w): s["run_dir"] for w, s in worlds.items()},
                   "wall_s": time.perf_counter() - t0}
        track.log_metrics(run_id, {k: summary[k] for k in ("pass1_gain_mean", "pass1_gain_min", "pass1_gain_max")},
                          0)
    run.summary.write_text(json.dumps(summary, indent=1))
    create_markdown_artifact(_markdown(summary), key="campaign-worlds-summary")
    return summary


def _markdown(summary: dict) -> str:
    """One row per run (world seed, RL seed), then the gains' mean with min, max and both intervals."""
    lines = [f"| world seed | rl seed | SFT pass@1 ({summary['eval_split']}) | after RL | gain |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['world_seed']} | {r['rl_seed']} | {r['pass1_sft']:.3f} | {r['pass1']:.3f} "
              f"| {r['pass1_gain']:+.3f} |"
              for r in summary["runs"]]
    (lo, hi), (wlo, whi) = summary["pass1_gain_ci95"], summary["pass1_gain_worlds_ci95"]
    lines.append(f"| all {len(summary['runs'])} runs | | | | {summary['pass1_gain_mean']:+.3f} (min "
                 f"{summary['pass1_gain_min']:+.3f}, max {summary['pass1_gain_max']:+.3f}; 95 % interval over runs "
                 f"[{lo:+.3f}, {hi:+.3f}], over world means [{wlo:+.3f}, {whi:+.3f}]) |")
    return "\n".join(lines) + "\n"
