"""The step simulator (bench/step_sim.py): its cost model by hand, a partial rollout's stop and carry-over on a
workload small enough to follow, a measured rollout read back as a workload, and the engine fit recovering a known
engine from rollouts it timed."""

import numpy as np
import polars as pl
import pytest

from rstar2.bench import step_sim
from rstar2.bench.rollout_sim import Hardware, Quota, Workload, simulate, simulate_until
from rstar2.core.config import SchedulerCfg

# one step: t0 + 1 ms per running sequence; nothing memory-bound, KV ample
ENGINE = Hardware(capacity=100_000, t0=0.0, weights_s=0.0, kv_s=0.0, dec_s=1e-3, prefill_s=0.0, max_num_seqs=64)


def test_update_and_sync_costs_by_hand():
    c = step_sim.Costs(params=1e9, trainer_flops=1e14, sync_bytes_per_s=1e9, sync_fixed_s=0.5)
    # 1M tokens x 8 FLOPs x 1e9 params over 4 GPUs at 1e14 FLOP/s: 8e15 / 4e14 = 20 s
    assert c.update_s(1e6, 4) == pytest.approx(20.0)
    assert c.sync_s == pytest.approx(0.5 + 2e9 / 1e9)  # bf16: 2 bytes a parameter


def _two_groups() -> Workload:
    """Group 0: two one-turn trajectories of 10 tokens; group 1: two of 1000 tokens over two turns (a 0 s tool)."""
    return Workload(np.array([0, 0, 1, 1]), np.array([5, 5, 5, 5]), [[10], [10], [500, 500], [500, 500]],
                    [[], [], [20], [20]], [[], [], [0.0], [0.0]], 2048)


def test_a_partial_rollout_stops_at_its_quota_and_says_where_each_trajectory_stood():
    wl = _two_groups()
    full = simulate(wl, ENGINE, 1, "least_requests", SchedulerCfg())
    res, left, ended = simulate_until(wl, ENGINE, 1, "least_requests", SchedulerCfg(), Quota(wl.group, 1))
    assert sorted(ended) == [0, 1] and res.makespan_s < full.makespan_s / 10
    # at the stop the long ones are inside their first turn: 10 steps decoded, nothing of the response done yet
    assert [(u.tid, u.turn, u.response, u.decoded) for u in left] == [(2, 0, 0, 10), (3, 0, 0, 10)]
    nxt, quota_of, born = step_sim._carry(wl, left, wl.group, np.zeros(4, dtype=int), 100)
    assert nxt.decode == [[490, 500], [490, 500]] and nxt.prompt_len.tolist() == [15, 15]  # context prefilled again
    assert quota_of.tolist() == [1, 1] and nxt.group.tolist() == [100, 101] and born.tolist() == [0, 0]


def test_the_modes_compose_rollout_update_and_sync():
    shape = step_sim.Shape(engines=2, tp=1, trainer_gpus=2, colocated=False, prompts=4, samples=4, keep=2)
    costs = step_sim.Costs(params=1e6, trainer_flops=1e9, sync_bytes_per_s=1e6)
    sync = step_sim.step_figures(shape, costs, ENGINE, "synchronous")
    over = step_sim.step_figures(shape, costs, ENGINE, "overlap")
    r, u, s = sync["rollout_s"], sync["update_s"], sync["sync_s"]
    assert s == pytest.approx(2.0) and sync["step_s"] == pytest.approx(r + u + s)
    assert over["step_s"] == pytest.approx(max(r, u) + s) and over["staleness"] == 1.0
    assert sync["trainer_idle"] == pytest.approx(1 - (u + s) / (r + u + s))
    assert over["gpu_s"] == pytest.approx(4 * over["step_s"])
    with pytest.raises(ValueError, match="separate engine and trainer GPUs"):
        step_sim.step_figures(step_sim.qwen3_14b(prompts=4), costs, ENGINE, "overlap")


def test_a_measured_rollout_becomes_the_workload_it_was(tmp_path):
    # model tokens (mask 1) and between them the tool's reply (mask 0); a trailing template token after the answer
    rows = {"problem_id": ["a", "a", "b"], "prompt_ids": [[1] * 7, [1] * 7, [1] * 9],
            "loss_mask": [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0]],
            "tool_wall_s": [[0.25], [], [0.5]]}
    pl.DataFrame(rows).write_parquet(tmp_path / "rollouts.parquet")
    wl = step_sim.workload_of(str(tmp_path / "rollouts.parquet"))
    assert wl.group.tolist() == [0, 0, 1] and wl.prompt_len.tolist() == [7, 7, 9]
    assert wl.decode == [[3, 2], [4], [1, 2]] and wl.tool_out == [[2], [], [3]] and wl.tool_s == [[0.25], [], [0.5]]


def test_the_engine_fit_recovers_an_engine_from_the_rollouts_it_timed():
    rng = np.random.default_rng(0)
    truth = Hardware(capacity=50_000, t0=4e-3, weights_s=0.0, kv_s=0.0, dec_s=3e-4, prefill_s=3e-4 / 8,
                     max_num_seqs=256)
    wls = []
    for _ in range(4):
        n = 32
        dec = [list(rng.integers(5, 60, size=int(rng.integers(1, 4)))) for _ in range(n)]
        wls.append(Workload(np.repeat(np.arange(8), 4), rng.integers(40, 80, size=n),
                            [[int(x) for x in d] for d in dec], [[12] * (len(d) - 1) for d in dec],
                            [[0.01] * (len(d) - 1) for d in dec], 1024))
    timed = [simulate(w, truth, 2, "kv_aware", SchedulerCfg()).makespan_s for w in wls]
    fit = step_sim.fit_engine(wls[:2], timed[:2], 2, 50_000, 256, SchedulerCfg())
    for w, t in zip(wls[2:], timed[2:]):  # steps it was not fitted on
        assert simulate(w, fit, 2, "kv_aware", SchedulerCfg()).makespan_s == pytest.approx(t, rel=0.15)
