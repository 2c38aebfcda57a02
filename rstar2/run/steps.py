"""The operations of one RL step, over URIs (Parquet files, checkpoint dirs): each one is what a Prefect task runs.

rollout -> score (answer verification) -> sandbox stats -> RoC filter -> (trainer update) -> (checkpoint) -> evaluate
"""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from rstar2.core import checkpoint as ckpt
from rstar2.core.config import EvalCfg, RoCCfg, RolloutCfg, SchedulerCfg
from rstar2.data import clean
from rstar2.data.schema import validate
from rstar2.evaluation import stats
from rstar2.reward import Verifier, extract_answer
from rstar2.rollout import partial, stream_check, trajectory
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.estimator import LengthEstimator
from rstar2.sandbox import ExecRequest, ExecResult
from rstar2.sandbox.backends import Backend
from rstar2.sandbox.metrics import summarize
from rstar2.training import roc


class ToolDisabled:
    """The no-tool ablation's environment: every tool call is refused (nothing runs), so the policy must answer on
    its own."""

    def submit(self, req: ExecRequest) -> Future:
        refused: Future = Future()
        refused.set_result(ExecResult("error", "", "the Python tool is disabled in this run", 1, 0.0, 0.0))
        return refused


def select_prompts(problems_uri: str, step: int, n: int, seed: int) -> list[dict]:
    """The step's prompts: a fixed seeded permutation of the split, read in order (epoch after epoch), so a resumed
    run sees exactly the data the uninterrupted one would have."""
    return draw_prompts(problems_uri, step * n, n, seed)[0]


def draw_prompts(problems_uri: str, cursor: int, n: int, seed: int,
                 skip: set[str] | None = None) -> tuple[list[dict], int]:
    """`n` prompts read from position `cursor` of the split's seeded permutation (epoch after epoch), and the
    position after them. With `skip` (a partial rollout's problems still in flight) they are `n` distinct problems,
    none of them in `skip`."""
    df = validate(pl.read_parquet(problems_uri), problems_uri)
    if df.height == 0:
        raise ValueError(f"{problems_uri} has no problems")
    if skip is not None and df.height < n + len(skip):
        raise ValueError(f"{problems_uri} has {df.height} problems: too few for {n} new prompts beside the "
                         f"{len(skip)} still in flight (rollout.partial draws only problems not in flight)")
    perm = list(range(df.height))
    random.Random(seed).shuffle(perm)
    ids, idx = df["problem_id"].to_list(), []
    while len(idx) < n:  # with skip: found within one epoch's positions, so distinct
        i = perm[cursor % df.height]
        cursor += 1
        if not skip or ids[i] not in skip:
            idx.append(i)
    return df[idx].select("problem_id", "prompt", "answer").to_dicts(), cursor


def read_carry(uri: str | None) -> partial.Carry:
    """The carry a partial rollout left at `uri` (None or a stage's first step: nothing, cursor 0)."""
    if uri is None:
        return partial.Carry([], {}, 0)
    if not Path(uri).is_file():
        raise FileNotFoundError(f"{uri}: the step before left no carry (was it rolled out with rollout.partial?)")
    trajs, prompts = partial.from_carry_rows(pl.read_parquet(uri).to_dicts())
    return partial.Carry(trajs, prompts, int(pl.read_parquet_metadata(uri)["rstar2.cursor"]))


def write_carry(uri: str, carry: partial.Carry) -> None:
    rows = partial.carry_rows(carry.trajs, carry.prompts)
    df = pl.DataFrame(rows, schema=partial.CARRY_SCHEMA, strict=False)
    ckpt.write_atomic(Path(uri), lambda tmp: df.write_parquet(tmp, metadata={"rstar2.cursor": str(carry.cursor)}))


