"""The campaign: world -> SFT -> evaluate SFT -> for each RL stage: transition (mining, optimizer reset) -> stage ->
final evaluation; tracked in MLflow (campaign run -> stage child runs -> per-step metrics, a LoggedModel per checkpoint).

With `seeds` N > 1 the RL part runs N times from the one world, SFT model and SFT evaluation (the config's rl_seed,
rl_seed+1, ...: rollout sampling, data order, RoC draws, the trainer's seed), each with its own fresh trainer, stages
and final evaluation on the same split, in `seed-<rl_seed>/` of the run directory; MLflow: campaign run -> one seed
run per seed (tag rl_seed) -> its stage runs. The summary gives the mean over seeds, each seed's figures, and the
gain's min, max and 95 % interval over seeds (rstar2.report.seed_aggregate).

Retrying a failed or killed campaign run (Prefect UI: Retry, or the same command again) resumes from what was
committed: the world, the SFT model, finished evaluations, finished stages, and inside a stage its last checkpoint,
whose trainer state (optimizer, LR schedule, RNG, step) is restored; the data order is a function of rl_seed and the
step, so no step is lost or done twice; with several seeds, a finished seed is not redone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from pydantic import BaseModel, Field

from rstar2 import checkpoint, config, report, runstate, tracking
from rstar2.config import RunCfg
from flows.evaluate import evaluate_checkpoint
from flows.stage_transition import stage_transition
from flows.train_stage import train_stage
from tasks import rl
from tasks.world import build_world, run_sft


class CampaignParams(BaseModel):
    """The run form in the Prefect UI: a preset name plus optional `section.key=value` overrides."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None  # the run directory under out_dir (default: the preset's name)
    sft_checkpoint: str | None = None  # start RL from this committed SFT model instead of training one (ablations)
    seeds: int = Field(1, ge=1)  # RL seeds from the one SFT model (1: today's single run and layout)


EVAL_KEYS = ("pass1", "pass1_se", "problems", "samples")  # with pass_at_{k}: what a seed reports of its evaluation


@flow(name="rl-seed", flow_run_name="seed-{cfg.rl_seed}")
def rl_seed(cfg: RunCfg, actors: dict, world: dict, run_dir: str, experiment_id: str, mlflow_run_id: str,
            sft_model: str) -> dict:
    """One RL seed: its stages from the SFT model (finished ones are kept), then its final evaluation."""
    run = Path(run_dir)
    global_step, model = 0, sft_model
    for stage in cfg.stages:
        end = runstate.finished(run, stage)
        if end is None:
            start = stage_transition(cfg, stage.name, actors, world, run_dir, experiment_id, mlflow_run_id, sft_model)
            end = train_stage(cfg, stage, actors, world, run_dir, experiment_id, mlflow_run_id, start["global_step0"],
                              start["problems_uri"])
        global_step, model = end["global_step"], end["final_checkpoint"] or model
    after = evaluate_checkpoint(cfg, actors, world, model, run_dir, experiment_id, mlflow_run_id,
                                f"final-{cfg.eval.split}", cfg.eval.split, global_step)
    return {"rl_seed": cfg.rl_seed, "run_dir": run_dir, "mlflow_run_id": mlflow_run_id, "steps": global_step,
            "final_checkpoint": model,
            "stages": {s.name: (runstate.finished(run, s) or {}).get("decision", {}).get("reason") for s in cfg.stages},
            **{k: v for k, v in after.items() if k in EVAL_KEYS or k.startswith("pass_at_")}}


