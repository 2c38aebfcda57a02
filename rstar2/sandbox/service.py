"""The sandbox service: a central FIFO queue with backpressure in front of a pool of executor slots.

One dispatcher thread owns the slots: it takes calls from the head of the queue, hands each to a free slot's warm
zygote of the right profile (preferring slots whose zygote is already warm; starting one when needed), watches every
zygote's reply pipe with one `select`, and enforces a watchdog deadline per call (a zygote that stops answering is
killed and restarted). A call whose executor dies under it (killed from outside, or stopped answering) runs again
once on a fresh one, so an executor lost to the machine changes no result; a second death answers it `killed`.
Callers get a `Future`; `run_batch` keeps input order.
The same object serves the rollout in-process, the HTTP server (`server.py`) and each Ray actor (`ray_group.py`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import selectors
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from rstar2.sandbox.api import (
    ERROR,
    KILLED,
    MAX_REQUEST_BYTES,
    ExecRequest,
    ExecResult,
    QueueFull,
    SandboxLimits,
    SandboxUnavailable,
)
from rstar2.sandbox.executor import (
    HIDE,
    MAX_SLOTS,
    PROFILES,
    PROJECT_ROOT,
    STDLIB_PRELOAD,
    WARMUPS,
    Cgroups,
    ExecutorDied,
    Runtime,
    SlotCgroups,
    ZygoteProc,
    allocate_uids,
    pick_runtime,
    release_uids,
    route,
)
from rstar2.sandbox.metrics import SandboxMetrics

log = logging.getLogger(__name__)
MB = 1024 * 1024
SLOT_OVERHEAD_MB = 512  # a slot's memory cgroup holds its zygotes (numpy+sympy: ~100 MB) besides the call
ESSENTIAL = ("pid_namespace", "mount_namespace", "network_namespace", "unprivileged_uid", "no_new_privs",
             "rlimits", "landlock", "seccomp")


@dataclass
class _Call:
    req: ExecRequest
    future: Future
    profile: str
    t_enq: float
    depth: int = 0
    t_sent: float = 0.0
    deadline: float = math.inf
    zygote: ZygoteProc | None = None
    payload: bytes = b""
    reruns: int = 0  # times its executor died under it and it ran again on a fresh one


@dataclass
class _Slot:
    index: int
    uid: int | None
    cgroups: SlotCgroups
    zygotes: dict[str, ZygoteProc] = field(default_factory=dict)
    call: _Call | None = None


class SandboxService:
    """Run untrusted Python: `run`/`run_batch` block, `submit` returns a Future. `slots` calls run at once (2 per
    core); `queue_size` more may wait; `prewarm` starts those profiles' zygotes in every slot up front; `require`
    names isolation layers without which the service refuses to start. Close it (or use `with`) to stop them."""

    STARTUP_TIMEOUT_S = 180.0  # a zygote importing numpy + sympy on a loaded 2-core machine
    GRACE_S = 5.0  # a zygote that overruns a call's own deadline by this much is killed
    MAX_START_FAILURES = 3
    MAX_RERUNS = 1  # a call whose executor dies under it runs again once; a second death answers it `killed`

    def __init__(self, limits: SandboxLimits | None = None, slots: int = 4, queue_size: int = 4096,
                 profiles: dict[str, tuple[str, ...]] | None = None, require: tuple[str, ...] | list[str] = (),
                 prewarm: tuple[str, ...] | list[str] = (), runtime: Runtime | None = None):
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {slots}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be positive, got {queue_size}")
        self.limits = limits or SandboxLimits()
        self.profiles = dict(profiles or PROFILES)
        unknown = set(prewarm) - set(self.profiles)
        if unknown:
            raise ValueError(f"unknown profiles to prewarm: {sorted(unknown)}; known: {sorted(self.profiles)}")
        self.queue_size = queue_size
        self.runtime = runtime or pick_runtime()
        self.metrics = SandboxMetrics()
        self.metrics.slots.set(slots)
        self._tmp = tempfile.mkdtemp(prefix="rstar2-sandbox-")
        root = os.geteuid() == 0
        self._uids = allocate_uids(slots) if root else []
        self._cgroups = Cgroups(slots, (self.limits.memory_mb + SLOT_OVERHEAD_MB) * MB, self.limits.max_processes + 16)
        self._slots = [_Slot(k, self._uids[k] if root else None, self._cgroups.slots[k]) for k in range(slots)]
        self._queue: deque[_Call] = deque()
        self._cond = threading.Condition()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closing = False
        self._broken: dict[str, str] = {}  # profile -> why its executor cannot start
        self._start_failures: Counter = Counter()
        self._isolation: dict[str, str] = dict(self._cgroups.report)
        self._reported: set[str] = set()
        self._spawned = itertools.count()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="sandbox-dispatch", daemon=True)
        self._thread.start()
        try:
            # one call on a fresh executor: the isolation report exists (and is checked) before any real call
            probe = self.run(ExecRequest("print('ready')"))
            if probe.stdout != "ready\n":
                raise SandboxUnavailable(f"the sandbox cannot run code: {probe.status}: {probe.stderr[-800:]}")
            missing = [layer for layer in require if not self._isolation.get(layer, "").startswith("active")]
            if missing:
                raise SandboxUnavailable("required isolation layers are not active: " + "; ".join(
                    f"{m}: {self._isolation.get(m, 'unknown layer')}" for m in missing))
            warm = [self.submit(ExecRequest("pass"), profile=p) for p in prewarm for _ in self._slots]
            for f in warm:
                f.result()
        except BaseException:
            self.close()
            raise

    # -- caller side --------------------------------------------------------------------------------------------
    def submit(self, req: ExecRequest, block: bool = True, timeout: float | None = None,
               profile: str | None = None) -> Future:
        """Queue one call; the Future resolves to an ExecResult. A full queue blocks (up to `timeout`) or, with
        block=False, raises QueueFull at once (backpressure)."""
        req.validate()
        fut: Future = Future()
        if len(req.code.encode("utf-8", "replace")) + len(req.stdin.encode("utf-8", "replace")) > MAX_REQUEST_BYTES:
            fut.set_result(ExecResult(ERROR, "", f"[sandbox] request larger than {MAX_REQUEST_BYTES} bytes: not run",
                                      None, 0.0, 0.0))
            return fut
        call = _Call(req, fut, profile or route(req.code, self.profiles), time.monotonic())
        if call.profile not in self.profiles:
            raise ValueError(f"unknown profile {call.profile!r}")
        with self._cond:
            if self._closing:
                raise SandboxUnavailable("the sandbox service is closed")
            while len(self._queue) >= self.queue_size:
                if not block or not self._cond.wait(timeout):
                    self.metrics.rejected.inc()
                    raise QueueFull(f"sandbox queue full ({self.queue_size} calls waiting)")
                if self._closing:
                    raise SandboxUnavailable("the sandbox service is closed")
            call.depth = len(self._queue)
            self._queue.append(call)
        self.metrics.depth_at_submit.observe(call.depth)
        self.metrics.queue_depth.set(call.depth + 1)
        os.eventfd_write(self._wake, 1)
        return fut

    def run(self, req: ExecRequest) -> ExecResult:
        return self.submit(req).result()

    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]:
        """Results in input order."""
        return [f.result() for f in [self.submit(r) for r in reqs]]

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def isolation(self) -> dict[str, str]:
        """Each isolation layer and whether it is active here (from the executors' own probes)."""
        return dict(self._isolation)

    def snapshot(self) -> dict:
        return self.metrics.snapshot()

    def executors(self) -> list[ZygoteProc]:
        return [z for s in self._slots for z in list(s.zygotes.values())]

    def close(self) -> None:
        """Finish what is queued and running, then stop every executor."""
        with self._cond:
            if self._closing and not self._thread.is_alive():
                return
            self._closing = True
            self._cond.notify_all()
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        for s in self._slots:
            for z in s.zygotes.values():
                z.kill()
            s.zygotes.clear()
        self._cgroups.close()
        release_uids(self._uids)
        self._sel.close()
        os.close(self._wake)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> SandboxService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dispatcher thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                self._dispatch()
                busy = [s.call for s in self._slots if s.call is not None]
                if self._closing and not busy and not self._queue:
                    return
                nearest = min((c.deadline for c in busy), default=math.inf)
                wait = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
                for key, _ in self._sel.select(wait):
                    if key.data is None:
                        try:
                            os.eventfd_read(self._wake)
                        except BlockingIOError:
                            pass
                    else:
                        self._on_readable(key.data)
                now = time.monotonic()
                for s in self._slots:
                    if s.call is not None and now > s.call.deadline:
                        z = s.call.zygote
                        log.error("sandbox executor %s/%d missed its deadline: killing it", z.profile, s.index)
                        self._on_death(s, z, "[sandbox] the executor stopped answering and was restarted")
        except BaseException as e:  # never leave callers waiting on a dead dispatcher
            log.exception("sandbox dispatcher crashed")
            self._fail_everything(SandboxUnavailable(f"sandbox dispatcher crashed: {e!r}"))

    def _fail_everything(self, exc: Exception) -> None:
        with self._cond:
            self._closing = True
            calls = list(self._queue) + [s.call for s in self._slots if s.call is not None]
            self._queue.clear()
            self._cond.notify_all()
        for c in calls:
            if not c.future.done():
                c.future.set_exception(exc)

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    break
                call = self._queue[0]
                if call.future.cancelled():  # its caller gave it up before it ran (a partial rollout's cut)
                    self._queue.popleft()
                    self._cond.notify()
                    continue
                if call.profile in self._broken:
                    self._queue.popleft()
                    self._cond.notify()
                    call.future.set_exception(SandboxUnavailable(self._broken[call.profile]))
                    continue
                slot = self._pick_slot(call.profile)
                if slot is None:
                    break
                self._queue.popleft()
                self._cond.notify()
                self.metrics.queue_depth.set(len(self._queue))
            self._start(slot, call)

    def _pick_slot(self, profile: str) -> _Slot | None:
        free = [s for s in self._slots if s.call is None]
        for want in (lambda z: z is not None and z.ready, lambda z: z is not None):
            for s in free:
                if want(s.zygotes.get(profile)):
                    return s
        return free[0] if free else None

    def _start(self, slot: _Slot, call: _Call) -> None:
        z = slot.zygotes.get(call.profile)
        if z is None:
            z = slot.zygotes[call.profile] = self._spawn(slot, call.profile)
        t = call.req.timeout_s or self.limits.timeout_s
        cpu = max(1, math.ceil(t)) if call.req.timeout_s else self.limits.cpu_s
        if not call.payload:
            call.payload = json.dumps({"code": call.req.code, "stdin": call.req.stdin, "timeout_s": t, "cpu_s": cpu,
                                       "max_output_bytes": self.limits.max_output_chars}).encode()
        slot.call, call.zygote, call.t_sent = call, z, time.monotonic()
        call.deadline = self._deadline(z, t)
        self.metrics.queue_wait.observe(call.t_sent - call.t_enq)
        self.metrics.inflight.inc()
        try:
            z.send(call.payload)
        except ExecutorDied as e:
            self._on_death(slot, z, f"[sandbox] {e}")

    def _deadline(self, z: ZygoteProc, t: float) -> float:
        start = time.monotonic() if z.ready else z.started + self.STARTUP_TIMEOUT_S
        return start + t + self.GRACE_S

    def _spawn(self, slot: _Slot, profile: str) -> ZygoteProc:
        mods = self.profiles[profile]
        workdir = os.path.join(self._tmp, f"work-{slot.index}-{profile}")  # used only without a mount namespace
        os.makedirs(workdir, 0o700, exist_ok=True)
        if slot.uid is not None:
            os.chown(workdir, slot.uid, slot.uid)
        keep = [p for p in self.runtime.keep_paths  # nested kept paths ride along with their parent
                if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in self.runtime.keep_paths)]
        cfg = {"service_pid": os.getpid(), "uid": slot.uid, "cgroups": slot.cgroups.procs,
               "oom_file": slot.cgroups.oom_file, "tmpfs_mb": self.limits.tmpfs_mb, "keep_paths": keep,
               "hide_paths": [str(p) for p in (PROJECT_ROOT, *HIDE) if p], "sys_path": self.runtime.sys_path,
               "preload": list(STDLIB_PRELOAD) + list(mods),
               "warmup": "\n".join(WARMUPS[m] for m in mods if m in WARMUPS), "memory_mb": self.limits.memory_mb,
               "max_file_mb": self.limits.max_file_mb, "max_processes": self.limits.max_processes,
               "fallback_workdir": workdir}
        log_path = os.path.join(self._tmp, f"zygote-{slot.index}-{profile}-{next(self._spawned)}.log")
        z = ZygoteProc(slot.index, profile, cfg, self.runtime, log_path)
        self._sel.register(z.fd_out, selectors.EVENT_READ, (slot, z))
        return z

    def _on_readable(self, data: tuple[_Slot, ZygoteProc]) -> None:
        slot, z = data
        try:
            msgs = z.read()
        except ExecutorDied as e:
            self._on_death(slot, z, f"[sandbox] {e}")
            return
        for msg in msgs:
            if msg.get("ready"):
                z.ready = True
                self._start_failures[z.profile] = 0
                self._record_layers(msg["layers"])
                if slot.call is not None and slot.call.zygote is z:
                    slot.call.deadline = self._deadline(z, slot.call.req.timeout_s or self.limits.timeout_s)
            elif slot.call is not None and slot.call.zygote is z:
                self._finish(slot, msg)

    def _finish(self, slot: _Slot, msg: dict) -> None:
        call, slot.call = slot.call, None
        now = time.monotonic()
        res = ExecResult(msg["status"], msg["stdout"], msg["stderr"], msg["exit_code"], msg["wall_s"], msg["cpu_s"],
                         msg.get("signal"), round(call.t_sent - call.t_enq, 6), round(now - call.t_enq, 6),
                         call.profile)
        self.metrics.inflight.dec()
        self.metrics.calls.labels(res.status).inc()
        self.metrics.latency.observe(res.latency_s)
        self.metrics.exec_time.observe(res.wall_s)
        if not call.future.done():
            call.future.set_result(res)

    def _on_death(self, slot: _Slot, z: ZygoteProc, why: str) -> None:
        try:
            self._sel.unregister(z.fd_out)
        except (KeyError, ValueError):
            pass
        z.kill()
        if slot.zygotes.get(z.profile) is z:
            del slot.zygotes[z.profile]
        self.metrics.restarts.labels(z.profile).inc()
        call = slot.call
        if call is None or call.zygote is not z:
            return
        if not z.ready:  # it never started: run the call on a fresh one, give up after a few failures
            self._start_failures[z.profile] += 1
            slot.call = None
            self.metrics.inflight.dec()
            if self._start_failures[z.profile] >= self.MAX_START_FAILURES:
                self._broken[z.profile] = f"the '{z.profile}' executor failed to start " \
                                          f"{self.MAX_START_FAILURES} times: {why}"
                log.error(self._broken[z.profile])
            with self._cond:
                self._queue.appendleft(call)
            return
        if call.reruns < self.MAX_RERUNS:  # the executor's death is the service's fault, not the call's: run it again
            log.warning("sandbox executor %s/%d died during a call (%s): running the call again on a fresh one",
                        z.profile, slot.index, why)
            call.reruns += 1
            slot.call = None
            self.metrics.inflight.dec()
            with self._cond:
                self._queue.appendleft(call)
            return
        log.warning("sandbox executor %s/%d died during a call again: %s", z.profile, slot.index, why)
        self._finish(slot, {"status": KILLED, "stdout": "", "stderr": f"[sandbox] the executor died during the call "
                            f"and was replaced ({why.removeprefix('[sandbox] ')})", "exit_code": None, "signal": None,
                            "wall_s": round(time.monotonic() - call.t_sent, 6), "cpu_s": 0.0})

    def _record_layers(self, layers: dict[str, str]) -> None:
        """Merge an executor's report (a layer counts as active only if every executor has it) and log, once
        per layer, what is not active: nothing is skipped silently."""
        first = not self._reported
        for name, state in layers.items():
            old = self._isolation.get(name)
            if old is None or (old.startswith("active") and not state.startswith("active")):
                self._isolation[name] = state
        for name, state in self._isolation.items():
            self.metrics.layer.labels(name).set(1.0 if state.startswith("active") else 0.0)
            if name not in self._reported:
                self._reported.add(name)
                if not state.startswith("active"):
                    log.warning("sandbox isolation layer %s is NOT active: %s", name, state)
        if first:
            log.info("sandbox isolation active: %s",
                     ", ".join(sorted(n for n, s in self._isolation.items() if s.startswith("active"))))