@dataclass(frozen=True)
class RolloutSetup:
    """Where a rollout runs: the engines and their scheduler (`estimator`: kv_aware's length model carried over from
    earlier rollouts, None: a fresh one from its prior), the model's tokenizer directory, the sandbox for its tool
    calls, and the engines' context (`max_model_len`)."""
    engines: EngineSet
    sched_cfg: SchedulerCfg
    tokenizer_dir: str
    sandbox: Backend
    max_model_len: int | None = None
    estimator: LengthEstimator | None = None


def rollout_to_parquet(setup: RolloutSetup, problems: list[dict], n_samples: int, limits: RolloutCfg, out_uri: str,
                       on_done=None, seed: int | str | None = None, policy_version: int = 0,
                       partial_run: partial.PartialRun | None = None) -> dict:
    """Roll out through the agent loop (rstar2.rollout.agent_loop) as `setup` says and write the table, every turn
    marked with `policy_version` (the count of updates that made the engines' weights); on_done(finished, total)
    after each trajectory. The sandbox runs the tool calls (with limits.tool_enabled off every call is refused:
    ToolDisabled). `seed`: every trajectory-turn samples from a seed of its own (Trajectory.turn_seed), so the table
    is a function of the seed and the weights, not of scheduling. `partial_run`: a partial rollout
    (rstar2.rollout.partial): the table holds the groups it takes, and the rest goes to its carry. Returns the
    rollout's figures and scheduling metrics."""
    chat = ChatFormat.load(setup.tokenizer_dir)
    t0 = time.perf_counter()
    lim = trajectory.RolloutLimits(limits.max_turns, limits.max_response_tokens, limits.tool_response_chars,
                                   setup.max_model_len)
    sb = setup.sandbox if limits.tool_enabled else None
    before = sb.snapshot() if sb else None
    loop = AgentLoop(setup.engines, setup.sched_cfg, sb or ToolDisabled(), chat, lim, estimator=setup.estimator,
                     on_done=on_done)
    carry = partial_run.carry if partial_run else partial.Carry([], {}, 0)
    trajs, sched_stats = loop.run(problems, n_samples, seed, policy_version, carry.trajs,
                                  partial_run.quota if partial_run else None)
    sched_stats.pop("sched_failures")
    sched_stats.pop("sched_policy")
    service = summarize(before, sb.snapshot()) if sb else {}  # the service's counters are not per row
    prompts = {**carry.prompts, **{p["problem_id"]: p["prompt"] for p in problems}}
    Path(out_uri).parent.mkdir(parents=True, exist_ok=True)
    cut = {}
    if partial_run:
        trajs, cut = _take(loop.cut, trajs, prompts, partial_run)
    rows = trajectory.to_rows(trajs, chat.tokenizer)
    wall = time.perf_counter() - t0
    pl.DataFrame(rows).write_parquet(out_uri)
    t1 = time.perf_counter()  # checked once written: a mismatch leaves the table to look at
    try:
        checked = stream_check.check(stream_check.sample(trajs, limits.stream_check), prompts, chat)
    except stream_check.StreamMismatch as e:
        raise stream_check.StreamMismatch(f"{e} (the rollout table: {out_uri})") from None
    gen_tokens = sum(sum(r["loss_mask"]) for r in rows)
    oldest = min((r["policy_version"] for r in rows), default=policy_version)  # a partial rollout's carried turns
    return {"trajectories": len(rows), "oldest_version": oldest, "rollout_s": wall, "generated_tokens": gen_tokens,
            "rollout_tokens_per_s": gen_tokens / max(wall, 1e-9), "rollout_stream_checked": checked,
            "rollout_stream_check_s": time.perf_counter() - t1, **sched_stats, **cut, "sandbox": service}


