"""The RL step at scale, simulated: the rollout (bench/rollout_sim.py, placed by the scheduler's own code), the
update and the weight sync, composed four ways. Per step, with R the rollout's time, U the update's and S the sync's:

    synchronous   T = R + U + S          engines wait through U and S, the trainer through R
    overlap k=1   T = max(R, U) + S      the engines generate batch t+1 with the weights they hold while the trainer
                                         updates on batch t (every token one policy version old)
    partial       T = R_q + U + S        the rollout ends when `prompts` groups are complete; unfinished trajectories
                                         carry over to the next step with their turns (APRIL), so R_q cuts the tail
    both          T = max(R_q, U) + S

U = trained tokens x flops_per_token x N / (trainer GPUs x trainer FLOP/s), the trained tokens being the kept G of
each complete group; S = the weights' bytes / the sync's throughput. With the engines and the trainer on one set of
GPUs (colocated, the paper's hybrid engine) only the synchronous step exists, and the trainer has every GPU.
Reported per mode: T, GPU-seconds per step, and the idle share of each kind of device (engine GPUs: 1 - their busy
time / (GPUs x T); trainer GPUs: 1 - (U + S) / T). Partial rollouts are simulated over `steps` steps (the carry-over
settles), and their figures are the mean of all but the first.

`check_tiny` is the simulator against a measured run: the tiny campaign's engines modelled from its first steps
(per-step time t0 + dec_s x n, fitted), then each later step's rollout simulated from that step's own rollouts
(prompt, decoded tokens per turn, tool output, tool latency), plus the update and the rest of the step as measured in
the first steps: the predicted step time against the measured one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from rstar2.bench.rollout_sim import (
    STAGES,
    TOOLS,
    Hardware,
    Quota,
    Workload,
    WorkloadSpec,
    make_workload,
    simulate,
    simulate_until,
    warm_estimator,
)
from rstar2.core.config import SchedulerCfg

MODES = ("synchronous", "overlap", "partial", "both")
H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H200


@dataclass(frozen=True)
class Costs:
    """What the update and the sync cost: N parameters; the trainer's achieved FLOP/s per GPU; FLOPs per trained
    token per parameter (forward 2, backward 4, recompute 2 under gradient checkpointing); the sync's throughput in
    bytes/s of weights (bf16: 2 bytes a parameter) and its fixed cost."""
    params: float
    trainer_flops: float
    sync_bytes_per_s: float
    sync_fixed_s: float = 0.0
    flops_per_token: float = 8.0
    weight_bytes: float = 2.0

    def update_s(self, tokens: float, gpus: int) -> float:
        return tokens * self.flops_per_token * self.params / (gpus * self.trainer_flops)

    @property
    def sync_s(self) -> float:
        return self.sync_fixed_s + self.params * self.weight_bytes / self.sync_bytes_per_s


@dataclass(frozen=True)
class Shape:
    """The cluster and the batch: engines of `tp` GPUs each, trainer GPUs (colocated: the engines' own), a step's
    prompts x samples rollouts of which `keep` per prompt are trained on (RoC: 2G drawn, G kept)."""
    engines: int
    tp: int
    trainer_gpus: int
    colocated: bool
    prompts: int
    samples: int
    keep: int
    stage: str = "s1"
    capacity: int = 750_000
    tools: str = "base"

    @property
    def gpus(self) -> int:
        return self.engines * self.tp + (0 if self.colocated else self.trainer_gpus)


def qwen3_14b(split: tuple[int, int] | None = None, prompts: int = 512) -> Shape:
    """The `qwen3-14b` preset's shape: 64 GPUs, 16 engines of TP4, 512 prompts x 32 rollouts (keep 16), colocated;
    or with `split` (engine GPUs, trainer GPUs) the same 64 GPUs split in two pools, which overlap needs."""
    if split is None:
        return Shape(16, 4, 64, True, prompts, 32, 16)
    engine_gpus, trainer_gpus = split
    return Shape(engine_gpus // 4, 4, trainer_gpus, False, prompts, 32, 16)


def _stacked(parts: list[Workload], cap: int) -> Workload:
    return Workload(np.concatenate([w.group for w in parts]), np.concatenate([w.prompt_len for w in parts]),
                    [d for w in parts for d in w.decode], [o for w in parts for o in w.tool_out],
                    [s for w in parts for s in w.tool_s], cap)


def _carry(wl: Workload, left: list, quota_of: np.ndarray, born: np.ndarray, next_group: int
           ) -> tuple[Workload, np.ndarray, np.ndarray]:
    """The unfinished trajectories as the next step's: their context so far is prefilled again (new weights: no
    cached KV survives the sync), their current turn resumes after the tokens it had decoded; each gets a group of
    its own for prefix sharing (its context is its own) and keeps its quota group and birth step."""
    group, prompt, dec, out, tool = [], [], [], [], []
    for i, u in enumerate(left):
        t = u.tid
        group.append(next_group + i)
        prompt.append(int(wl.prompt_len[t]) + u.response + u.decoded)
        rest = wl.decode[t][u.turn:]
        dec.append([max(1, rest[0] - u.decoded)] + rest[1:])
        out.append(wl.tool_out[t][u.turn:])
        tool.append(wl.tool_s[t][u.turn:])
    tids = [u.tid for u in left]
    return (Workload(np.asarray(group, dtype=int), np.asarray(prompt, dtype=int), dec, out, tool, wl.cap),
            quota_of[tids], born[tids])


_ROLLED: dict[tuple, list[dict]] = {}  # modes that differ only after the rollout share its simulation


def rollout_steps(shape: Shape, hw: Hardware, policy: str, partial: bool, steps: int, seed: int, icc: float,
                  cfg: SchedulerCfg, extra: float = 0.25) -> list[dict]:
    key = (shape, hw, policy, partial, steps, seed, icc, cfg.model_dump_json(), extra)
    if key not in _ROLLED:
        _ROLLED[key] = _rollout_steps(shape, hw, policy, partial, steps, seed, icc, cfg, extra)
    return _ROLLED[key]


def _rollout_steps(shape: Shape, hw: Hardware, policy: str, partial: bool, steps: int, seed: int, icc: float,
                   cfg: SchedulerCfg, extra: float) -> list[dict]:
    """`steps` consecutive rollouts of `shape.prompts` new groups each; partial: groups in flight are topped up to
    (1 + `extra`) x prompts (what the last step left, then new ones) and a step ends when `prompts` of them are
    complete. Per step: its rollout time, the engines' busy seconds, the mean age in steps of what ended, and how
    many trajectories it left unfinished."""
    rng = np.random.default_rng(seed)
    spec = lambda n: WorkloadSpec(n, shape.samples, STAGES[shape.stage], icc, TOOLS[shape.tools])  # noqa: E731
    est = warm_estimator(make_workload(spec(shape.prompts), np.random.default_rng(10_000 + seed)), cfg)
    carried: tuple[Workload, np.ndarray, np.ndarray] | None = None
    target = math.ceil(shape.prompts * (1 + extra)) if partial else shape.prompts
    out, gid0 = [], 0
    for step in range(steps):
        in_flight = 0 if carried is None else len(np.unique(carried[1]))
        new = make_workload(spec(max(1, target - in_flight)), rng)
        new = replace(new, group=new.group + gid0)
        gid0 += target
        parts, quota_of, born = [new], [new.group.copy()], [np.full(len(new.group), step)]
        if carried is not None:
            parts.insert(0, carried[0])
            quota_of.insert(0, carried[1])
            born.insert(0, carried[2])
        wl = _stacked(parts, new.cap)
        quota_of, born = np.concatenate(quota_of), np.concatenate(born)
        if partial:
            res, left, ended = simulate_until(wl, hw, shape.engines, policy, cfg, Quota(quota_of, shape.prompts), est)
            carried = _carry(wl, left, quota_of, born, 10**8 + step * 10**6) if left else None
        else:
            res, ended = simulate(wl, hw, shape.engines, policy, cfg, est), list(range(len(wl.group)))
        out.append({"rollout_s": res.makespan_s, "engine_busy_s": sum(res.busy_s),
                    "age": float(np.mean(step - born[ended])) if ended else 0.0,
                    "carried": 0 if carried is None else len(carried[1])})
    return out


def step_figures(shape: Shape, costs: Costs, hw: Hardware, mode: str, policy: str = "kv_aware", steps: int = 4,
                 seed: int = 0, icc: float = 0.3, cfg: SchedulerCfg = SchedulerCfg()) -> dict:
    """One mode's step: T, R, U, S, GPU-seconds per step and the idle shares (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if shape.colocated and mode != "synchronous":
        raise ValueError(f"{mode} needs separate engine and trainer GPUs: a colocated shape has one set")
    partial = mode in ("partial", "both")
    rolled = rollout_steps(shape, hw, policy, partial, steps if partial else 1, seed, icc, cfg)
    settled = rolled[1:] if len(rolled) > 1 else rolled
    r = statistics.fmean(x["rollout_s"] for x in settled)
    busy = statistics.fmean(x["engine_busy_s"] for x in settled)
    spec = WorkloadSpec(shape.prompts, shape.samples, STAGES[shape.stage], icc)
    mean_tokens = _mean_tokens(spec, seed)
    u = costs.update_s(shape.prompts * shape.keep * mean_tokens, shape.trainer_gpus)
    s = costs.sync_s
    t = max(r, u) + s if mode in ("overlap", "both") else r + u + s
    engine_gpus = shape.engines * shape.tp
    # colocated: the engines' GPUs are the trainer's, busy generating in R and training in U
    engine_idle = 1 - (busy * shape.tp + (u * engine_gpus if shape.colocated else 0)) / (engine_gpus * t)
    return {"mode": mode, "policy": policy, "gpus": shape.gpus, "step_s": t, "rollout_s": r, "update_s": u,
            "sync_s": s, "gpu_s": shape.gpus * t, "engine_idle": engine_idle,
            "trainer_idle": None if shape.colocated else 1 - (u + s) / t,
            "staleness": statistics.fmean(x["age"] for x in settled) + (1 if mode in ("overlap", "both") else 0),
            "carried": statistics.fmean(x["carried"] for x in settled)}


