"""`rstar2 chaos`: kill parts of a running campaign, and check that the run they leave is the run without them.

A shrunken campaign of the preset (a few RL steps, see SHRINK) runs once without faults (`ref`). Then, from the
reference's SFT model, it runs again once per row of the plan, with each of the row's faults injected at its point,
in turn (a fault waits for the one before it in its row). A run that stops with an error is retried with the same
command (what the Prefect UI's Retry does), at most once per fault of its row. Verdicts:

    recovered   the run ended by itself and every check below holds
    retried     the run stopped with one error, a retry ended it, and every check below holds
    lost        the run ended, but a check failed (named)
    failed      a fault could not be injected, or the run did not end even on retry

Checks, against the reference: each step's figures (reward, tool errors, format, length, grad norm, loss, entropy,
RoC kept) and the held-out pass@1 to the last digit; each step's kept rollouts (a hash of problem, sample, tokens,
reward); each step's rollout table holding every (problem, sample) once and the same ones; each step in MLflow exactly
once; every checkpoint committed, with the trainer's optimizer step counting on, none left half-written, and none that
was committed before a retry written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from rstar2.cli import services
from rstar2.run import checkpoint
from rstar2.run.layout import RunLayout

# the shrunken campaign: three RL steps of a few prompts; every step updates (drop_all_equal off), so the optimizer
# step count shows whether the trainer's state came back
SHRINK = ["stages.0.steps=3", "stages.0.prompts_per_step=3", "rollout.group_size=4", "eval.samples=1",
          "roc.drop_all_equal=false"]
# and for the tiny world (no world.base_model): fewer problems, shorter answers. Its SFT stays the preset's: a weaker
# model earns no reward, so its updates are zero and a wrong trainer state after a fault would go unseen
SHRINK_TINY_WORLD = ["world.n_train=40", "world.n_test=20", "rollout.max_response_tokens=160",
                     "eval.max_response_tokens=160", "world.max_positions=512"]
# what a run must repeat to the digit. Not logprob_gap: the engine's log-probs of the same tokens move at the 1e-8
# level with how turns are batched together (one engine instead of two), so it is compared as noise (GAP_NOISE)
FIGURES = ["reward_mean", "tool_error_rate", "format_violation_rate", "response_len_mean", "grad_norm", "loss",
           "entropy", "roc_kept"]
GAP_NOISE = 1e-5
TIMEOUT_S = 1800.0  # one run of the shrunken campaign, at most


@dataclass
class Run:
    """One campaign process of a row and what the injection needs to see of it."""
    layout: RunLayout
    stage: str
    log: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # set in the campaign's environment
    state: dict = field(default_factory=dict)  # what the faults keep between looks

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def actors(self, cls: str) -> list[psutil.Process]:
        return [p for p in self.children() if _cmdline(p)[:1] and _cmdline(p)[0].startswith(f"ray::{cls}")]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Fault:
    """A fault: when it is due (`due`), what it does (`inject`: returns where it struck, or raises Unready to wait),
    and what to do before a retry (`mend`: e.g. free the disk)."""
    name: str
    point: str
    due: Callable[[Run], bool]
    inject: Callable[[Run], str]
    mend: Callable[[Run], None] = lambda run: None
    prepare: Callable[[Run], None] = lambda run: None  # before the run starts
    stops_run: bool = False  # it kills the campaign itself: the next fault waits for a retry
    cleanup: Callable[[Run], None] = lambda run: None  # after the row, whatever happened


class Unready(Exception):
    """The fault's point has come but not its moment (e.g. no call in flight yet): try again shortly."""


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _busy(procs: list[psutil.Process], above: float = 30.0) -> list[psutil.Process]:
    """Those of `procs` using more than `above` % of a core over a short look (an engine that is generating)."""
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(0.3)
    out = []
    for p in procs:
        try:
            if p.cpu_percent(None) > above:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _where(run: Run, step: int) -> str:
    """Where the run is within RL step `step` (0-based): before its rollout table is written, or after."""
    return f"step {step + 1}, {'after its rollout' if _rolled(step)(run) else 'rollout under way'}"