def _take(cut: partial.Cut, trajs: list[trajectory.Trajectory], prompts: dict[str, str],
          run: partial.PartialRun) -> tuple[list[trajectory.Trajectory], dict]:
    """A settled cut: the trajectories of the groups it takes (in rollout order: a function of the seeds), and the
    others, cut back to T*, written to the run's carry; the cut's figures."""
    taken = set(cut.taken())
    mine = [(g in taken, [trajs[i] for i in tids]) for g, tids in enumerate(cut.groups)]
    kept = [t for took, ts in mine if took for t in ts]
    left = [t for took, ts in mine if not took for t in ts]
    dropped = sum(partial.cut_back(t, cut.t_star) for t in left)
    write_carry(run.carry_uri, partial.Carry(left, {t.problem_id: prompts[t.problem_id] for t in left},
                                             run.carry.cursor))
    return kept, {"partial_groups": len(cut.groups), "partial_carried_in": len(run.carry.trajs),
                  "partial_carried_out": len(left), "partial_cut_clock": cut.t_star,
                  "partial_cut_tokens": dropped}


def score(rollouts_uri: str, check: Verifier | None, out_uri: str, answer_type: str = "math") -> dict:
    """Outcome reward (0/1) per trajectory, plus the RoC penalties p_err and p_format. `answer_type` math: Math-Verify
    in the sandbox through `check` (the RL reward); integer or choice (evaluation suites): an exact check here
    (rstar2.data.clean), no verifier needed. Returns the mean reward and the verifier's figures ("verify")."""
    df = pl.read_parquet(rollouts_uri)
    texts, golds, cut = df["final_text"].to_list(), df["gold"].to_list(), df["truncated"].to_list()
    statuses: Counter = Counter()
    if answer_type == "math":
        if check is None:
            raise ValueError(f"scoring {rollouts_uri} as math needs a verifier (Math-Verify in the sandbox)")
        rewards = check.score(texts, golds, cut)
        statuses = check.last_statuses
    else:
        rewards = [0.0 if c else clean.matches(extract_answer(t), g, answer_type) for t, g, c in zip(texts, golds, cut)]
    verify = {"verify_calls": float(sum(statuses.values())),
              **{f"verify_status_{k}": float(v) for k, v in statuses.items()}}
    blocks = [roc.count_answer_blocks(t) for t in df["assistant_text"].to_list()]
    df = df.with_columns(
        reward=pl.Series(rewards, dtype=pl.Float64),
        p_err=pl.Series([roc.p_err(s) for s in df["tool_statuses"].to_list()], dtype=pl.Float64),
        p_format=pl.Series([roc.p_format(n, bad, turns) for (n, bad), turns in zip(blocks, df["num_turns"].to_list())],
                           dtype=pl.Float64),
    )
    df.write_parquet(out_uri)
    return {"reward_mean": float(np.mean(rewards)) if rewards else 0.0, "verify": verify}


def sandbox_stats(scored_uri: str, service: dict) -> dict:
    """What the sandbox did this step: the tool calls' statuses and latency (from the rollout table), and `service`:
    the service's own figures over the rollout (calls/s, latency percentiles, queue wait and depth: the rollout's
    "sandbox") and the reward checks (the score's "verify")."""
    df = pl.read_parquet(scored_uri)
    statuses = Counter(s for row in df["tool_statuses"].to_list() for s in row)
    walls = [w for row in df["tool_wall_s"].to_list() for w in row if w > 0]
    calls = sum(statuses.values())
    return {"tool_calls": calls, "tool_calls_per_traj": calls / max(1, df.height),
            "tool_error_rate": 1 - sum(statuses[s] for s in roc.OK_STATUSES) / max(1, calls),
            "tool_latency_mean_s": float(np.mean(walls)) if walls else 0.0,
            "tool_latency_p99_s": float(np.quantile(walls, 0.99)) if walls else 0.0,
            **{f"tool_status_{k}": v for k, v in statuses.items()}, **service}


