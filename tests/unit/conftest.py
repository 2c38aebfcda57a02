import pytest

from rstar2.sandbox import SandboxLimits
from rstar2.sandbox.service import SandboxService

FAST = SandboxLimits(timeout_s=1.5, cpu_s=2, memory_mb=256)


@pytest.fixture(scope="session")
def fast():
    return FAST


@pytest.fixture(scope="session")
def service():
    """One in-process sandbox service (2 slots) for the sandbox, reward and rollout tests: executors start once."""
    with SandboxService(FAST, slots=2) as svc:
        yield svc