# --- the faults

def _sft_evaluated(run: Run) -> bool:
    """The SFT model's evaluation is recorded: RL starts next."""
    return run.layout.sft_record(run.state.get("split", "test")).exists()


def _kill_engine(run: Run) -> str:
    engines = run.actors("EngineActor")
    busy = _busy(engines)
    if not busy:
        raise Unready("no engine is generating yet")
    busy[0].kill()
    return f"{_where(run, 0)}: engine pid {busy[0].pid} (of {len(engines)})"


def _kill_trainer(run: Run) -> str:
    """SIGKILL the trainer once step 1's rollout table is written: its update, which comes next, finds it dead (on
    a small model the update itself is over in a fraction of a second, too soon to be caught in flight)."""
    trainers = run.actors("PolicyTrainer")
    if not trainers:
        raise Unready("no trainer process")
    for t in trainers:
        t.kill()
    updated = (run.layout.checkpoint(run.stage, 1)).exists()
    return f"step 1, {'after' if updated else 'before'} its update: trainer pid {trainers[0].pid}"


def _zygotes(run: Run, where: psutil.Process | None = None) -> list[psutil.Process]:
    """The sandbox's executors: zygote processes whose parent is not one (their forks run the calls), under `where`
    (default: the campaign, and the row's sandbox server if it has one)."""
    if where is not None:
        tree = where.children(recursive=True)
    else:
        server = run.state.get("servers", {}).get("sandbox")
        tree = run.children() + (psutil.Process(server.proc.pid).children(recursive=True)
                                 if server is not None and server.down_at is None else [])
    procs = [p for p in tree if any(a.endswith("zygote.py") for a in _cmdline(p)[:4])]
    pids = {p.pid for p in procs}
    return [p for p in procs if _parent(p) not in pids]


def _parent(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:  # gone meanwhile (an executor restarting)
        return None


def _busy_executor(zygotes: list[psutil.Process]) -> psutil.Process | None:
    """The first of `zygotes` running a call now, if any (one that died meanwhile is not)."""
    for z in zygotes:
        try:
            if _in_call(z):
                return z
        except psutil.Error:
            continue
    return None


def _in_call(zygote: psutil.Process) -> bool:
    """Whether the executor runs a call now: it forks one process per call, long after it started (a fork made at
    its start, the namespace's first process, is not a call)."""
    born = zygote.create_time()
    return any(p.create_time() - born > 1.0 for p in zygote.children(recursive=True))


def _kill_executor(run: Run) -> str:
    """SIGKILL a sandbox executor (zygote) while it runs a call; if the step's rollout ends with none seen in flight
    (a model that calls no tool), every executor between calls, the next call starting them again."""
    zygotes = _zygotes(run)
    if (z := _busy_executor(zygotes)) is not None:
        z.kill()
        return f"{_where(run, 0)}: executor pid {z.pid} mid-call"
    if zygotes and _rolled(0)(run):
        for z in zygotes:
            try:
                z.kill()
            except psutil.NoSuchProcess:
                pass
        return f"step 1, after its rollout: {len(zygotes)} executors between calls (no call was seen in flight)"
    raise Unready("no call in flight")


def _rolled(step: int) -> Callable[[Run], bool]:
    return lambda run: (run.layout.step_dir(run.stage, step) / "rollouts.parquet").exists()


def _kill_flow(run: Run) -> str:
    os.killpg(run.proc.pid, signal.SIGKILL)
    return "step 2, once its rollout table is written: the campaign's process group"


def _committed(step: int) -> Callable[[Run], bool]:
    return lambda run: checkpoint.is_committed(run.layout.checkpoint(run.stage, step))


def _disk_prepare(run: Run) -> None:
    """The run's checkpoints on a filesystem of their own: a tmpfs sized for ten copies of the SFT model (weights,
    optimizer state, a few checkpoints), in memory, so at most half of it."""
    d = run.layout.checkpoints(run.stage)
    model_mb = sum(f.stat().st_size for f in Path(run.state["sft"]).rglob("*") if f.is_file()) / 2**20
    size_mb = max(256, int(10 * model_mb))
    if size_mb > psutil.virtual_memory().total / 2**21:
        raise RuntimeError(f"the disk row needs a {size_mb} MB tmpfs, more than half this machine's memory: leave it "
                           "out (--row ...)")
    d.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(d)], capture_output=True,
                         text=True)
    if res.returncode:
        raise RuntimeError(f"mounting a small filesystem for the checkpoints needs root: {res.stderr.strip()}")