def _mean_tokens(spec: WorkloadSpec, seed: int) -> float:
    """Mean trained tokens (prompt + response) of one rollout of the workload model."""
    wl = make_workload(spec, np.random.default_rng(20_000 + seed))
    return float(np.mean(wl.prompt_len + wl.response_len))


def scale_table(costs: Costs, hw: Hardware, split: tuple[int, int], policies: tuple[str, ...], seeds: int,
                icc: float, prompts: int = 512, steps: int = 4) -> list[dict]:
    """The `qwen3-14b` shape: colocated synchronous (the paper's), then on `split` GPUs each mode; medians over
    seeds."""
    rows = []
    cases = [(qwen3_14b(prompts=prompts), "synchronous")] + [(qwen3_14b(split, prompts), m) for m in MODES]
    for shape, mode in cases:
        for p in policies:
            runs = [step_figures(shape, costs, hw, mode, p, steps, seed, icc) for seed in range(seeds)]
            row = {k: statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else runs[0][k]
                   for k in runs[0]}
            rows.append({"layout": "colocated" if shape.colocated else f"{split[0]}+{split[1]}", **row})
    return rows


# ---- against a measured tiny campaign -----------------------------------------------------------------------
def workload_of(rollouts: str) -> Workload:
    """A measured rollout as the simulator's workload: per trajectory its prompt, the model's tokens per turn
    (runs of the loss mask), the tokens between them (tool output and the template around it) and each tool call's
    measured wall time."""
    import polars as pl

    df = pl.read_parquet(rollouts, columns=["problem_id", "prompt_ids", "loss_mask", "tool_wall_s"])
    groups = {p: i for i, p in enumerate(dict.fromkeys(df["problem_id"].to_list()))}
    dec, out, tool = [], [], []
    for mask, walls in zip(df["loss_mask"].to_list(), df["tool_wall_s"].to_list()):
        runs = _runs(mask)
        model = [n for v, n in runs if v == 1] or [1]
        between = [n for i, (v, n) in enumerate(runs) if v == 0 and 0 < i < len(runs) - 1]
        between = (between + [0] * len(model))[:len(model) - 1]
        walls = list(walls or [])
        dec.append(model)
        out.append(between)
        tool.append([walls[i] if i < len(walls) else 0.0 for i in range(len(model) - 1)])
    prompt = np.array([len(p) for p in df["prompt_ids"].to_list()])
    return Workload(np.array([groups[p] for p in df["problem_id"].to_list()]), prompt, dec, out, tool,
                    int(max(sum(d) + sum(o) for d, o in zip(dec, out))))


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for v in mask:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def fit_engine(workloads: list[Workload], measured_s: list[float], engines: int, capacity: int, max_seqs: int,
               cfg: SchedulerCfg) -> Hardware:
    """The engine model t0 + dec_s x n a step (CPU engines: no memory-bound term) whose simulated rollouts best fit
    the measured times (least squares on log time), by a grid over t0 and dec_s."""
    best = None
    for t0 in np.geomspace(1e-3, 5e-2, 14):
        for dec in np.geomspace(1e-5, 5e-3, 14):
            hw = Hardware(capacity=capacity, t0=float(t0), weights_s=0.0, kv_s=0.0, dec_s=float(dec),
                          prefill_s=float(dec) / 8, max_num_seqs=max_seqs)
            err = sum((math.log(simulate(w, hw, engines, "kv_aware", cfg).makespan_s) - math.log(m)) ** 2
                      for w, m in zip(workloads, measured_s))
            if best is None or err < best[0]:
                best = (err, hw)
    return best[1]


