"""Hard-sample mining between stages (paper §4.4): sample k rollouts per training problem with the current policy and
keep the problems it does not solve k/k; stage 3 trains on those. The hard set is written as Parquet with its lineage
(checkpoint, k, counts before/after) so a run can always say where its data came from."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from rstar2.core.config import MiningCfg, RolloutCfg, SchedulerCfg
from rstar2.data.schema import validate
from rstar2.reward import Verifier
from rstar2.rollout.agent_loop import EngineSet
from rstar2.run import steps
from rstar2.sandbox.backends import Backend


def candidates(train_uri: str, max_problems: int | None, seed: int) -> pl.DataFrame:
    """The problems to mine: the whole split, or a seeded subset of `max_problems` (same subset on every retry)."""
    df = validate(pl.read_parquet(train_uri), train_uri)
    if max_problems is not None and max_problems < df.height:
        df = df.sample(n=max_problems, seed=seed, shuffle=True)
    return df


def hard_set(problems: pl.DataFrame, scored: pl.DataFrame, k: int) -> tuple[pl.DataFrame, dict]:
    """Drop the problems solved in all k samples. `scored` has one row per rollout (problem_id, reward)."""
    solved = scored.group_by("problem_id").agg(pl.col("reward").sum().alias("solved"), pl.len().alias("samples"))
    if (solved["samples"] != k).any():
        raise ValueError(f"mining expects {k} rollouts per problem; got {sorted(set(solved['samples'].to_list()))}")
    joined = problems.join(solved, on="problem_id", how="inner", maintain_order="left")
    hard = joined.filter(pl.col("solved") < k)
    counts = {"problems_before": problems.height, "problems_after": hard.height,
              "solved_all": int((joined["solved"] == k).sum()), "solved_none": int((joined["solved"] == 0).sum()),
              "k": k}
    return hard.drop("samples").rename({"solved": "mined_solved"}), counts


def mine(engines: EngineSet, sched_cfg: SchedulerCfg, checkpoint: str, train_uri: str, cfg: MiningCfg,
         limits: RolloutCfg, sandbox: Backend, check: Verifier, max_model_len: int, out_dir: str, seed: int,
         on_done=None) -> dict:
    """Roll out k samples per candidate through the agent loop on `engines` (they hold `checkpoint`), write
    hard.parquet and lineage.json under out_dir; returns the lineage (with the URIs)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = candidates(train_uri, cfg.max_problems, seed)
    rolled = str(out / "rollouts.parquet")
    limits = limits.model_copy(update={"temperature": cfg.temperature})
    info = steps.rollout_to_parquet(steps.RolloutSetup(engines, sched_cfg, checkpoint, sandbox, max_model_len),
                                    problems.select("problem_id", "prompt", "answer").to_dicts(), cfg.k, limits,
                                    rolled, on_done, seed=f"mine/{seed}")
    steps.score(rolled, check, rolled)
    hard, counts = hard_set(problems, pl.read_parquet(rolled), cfg.k)
    if hard.height == 0:
        raise ValueError(f"mining found no hard problem: the policy solved all {problems.height} candidates "
                         f"{cfg.k}/{cfg.k}")
    hard.write_parquet(out / "hard.parquet")
    lineage = {"checkpoint": checkpoint, "source": train_uri, "seed": seed, "temperature": cfg.temperature,
               "max_response_tokens": limits.max_response_tokens, "rollout_s": info["rollout_s"], **counts}
    (out / "lineage.json").write_text(json.dumps(lineage, indent=1))
    return read_lineage(out_dir)


def read_lineage(out_dir: str) -> dict:
    """The lineage of a mined hard set, with the absolute URIs of its tables (the directory may have been renamed
    into place after mining)."""
    out = Path(out_dir)
    return {**json.loads((out / "lineage.json").read_text()), "hard_uri": str(out / "hard.parquet"),
            "rollouts_uri": str(out / "rollouts.parquet")}
