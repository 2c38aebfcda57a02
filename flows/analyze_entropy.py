"""Entropy analysis of a run (paper §5): the policy's per-token entropy on trajectories the run sampled, before and
after RL. The same trajectories (by default a sample of the last RL step's rollouts) go through each checkpoint's
forward (by default the SFT model and the newest RL checkpoint); the top-entropy tokens are split into forking tokens
(reasoning) and reflection tokens (the first tokens after a tool response), see rstar2/entropy.py. The table and
plots go to an MLflow run of the run's experiment (`<run>-entropy`) and a Prefect markdown artifact."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, Field

from rstar2 import config, runstate
from rstar2.config import RunCfg
from tasks import track
from tasks.analysis import entropy_report, token_entropy


class EntropyParams(BaseModel):
    """The run form: which run, which checkpoints, which trajectories."""
    preset: str = "tiny"
    run_name: str | None = None  # default: the preset's name
    rl_seed: int | None = None  # a campaign over several seeds: whose RL checkpoints and rollouts (default: the lowest)
    checkpoints: list[str] = []  # model directories, in order (default: the SFT model, then the newest RL checkpoint)
    trajectories: str | None = None  # a rollout table (default: the last RL step's scored.parquet)
    samples: int = Field(64, ge=1)  # trajectories drawn from the table
    window: int = Field(8, ge=1)  # model tokens after a tool response that count as reflection tokens
    top_frac: float = Field(0.2, gt=0, lt=1)  # the high-entropy set: this top fraction of model tokens (paper: 20 %)


def run_paths(params: EntropyParams) -> tuple[RunCfg, Path, Path]:
    """The run's own config (its config.json), its directory and the directory of its RL stages (a seed's)."""
    cfg = config.load(params.preset)
    run = runstate.run_dir(cfg, params.run_name)
    if not (run / "config.json").is_file():
        raise ValueError(f"{run} is not a campaign's run directory (it has no config.json)")
    cfg = config.load(str(run / "config.json"))
    seeds = sorted(int(p.name.removeprefix("seed-")) for p in run.glob("seed-*") if p.is_dir())
    if params.rl_seed is not None and params.rl_seed not in seeds and seeds:
        raise ValueError(f"{run} has no seed-{params.rl_seed} (it has {', '.join(map(str, seeds))})")
    rl = run if not seeds else runstate.seed_dir(run, seeds[0] if params.rl_seed is None else params.rl_seed, 2)
    return cfg, run, rl


def last_rollouts(cfg: RunCfg, rl: Path) -> Path:
    """The scored rollouts of the run's last RL step."""
    for stage in reversed(cfg.stages):
        steps = sorted((rl / stage.name).glob("step-*/scored.parquet"))
        if steps:
            return steps[-1]
    raise ValueError(f"{rl} has no RL step's rollouts (no <stage>/step-*/scored.parquet): run RL first, or pass "
                     "--trajectories")


def default_checkpoints(cfg: RunCfg, run: Path, rl: Path) -> list[str]:
    newest = runstate.newest_checkpoint(rl, cfg)
    if newest is None:
        raise ValueError(f"{rl} has no committed RL checkpoint: nothing to compare the SFT model with")
    return [runstate.rl_start_model(run, cfg), str(newest)]


def label(model_dir: str) -> str:
    """A checkpoint's short name: `sft`, `stage1/step-0016`, or the directory's name."""
    p = Path(model_dir)
    return f"{p.parent.name}/{p.name}" if p.name.startswith("step-") else p.name


@flow(name="analyze-entropy", flow_run_name="{params.run_name}-entropy")
def analyze_entropy(params: EntropyParams = EntropyParams()) -> dict:
    cfg, run, rl = run_paths(params)
    trajectories = params.trajectories or str(last_rollouts(cfg, rl))
    ckpts = params.checkpoints or default_checkpoints(cfg, run, rl)
    for c in ckpts:
        if not (Path(c) / "config.json").is_file():
            raise ValueError(f"{c} is not a model directory (it has no config.json)")
    labels = [label(c) for c in ckpts]
    labels = labels if len(set(labels)) == len(labels) else ckpts  # short names only while they tell them apart
    by_ckpt = {lb: token_entropy(c, trajectories, params.samples, cfg.seed, params.window, params.top_frac,
                                 cfg.trainer.micro_batch_tokens, cfg.trainer.device) for lb, c in zip(labels, ckpts)}
    name = f"{run.name}-entropy"
    inputs = {"trajectories": trajectories, "checkpoints": ",".join(ckpts), "samples": params.samples,
              "window": params.window, "top_frac": params.top_frac}
    # one MLflow run per analysis: a retry finds its own, other checkpoints or settings get a new one
    key = f"{rl}/entropy/{zlib.crc32(json.dumps(inputs, sort_keys=True).encode()):08x}"
    _, run_id = track.open_run(cfg.experiment, cfg.out_dir, name, key, tags={"kind": "entropy-analysis"},
                               params=inputs)
    plots = entropy_report(run_id, str(rl / "analysis"), by_ckpt, re.sub(r"[^a-z0-9-]", "-", name.lower()))
    track.end_run(run_id)
    return {"run_dir": str(run), "trajectories": trajectories, "checkpoints": ckpts, "by_checkpoint": by_ckpt,
            "plots": plots, "mlflow_run_id": run_id}