def check_tiny(step_dirs: list[Path], measured: list[dict], engines: int, capacity: int, max_seqs: int,
               calibrate: int, cfg: SchedulerCfg = SchedulerCfg()) -> dict:
    """Fit the engines on the first `calibrate` steps (their rollout times), take the update and the rest of the step
    (step_s - rollout_wall_s - update_s: scoring, RoC, checkpoint, sync, orchestration) as their medians there, and
    predict every later step's time from its own rollouts. `measured[i]`: step i's rollout_wall_s, update_s, step_s."""
    wls = [workload_of(str(d / "rollouts.parquet")) for d in step_dirs]
    hw = fit_engine(wls[:calibrate], [m["rollout_wall_s"] for m in measured[:calibrate]], engines, capacity, max_seqs,
                    cfg)
    update = statistics.median(m["update_s"] for m in measured[:calibrate])
    rest = statistics.median(m["step_s"] - m["rollout_wall_s"] - m["update_s"] for m in measured[:calibrate])
    rows = []
    for i, (w, m) in enumerate(zip(wls[calibrate:], measured[calibrate:]), start=calibrate):
        r = simulate(w, hw, engines, "kv_aware", cfg).makespan_s
        rows.append({"step": i + 1, "rollout_sim_s": r, "rollout_s": m["rollout_wall_s"],
                     "step_pred_s": r + update + rest, "step_s": m["step_s"]})
    pred, real = sum(r["step_pred_s"] for r in rows), sum(r["step_s"] for r in rows)
    return {"engine": {"t0": hw.t0, "dec_s": hw.dec_s, "prefill_s": hw.prefill_s}, "update_s": update, "rest_s": rest,
            "steps": rows, "predicted_s": pred, "measured_s": real, "error": pred / real - 1}


