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
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from rstar2 import checkpoint, config, plan, report, runstate
from rstar2.config import RunCfg
from rstar2.controller import Controller
from flows.evaluate import evaluate_checkpoint
from flows.stage_transition import stage_transition
from flows.train_stage import train_stage
from tasks import rl, track
from tasks.preflight import preflight
from tasks.reports import campaign_report
from tasks.run import run_context
from tasks.world import run_sft


class CampaignParams(BaseModel):
    """The run form in the Prefect UI: a preset name plus optional `section.key=value` overrides."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None  # the run directory under out_dir (default: the preset's name)
    sft_checkpoint: str | None = None  # start RL from this committed SFT model instead of training one (ablations)
    seeds: int = Field(1, ge=1)  # RL seeds from the one SFT model (1: today's single run and layout)
    parent_mlflow_run_id: str | None = None  # nest this campaign's MLflow run (flows/campaign_worlds.py's worlds)


EVAL_KEYS = ("pass1", "pass1_se", "problems", "samples")  # with pass_at_{k}: what a seed reports of its evaluation


@flow(name="rl-seed", flow_run_name="seed-{cfg.rl_seed}")
def rl_seed(cfg: RunCfg, ctl: Controller, world: dict, run_dir: str, experiment_id: str, mlflow_run_id: str,
            sft_model: str) -> dict:
    """One RL seed: its stages from the SFT model (finished ones are kept), then its final evaluation."""
    run = Path(run_dir)
    global_step, model = 0, sft_model
    for stage in cfg.stages:
        end = runstate.finished(run, stage)
        if end is None:
            start = stage_transition(cfg, stage.name, ctl, world, run_dir, experiment_id, mlflow_run_id, sft_model)
            end = train_stage(cfg, stage, ctl, world, run_dir, experiment_id, mlflow_run_id, start["global_step0"],
                              start["problems_uri"])
        global_step, model = end["global_step"], end["final_checkpoint"] or model
    after = evaluate_checkpoint(cfg, ctl, world, model, run_dir, experiment_id, mlflow_run_id,
                                f"final-{cfg.eval.split}", cfg.eval.split, global_step)
    return {"rl_seed": cfg.rl_seed, "run_dir": run_dir, "mlflow_run_id": mlflow_run_id, "steps": global_step,
            "final_checkpoint": model,
            "stages": {s.name: (runstate.finished(run, s) or {}).get("decision", {}).get("reason") for s in cfg.stages},
            **{k: v for k, v in after.items() if k in EVAL_KEYS or k.startswith("pass_at_")}}


@flow(name="campaign", flow_run_name="{params.preset}")
def campaign(params: CampaignParams = CampaignParams()) -> dict:
    t0 = time.perf_counter()
    cfg = config.load(params.preset, params.overrides)
    plan.require_fit(cfg)  # a run that cannot fit its GPUs stops here, before Ray or any actor starts
    run = runstate.run_dir(cfg, params.run_name)
    run.mkdir(parents=True, exist_ok=True)
    preflight(cfg, str(run), sft=not params.sft_checkpoint)  # model, every prompt, sandbox: before anything starts
    (run / "config.json").write_text(cfg.model_dump_json(indent=1))
    tags = {"preset": params.preset, "kind": "campaign", **({"ablation": cfg.ablation} if cfg.ablation else {})}
    seeds = [cfg.model_copy(update={"rl_seed": cfg.rl_seed + i}) for i in range(params.seeds)]
    with run_context(cfg, run, run.name, tags, owns_run=True, link_key="campaign-mlflow", params=cfg.model_dump(),
                     set_tags={"seeds": params.seeds},  # a tag, not a param: a re-run may add seeds
                     parent_id=params.parent_mlflow_run_id) as ctx:
        ctl, world, exp_id, run_id = ctx.ctl, ctx.world, ctx.experiment_id, ctx.mlflow_run_id
        sft_model = _sft_model(cfg, params, world, run)
        by_seed = []
        for i, cfg_s in enumerate(seeds):
            d = runstate.seed_dir(run, cfg_s.rl_seed, params.seeds)
            resume, is_rl = runstate.resume_point(d, cfg_s, sft_model)
            if i == 0:  # the engines (kept for every seed) and the first seed's trainer, then the one SFT evaluation
                rl.start_actors(ctl, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(ctl, resume)
                before = evaluate_checkpoint(cfg, ctl, world, sft_model, str(run), exp_id, run_id,
                                             f"sft-{cfg.eval.split}", cfg.eval.split, 0)
            elif any(runstate.finished(d, s) is None for s in cfg.stages):  # a finished seed needs no trainer
                rl.restart_trainer(ctl, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(ctl, resume)
            rl.load_weights(ctl, resume)
            seed_run_id = run_id if params.seeds == 1 else track.open_run(
                cfg.experiment, cfg.out_dir, f"seed-{cfg_s.rl_seed}", str(d), run_id,
                {**tags, "kind": "seed", "rl_seed": str(cfg_s.rl_seed)})[1]
            by_seed.append(rl_seed(cfg_s, ctl, world, str(d), exp_id, seed_run_id, sft_model))
            if seed_run_id != run_id:
                track.log_metrics(seed_run_id, {k: by_seed[-1][k] for k in ("pass1", "pass1_se")}, by_seed[-1]["steps"])
                track.end_run(seed_run_id)
        first = by_seed[0]
        summary = {"run_dir": str(run), "mlflow_run_id": run_id, "steps": first["steps"],
                   "final_checkpoint": first["final_checkpoint"], "stages": first["stages"],
                   **report.seed_aggregate(before, by_seed), "eval_split": _headline(cfg),
                   "eval_samples": cfg.eval.samples, "eval_problems": first["problems"],
                   "wall_s": time.perf_counter() - t0}
        campaign_report(exp_id, run_id, str(run), summary)
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        create_markdown_artifact(_summary_markdown(summary, _headline(cfg)), key="campaign-summary")
        return summary


def _sft_model(cfg: RunCfg, params: CampaignParams, world: dict, run: Path) -> str:
    """The model RL starts from: the given committed SFT checkpoint, else this run's SFT (trained once), else the
    world's initial model when SFT is off."""
    if params.sft_checkpoint:
        if not checkpoint.is_committed(Path(params.sft_checkpoint)):
            raise ValueError(f"sft_checkpoint {params.sft_checkpoint} is not a committed checkpoint")
        return params.sft_checkpoint
    if cfg.sft.enabled:
        return run_sft(cfg, world["init_model"], world["sft_data"], str(run / "sft"))
    return world["init_model"]


def _headline(cfg: RunCfg) -> str:
    """What the campaign's pass@1 before and after RL is measured on: the first of eval.suites, else the split."""
    return cfg.eval.suites[0].name if cfg.eval.suites else cfg.eval.split


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
