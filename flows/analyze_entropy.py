"""Entropy analysis of a run (paper §5): the policy's per-token entropy on trajectories the run sampled, before and
after RL. The same trajectories (by default a sample of the last RL step's rollouts) go through each checkpoint's
forward (by default the SFT model and the newest RL checkpoint); the top-entropy tokens are split into forking tokens
(reasoning) and reflection tokens (the first tokens after a tool response), see rstar2/evaluation/entropy.py. The table
and plots go to an MLflow run of the run's experiment (`<run>-entropy`) and a Prefect markdown artifact."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, Field

from rstar2.core import config
from rstar2.core.config import RunCfg
from rstar2.core.layout import SCORED, RunLayout
from rstar2.run import runstate
from rstar2.tasks import track
from rstar2.tasks.analysis import EntropySettings, entropy_report, token_entropy


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


def run_paths(params: EntropyParams) -> tuple[RunCfg, RunLayout]:
    """The run's own config (its config.json) and its layout, rooted at the RL seed whose stages are analysed."""
    run = runstate.layout(config.load(params.preset), params.run_name)
    if not run.config.is_file():
        raise ValueError(f"{run.top} is not a campaign's run directory (it has no config.json)")
    cfg = config.load(str(run.config))
    seeds = run.seeds()
    if params.rl_seed is not None and params.rl_seed not in seeds and seeds:
        raise ValueError(f"{run.top} has no seed-{params.rl_seed} (it has {', '.join(map(str, seeds))})")
    return cfg, run if not seeds else run.for_seed(seeds[0] if params.rl_seed is None else params.rl_seed, 2)


def last_rollouts(cfg: RunCfg, run: RunLayout) -> Path:
    """The scored rollouts of the run's last RL step."""
    for stage in reversed(cfg.stages):
        steps = run.step_tables(stage.name, SCORED)
        if steps:
            return steps[-1]
    raise ValueError(f"{run.root} has no RL step's rollouts (no scored.parquet in any stage's steps): run RL first, "
                     "or pass --trajectories")


def default_checkpoints(cfg: RunCfg, run: RunLayout) -> list[str]:
    newest = runstate.newest_checkpoint(run, cfg)
    if newest is None:
        raise ValueError(f"{run.root} has no committed RL checkpoint: nothing to compare the SFT model with")
    return [runstate.rl_start_model(run, cfg), str(newest)]


@flow(name="analyze-entropy", flow_run_name="{params.run_name}-entropy")
def analyze_entropy(params: EntropyParams = EntropyParams()) -> dict:
    cfg, run = run_paths(params)
    trajectories = params.trajectories or str(last_rollouts(cfg, run))
    ckpts = params.checkpoints or default_checkpoints(cfg, run)
    for c in ckpts:
        if not (Path(c) / "config.json").is_file():
            raise ValueError(f"{c} is not a model directory (it has no config.json)")
    labels = [RunLayout.label(c) for c in ckpts]
    labels = labels if len(set(labels)) == len(labels) else ckpts  # short names only while they tell them apart
    how = EntropySettings(samples=params.samples, seed=cfg.seed, window=params.window, top_frac=params.top_frac,
                          max_tokens=cfg.trainer.micro_batch_tokens)
    by_ckpt = {lb: token_entropy(c, trajectories, how, cfg.trainer.device) for lb, c in zip(labels, ckpts)}
    name = f"{run.top.name}-entropy"
    inputs = {"trajectories": trajectories, "checkpoints": ",".join(ckpts), "samples": params.samples,
              "window": params.window, "top_frac": params.top_frac}
    # one MLflow run per analysis: a retry finds its own, other checkpoints or settings get a new one
    key = f"{run.root}/entropy/{zlib.crc32(json.dumps(inputs, sort_keys=True).encode()):08x}"
    _, run_id = track.open_run(track.RunSpec(experiment=cfg.experiment, out_dir=cfg.out_dir, name=name, key=key,
                                             tags={"kind": "entropy-analysis"}, params=inputs))
    plots = entropy_report(run_id, str(run.analysis()), by_ckpt, re.sub(r"[^a-z0-9-]", "-", name.lower()))
    track.end_run(run_id)
    return {"run_dir": str(run.top), "trajectories": trajectories, "checkpoints": ckpts, "by_checkpoint": by_ckpt,
            "plots": plots, "mlflow_run_id": run_id}
