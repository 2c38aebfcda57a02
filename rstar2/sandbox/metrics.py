"""Service metrics: Prometheus text at `/metrics`, and snapshots whose difference summarises an interval (one RL
step's rollout) as flat numbers for MLflow."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rstar2.sandbox.api import STATUSES

LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.25,
                   0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0)
DEPTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class SandboxMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.calls = Counter("rstar2_sandbox_calls", "Finished calls by status", ["status"], registry=r)
        for s in STATUSES:
            self.calls.labels(s)
        self.latency = Histogram("rstar2_sandbox_latency_seconds", "Submit to result", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.exec_time = Histogram("rstar2_sandbox_exec_seconds", "Execution wall time (fork to exit)",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("rstar2_sandbox_queue_wait_seconds", "Time in the queue",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.depth_at_submit = Histogram("rstar2_sandbox_queue_depth_at_submit", "Queue depth seen by each call",
                                         buckets=DEPTH_BUCKETS, registry=r)
        self.queue_depth = Gauge("rstar2_sandbox_queue_depth", "Calls waiting now", registry=r)
        self.inflight = Gauge("rstar2_sandbox_inflight", "Calls running now", registry=r)
        self.rejected = Counter("rstar2_sandbox_rejected", "Submissions refused: queue full", registry=r)
        self.restarts = Counter("rstar2_sandbox_executor_restarts", "Executors that died or were killed",
                                ["profile"], registry=r)
        self.slots = Gauge("rstar2_sandbox_slots", "Executor slots", registry=r)
        self.layer = Gauge("rstar2_sandbox_isolation_layer", "1 if the isolation layer is active", ["layer"],
                           registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """Cumulative counters and histogram buckets (JSON-able; snapshots of several services can be summed)."""
        snap: dict = {"time": time.time(), "calls": {}, "hist": {}, "rejected": 0.0, "restarts": 0.0, "services": 1}
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == "rstar2_sandbox_calls_total":
                    snap["calls"][s.labels["status"]] = s.value
                elif s.name.endswith("_bucket"):
                    snap["hist"].setdefault(s.name[:-7], {})[s.labels["le"]] = s.value
                elif s.name.endswith(("_sum", "_count")) and s.name[:-4 if s.name.endswith("_sum") else -6] in (
                        "rstar2_sandbox_latency_seconds", "rstar2_sandbox_exec_seconds",
                        "rstar2_sandbox_queue_wait_seconds", "rstar2_sandbox_queue_depth_at_submit"):
                    snap["hist"].setdefault(s.name, {})["value"] = s.value
                elif s.name == "rstar2_sandbox_rejected_total":
                    snap["rejected"] = s.value
                elif s.name == "rstar2_sandbox_executor_restarts_total":
                    snap["restarts"] += s.value
        return snap


def merge(snaps: list[dict]) -> dict:
    """The sum of several services' snapshots (a Ray actor group, several HTTP servers)."""
    out = {"time": max(s["time"] for s in snaps), "calls": {}, "hist": {}, "rejected": 0.0, "restarts": 0.0,
           "services": 0}
    for s in snaps:
        for k, v in s["calls"].items():
            out["calls"][k] = out["calls"].get(k, 0.0) + v
        for name, buckets in s["hist"].items():
            dst = out["hist"].setdefault(name, {})
            for le, v in buckets.items():
                dst[le] = dst.get(le, 0.0) + v
        for k in ("rejected", "restarts", "services"):
            out[k] += s[k]
    return out


def _quantile(buckets: dict[str, float], q: float) -> float:
    """Quantile from cumulative bucket counts (linear within the bucket, as Prometheus' histogram_quantile)."""
    edges = sorted(((float(le), c) for le, c in buckets.items()), key=lambda e: e[0])
    total = edges[-1][1] if edges else 0.0
    if total <= 0:
        return 0.0
    rank, prev_le, prev_c = q * total, 0.0, 0.0
    for le, c in edges:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return prev_le


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summarize(before: dict, after: dict, prefix: str = "sandbox_") -> dict:
    """What the service did between two snapshots: calls, calls/s, statuses, latency and queue figures."""
    dt = max(after["time"] - before["time"], 1e-9)
    calls = _delta(after["calls"], before["calls"])
    n = sum(calls.values())
    h = {name: _delta(after["hist"].get(name, {}), before["hist"].get(name, {})) for name in after["hist"]}

    def mean(name: str) -> float:
        return h[f"{name}_sum"]["value"] / max(h[f"{name}_count"]["value"], 1) if f"{name}_sum" in h else 0.0

    lat, wait = h.get("rstar2_sandbox_latency_seconds", {}), h.get("rstar2_sandbox_queue_wait_seconds", {})
    depth = h.get("rstar2_sandbox_queue_depth_at_submit", {})
    out = {"calls": n, "calls_per_s": n / dt,
           "latency_mean_s": mean("rstar2_sandbox_latency_seconds"),
           "latency_p50_s": _quantile(lat, 0.5), "latency_p99_s": _quantile(lat, 0.99),
           "exec_mean_s": mean("rstar2_sandbox_exec_seconds"),
           "queue_wait_mean_s": mean("rstar2_sandbox_queue_wait_seconds"), "queue_wait_p99_s": _quantile(wait, 0.99),
           "queue_depth_mean": mean("rstar2_sandbox_queue_depth_at_submit"), "queue_depth_p99": _quantile(depth, 0.99),
           "rejected": after["rejected"] - before["rejected"],
           "executor_restarts": after["restarts"] - before["restarts"],
           **{f"status_{k}": v for k, v in calls.items()}}
    return {prefix + k: float(v) for k, v in out.items()}
