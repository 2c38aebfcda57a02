"""infra/compose.yaml for real: Prefect server, MLflow server (serving artifacts), the sandbox service and a Ray head
in containers on the host's network; a two-step tiny campaign on this machine runs against them through
PREFECT_API_URL, MLFLOW_TRACKING_URI and sandbox.backend=http; the run is read back from both servers; `down`
leaves no container, volume or listening port. Needs the images of `bash infra/dev.sh images` (else skipped).

The campaign's own Ray stays local: a driver joins a Ray cluster only with the head's exact Python version (patch
level included), and this venv's interpreter is not the image's; the head is checked to be up and to accept jobs."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

pytestmark = [pytest.mark.docker, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ["docker-compose", "-f", str(ROOT / "infra" / "compose.yaml")]
SERVICES = ["prefect", "mlflow", "ray-head", "sandbox"]
TWO_STEPS = ["world.n_sft=120", "world.n_train=20", "world.n_test=4", "sft.epochs=0.5", "eval.samples=1",
             "rollout.group_size=4", "rollout.max_response_tokens=128", "eval.max_response_tokens=128",
             "world.max_positions=512", "stages.0.steps=2", "stages.0.prompts_per_step=2",
             "stages.0.max_response_tokens=128"]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _until(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def stack():
    try:
        import docker

        engine = docker.from_env()
        for image in ("rstar2:cpu", "rstar2-sandbox:latest"):
            engine.images.get(image)
    except Exception as e:  # noqa: BLE001 - no SDK, engine or image: the same skip
        pytest.skip(f"no Docker engine with the rstar2 images (bash infra/dev.sh images): {e}")
    ports = {name: free_port() for name in ("PREFECT", "MLFLOW", "SANDBOX", "RAY", "RAY_CLIENT")}
    project = f"rstar2test{os.getpid()}"
    env = {**os.environ, **{f"RSTAR2_{k}_PORT": str(v) for k, v in ports.items()}}
    cmd = [*COMPOSE, "-p", project]
    subprocess.run([*cmd, "up", "-d", *SERVICES], env=env, check=True, capture_output=True)
    try:
        _until("the Prefect server", lambda: _healthy(f"http://127.0.0.1:{ports['PREFECT']}/api/health"), 180)
        _until("the MLflow server", lambda: _healthy(f"http://127.0.0.1:{ports['MLFLOW']}/health"), 180)
        _until("the sandbox service", lambda: _healthy(f"http://127.0.0.1:{ports['SANDBOX']}/health"), 120)
        _until("the Ray head", lambda: _listening(ports["RAY"]), 120)
        yield ports, cmd, env, engine, project
    finally:
        subprocess.run([*cmd, "down", "-v", "--timeout", "20"], env=env, capture_output=True)


def test_a_campaign_against_the_compose_stack_is_read_back_from_both_servers(stack, tmp_path, request):
    import mlflow
    from prefect.client.orchestration import SyncPrefectClient

    ports, cmd, env, engine, project = stack
    ray = subprocess.run([*cmd, "exec", "-T", "ray-head", "python", "-c",
                          f"import ray; ray.init(address='127.0.0.1:{ports['RAY']}'); "
                          "print(ray.get(ray.remote(lambda: 'ray-ok').remote()))"],
                         env=env, capture_output=True, text=True, timeout=180)
    if "ray-ok" not in ray.stdout:
        logs = subprocess.run([*cmd, "logs", "--tail", "40", "ray-head"], env=env, capture_output=True, text=True)
        pytest.fail(f"the Ray head took no job (exit {ray.returncode}): {ray.stdout[-1000:]} {ray.stderr[-2000:]}\n"
                    f"{logs.stdout[-3000:]}")

    prefect_api, mlflow_uri = f"http://127.0.0.1:{ports['PREFECT']}/api", f"http://127.0.0.1:{ports['MLFLOW']}"
    home = Path(tempfile.mkdtemp(prefix="rs2c-", dir="/tmp"))  # short: Ray's socket paths under it
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    run_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run_env.update(RSTAR2_HOME=str(home), PYTHONPATH=str(ROOT), PREFECT_API_URL=prefect_api,
                   MLFLOW_TRACKING_URI=mlflow_uri)
    sets = [*TWO_STEPS, f"out_dir={tmp_path}", "sandbox.backend=http",
            f"sandbox.urls=[http://127.0.0.1:{ports['SANDBOX']}]"]
    done = subprocess.run([sys.executable, "-m", "rstar2.cli.main", "campaign", "--preset", "tiny",
                           "--run-name", "compose", *[a for s in sets for a in ("--set", s)]],
                          cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])

    with SyncPrefectClient(prefect_api) as c:  # the flow run, on the compose Prefect server
        runs = c.read_flow_runs()
        campaign = [r for r in runs if c.read_flow(r.flow_id).name == "campaign"]
        assert len(campaign) == 1 and campaign[0].state.is_completed(), [(r.name, r.state) for r in runs]
    client = mlflow.MlflowClient(mlflow_uri)  # the tracked run and its artifacts, through the MLflow server
    (run,) = client.search_runs([client.get_experiment_by_name("rstar2-tiny").experiment_id],
                                "tags.`mlflow.runName` = 'compose'")
    assert run.info.status == "FINISHED" and "pass1_rl" in run.data.metrics
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # served by the server, not a path on this disk
    assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    served = Path(tempfile.mkdtemp(dir=tmp_path))
    client.download_artifacts(run.info.run_id, "summary.json", str(served))
    assert (served / "summary.json").read_text().startswith("{")

    # the sandbox container ran the campaign's tool calls (its call counters, by status)
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['SANDBOX']}/metrics/snapshot", timeout=5) as r:
        assert sum(json.loads(r.read())["calls"].values()) > 0


def test_down_leaves_nothing(stack):
    ports, cmd, env, engine, project = stack
    subprocess.run([*cmd, "down", "-v", "--timeout", "20"], env=env, check=True, capture_output=True)
    label = f"com.docker.compose.project={project}"
    assert engine.containers.list(all=True, filters={"label": label}) == []
    assert engine.volumes.list(filters={"label": label}) == []
    for port in ports.values():
        assert not _healthy(f"http://127.0.0.1:{port}/"), f"port {port} still answers"