def roc_filter(scored_uri: str, cfg: RoCCfg, keep: int, seed: int, out_uri: str) -> dict:
    """GRPO-RoC down-sampling (oversampled 2G -> G per prompt); with RoC off, groups are kept whole (plain GRPO).
    Either way, groups whose rewards are all equal are dropped unless cfg.drop_all_equal is off."""
    df = pl.read_parquet(scored_uri)
    penalties = (df["p_err"] + df["p_format"]).to_numpy()
    res = roc.roc_select(df["problem_id"].to_numpy(), df["reward"].to_numpy(), penalties, keep if cfg.enabled else None,
                         np.random.default_rng(seed), cfg.mode, cfg.drop_all_equal, cfg.min_pos, cfg.min_neg)
    kept = df.filter(pl.Series(res.mask))
    kept.write_parquet(out_uri)
    return {"roc_kept": kept.height, "roc_dropped": df.height - kept.height, "roc_dropped_groups": res.dropped_groups}


def batch_metrics(scored_uri: str, kept_uri: str) -> dict:
    """The per-step curves of the paper (Fig. 4, 8): reward, tool errors among positives, format, length, clipping."""
    df, kept = pl.read_parquet(scored_uri), pl.read_parquet(kept_uri)
    pos, kpos = df.filter(pl.col("reward") > 0), kept.filter(pl.col("reward") > 0)

    def err_rate(d: pl.DataFrame) -> float:
        return float((d["p_err"].filter(d["num_tool_calls"] > 0) > 0).mean() or 0.0) if d.height else 0.0

    return {
        "reward_mean": float(df["reward"].mean()), "pass1_train": float(df.group_by("problem_id").agg(
            pl.col("reward").mean())["reward"].mean()),
        "tool_error_rate_pos": err_rate(pos), "tool_error_rate_pos_kept": err_rate(kpos),
        "format_violation_rate": float((df["p_format"] > 0).mean()),
        "no_tool_rate": float((df["num_tool_calls"] == 0).mean()),
        "response_len_mean": float(df["response_len"].mean()), "truncation_rate": float(df["truncated"].mean()),
        "turns_mean": float(df["num_turns"].mean()),
    }


def evaluate(engines: EngineSet, sched_cfg: SchedulerCfg, tokenizer_dir: str, problems_uri: str, cfg: EvalCfg,
             max_model_len: int, sandbox: Backend, check: Verifier | None, out_uri: str, on_done=None,
             answer_type: str = "math") -> dict:
    """pass@1 averaged over `cfg.samples` samples per held-out problem (paper §5.1 protocol, sizes from config), with
    its standard error and pass@k (eval_stats); rolled out through the agent loop like the RL step, answers checked
    as `answer_type` (see score; `check` may be None unless it is math)."""
    df = validate(pl.read_parquet(problems_uri), problems_uri)
    if cfg.n_problems:
        df = df.head(cfg.n_problems)
    limits = RolloutCfg(max_turns=cfg.max_turns, temperature=cfg.temperature,
                        max_response_tokens=cfg.max_response_tokens)
    info = rollout_to_parquet(RolloutSetup(engines, sched_cfg, tokenizer_dir, sandbox, max_model_len),
                              df.select("problem_id", "prompt", "answer").to_dicts(), cfg.samples, limits, out_uri,
                              on_done, seed=f"eval/{cfg.seed}")
    scored = score(out_uri, check, out_uri, answer_type)
    return {**eval_stats(out_uri, cfg.pass_k or None), "eval_s": info["rollout_s"],
            "reward_mean": scored["reward_mean"]}


def eval_stats(scored_uri: str, ks: list[int] | None = None) -> dict:
    """An evaluation's figures from its scored samples: pass1 (avg@k) with its standard error over problems (pass1_se),
    unbiased pass_at_{k} for `ks` (default 1, 2, 4, ... up to the samples per problem; rstar2.evaluation.stats),
    problems, samples, and the mean response length."""
    res = pl.read_parquet(scored_uri)
    by_problem = res.group_by("problem_id", maintain_order=True).agg(pl.col("reward"))["reward"].to_list()
    return {**stats.evaluation_stats(by_problem, ks), "response_len_mean": float(res["response_len"].mean())}