def _ballast(run: Run) -> Path:
    return run.layout.checkpoints(run.stage) / ".ballast"


def _fill_disk(run: Run) -> str:
    """Fill the checkpoints' filesystem to its last byte: the next checkpoint cannot be written."""
    with open(_ballast(run), "ab", buffering=0) as f:
        for chunk in (2**20, 2**12, 1):
            try:
                while f.write(b"\0" * chunk):
                    pass
            except OSError:  # full at this chunk's size: on with a smaller one
                pass
    return "after step 1's checkpoint: the checkpoints' disk filled"


def _disk_cleanup(run: Run) -> None:
    _ballast(run).unlink(missing_ok=True)


def _disk_unmount(run: Run) -> None:
    """Copy the checkpoints off the small filesystem (for the checks), then unmount it."""
    d = run.layout.checkpoints(run.stage)
    keep = d.with_name(d.name + ".kept")
    _disk_cleanup(run)
    shutil.copytree(d, keep, dirs_exist_ok=True)
    subprocess.run(["umount", str(d)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)
    keep.rename(d)


@dataclass
class Server:
    """A server a row runs beside its campaign (MLflow, the sandbox's HTTP server, Prefect): a fault stops it, and it
    is started again `down_for` seconds later, as a supervisor would, in a thread of its own (the faults after it
    keep their moments while it starts)."""
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | None = None
    down_at: float | None = None
    down_for: float = 0.0
    starting: threading.Thread | None = None

    def up(self) -> None:
        self.proc, self.down_at = self.start(), None

    def kill(self, sig: signal.Signals, down_for: float) -> None:
        os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=60)
        self.down_at, self.down_for = time.monotonic(), down_for

    def due(self) -> bool:
        return self.down_at is not None and self.starting is None and time.monotonic() - self.down_at >= self.down_for

    def up_soon(self) -> None:
        self.starting = threading.Thread(target=self.up, daemon=True)
        self.starting.start()

    def wait_up(self) -> None:
        """Up now: the start under way finished, or a start now."""
        if self.starting is not None:
            self.starting.join()
            self.starting = None
        if self.down_at is not None:
            self.up()

    def stop(self) -> None:
        if self.starting is not None:
            self.starting.join()
        if self.proc is not None and self.down_at is None:
            services.stop_tree(services.tree(self.proc), grace_s=30)


def _servers_up(run: Run, due_only: bool = False) -> None:
    """Start again the row's servers a fault stopped: those whose time is up, in the background (`due_only`), or all,
    waiting until they answer."""
    for server in run.state.get("servers", {}).values():
        if due_only:
            if server.due():
                server.up_soon()
        else:
            server.wait_up()


def _mlflow_stop(run: Run) -> str:
    run.state["servers"]["mlflow"].kill(signal.SIGTERM, run.state["outage_s"])
    return f"step 2 starts: the MLflow server stopped for {run.state['outage_s']:.0f} s"


PREFECT_RESTART_S = 5.0  # the Prefect server's restart: down this long, then as long as its start takes


