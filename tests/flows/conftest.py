import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    # one temporary Prefect server for all flow tests; generous start-up time on a loaded 2-core CI machine
    with prefect_test_harness(server_startup_timeout=120):
        yield