# ---- `rstar2 bench step` ------------------------------------------------------------------------------------
def measured_run(run_dir: Path, stage: str) -> tuple[list[Path], list[dict], dict]:
    """A one-seed campaign's steps of `stage` as check_tiny takes them: their step directories, their measured
    rollout_wall_s, update_s and step_s (from the stage's MLflow run) and the engines' shape (count, KV tokens,
    sequences at most)."""
    import json

    from rstar2.core import tracking
    from rstar2.core.config import RunCfg
    from rstar2.core.layout import RunLayout

    layout = RunLayout.at(run_dir)
    if not layout.config.exists():
        raise ValueError(f"{run_dir} is not a campaign's run directory (no {layout.config.name})")
    cfg = RunCfg.model_validate_json(layout.config.read_text())
    exp = tracking.setup(cfg.experiment, cfg.out_dir)
    found = tracking.client().search_runs([exp], f"tags.`rstar2.key` = '{layout.root}#{stage}'", max_results=1)
    if not found:
        raise ValueError(f"no MLflow run of stage {stage} of {run_dir}")
    keys = ("rollout_wall_s", "update_s", "step_s")
    hist = {k: {m.step: m.value for m in tracking.client().get_metric_history(found[0].info.run_id, k)} for k in keys}
    steps = sorted(set.intersection(*(set(h) for h in hist.values())))
    if len(steps) < 4:
        raise ValueError(f"stage {stage} of {run_dir} has {len(steps)} logged steps; the check needs at least 4")
    arch = json.loads((layout.checkpoint(stage, steps[-1]) / "config.json").read_text())  # the engines' model
    head_dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    per_token = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * (
        4 if cfg.engine.dtype == "float32" else 2)
    engines = {"engines": cfg.engine.num_engines, "capacity": cfg.engine.kv_cache_mb * 2**20 // per_token,
               "max_seqs": cfg.scheduler.max_inflight}
    return ([layout.step_dir(stage, s - 1) for s in steps], [{k: hist[k][s] for k in keys} for s in steps], engines)