def _prefect_restart(run: Run) -> str:
    run.state["servers"]["prefect"].kill(signal.SIGTERM, PREFECT_RESTART_S)
    return f"step 2 starts: the Prefect server stopped, started again {PREFECT_RESTART_S:.0f} s later"


SANDBOX_RESTART_S = 3.0  # a supervisor's restart delay: the client's retries (sandbox.retries) span it and the start


def _kill_sandbox_server(run: Run) -> str:
    """SIGKILL the sandbox's HTTP server (its executors die with it) while it runs a call, or once step 1's rollout
    table is written if none was seen in flight; it is started again SANDBOX_RESTART_S later."""
    server = run.state["servers"]["sandbox"]
    busy = _busy_executor(_zygotes(run, psutil.Process(server.proc.pid))) is not None
    if not busy and not _rolled(0)(run):
        raise Unready("no call in flight")
    server.kill(signal.SIGKILL, SANDBOX_RESTART_S)
    return (f"{_where(run, 0)}: the sandbox server {'mid-call' if busy else 'between calls'}, started again "
            f"{SANDBOX_RESTART_S:.0f} s later")


def fault_table(outage_s: float) -> dict[str, Fault]:
    """Every fault the command knows, by name."""
    return {f.name: f for f in [
        Fault("none", "nowhere", lambda run: True, lambda run: "no fault: the same run again (repeatability)"),
        Fault("engine", "step 1 rollout", _sft_evaluated, _kill_engine),
        Fault("executor", "step 1 rollout", _sft_evaluated, _kill_executor),
        Fault("trainer", "step 1, before its update", _rolled(0), _kill_trainer),
        Fault("flow", "step 2, its rollout table written", _rolled(1), _kill_flow, stops_run=True),
        Fault("disk", "step 2 checkpoint", _committed(1), _fill_disk, mend=_disk_cleanup, prepare=_disk_prepare,
              cleanup=_disk_unmount),
        Fault("server", "step 1 rollout", _sft_evaluated, _kill_sandbox_server),
        Fault("mlflow", f"step 2, for {outage_s:.0f} s", _committed(1), _mlflow_stop),
        Fault("prefect", "step 2", _committed(1), _prefect_restart),
    ]}


# --- running a row

def campaign_cmd(preset: str, overrides: list[str], out: Path, name: str, sft: Path | None) -> list[str]:
    sets = [a for s in overrides + [f"out_dir={out}"] for a in ("--set", s)]
    return [sys.executable, "-m", "rstar2.cli.main", "campaign", "--preset", preset, "--run-name", name, *sets,
            *(["--sft-checkpoint", str(sft)] if sft else [])]


def _start(run: Run, cmd: list[str]) -> None:
    env = {**os.environ, **run.env}
    run.proc = subprocess.Popen(cmd, stdout=run.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)


def _drive(run: Run, pending: list[Fault], struck: dict[str, str], deadline: float) -> None:
    """Wait for the run to end, injecting the first pending fault once it is due."""
    while run.alive():
        if time.monotonic() > deadline:
            os.killpg(run.proc.pid, signal.SIGKILL)
            raise TimeoutError(f"{run.layout.name} ran past {TIMEOUT_S:.0f} s")
        f = pending[0] if pending else None  # a row's faults strike in turn: each after the one before it
        if f is not None and f.due(run) and run.alive():
            try:
                struck[f.name] = f.inject(run)
                pending.remove(f)
                if f.stops_run:  # dead before the next fault is armed (one armed meanwhile would be mended away)
                    run.proc.wait(timeout=60)
                continue
            except Unready:
                pass
            except psutil.Error as e:  # the process ended between finding it and the signal
                struck[f.name] = f"could not be injected: {e}"
                pending.remove(f)
        _servers_up(run, due_only=True)
        time.sleep(0.05)


