"""The entropy analysis (rstar2/evaluation/entropy.py) as tasks: one checkpoint's figures on a run's sampled
trajectories, and their report in MLflow (metrics, the figures as JSON, the plots) and as a Prefect markdown
artifact."""

from __future__ import annotations

import polars as pl
from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from rstar2.core import tracking
from rstar2.evaluation import entropy
from rstar2.rollout.chat import load_tokenizer
from rstar2.tasks import costs
from rstar2.training import device as dev
from rstar2.training.trainer import load_model


class EntropySettings(BaseModel):
    """What the analysis reads: `samples` trajectories drawn with `seed`, `window` tokens after each tool response,
    the top `top_frac` of tokens by entropy, forward passes of at most `max_tokens`."""
    samples: int
    seed: int
    window: int
    top_frac: float
    max_tokens: int


@task(name="token-entropy", cache_policy=None)
@costs.work
def token_entropy(model_dir: str, trajectories_uri: str, how: EntropySettings, device: str = "auto") -> dict:
    """rstar2.evaluation.entropy.analyze of `model_dir` on `how.samples` trajectories of the table (drawn with
    `how.seed`, so every checkpoint sees the same ones)."""
    df = pl.read_parquet(trajectories_uri)
    rows = df.sample(n=min(how.samples, df.height), seed=how.seed).to_dicts()
    model = load_model(model_dir, dev.pick(device))
    return entropy.analyze(model, load_tokenizer(model_dir), rows, how.window, how.top_frac, how.max_tokens)


@task(name="entropy-report", cache_policy=None)
@costs.work
def entropy_report(run_id: str, out_dir: str, by_checkpoint: dict[str, dict], key: str) -> list[str]:
    """Per checkpoint (in order, MLflow step 0, 1, ...) the shares and rates as metrics; the figures as
    entropy.json; the plots; the markdown table as a Prefect artifact keyed `key`. Returns the plots' paths."""
    pngs = entropy.plots(by_checkpoint, out_dir)
    with costs.mlflow():
        for step, row in enumerate(entropy.comparison_rows(by_checkpoint)):
            tracking.log_metrics(run_id, {k: v for k, v in row.items() if k != "checkpoint"}, step, "entropy/")
        tracking.client().log_dict(run_id, by_checkpoint, "entropy.json")
        for png in pngs:
            tracking.client().log_artifact(run_id, png, "entropy")
    create_markdown_artifact(entropy.markdown(by_checkpoint), key=key,
                             description="top-entropy tokens: forking (reasoning) vs reflection (after tool output)")
    return pngs