@flow(name="campaign", flow_run_name="{params.preset}")
def campaign(params: CampaignParams = CampaignParams()) -> dict:
    t0 = time.perf_counter()
    cfg = config.load(params.preset, params.overrides)
    run = runstate.run_dir(cfg, params.run_name)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(cfg.model_dump_json(indent=1))
    exp_id = tracking.setup(cfg.experiment, cfg.out_dir)
    tags = {"preset": params.preset, "kind": "campaign", **({"ablation": cfg.ablation} if cfg.ablation else {})}
    run_id = tracking.find_or_create_run(exp_id, run.name, str(run), tags=tags)
    tracking.client().set_tag(run_id, "seeds", str(params.seeds))  # a tag, not a param: a re-run may add seeds
    tracking.log_params(run_id, cfg.model_dump())
    create_link_artifact(tracking.ui_url(exp_id, run_id), link_text="MLflow: campaign run", key="campaign-mlflow")
    seeds = [cfg.model_copy(update={"rl_seed": cfg.rl_seed + i}) for i in range(params.seeds)]
    actors: dict = {}
    try:
        world = build_world(cfg, str(run / "world"))
        if params.sft_checkpoint:
            if not checkpoint.is_committed(Path(params.sft_checkpoint)):
                raise ValueError(f"sft_checkpoint {params.sft_checkpoint} is not a committed checkpoint")
            sft_model = params.sft_checkpoint
        elif cfg.sft.enabled:
            sft_model = run_sft(cfg, world["init_model"], world["sft_data"], str(run / "sft"))
        else:
            sft_model = world["init_model"]
        by_seed = []
        for i, cfg_s in enumerate(seeds):
            d = runstate.seed_dir(run, cfg_s.rl_seed, params.seeds)
            resume, is_rl = runstate.resume_point(d, cfg_s, sft_model)
            if i == 0:  # the engines (kept for every seed) and the first seed's trainer, then the one SFT evaluation
                actors = rl.start_actors(run.name, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(actors, resume)
                before = evaluate_checkpoint(cfg, actors, world, sft_model, str(run), exp_id, run_id,
                                             f"sft-{cfg.eval.split}", cfg.eval.split, 0)
            elif any(runstate.finished(d, s) is None for s in cfg.stages):  # a finished seed needs no trainer
                rl.restart_trainer(run.name, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(actors, resume)
            rl.load_weights(actors, resume)
            seed_run_id = run_id if params.seeds == 1 else tracking.find_or_create_run(
                exp_id, f"seed-{cfg_s.rl_seed}", str(d), run_id, {**tags, "kind": "seed", "rl_seed": str(cfg_s.rl_seed)})
            by_seed.append(rl_seed(cfg_s, actors, world, str(d), exp_id, seed_run_id, sft_model))
            if seed_run_id != run_id:
                tracking.log_metrics(seed_run_id, {k: by_seed[-1][k] for k in ("pass1", "pass1_se")},
                                     by_seed[-1]["steps"])
                tracking.end(seed_run_id)
        first = by_seed[0]
        summary = {"run_dir": str(run), "mlflow_run_id": run_id, "steps": first["steps"],
                   "final_checkpoint": first["final_checkpoint"], "stages": first["stages"],
                   **report.seed_aggregate(before, by_seed), "eval_split": cfg.eval.split,
                   "eval_samples": cfg.eval.samples, "eval_problems": first["problems"],
                   "wall_s": time.perf_counter() - t0}
        tracking.log_metrics(run_id, {**{k: v for k, v in summary.items() if k.startswith(("pass1", "pass_at", "wall"))},
                                      "pass1_gain_ci95_lo": summary["pass1_gain_ci95"][0],
                                      "pass1_gain_ci95_hi": summary["pass1_gain_ci95"][1]},
                             max(s["steps"] for s in by_seed))
        tracking.client().log_dict(run_id, summary, "summary.json")
        if params.seeds == 1:  # one line per stage
            curves = tracking.histories_by_stage(exp_id, run_id, list(report.CURVES))
            title = f"{run.name}: stages"
        else:  # the seeds' mean with a min-max band
            curves = {run.name: [tracking.stage_histories(exp_id, s["mlflow_run_id"], list(report.CURVES))
                                 for s in by_seed]}
            title = f"{run.name}: {params.seeds} RL seeds"
        for png in report.comparison_plots(curves, str(run / "plots"), title):
            tracking.client().log_artifact(run_id, png, "plots")
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        create_markdown_artifact(_summary_markdown(summary, cfg.eval.split), key="campaign-summary")
        tracking.end(run_id)
        return summary
    except BaseException:
        tracking.end(run_id, "FAILED")
        raise
    finally:
        rl.stop_actors(actors)


def _summary_markdown(summary: dict, split: str) -> str:
    """SFT, each seed after RL, and (several seeds) the mean with its range and 95 % interval."""
    pm = lambda v, se: f"{v:.3f} ± {se:.3f}"  # noqa: E731
    lines = [f"| checkpoint | held-out pass@1 ± se ({split}) | gain |", "|---|---|---|",
             f"| SFT | {pm(summary['pass1_sft'], summary['pass1_sft_se'])} | |"]
    lines += [f"| after RL, rl_seed {s['rl_seed']} ({s['steps']} steps) | {pm(s['pass1'], s['pass1_se'])} | "
              f"{s['pass1_gain']:+.3f} |" for s in summary["by_seed"]]
    if summary["seeds"] > 1:
        lo, hi = summary["pass1_gain_ci95"]
        lines.append(f"| mean of {summary['seeds']} seeds | {summary['pass1_rl']:.3f} | {summary['pass1_gain']:+.3f} "
                     f"(min {summary['pass1_gain_min']:+.3f}, max {summary['pass1_gain_max']:+.3f}, 95 % interval "
                     f"[{lo:+.3f}, {hi:+.3f}]) |")
    return "\n".join(lines) + "\n"