def run_row(run: Run, cmd: list[str], faults: list[Fault]) -> dict:
    """One row: the run with its faults, retried (at most once per fault) while it stops with an error. Returns how it
    went."""
    struck: dict[str, str] = {}
    committed_before: dict[str, str] = {}
    t0, attempts = time.monotonic(), 0
    pending = list(faults)
    try:
        for f in faults:
            f.prepare(run)
        for attempts in range(1, len(faults) + 2):
            _start(run, cmd)
            _drive(run, pending, struck, t0 + TIMEOUT_S)
            if run.proc.returncode == 0 or attempts == len(faults) + 1:
                break
            committed_before |= {c.name: checkpoint.manifest(c)["committed_at"]
                                for c in checkpoint.committed(run.layout.checkpoints(run.stage))}
            for f in faults:
                f.mend(run)
            _servers_up(run)  # the servers come back before the retry
        _servers_up(run)  # and before the run's records are read
    finally:
        for f in faults:
            f.cleanup(run)
    return {"returncode": run.proc.returncode, "attempts": attempts, "struck": struck,
            "not_injected": [f.name for f in pending], "committed_before_retry": committed_before,
            "wall_s": round(time.monotonic() - t0, 1)}


# --- what a run left

def _digest(frame) -> str:
    """A table's rows, sorted by (problem, sample), as one hash."""
    return hashlib.sha256(frame.sort("problem_id", "sample_idx").write_json().encode()).hexdigest()


def results(layout: RunLayout, stage: str, tracking_uri: str) -> dict:
    """The figures and records a run left, as the checks compare them."""
    import polars as pl

    summary = json.loads(layout.summary.read_text()) if layout.summary.exists() else {}
    out: dict = {"pass1": summary.get("pass1_rl"), "steps": summary.get("steps"), "figures": {}, "mlflow_steps": {}}
    if summary.get("mlflow_run_id"):
        import mlflow

        client = mlflow.MlflowClient(tracking_uri)
        exp = client.get_run(summary["mlflow_run_id"]).info.experiment_id
        stages = client.search_runs([exp], f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
        for r in stages:
            for m in FIGURES + ["logprob_gap"]:
                hist = sorted(client.get_metric_history(r.info.run_id, m), key=lambda h: h.step)
                out["figures"].setdefault(m, []).extend(h.value for h in hist)
                out["mlflow_steps"].setdefault(m, []).extend(h.step for h in hist)
    out["kept"], out["rollouts"] = [], []
    for kept in layout.step_tables(stage, "kept.parquet"):
        rows = pl.read_parquet(kept).select("problem_id", "sample_idx", "response_ids", "reward")
        out["kept"].append(_digest(rows))
    for rolled in layout.step_tables(stage, "rollouts.parquet"):
        keys = pl.read_parquet(rolled).select("problem_id", "sample_idx")
        out["rollouts"].append({"rows": keys.height, "unique": keys.unique().height, "keys": _digest(keys)})
    ckpts = layout.checkpoints(stage)
    out["checkpoints"] = [{"name": c.name, "committed": checkpoint.is_committed(c),
                           "optimizer_step": checkpoint.manifest(c).get("optimizer_step")
                           if checkpoint.is_committed(c) else None,
                           "committed_at": checkpoint.manifest(c).get("committed_at")
                           if checkpoint.is_committed(c) else None}
                          for c in sorted(ckpts.iterdir()) if c.is_dir()] if ckpts.is_dir() else []
    out["leftovers"] = sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".")) if ckpts.is_dir() else []
    return out


