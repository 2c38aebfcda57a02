"""The campaign: world -> SFT -> evaluate SFT (an imported model first as it came) -> for each RL stage: transition
(mining, optimizer reset) -> stage -> final evaluation; tracked in MLflow (campaign run -> stage child runs ->
per-step metrics, a LoggedModel per checkpoint).

With `seeds` N > 1 the RL part runs N times from the one world, SFT model and SFT evaluation (the config's rl_seed,
rl_seed+1, ...: rollout sampling, data order, RoC draws, the trainer's seed), each with its own fresh trainer, stages
and final evaluation on the same split, in `seed-<rl_seed>/` of the run directory; MLflow: campaign run -> one seed
run per seed (tag rl_seed) -> its stage runs. The summary gives the mean over seeds, each seed's figures, and the
gain's min, max and 95 % interval over seeds (rstar2.evaluation.report.seed_aggregate).

Retrying a failed or killed campaign run (Prefect UI: Retry, or the same command again) resumes from what was
committed: the world, the SFT model, finished evaluations, finished stages, and inside a stage its last checkpoint,
whose trainer state (optimizer, LR schedule, RNG, step) is restored; the data order is a function of rl_seed and the
step, so no step is lost or done twice; with several seeds, a finished seed is not redone.
"""

from __future__ import annotations

import json
import logging
import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from rstar2.core import config
from rstar2.core.config import RunCfg
from rstar2.core.layout import RunRef
from rstar2.evaluation import report
from rstar2.flows.evaluate import evaluate_checkpoint
from rstar2.flows.stage_transition import stage_transition
from rstar2.flows.train_stage import train_stage
from rstar2.run import plan, runstate
from rstar2.tasks import rl, track
from rstar2.tasks.preflight import preflight
from rstar2.tasks.reports import campaign_report
from rstar2.tasks.run import run_context
from rstar2.tasks.world import run_sft

log = logging.getLogger(__name__)


