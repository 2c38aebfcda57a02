"""The faults of `rstar2 chaos` (rstar2.cli.chaos): one campaign process of a row (`Run`), and each fault's moment
and injection (`Fault`, `fault_table`); the servers a row runs of its own (rstar2.cli.chaos.servers) are stopped
here and started again by the runner."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from rstar2.core import checkpoint
from rstar2.core.layout import ROLLOUTS, RunLayout


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


def _script(cmdline: list[str]) -> str:
    """The program an interpreter's command line runs: its first argument that is not an option."""
    return next((a for a in cmdline[1:] if not a.startswith("-")), "")


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
    procs = [p for p in tree if _script(_cmdline(p)).endswith("zygote.py")]
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
    return lambda run: run.layout.step_table(run.stage, step, ROLLOUTS).exists()


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
    checkpoint.write_dir_atomic(d, lambda tmp: shutil.copytree(keep, tmp, dirs_exist_ok=True))
    shutil.rmtree(keep)


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
