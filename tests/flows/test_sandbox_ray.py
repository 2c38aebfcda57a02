"""The sandbox service as a Ray actor group, through the same batching client as HTTP (backend "ray")."""

import pytest

from rstar2.core.config import SandboxCfg
from rstar2.rollout import cluster
from rstar2.sandbox import ExecRequest
from rstar2.sandbox.backends import connect

pytestmark = pytest.mark.e2e


def test_ray_actor_group_runs_calls_and_reports_metrics():
    cluster.init()
    sb = connect(SandboxCfg(backend="ray", ray_actors=2, workers=1, timeout_s=1.0, batch_size=4))
    try:
        reqs = [ExecRequest(f"print({i} ** 2)") for i in range(10)] + [ExecRequest("while True:\n    pass")]
        results = sb.run_batch(reqs)
        assert [r.stdout for r in results[:10]] == [f"{i ** 2}\n" for i in range(10)]
        assert results[10].status == "timeout"
        snap = sb.snapshot()
        assert snap["services"] == 2 and snap["calls"]["ok"] >= 10 and snap["calls"]["timeout"] == 1
        assert sb.isolation()["pid_namespace"].startswith(("active", "unavailable"))
    finally:
        sb.close()