class CampaignParams(BaseModel):
    """The run form in the Prefect UI: a preset name plus optional `section.key=value` overrides."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None  # the run directory under out_dir (default: the preset's name)
    sft_checkpoint: str | None = None  # start RL from this committed SFT model instead of training one (ablations)
    seeds: int = Field(1, ge=1)  # RL seeds from the one SFT model (1: today's single run and layout)
    parent_mlflow_run_id: str | None = None  # nest this campaign's MLflow run (flows/campaign_worlds.py's worlds)


EVAL_KEYS = ("pass1", "pass1_se", "problems", "samples", "suites")  # with pass_at_{k}: what a seed reports of its
# evaluation (suites: each of eval.suites' figures, where the headline is the world's split: eval.also_split)


@flow(name="rl-seed", flow_run_name="seed-{cfg.rl_seed}")
def rl_seed(cfg: RunCfg, run: RunRef, sft_model: str) -> dict:
    """One RL seed: its stages from the SFT model (finished ones are kept), then its final evaluation."""
    global_step, model = 0, sft_model
    for stage in cfg.stages:
        end = runstate.finished(run.layout, stage)
        if end is None:
            start = stage_transition(cfg, run, stage.name, sft_model)
            end = train_stage(cfg, run, stage, start)
        global_step, model = end["global_step"], end["final_checkpoint"] or model
    after = evaluate_checkpoint(cfg, run, model, f"final-{cfg.eval.split}", cfg.eval.split)
    return {"rl_seed": cfg.rl_seed, "run_dir": str(run.layout.root), "mlflow_run_id": run.mlflow_run_id,
            "steps": global_step, "final_checkpoint": model,
            "stages": {s.name: (runstate.finished(run.layout, s) or {}).get("decision", {}).get("reason")
                       for s in cfg.stages},
            **{k: v for k, v in after.items() if k in EVAL_KEYS or k.startswith("pass_at_")}}


@flow(name="campaign", flow_run_name="{params.preset}")
def campaign(params: CampaignParams = CampaignParams()) -> dict:
    t0 = time.perf_counter()
    cfg = config.load(params.preset, params.overrides)
    plan.require_fit(cfg)  # a run that cannot fit its GPUs stops here, before Ray or any actor starts
    layout = runstate.layout(cfg, params.run_name)
    layout.top.mkdir(parents=True, exist_ok=True)
    cfg, why = plan.settle_numerics(cfg, layout.config)  # auto numerics measured once; config.json states them
    log.info(why)
    preflight(cfg, layout, params.sft_checkpoint)  # model, every prompt, sandbox: before anything
    layout.config.write_text(cfg.model_dump_json(indent=1))
    tags = {"preset": params.preset, "kind": "campaign", **({"ablation": cfg.ablation} if cfg.ablation else {})}
    seeds = [cfg.model_copy(update={"rl_seed": cfg.rl_seed + i}) for i in range(params.seeds)]
    with run_context(cfg, layout, layout.name, tags, owns_run=True, link_key="campaign-mlflow",
                     params=cfg.model_dump(), set_tags={"seeds": params.seeds},  # a tag: a re-run may add seeds
                     parent_id=params.parent_mlflow_run_id) as run:
        sft_model = _sft_model(cfg, params, run)
        settled = _settled(cfg, run, seeds, params.seeds, sft_model, params)  # run again once done: no actor starts
        by_seed = []
        for i, cfg_s in enumerate(seeds):
            seed_layout = layout.for_seed(cfg_s.rl_seed, params.seeds)
            resume, is_rl = runstate.resume_point(seed_layout, cfg_s, sft_model)
            if i == 0 and not settled:  # the engines (kept for every seed) and the first seed's trainer
                rl.start_actors(run, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(run, resume)
            elif i > 0 and runstate.final_model(seed_layout, cfg_s, sft_model) is None:  # a finished seed: no trainer
                rl.restart_trainer(run, cfg_s, resume)
                if is_rl:
                    rl.restore_trainer(run, resume)
            if i == 0:  # the imported model as it came (tool template only), then the one SFT evaluation
                came = _as_it_came(cfg, params, run)
                before = evaluate_checkpoint(cfg, run, sft_model, f"sft-{cfg.eval.split}", cfg.eval.split)
            if not settled:
                rl.load_weights(run, resume)
            seed_run_id = run.mlflow_run_id if params.seeds == 1 else track.open_run(track.RunSpec(
                experiment=cfg.experiment, out_dir=cfg.out_dir, name=f"seed-{cfg_s.rl_seed}",
                key=str(seed_layout.root), parent_id=run.mlflow_run_id,
                tags={**tags, "kind": "seed", "rl_seed": str(cfg_s.rl_seed)}))[1]
            by_seed.append(rl_seed(cfg_s, run.for_seed(cfg_s.rl_seed, params.seeds, seed_run_id), sft_model))
            if seed_run_id != run.mlflow_run_id:
                track.log_metrics(seed_run_id, {k: by_seed[-1][k] for k in ("pass1", "pass1_se")}, by_seed[-1]["steps"])
                track.end_run(seed_run_id)
        first = by_seed[0]
        summary = {"run_dir": str(layout.top), "mlflow_run_id": run.mlflow_run_id, "steps": first["steps"],
                   "final_checkpoint": first["final_checkpoint"], "stages": first["stages"],
                   **report.seed_aggregate(before, by_seed), **came,
                   **({"suites_sft": before["suites"]} if "suites" in before else {}), "eval_split": _headline(cfg),
                   "eval_samples": cfg.eval.samples, "eval_problems": first["problems"],
                   "speed": runstate.speed(layout.for_seed(seeds[0].rl_seed, params.seeds), cfg),
                   "wall_s": time.perf_counter() - t0}
        campaign_report(run, summary)
        layout.summary.write_text(json.dumps(summary, indent=1))
        create_markdown_artifact(_summary_markdown(summary, _headline(cfg)), key="campaign-summary")
        return summary


def _as_it_came(cfg: RunCfg, params: CampaignParams, run: RunRef) -> dict:
    """An imported model's evaluation before SFT (`instruct-<split>`), with the tool template it was given: what the
    pretrained model does before this pipeline trained it. {} for a model the world made or a given SFT model."""
    if not _imported_and_trained(cfg, params):
        return {}
    came = evaluate_checkpoint(cfg, run, run.needs_world().init_model, f"instruct-{cfg.eval.split}", cfg.eval.split)
    return {"pass1_instruct": came["pass1"], "pass1_instruct_se": came["pass1_se"],
            **({"suites_instruct": came["suites"]} if "suites" in came else {})}


def _imported_and_trained(cfg: RunCfg, params: CampaignParams) -> bool:
    return bool(cfg.world.import_model) and cfg.sft.enabled and not params.sft_checkpoint


def _settled(cfg: RunCfg, run: RunRef, seeds: list[RunCfg], n_seeds: int, sft_model: str,
             params: CampaignParams) -> bool:
    """Whether the run has nothing left to do: the imported model as it came and the SFT model evaluated, and every
    seed's stages finished with their final model evaluated. Run again then, it reports what it recorded and starts
    no engine or trainer."""
    split = cfg.eval.split
    if runstate.recorded(run.layout.eval_out(f"sft-{split}"), sft_model) is None:
        return False
    if _imported_and_trained(cfg, params) and runstate.recorded(
            run.layout.eval_out(f"instruct-{split}"), run.needs_world().init_model) is None:
        return False
    for cfg_s in seeds:
        seed_layout = run.layout.for_seed(cfg_s.rl_seed, n_seeds)
        final = runstate.final_model(seed_layout, cfg_s, sft_model)
        if final is None or runstate.recorded(seed_layout.eval_out(f"final-{split}"), final) is None:
            return False
    return True


def _sft_model(cfg: RunCfg, params: CampaignParams, run: RunRef) -> str:
    """The model RL starts from: the given committed SFT checkpoint, else this run's SFT (trained once), else the
    world's initial model when SFT is off."""
    world = run.needs_world()
    if params.sft_checkpoint:  # committed: the preflight saw it
        return params.sft_checkpoint
    if cfg.sft.enabled:
        return run_sft(cfg, world.init_model, world.sft_data, str(run.layout.sft))
    return world.init_model


