"""`rstar2 bench sandbox`: the sandbox service against the naive baseline, `subprocess.run([python, "-c", code])` per
call, in the same run: calls/s and latency percentiles for a trivial snippet, a CPU loop and a sympy
snippet at several concurrencies (client threads, one call in flight each). Each point also records the CPU the
benchmark's own process tree used per call and the CPU other tenants used meanwhile ("foreign load": on a shared
machine, rows with a high one understate throughput).

`--soak-s N` adds a sustained run: many concurrent clients (each its own HTTP client against a `rstar2 sandbox
serve` process, or threads on an in-process service) send calls whose output must carry a unique token; it
counts lost, mismatched and duplicated results and samples the service's memory (its process and executors).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import typer
from rich.table import Table

from rstar2.core import progress

console = progress.console()
SNIPPETS = {
    "trivial": "print(1 + 1)",
    "loop": "s = 0\nfor i in range(10**5):\n    s += i\nprint(s)",
    "sympy": "import sympy\nprint(sorted(sympy.factorint(2**64 - 1).items()))",
}
TARGETS = {"trivial_calls_per_s": 400.0, "sympy_speedup": 40.0, "trivial_p99_ms_at_8": 40.0}  # the sandbox's targets


def cleanest(measure_once: Callable[[], "Point"], attempts: int, max_foreign: float) -> "Point":
    """On a shared machine: measure again (up to `attempts` times) while other tenants used more than
    `max_foreign` cores; keep the least contaminated run (figures with other load on the cores understate
    throughput)."""
    best = None
    for i in range(attempts):
        p = measure_once()
        p.attempt = i + 1
        if best is None or p.foreign_load_cores < best.foreign_load_cores:
            best = p
        if p.foreign_load_cores <= max_foreign:
            break
    return best


@dataclass
class Point:
    snippet: str
    impl: str  # "service" | "naive"
    concurrency: int
    calls: int
    wall_s: float
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    errors: int
    cpu_ms_per_call: float
    foreign_load_cores: float
    attempt: int = 1


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s(service) -> float:
    """This process (all threads), its reaped children (naive runs) and the service's live executor trees."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return total + (sum(z.cpu_seconds() for z in service.executors()) if service is not None else 0.0)


def measure(call: Callable[[], Optional[str]], expected: str, concurrency: int, duration_s: float,
            snippet: str, impl: str, service=None) -> Point:
    """`concurrency` threads call `call()` (returns stdout, or None on failure) back to back for `duration_s`;
    calls in flight at the end are finished and counted."""
    stop = time.monotonic() + duration_s
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client():
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            out = call()
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                errors[0] += out != expected

    cpu0, busy0, t0 = _own_cpu_s(service), _machine_busy_s(), time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    own, busy = _own_cpu_s(service) - cpu0, _machine_busy_s() - busy0
    ms = np.array(lat) * 1000
    return Point(snippet, impl, concurrency, len(lat), round(wall, 3), round(len(lat) / wall, 2),
                 round(float(np.percentile(ms, 50)), 2), round(float(np.percentile(ms, 99)), 2),
                 round(float(ms.mean()), 2), errors[0], round(own / max(len(lat), 1) * 1000, 2),
                 round(max(0.0, busy - own) / wall, 2))


def naive_call(code: str) -> Callable[[], Optional[str]]:
    """The baseline: a fresh interpreter per call (this environment's own, as a naive tool server would use)."""
    def call():
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            return r.stdout if r.returncode == 0 else None
        except subprocess.TimeoutExpired:
            return None
    return call