def differences(got: dict, ref: dict, committed_before: dict[str, str]) -> list[str]:
    """What differs from the reference run, or breaks a rule on its own, one line each (empty: nothing)."""
    diffs = []
    for m in FIGURES:
        if got["figures"].get(m) != ref["figures"].get(m):
            diffs.append(f"{m} per step {got['figures'].get(m)} != {ref['figures'].get(m)}")
    gaps = got["figures"].get("logprob_gap", [])
    if any(g >= GAP_NOISE for g in gaps):
        diffs.append(f"logprob_gap {max(gaps):.2e} >= {GAP_NOISE:g} (the engines sampled from other weights)")
    if got["pass1"] != ref["pass1"]:
        diffs.append(f"held-out pass@1 {got['pass1']} != {ref['pass1']}")
    for m, steps in got["mlflow_steps"].items():
        if sorted(steps) != sorted(set(steps)) or len(steps) != len(ref["mlflow_steps"].get(m, [])):
            diffs.append(f"MLflow {m} steps {steps} (reference {ref['mlflow_steps'].get(m)})")
            break
    if got["kept"] != ref["kept"]:
        diffs.append(f"kept rollouts differ at steps "
                     f"{[i + 1 for i, (a, b) in enumerate(zip(got['kept'], ref['kept'])) if a != b] or 'count'}")
    for i, (a, b) in enumerate(zip(got["rollouts"], ref["rollouts"])):
        if a["rows"] != a["unique"]:
            diffs.append(f"step {i + 1}: {a['rows'] - a['unique']} rollouts counted twice")
        if a["keys"] != b["keys"]:
            diffs.append(f"step {i + 1}: the rollout table holds other (problem, sample) pairs ({a['unique']} of "
                         f"{b['unique']})")
    if len(got["rollouts"]) != len(ref["rollouts"]):
        diffs.append(f"{len(got['rollouts'])} rollout tables, reference {len(ref['rollouts'])}")
    half = [c["name"] for c in got["checkpoints"] if not c["committed"]] + got["leftovers"]
    if half:
        diffs.append(f"half-written checkpoints or leftovers: {half}")
    steps = [c["optimizer_step"] for c in got["checkpoints"] if c["committed"]]
    if steps != [c["optimizer_step"] for c in ref["checkpoints"] if c["committed"]]:
        diffs.append(f"optimizer steps at the checkpoints {steps} (reference "
                     f"{[c['optimizer_step'] for c in ref['checkpoints']]})")
    again = [c["name"] for c in got["checkpoints"] if c["name"] in committed_before
             and c["committed_at"] != committed_before[c["name"]]]
    if again:
        diffs.append(f"checkpoints written again after the retry: {again}")
    return diffs


def verdict(row: dict) -> str:
    if row["not_injected"] or any(s.startswith("could not") for s in row["struck"].values()):
        return "failed"
    if row["returncode"] != 0:
        return "failed"
    if row["differences"]:
        return "lost"
    return "recovered" if row["attempts"] == 1 else "retried"


# --- the command's work

DEFAULT_ROWS = ["none", "engine", "executor", "server", "trainer", "flow", "disk", "mlflow", "prefect"]


def parse_rows(rows: list[str], known: dict[str, Fault]) -> list[list[str]]:
    """`a+b` puts faults a and b in one run (a row); each name must be known."""
    parsed = [r.split("+") for r in rows]
    unknown = sorted({n for r in parsed for n in r} - set(known))
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return parsed