def _headline(cfg: RunCfg) -> str:
    """What the campaign's pass@1 before and after RL is measured on: the first of eval.suites, else (or with
    eval.also_split) the split."""
    return cfg.eval.suites[0].name if cfg.eval.suites and not cfg.eval.also_split else cfg.eval.split


def _summary_markdown(summary: dict, split: str) -> str:
    """SFT, each seed after RL, and (several seeds) the mean with its range and 95 % interval."""
    pm = lambda v, se: f"{v:.3f} ± {se:.3f}"  # noqa: E731
    lines = [f"| checkpoint | held-out pass@1 ± se ({split}) | gain |", "|---|---|---|"]
    if "pass1_instruct" in summary:
        lines.append(f"| imported model as it came | {pm(summary['pass1_instruct'], summary['pass1_instruct_se'])} | |")
    lines.append(f"| SFT | {pm(summary['pass1_sft'], summary['pass1_sft_se'])} | |")
    lines += [f"| after RL, rl_seed {s['rl_seed']} ({s['steps']} steps) | {pm(s['pass1'], s['pass1_se'])} | "
              f"{s['pass1_gain']:+.3f} |" for s in summary["by_seed"]]
    if summary["seeds"] > 1:
        lo, hi = summary["pass1_gain_ci95"]
        lines.append(f"| mean of {summary['seeds']} seeds | {summary['pass1_rl']:.3f} | {summary['pass1_gain']:+.3f} "
                     f"(min {summary['pass1_gain_min']:+.3f}, max {summary['pass1_gain_max']:+.3f}, 95 % interval "
                     f"[{lo:+.3f}, {hi:+.3f}]) |")
    return "\n".join(lines) + "\n"
