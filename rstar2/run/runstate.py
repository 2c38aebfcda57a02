"""Where a run stands, read from its run directory alone (rstar2.core.layout names its paths): which stages are
finished, which checkpoint a stage starts from, where a retried run resumes. Everything here is derived from committed
files (checkpoints, stage markers), so a run killed at any point and retried continues from its last commit with the
same data order: no step lost, none done twice."""

from __future__ import annotations

import json
from pathlib import Path

from rstar2.core import checkpoint
from rstar2.core.config import RunCfg, StageCfg
from rstar2.core.layout import RunLayout
from rstar2.world import build


def layout(cfg: RunCfg, run_name: str | None) -> RunLayout:
    """The layout of the run `run_name` (default: the preset's name) under the config's out_dir."""
    return RunLayout.of(cfg.out_dir, run_name or cfg.name)


def sft_model(run: RunLayout, cfg: RunCfg) -> str:
    """The model a run's RL starts from: its SFT model (`<run>/sft`), or with sft.enabled off the world's initial
    model (world.base_model when set, else the run's generated one)."""
    return str(run.sft) if cfg.sft.enabled else build.uris(cfg, run.world)["init_model"]


def rl_start_model(run: RunLayout, cfg: RunCfg) -> str:
    """The model the run's RL actually started from: the one its SFT evaluation recorded (a shared SFT model, e.g. an
    ablation's, lives in another run), else `sft_model`."""
    rec = run.sft_record(cfg.eval.split)
    if rec.is_file():
        return json.loads(rec.read_text())["model_dir"]
    return sft_model(run, cfg)


def committed_steps(run: RunLayout, stage: StageCfg) -> list[Path]:
    return checkpoint.committed(run.checkpoints(stage.name))


def latest_step(run: RunLayout, stage: StageCfg) -> Path | None:
    return checkpoint.latest(run.checkpoints(stage.name))


def finished(run: RunLayout, stage: StageCfg) -> dict | None:
    """The stage's end record (decision, evidence, final checkpoint), or None while it is not finished."""
    d = run.stage_marker(stage.name)
    return checkpoint.manifest(d) if checkpoint.is_committed(d) else None


def mark_finished(run: RunLayout, stage: StageCfg, record: dict) -> dict:
    """Commit the stage's end record atomically (the stage counts as finished only once this exists)."""
    checkpoint.commit(run.stage_marker(stage.name),
                      lambda tmp: (tmp / "decision.json").write_text(json.dumps(record, indent=1)), record)
    return record


def stage_start(run: RunLayout, cfg: RunCfg, index: int, sft_model: str) -> tuple[str, int]:
    """(model dir, global step) a stage starts from: the previous stage's final checkpoint, or the SFT model."""
    for prev in reversed(cfg.stages[:index]):
        last = latest_step(run, prev)
        if last:
            return str(last), checkpoint.manifest(last)["global_step"]
    return sft_model, 0


def resume_point(run: RunLayout, cfg: RunCfg, sft_model: str, upto: int | None = None) -> tuple[str, bool]:
    """The newest committed RL checkpoint of stages[:upto+1] (model dir, True) or the SFT model (dir, False):
    the trainer and the engines start from it."""
    stages = cfg.stages if upto is None else cfg.stages[: upto + 1]
    for stage in reversed(stages):
        last = latest_step(run, stage)
        if last:
            return str(last), True
    return sft_model, False


def newest_checkpoint(run: RunLayout, cfg: RunCfg) -> Path | None:
    """The run's newest committed RL checkpoint over all its stages, or None before the first one."""
    found = resume_point(run, cfg, "")
    return Path(found[0]) if found[1] else None


def record(out: str | Path, model_dir: str, result: dict) -> None:
    """An evaluation is done: its result for `model_dir` in `<out>.json`, beside its samples (written atomically)."""
    checkpoint.write_atomic(Path(f"{out}.json"), json.dumps({"model_dir": model_dir, "result": result}))


def recorded(out: str | Path, model_dir: str | Path) -> dict | None:
    """The result `record` left for an evaluation of `model_dir` in `<out>.json`, else None: a finished evaluation
    is never redone."""
    try:
        record = json.loads(Path(f"{out}.json").read_text())
    except (OSError, ValueError):
        return None
    return record.get("result") if record.get("model_dir") == str(model_dir) else None


def final_model(run: RunLayout, cfg: RunCfg, sft_model: str) -> str | None:
    """The model a seed's stages ended with (its last stage's final checkpoint, or the one before where a stage
    made none), None while any stage is unfinished."""
    model = sft_model
    for stage in cfg.stages:
        end = finished(run, stage)
        if end is None:
            return None
        model = end["final_checkpoint"] or model
    return model


def evaluated(run: RunLayout, model_dir: str | Path, split: str) -> bool:
    """Whether an evaluation of `model_dir` on `split` is recorded in the run, under any name."""
    return any(recorded(f.with_suffix(""), model_dir) is not None for f in run.eval_records(split))


def speed(run: RunLayout, cfg: RunCfg) -> dict:
    """What the run's SFT and each RL step took, from its committed files: the SFT's tokens per second and seconds
    (its sft_result.json), and over the RL steps that updated (their checkpoints' figures) the mean seconds of the
    rollout and of the update, the rollout's generated tokens per second and the update's tokens per second."""
    out = {"trainer_dtype": cfg.trainer.dtype}  # the numerics both ran in (a run settles auto before it starts)
    sft = run.sft / "sft_result.json"
    if sft.is_file():
        res = json.loads(sft.read_text())
        out.update(sft_tokens_per_s=res["tokens_per_s"], sft_s=res["wall_s"])
    steps = [checkpoint.manifest(d).get("metrics", {}) for s in cfg.stages for d in committed_steps(run, s)]
    steps = [m for m in steps if m.get("update_s")]
    if steps:
        mean = lambda f: sum(f(m) for m in steps) / len(steps)  # noqa: E731
        out.update(rl_steps=len(steps), rollout_s=mean(lambda m: m["rollout_s"]),
                   rollout_tokens_per_s=mean(lambda m: m["rollout_tokens_per_s"]),
                   update_s=mean(lambda m: m["update_s"]),
                   update_tokens_per_s=mean(lambda m: m["update_tokens"] / m["update_s"]))
    return out
