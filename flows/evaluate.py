"""Evaluation (paper §5.1 protocol, sizes from config): pass@1 averaged over k samples at temperature T, with the
length and turn limits of `eval`, on the held-out split or on each of `eval.suites` (one table per checkpoint); the
result is attached to the checkpoint's MLflow LoggedModel. A plain HF model directory (`model`) is evaluated the same
way.

Inside a campaign it reuses the campaign's engines; as a deployment it starts its own engine. Triggered runs (the
nightly schedule, the `rstar2.core.checkpoint.committed` event) evaluate the run's newest committed checkpoint and skip,
starting no engine, when it is already evaluated (so a burst of checkpoints costs one evaluation, an older checkpoint
queued behind a newer one is never run, and a night with nothing new costs nothing), when the preset turns
on-checkpoint evaluation off (`eval.on_checkpoint`), or while the run's campaign is still running unless the preset
allows it (`eval.while_training`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from pydantic import BaseModel

from rstar2.core import checkpoint, config
from rstar2.core.config import RunCfg
from rstar2.core.layout import RunLayout, RunRef
from rstar2.run import runstate
from rstar2.tasks import rl
from rstar2.tasks.run import run_context
from rstar2.tasks.world import prepare_suites

log = logging.getLogger(__name__)


class EvalParams(BaseModel):
    """The run form: which run's checkpoint to evaluate (default: the run's newest committed checkpoint)."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None
    checkpoint: str | None = None
    split: Literal["test", "val"] | None = None  # default: the preset's eval.split
    model: str | None = None  # a plain HF model directory to evaluate instead (manual runs; results under run_name,
    # default eval-<directory name>)
    run_dir: str | None = None  # the run directory itself (its config.json is the run's config); set by the trigger
    trigger: Literal["manual", "checkpoint", "nightly"] = "manual"  # how this run was started (see the module doc)


def result_name(model_dir: str, split: str) -> str:
    return f"{RunLayout.label(model_dir, '-')}-{split}"


@flow(name="evaluate-checkpoint", flow_run_name="{name}")
def evaluate_checkpoint(cfg: RunCfg, run: RunRef, model_dir: str, name: str, split: str) -> dict:
    """Evaluate `model_dir` with the run's engines (they are loaded with it first), record it as `name` in the run's
    evaluations and in MLflow (at the checkpoint's global step; 0 for a model that is not an RL checkpoint). An
    evaluation already recorded loads nothing into the engines (a finished run again starts none)."""
    if runstate.recorded(run.layout.eval_out(name), model_dir) is None:
        rl.load_weights(run, model_dir)
    meta = checkpoint.manifest(Path(model_dir)) if checkpoint.is_committed(Path(model_dir)) else {"stage": name}
    model = rl.ModelRef(dir=model_dir, meta={k: v for k, v in meta.items() if k not in ("metrics", "files")},
                        step=meta.get("global_step", 0))
    return evaluate_loaded(cfg, run, model, split, str(run.layout.eval_out(name)))


def evaluate_loaded(cfg: RunCfg, run: RunRef, model: rl.ModelRef, split: str, out: str) -> dict:
    """Evaluate `model` (already in the engines) and record it in MLflow. Without eval.suites: the world's `split`,
    samples in `<out>.parquet`, figures as eval_<figure> (eval_<split>_<figure> for val). With suites: each suite
    (samples in `<out>/<suite>.parquet`), one table and eval/<suite>/<figure> metrics; the first suite's figures are
    the headline returned (what a campaign compares before and after RL), all of them under "suites"; with
    eval.also_split the world's `split` as well, as the headline."""
    if not cfg.eval.suites:
        result = rl.evaluate(run, cfg, model.dir, rl.EvalTable(uri=run.needs_world().split(split)), f"{out}.parquet")
        rl.log_evaluation(run, result, model, split)
        return result
    tables = prepare_suites(cfg, str(run.layout.suites), run.world.fit if run.world else None)
    results = {s.name: rl.evaluate(run, cfg, model.dir, rl.EvalTable(uri=tables[s.name], answer_type=s.answer_type),
                                   str(Path(out) / f"{s.name}.parquet"))
               for s in cfg.eval.suites}
    rl.log_suites(run, results, model, Path(out).name)
    if cfg.eval.also_split:  # the world's split is the headline, the suites are reported beside it
        result = rl.evaluate(run, cfg, model.dir, rl.EvalTable(uri=run.needs_world().split(split)), f"{out}.parquet")
        rl.log_evaluation(run, result, model, split)
        headline = {**result, "suites": results}
    else:
        headline = {**results[cfg.eval.suites[0].name], "suites": results}
    # what runstate.evaluated looks for: this model's evaluation is done
    runstate.record(out, model.dir, headline)
    return headline