def start_sandbox_server(sandbox, port: int, log: Path) -> subprocess.Popen:
    """`rstar2 sandbox serve` on 127.0.0.1:`port` with the run's limits and slots (`sandbox`: its SandboxCfg)."""
    from dataclasses import asdict

    from rstar2.sandbox.backends import limits_of

    proc = subprocess.Popen([sys.executable, "-m", "rstar2.cli.main", "sandbox", "serve", "--port", str(port),
                             "--slots", str(sandbox.workers), "--limits", json.dumps(asdict(limits_of(sandbox)))],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    services.wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def run_chaos(preset: str, overrides: list[str], rows: list[str], outage_s: float, sft: Path | None = None,
              say: Callable[[str], None] = print) -> dict:
    """The reference run (from `sft`, a committed SFT model, when given; else it trains its own), then each row from
    the same SFT model; returns every figure the table shows (see the module docstring)."""
    from rstar2.run import config, tracking
    from rstar2.run.net import free_port

    known = fault_table(outage_s)
    plan = parse_rows(rows, known)
    if sft is not None and not checkpoint.is_committed(Path(sft)):
        raise ValueError(f"--sft-checkpoint {sft} is not a committed checkpoint (no {checkpoint.MARKER})")
    cfg = config.load(preset, overrides)
    sets = SHRINK + ([] if cfg.world.base_model else SHRINK_TINY_WORLD) + list(overrides)  # the user's win
    cfg = config.load(preset, sets)
    stage = cfg.stages[0].name
    out = Path(cfg.out_dir).resolve() / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    uri = tracking.store_uri(str(out))

    ref = Run(RunLayout.of(out, "ref"), stage, out / "ref.log")
    say(f"reference run (no faults) -> {ref.layout.top}")
    ref_row = run_row(ref, campaign_cmd(preset, sets, out, "ref", sft), [])
    if ref_row["returncode"] != 0:
        raise RuntimeError(f"the reference run failed (exit {ref_row['returncode']}); its log: {ref.log}")
    want = results(ref.layout, stage, uri)
    sft = sft or ref.layout.sft
    report = {"preset": preset, "overrides": sets, "out_dir": str(out), "reference": {
        "wall_s": ref_row["wall_s"], "pass1": want["pass1"], "steps": want["steps"]}, "rows": []}
    for faults in plan:
        name = "+".join(faults)
        run = Run(RunLayout.of(out, name), stage, out / f"{name}.log",
                  state={"sft": sft, "split": cfg.eval.split, "outage_s": outage_s, "servers": {}})
        row_uri, row_sets = uri, list(sets)
        say(f"row {name}: {', '.join(known[f].point for f in faults)} -> {run.layout.top}")
        try:
            if "mlflow" in faults:  # this row tracks to a server of its own, which the fault stops and starts again
                port, store = free_port(), out / f"{name}-mlflow"
                server = run.state["servers"]["mlflow"] = Server(
                    lambda: services.start_mlflow(port, store, out / f"{name}-mlflow.log"))
                server.up()
                row_uri = run.env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{port}"
            if "prefect" in faults:  # the row's flows report to a Prefect server of its own (its own database)
                port_p, home = free_port(), out / f"{name}-prefect"
                server = run.state["servers"]["prefect"] = Server(lambda: services.start_prefect(
                    port_p, out / f"{name}-prefect.log", env={"PREFECT_HOME": str(home)}))
                server.up()
                run.env["PREFECT_API_URL"] = f"http://127.0.0.1:{port_p}/api"
            if "server" in faults:  # the row's code runs on a sandbox server of its own, with the run's limits
                port_s = free_port()
                server = run.state["servers"]["sandbox"] = Server(
                    lambda: start_sandbox_server(cfg.sandbox, port_s, out / f"{name}-sandbox.log"))
                server.up()
                row_sets += ["sandbox.backend=http", f"sandbox.urls=[http://127.0.0.1:{port_s}]"]
            row = run_row(run, campaign_cmd(preset, row_sets, out, name, sft), [known[f] for f in faults])
            got = results(run.layout, stage, row_uri)
            row["differences"] = differences(got, want, row.pop("committed_before_retry"))
        except (RuntimeError, OSError, TimeoutError) as e:
            row = {"returncode": None, "attempts": 0, "struck": {}, "not_injected": faults, "wall_s": None,
                   "differences": [str(e)]}
        finally:
            for server in run.state["servers"].values():
                server.stop()
        row.update(faults=faults, point={f: known[f].point for f in faults}, log=str(run.log))
        row["verdict"] = verdict(row)
        say(f"row {name}: {row['verdict']}" + "".join(f"\n  {d}" for d in row["differences"]))
        report["rows"].append(row)
    report["all_recovered"] = all(r["verdict"] in ("recovered", "retried") for r in report["rows"])
    return report
