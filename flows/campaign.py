"""The campaign: world -> SFT -> evaluate SFT -> for each RL stage: transition (mining, optimizer reset) -> stage ->
final evaluation; tracked in MLflow (campaign run -> stage child runs -> per-step metrics, a LoggedModel per checkpoint).

Retrying a failed or killed campaign run (Prefect UI: Retry, or the same command again) resumes from what was
committed: the world, the SFT model, finished evaluations, finished stages, and inside a stage its last checkpoint,
whose trainer state (optimizer, LR schedule, RNG, step) is restored; the data order is a function of the seed and the
step, so no step is lost or done twice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from pydantic import BaseModel

from rstar2 import checkpoint, config, runstate, tracking
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
    tracking.log_params(run_id, cfg.model_dump())
    create_link_artifact(tracking.ui_url(exp_id, run_id), link_text="MLflow: campaign run", key="campaign-mlflow")
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
        resume, is_rl = runstate.resume_point(run, cfg, sft_model)
        actors = rl.start_actors(run.name, cfg, resume)
        if is_rl:
            rl.restore_trainer(actors, resume)
        before = evaluate_checkpoint(cfg, actors, world, sft_model, str(run), exp_id, run_id,
                                     f"sft-{cfg.eval.split}", cfg.eval.split, 0)
        rl.load_weights(actors, resume)
        global_step, model = 0, sft_model
        for stage in cfg.stages:
            end = runstate.finished(run, stage)
            if end is None:
                start = stage_transition(cfg, stage.name, actors, world, str(run), exp_id, run_id, sft_model)
                end = train_stage(cfg, stage, actors, world, str(run), exp_id, run_id, start["global_step0"],
                                  start["problems_uri"])
            global_step, model = end["global_step"], end["final_checkpoint"] or model
        after = evaluate_checkpoint(cfg, actors, world, model, str(run), exp_id, run_id,
                                    f"final-{cfg.eval.split}", cfg.eval.split, global_step)
        summary = {"run_dir": str(run), "mlflow_run_id": run_id, "steps": global_step, "final_checkpoint": model,
                   "stages": {s.name: (runstate.finished(run, s) or {}).get("decision", {}).get("reason")
                              for s in cfg.stages},
                   "pass1_sft": before["pass1"], "pass1_rl": after["pass1"],
                   "pass1_gain": after["pass1"] - before["pass1"], "eval_split": cfg.eval.split,
                   "eval_samples": cfg.eval.samples, "eval_problems": after["problems"],
                   "wall_s": time.perf_counter() - t0}
        tracking.log_metrics(run_id, {k: v for k, v in summary.items() if k.startswith(("pass1", "wall"))}, global_step)
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        create_markdown_artifact(
            f"| checkpoint | held-out pass@1 ({cfg.eval.split}) |\n|---|---|\n| SFT | {before['pass1']:.3f} |\n"
            f"| after RL ({global_step} steps) | {after['pass1']:.3f} |\n", key="campaign-summary")
        tracking.end(run_id)
        return summary
    except BaseException:
        tracking.end(run_id, "FAILED")
        raise
    finally:
        rl.stop_actors(actors)