class DockerBench:
    """The docker backend (one warm container of the sandbox image, the same limits) for the bench; its
    `executors()` stand for the container's CPU time, so CPU ms/call compares with the local service's."""

    def __init__(self, limits, slots: int):
        from rstar2.sandbox.docker_backend import DEFAULT_IMAGE, docker_sandbox

        self.sandbox = docker_sandbox(DEFAULT_IMAGE, limits, slots)
        self.run = self.sandbox.run

    def executors(self) -> list:
        return [SimpleNamespace(cpu_seconds=self.sandbox.service.cpu_seconds)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sandbox.close()


def service_call(service, code: str) -> Callable[[], Optional[str]]:
    from rstar2.sandbox.api import ExecRequest

    def call():
        r = service.run(ExecRequest(code))
        return r.stdout if r.status == "ok" else None
    return call


# ---------------------------------------------------------------------------------------------------------------
# soak: many clients for a sustained period; no result may be lost, mismatched or duplicated; memory stays flat

@dataclass
class Soak:
    over: str
    clients: int
    duration_s: float
    sent: int = 0
    received: int = 0
    lost: int = 0  # an exception or no result
    mismatched: int = 0  # a result that does not carry the request's own token (or carries it twice)
    executed: int = 0  # calls the service ran (its own counter): more than sent = a request ran twice
    duplicated: int = 0  # executed - sent, at least 0
    statuses: dict = field(default_factory=dict)
    calls_per_s: float = 0.0
    rss_mb_start: float = 0.0
    rss_mb_end: float = 0.0
    rss_mb_max: float = 0.0
    rss_mb_per_min: float = 0.0  # slope of a line fitted to the samples after warm-up
    rss_mb_samples: list = field(default_factory=list)  # one a second


def _service_rss_mb(root_pid: int) -> float:
    """Resident memory of the service process and its executors (zygotes), not of the calls they fork (those come
    and go, and their pages are mostly the zygote's own, shared)."""
    total, todo = 0, [(root_pid, 0)]
    while todo:
        pid, depth = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            if depth < 2:  # service -> zygote (host side) -> zygote (pid 1 of its namespace)
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo += [(int(p), depth + 1) for p in f.read().split()]
        except OSError:
            pass
    return total / 1024


def _soak_request(i: int):
    """A request and what its output must be: every kind carries a fresh token."""
    from rstar2.sandbox.api import ExecRequest

    token = uuid.uuid4().hex
    kind = i % 4
    if kind == 0:
        return ExecRequest("import sys\nprint(sys.stdin.read()[::-1])", stdin=token), ("ok", token[::-1] + "\n")
    if kind == 1:
        return ExecRequest(f"import sympy\nprint({token!r}, sympy.isprime({10**9 + 7}))"), ("ok", f"{token} True\n")
    if kind == 2:
        return ExecRequest(f"raise ValueError({token!r})"), ("error", token)
    return ExecRequest(f"print({token!r})"), ("ok", token + "\n")


def isolation_table(layers: dict[str, str]) -> Table:
    """The sandbox's isolation layers and whether each is active on this machine (also `rstar2 sandbox check`)."""
    table = Table(title="sandbox isolation layers")
    table.add_column("layer")
    table.add_column("state")
    for name, state in sorted(layers.items()):
        table.add_row(name, state if state.startswith("active") else f"[red]{state}[/red]")
    return table


def soak(over: str, clients: int, duration_s: float, slots: int) -> Soak:
    from rstar2.sandbox.api import SandboxLimits

    res = Soak(over, clients, duration_s)
    lock = threading.Lock()
    server = service = None
    if over == "http":
        port = 18000 + os.getpid() % 1000
        server = subprocess.Popen([sys.executable, "-m", "rstar2.cli.main", "sandbox", "serve", "--port", str(port),
                                   "--slots", str(slots)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the sandbox server did not start")
                time.sleep(0.5)
        root_pid = server.pid
    else:
        from rstar2.sandbox.service import SandboxService

        service = SandboxService(SandboxLimits(), slots=slots, prewarm=("bare", "sci"))
        root_pid = os.getpid()

    def make_client():
        if over == "http":
            from rstar2.sandbox.client import BatchingClient, HttpTransport, SyncSandbox
            return SyncSandbox(BatchingClient(HttpTransport([url]), batch_size=4, senders=1))
        return service

    def executed() -> int:  # the service's own count of finished calls (its start-up probes included)
        snap = service.snapshot() if service else json.loads(
            urllib.request.urlopen(f"{url}/metrics/snapshot", timeout=10).read())
        return int(sum(snap["calls"].values()))

    executed_before = executed()
    samples: list[float] = []
    stop = time.monotonic() + duration_s
    counter = iter(range(10**9))

    def client():
        sb = make_client()
        try:
            while time.monotonic() < stop:
                with lock:
                    i = next(counter)
                    res.sent += 1
                req, (status, token) = _soak_request(i)
                try:
                    r = sb.run(req)
                except Exception:  # noqa: BLE001 - counted as lost
                    with lock:
                        res.lost += 1
                    continue
                text = r.stdout if status == "ok" else r.stderr
                ok = r.status == status and (text == token if status == "ok" else token in text)
                with lock:
                    res.received += 1
                    res.statuses[r.status] = res.statuses.get(r.status, 0) + 1
                    res.mismatched += not ok
        finally:
            if sb is not service:
                sb.close()

    def sampler():
        while time.monotonic() < stop:
            samples.append(_service_rss_mb(root_pid))
            time.sleep(1.0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)] + [threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    res.calls_per_s = round(res.received / wall, 1)
    # the start is taken after a tenth of the run: executors still being started are not "growth"
    warm = samples[max(1, len(samples) // 10):] or samples
    res.rss_mb_start, res.rss_mb_end, res.rss_mb_max = round(warm[0], 1), round(samples[-1], 1), round(max(warm), 1)
    res.rss_mb_samples = [round(x, 1) for x in samples]
    if len(warm) > 2:
        res.rss_mb_per_min = round(float(np.polyfit(np.arange(len(warm)), warm, 1)[0]) * 60, 2)  # 1 sample/s
    res.executed = executed() - executed_before
    res.duplicated = max(0, res.executed - res.sent)
    if server is not None:
        server.terminate()
        server.wait(timeout=30)
    if service is not None:
        service.close()
    return res


# ---------------------------------------------------------------------------------------------------------------

def _summary(points: list[Point]) -> dict:
    def best(snippet, impl):
        pts = [p for p in points if p.snippet == snippet and p.impl == impl and p.errors == 0]
        return max(pts, key=lambda p: p.calls_per_s) if pts else None

    out: dict = {}
    for snippet in SNIPPETS:
        s, n = best(snippet, "service"), best(snippet, "naive")
        if s:
            out[f"{snippet}_service_best_calls_per_s"] = s.calls_per_s
            # what the cores could do with nothing else running: the noise-robust figure
            out[f"{snippet}_service_cpu_bound_calls_per_s"] = round((os.cpu_count() or 1) * 1000 / s.cpu_ms_per_call, 1)
        if n:
            out[f"{snippet}_naive_best_calls_per_s"] = n.calls_per_s
        if s and n:
            out[f"{snippet}_speedup"] = round(s.calls_per_s / n.calls_per_s, 1)
    at8 = [p for p in points if p.snippet == "trivial" and p.impl == "service" and p.concurrency == 8]
    if at8:
        out["trivial_p99_ms_at_8"] = at8[0].p99_ms
    checks = {}
    if "trivial_service_best_calls_per_s" in out:
        checks["trivial_calls_per_s"] = out["trivial_service_best_calls_per_s"] >= TARGETS["trivial_calls_per_s"]
    if "sympy_speedup" in out:
        checks["sympy_speedup"] = out["sympy_speedup"] >= TARGETS["sympy_speedup"]
    if "trivial_p99_ms_at_8" in out:
        checks["trivial_p99_ms_at_8"] = out["trivial_p99_ms_at_8"] <= TARGETS["trivial_p99_ms_at_8"]
    out["targets"], out["targets_met"] = TARGETS, checks
    return out


def main(concurrency: str = typer.Option("1,4,8,32", help="comma-separated client counts"),
         snippets: str = typer.Option(",".join(SNIPPETS), help=f"comma-separated, from {', '.join(SNIPPETS)}"),
         duration_s: float = typer.Option(3.0, help="seconds per point"),
         slots: int = typer.Option(2 * (os.cpu_count() or 1), help="executor slots of the service"),
         naive: bool = typer.Option(True, help="also measure the naive baseline (same run)"),
         attempts: int = typer.Option(3, help="measure a point again while other tenants load the machine"),
         max_foreign: float = typer.Option(0.25, help="cores other tenants may use during a point before it is redone"),
         soak_s: float = typer.Option(0.0, help="then a sustained run of this many seconds (0: none)"),
         soak_clients: int = typer.Option(32, help="concurrent clients of the sustained run"),
         soak_over: str = typer.Option("http", help="sustained run against: http (a server process) | local"),
         backend: str = typer.Option("local", help="local: the service in this process; docker: also the docker "
                                                   "backend (one warm container, same limits), measured beside it"),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Sandbox service vs naive subprocess per call: calls/s, p50/p99 latency, CPU per call; optional soak."""
    from rstar2.sandbox.api import SandboxLimits
    from rstar2.sandbox.service import SandboxService

    try:
        conc = [int(c) for c in concurrency.split(",")]
        names = [s.strip() for s in snippets.split(",")]
        if unknown := set(names) - set(SNIPPETS):
            raise ValueError(f"unknown snippets {sorted(unknown)}")
        if soak_over not in ("http", "local") or min(conc) < 1:
            raise ValueError("--soak-over must be http or local, concurrencies positive")
        if backend not in ("local", "docker"):
            raise ValueError("--backend must be local or docker")
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    load_start = os.getloadavg()  # 1, 5, 15 min: other tenants of a shared machine show here
    expected = {}
    for name in names:  # ground truth from a plain interpreter; the sandbox must print the same
        r = subprocess.run([sys.executable, "-c", SNIPPETS[name]], capture_output=True, text=True, check=True)
        expected[name] = r.stdout
    points: list[Point] = []
    limits = SandboxLimits(timeout_s=30.0, cpu_s=30)
    with SandboxService(limits, slots=slots, prewarm=("bare", "sci")) as svc, \
            (DockerBench(limits, slots) if backend == "docker" else contextlib.nullcontext()) as box:
        layers = svc.isolation()
        console.print(isolation_table(layers))
        targets = [("service", svc)] + ([("docker", box)] if box else [])
        for name in names:
            for c in conc:
                start = len(points)
                for impl, target in targets:
                    measure(service_call(target, SNIPPETS[name]), expected[name], c, min(0.5, duration_s), name,
                            impl, target)  # warm-up: caches, page tables, the scheduler settle
                    points.append(cleanest(lambda: measure(service_call(target, SNIPPETS[name]), expected[name], c,
                                                           duration_s, name, impl, target), attempts, max_foreign))
                if naive:
                    points.append(cleanest(lambda: measure(naive_call(SNIPPETS[name]), expected[name], c, duration_s,
                                                           name, "naive"), attempts, max_foreign))
                console.print(f"  {name} x{c}: " + "  ".join(
                    f"{p.impl} {p.calls_per_s:.1f}/s p99 {p.p99_ms:.1f} ms" for p in points[start:]))
    table = Table(title=f"sandbox service vs naive subprocess per call ({slots} slots, {os.cpu_count()} cores, "
                        f"{duration_s:g} s per point)")
    for col in ("snippet", "clients", "impl", "calls/s", "p50 ms", "p99 ms", "CPU ms/call", "foreign load", "errors",
                "try"):
        table.add_column(col, justify="right" if col not in ("snippet", "impl") else "left")
    for p in points:
        table.add_row(p.snippet, str(p.concurrency), p.impl, f"{p.calls_per_s:.1f}", f"{p.p50_ms:.1f}",
                      f"{p.p99_ms:.1f}", f"{p.cpu_ms_per_call:.1f}", f"{p.foreign_load_cores:.2f}", str(p.errors),
                      str(p.attempt))
    console.print(table)
    summary = _summary(points)
    console.print({k: v for k, v in summary.items() if k != "targets"})
    out = {"command": "rstar2 bench sandbox " + " ".join(sys.argv[3:]), "cores": os.cpu_count(), "slots": slots,
           "python": sys.executable, "isolation": layers, "points": [asdict(p) for p in points], "summary": summary,
           "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    if soak_s > 0:
        s = soak(soak_over, soak_clients, soak_s, slots)
        t = Table(title=f"soak: {s.clients} clients over {s.over} for {s.duration_s:g} s")
        for col in ("sent", "received", "executed", "lost", "mismatched", "duplicated", "calls/s", "statuses",
                    "service RSS MB start/end/max", "MB/min"):
            t.add_column(col)
        t.add_row(str(s.sent), str(s.received), str(s.executed), str(s.lost), str(s.mismatched), str(s.duplicated),
                  f"{s.calls_per_s:.1f}",
                  json.dumps(s.statuses), f"{s.rss_mb_start:.0f} / {s.rss_mb_end:.0f} / {s.rss_mb_max:.0f}",
                  f"{s.rss_mb_per_min:+.2f}")
        console.print(t)
        out["soak"] = asdict(s)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {json_path}")
