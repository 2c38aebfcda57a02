"""Where a run stands, read from its run directory alone: which stages are finished, which checkpoint a stage starts
from, where a retried run resumes. Everything here is derived from committed files (checkpoints, stage markers), so a
run killed at any point and retried continues from its last commit with the same data order: no step lost, none
done twice."""

from __future__ import annotations

import json
from pathlib import Path

from rstar2 import checkpoint
from rstar2.config import RunCfg, StageCfg
from rstar2.world import build


def run_dir(cfg: RunCfg, run_name: str | None) -> Path:
    return Path(cfg.out_dir).resolve() / (run_name or cfg.name)


def seed_dir(run: Path, rl_seed: int, seeds: int) -> Path:
    """Where one RL seed of a campaign keeps its stages, checkpoints and final evaluation: the run directory itself
    for a single seed (today's layout), else `seed-<rl_seed>/` inside it (world, SFT model and SFT evaluation stay
    shared at the top)."""
    return run if seeds == 1 else run / f"seed-{rl_seed}"


def sft_model(run: Path, cfg: RunCfg) -> str:
    """The model a run's RL starts from: its SFT model (`<run>/sft`), or with sft.enabled off the world's initial
    model (world.base_model when set, else the run's generated one)."""
    return str(run / "sft") if cfg.sft.enabled else build.uris(cfg, run / "world")["init_model"]


def rl_start_model(run: Path, cfg: RunCfg) -> str:
    """The model the run's RL actually started from: the one its SFT evaluation recorded (`eval/sft-<split>.json`;
    a shared SFT model, e.g. an ablation's, lives in another run), else `sft_model`."""
    rec = run / "eval" / f"sft-{cfg.eval.split}.json"
    if rec.is_file():
        return json.loads(rec.read_text())["model_dir"]
    return sft_model(run, cfg)


def config_of(model_dir: str | Path) -> Path | None:
    """The resolved config (`<run>/config.json`) of the run a model directory belongs to (`<run>/sft`,
    `<run>/checkpoints/<stage>/step-N`, `<run>/seed-K/checkpoints/...`), or None for a model outside a run."""
    for d in Path(model_dir).resolve().parents[:4]:
        if (d / "config.json").is_file() and (d / "world").is_dir():
            return d / "config.json"
    return None


def stage_ckpts(run: Path, stage: StageCfg) -> Path:
    return run / "checkpoints" / stage.name


def stage_marker(run: Path, stage: StageCfg) -> Path:
    return run / "stages" / stage.name


def finished(run: Path, stage: StageCfg) -> dict | None:
    """The stage's end record (decision, evidence, final checkpoint), or None while it is not finished."""
    d = stage_marker(run, stage)
    return checkpoint.manifest(d) if checkpoint.is_committed(d) else None


def mark_finished(run: Path, stage: StageCfg, record: dict) -> dict:
    """Commit the stage's end record atomically (the stage counts as finished only once this exists)."""
    d = stage_marker(run, stage)
    checkpoint.commit(d, lambda tmp: (tmp / "decision.json").write_text(json.dumps(record, indent=1)), record)
    return record


def stage_start(run: Path, cfg: RunCfg, index: int, sft_model: str) -> tuple[str, int]:
    """(model dir, global step) a stage starts from: the previous stage's final checkpoint, or the SFT model."""
    for prev in reversed(cfg.stages[:index]):
        last = checkpoint.latest(stage_ckpts(run, prev))
        if last:
            return str(last), checkpoint.manifest(last)["global_step"]
    return sft_model, 0


def resume_point(run: Path, cfg: RunCfg, sft_model: str, upto: int | None = None) -> tuple[str, bool]:
    """The newest committed RL checkpoint of stages[:upto+1] (model dir, True) or the SFT model (dir, False):
    the trainer and the engines start from it."""
    stages = cfg.stages if upto is None else cfg.stages[: upto + 1]
    for stage in reversed(stages):
        last = checkpoint.latest(stage_ckpts(run, stage))
        if last:
            return str(last), True
    return sft_model, False


def newest_checkpoint(run: Path, cfg: RunCfg) -> Path | None:
    """The run's newest committed RL checkpoint over all its stages, or None before the first one."""
    found = resume_point(run, cfg, "")
    return Path(found[0]) if found[1] else None


def evaluated(run: Path, model_dir: str | Path, split: str) -> bool:
    """Whether an evaluation of `model_dir` on `split` is recorded in the run (`eval/*-<split>.json`, written by
    the evaluate task with the model it evaluated)."""
    for f in (Path(run) / "eval").glob(f"*-{split}.json"):
        try:
            if json.loads(f.read_text()).get("model_dir") == str(model_dir):
                return True
        except (OSError, ValueError):
            continue
    return False