def command(prompts: int = typer.Option(512, help="prompts per step, 32 rollouts each, 16 kept (the preset's)"),
            split: str = typer.Option("48,16", help="engine GPUs,trainer GPUs of the 64 when they are two pools"),
            policies: str = typer.Option("kv_aware,least_requests", help="rollout placement policies, comma-separated"),
            seeds: int = typer.Option(2, min=1, help="workloads per case (medians)"),
            steps: int = typer.Option(4, min=2, help="partial: consecutive steps simulated (the first is left out)"),
            icc: float = typer.Option(0.3, help="within-prompt correlation of response lengths"),
            trainer_mfu: float = typer.Option(0.35, help="trainer FLOP/s as a share of the H200's bf16 peak"),
            sync_gb_per_s: float = typer.Option(8.6, help="weight sync throughput, GB of bf16 weights a second"),
            check_run: Optional[Path] = typer.Option(None, help="a one-seed campaign's run directory: predict its "
                                                                "step times from its measured per-phase costs"),
            check_stage: str = typer.Option("stage1", help="the checked run's stage"),
            calibrate: int = typer.Option(8, min=1, help="check: steps that fit the engine model and the costs"),
            json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """The RL step at the qwen3-14b preset's shape, simulated: synchronous (colocated, and on two GPU pools),
    overlap k=1, partial rollouts and both; GPU-seconds per step and each kind of GPU's idle share. With
    --check-run, the simulator against a measured tiny campaign."""
    from rich.table import Table

    from rstar2.core import progress

    console, out = progress.console(), {}
    try:
        engine_gpus, trainer_gpus = (int(x) for x in split.split(","))
    except ValueError:
        console.print(f"[red]error:[/red] --split takes two GPU counts, e.g. 48,16; got {split!r}")
        raise typer.Exit(2)
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    if check_run:
        try:
            dirs, measured, eng = measured_run(check_run, check_stage)
        except ValueError as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2)
        if calibrate >= len(measured):
            console.print(f"[red]error:[/red] --calibrate {calibrate} leaves no step of {len(measured)} to predict")
            raise typer.Exit(2)
        chk = check_tiny(dirs, measured, eng["engines"], eng["capacity"], eng["max_seqs"], calibrate)
        t = Table(title=f"simulated vs measured step time, {check_run} (engines fitted on steps 1-{calibrate}: "
                        f"t0 {chk['engine']['t0'] * 1e3:.2f} ms + {chk['engine']['dec_s'] * 1e3:.3f} ms a sequence; "
                        f"update {chk['update_s']:.2f} s, rest {chk['rest_s']:.2f} s)")
        for col in ("step", "rollout sim s", "rollout s", "step predicted s", "step s"):
            t.add_column(col, justify="right")
        for r in chk["steps"]:
            t.add_row(str(r["step"]), f"{r['rollout_sim_s']:.2f}", f"{r['rollout_s']:.2f}", f"{r['step_pred_s']:.2f}",
                      f"{r['step_s']:.2f}")
        t.add_row("all", "", "", f"{chk['predicted_s']:.1f}", f"{chk['measured_s']:.1f} ({chk['error']:+.1%})")
        console.print(t)
        out["check"] = chk
    costs = Costs(params=14.8e9, trainer_flops=trainer_mfu * H200_BF16_FLOPS, sync_bytes_per_s=sync_gb_per_s * 1e9)
    rows = scale_table(costs, Hardware(), (engine_gpus, trainer_gpus), chosen, seeds, icc, prompts, steps)
    t = Table(title=f"RL step, qwen3-14b shape ({prompts} prompts x 32, 64 GPUs; trainer at {trainer_mfu:.0%} of "
                    f"the H200's bf16 peak, sync {sync_gb_per_s} GB/s; medians of {seeds} workloads)")
    for col in ("GPUs", "mode", "policy", "step s", "rollout s", "update s", "sync s", "GPU-s / step",
                "engine idle", "trainer idle", "staleness", "carried"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["layout"], r["mode"], r["policy"], f"{r['step_s']:.0f}", f"{r['rollout_s']:.0f}",
                  f"{r['update_s']:.0f}", f"{r['sync_s']:.1f}", f"{r['gpu_s']:,.0f}", f"{r['engine_idle']:.0%}",
                  "-" if r["trainer_idle"] is None else f"{r['trainer_idle']:.0%}", f"{r['staleness']:.2f}",
                  f"{r['carried']:.0f}")
    console.print(t)
    out.update({"rows": rows, "prompts": prompts, "split": [engine_gpus, trainer_gpus], "seeds": seeds,
                "trainer_mfu": trainer_mfu, "sync_gb_per_s": sync_gb_per_s, "icc": icc, "steps": steps})
    if json_path:
        import json

        json_path.write_text(json.dumps(out, indent=1))