def campaign_running(run: RunLayout) -> bool:
    """Whether a campaign flow run writing into `run` is running or about to (Prefect API)."""
    states = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["campaign"])),
                                      flow_run_filter=FlowRunFilter(state=states))
    for fr in found:
        p = (fr.parameters or {}).get("params") or {}
        try:
            other = runstate.layout(config.load(p.get("preset", "tiny"), p.get("overrides", [])), p.get("run_name"))
        except Exception:  # noqa: BLE001 - a campaign with a config we cannot resolve cannot be ours to compare
            continue
        if other.top == run.top:
            return True
    return False


def _run_cfg(params: "EvalParams") -> tuple[RunCfg, RunLayout]:
    """The run's own config (its config.json; a seed directory's is its run's) when the trigger names the directory,
    else the preset's."""
    if params.run_dir:
        root = Path(params.run_dir).resolve()
        run = RunLayout.at(RunLayout.top_of(root)).model_copy(update={"root": root})
        if not run.config.is_file():
            raise ValueError(f"run_dir {root} has no config.json (not a campaign's run directory)")
        return config.load(str(run.config), params.overrides), run
    cfg = config.load(params.preset, params.overrides)
    own = f"eval-{Path(params.model).name}" if params.model else None  # a model directory is not the preset's run
    return cfg, runstate.layout(cfg, params.run_name or own)


@flow(name="evaluate", flow_run_name="{params.run_name}")
def evaluate(params: EvalParams = EvalParams()) -> dict:
    """Deployment entry: evaluate one checkpoint of a run with a fresh engine (triggered: the newest, once)."""
    cfg, run = _run_cfg(params)
    split = params.split or cfg.eval.split
    if params.model:
        if params.trigger != "manual" or params.checkpoint:
            raise ValueError("model (a plain HF model directory) is for manual runs, instead of a checkpoint")
        return _evaluate_model(cfg, run, str(Path(params.model).resolve()), split)
    if params.trigger == "manual":
        model_dir = params.checkpoint or runstate.resume_point(run, cfg, runstate.sft_model(run, cfg))[0]
    else:
        if params.trigger == "checkpoint" and not cfg.eval.on_checkpoint:
            return _skip(f"eval.on_checkpoint is off for {cfg.name}")
        newest = runstate.newest_checkpoint(run, cfg)
        if newest is None:
            return _skip(f"{run.root} has no committed RL checkpoint yet")
        model_dir = str(newest)
        if runstate.evaluated(run, model_dir, split):
            return _skip(f"the newest checkpoint {model_dir} is already evaluated on {split}")
        if not cfg.eval.while_training and campaign_running(run):
            return _skip(f"the campaign of {run.root} is still running (eval.while_training is off)")
    if not checkpoint.is_committed(Path(model_dir)):
        raise ValueError(f"{model_dir} is not a committed checkpoint; nothing to evaluate")
    # held: the campaign's checkpoint.keep_last pruning leaves it alone while it is evaluated
    with checkpoint.hold(Path(model_dir)), run_context(cfg, run, f"{run.name}-eval",
                                                       {"kind": "campaign", "preset": cfg.name}) as ref:
        rl.start_actors(ref, cfg, model_dir, with_trainer=False)
        return evaluate_checkpoint(cfg, ref, model_dir, result_name(model_dir, split), split)


def _evaluate_model(cfg: RunCfg, run: RunLayout, model_dir: str, split: str) -> dict:
    """A plain HF model directory (no run, no manifest) evaluated like a checkpoint; the world is built only when it
    is what is evaluated (no eval.suites)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (it has no config.json)")
    with run_context(cfg, run, f"{run.name}-eval", {"kind": "evaluation", "preset": cfg.name},
                     with_world=not cfg.eval.suites or cfg.eval.also_split) as ref:
        rl.start_actors(ref, cfg, model_dir, with_trainer=False)
        return evaluate_checkpoint(cfg, ref, model_dir, result_name(model_dir, split), split)


def _skip(why: str) -> dict:
    log.info("nothing to evaluate: %s", why)
    return {"skipped": why}
