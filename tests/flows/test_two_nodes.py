"""A Ray cluster of two nodes on this machine, started with `ray start` as an operator would: a head offering the
custom resource `engines` and a second node offering `trainer`. The campaign knows only RAY_ADDRESS; placement's
engine_resources / trainer_resources put the vLLM engine on the head and the trainer on the second node, and the
sandbox is the HTTP service (`rstar2 sandbox serve`). Ray's state API says where each actor ran. Both nodes and the
service are stopped by their own process trees (never a machine-wide `ray stop`)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from rstar2.cli.supervisor import stop_tree, tree, wait_http
from rstar2.core import checkpoint
from rstar2.rollout import cluster
from tests.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=1",
         "stages.0.steps=1", "stages.0.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=160",
         "eval.max_response_tokens=160", "world.max_positions=512",
         "placement.engine_resources={engines: 1}", "placement.trainer_resources={trainer: 1}",
         "engine.num_engines=1"]  # the head offers one engine slot


def _node(args: list[str], temp: Path, log: Path) -> subprocess.Popen:
    """`ray start --block` (it lives as long as its node, so the node stops with its process tree)."""
    ports = ["--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
             "--runtime-env-agent-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1",
                             "--object-store-memory", str(200 * 2**20), "--temp-dir", str(temp), *ports, *args],
                            cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(check, what: str, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert all(p.poll() is None for p in procs), f"a process exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """(RAY_ADDRESS, sandbox URL) of a head {engines: 1}, a second node {trainer: 1} and a sandbox service."""
    if ray.is_initialized():  # an earlier test's local cluster: this driver must join the two nodes instead
        ray.shutdown()
    temp = Path(f"/tmp/rs2n-{os.getpid()}")  # short: Ray's socket paths have a length limit
    gcs, sandbox_port = free_port(), free_port()
    address, url = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{sandbox_port}"
    procs = [_node(["--head", "--port", str(gcs), "--dashboard-port", str(free_port()), "--include-dashboard", "true",
                    "--ray-client-server-port", str(free_port()), "--resources", json.dumps({"engines": 1})],
                   temp / "head", tmp_path / "head.log")]
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rstar2.cli.main", "sandbox", "serve", "--port", str(sandbox_port), "--slots", "2"],
            cwd=ROOT, stdout=(tmp_path / "sandbox.log").open("ab"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait(lambda: _listening(gcs), "the head's GCS", procs)
        procs.append(_node(["--address", address, "--resources", json.dumps({"trainer": 1})], temp / "node2",
                           tmp_path / "node2.log"))
        monkeypatch.setenv("RAY_ADDRESS", address)
        cluster.init()
        _wait(lambda: ray.cluster_resources().get("trainer") == 1, "the second node", procs)
        wait_http(f"{url}/health")
        yield address, url
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_tree([q for p in procs for q in tree(p)], grace_s=3)  # all at once; the driver has left the cluster
        shutil.rmtree(temp, ignore_errors=True)


def test_engines_on_one_node_trainer_on_the_other(two_nodes, tmp_path):
    from ray.util.state import list_actors

    from rstar2.flows.campaign import CampaignParams, campaign

    _, url = two_nodes
    overrides = SMOKE + [f"out_dir={tmp_path / 'runs'}", "sandbox.backend=http", f"sandbox.urls=[{url}]"]
    summary = campaign(CampaignParams(preset="tiny", overrides=overrides, run_name="two"))
    assert summary["steps"] == 1 and checkpoint.is_committed(Path(summary["final_checkpoint"]))

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    actors = {a.name: a.node_id for a in list_actors(detail=True, limit=10_000) if a.name}
    engines = [node for name, node in actors.items() if "-engine-" in name]
    trainers = [node for name, node in actors.items() if name.endswith("-trainer")]
    assert engines and trainers
    assert all(nodes[n].get("engines") == 1 for n in engines)  # the head
    assert all(nodes[n].get("trainer") == 1 for n in trainers)  # the second node
    with urllib.request.urlopen(f"{url}/metrics/snapshot", timeout=10) as r:
        calls = json.loads(r.read())["calls"]
    assert sum(calls.values()) > 0  # the run's code and answer checks went to the HTTP service
