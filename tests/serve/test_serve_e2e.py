"""`rstar2 serve` as a user lives with it (real Prefect and MLflow servers on free 127.0.0.1 ports, the deployments
of prefect.yaml, a worker): a shrunk campaign run through its deployment is interrupted by SIGTERM or SIGINT to
`serve` after its first committed checkpoint; within the bound nothing `serve` started is left and both ports are
free. A second `serve` on the same state retries the interrupted run; its Prefect server is killed (SIGKILL) while the
run runs, `serve` starts it again, and the run completes from its checkpoint without a person; the
checkpoint event fired at most one on-checkpoint evaluation for the burst, and the newest checkpoint's evaluation
is on its MLflow LoggedModel."""

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import mlflow
import psutil
import pytest

from rstar2.cli import supervisor
from rstar2.core import config
from tests.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=6", "sft.epochs=0.5", "eval.samples=2",
         "rollout.group_size=4", "rollout.max_response_tokens=160", "eval.max_response_tokens=160",
         "world.max_positions=512", "stages.0.steps=2", "stages.0.prompts_per_step=3",
         "stages.0.max_response_tokens=160",
         # one engine each (a start costs ~10 s of CPU); several engines: tests/engine, the chaos test
         "engine.num_engines=1"]
BOUND_S = supervisor.WORKER_GRACE_S + supervisor.SERVER_GRACE_S + 20  # serve's own bound, plus start-up slack


def _until(what: str, check, timeout_s: float, every: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


class Serve:
    def __init__(self, home: Path, runs: Path, monkeypatch):
        self.pp, self.mp = free_port(), free_port()
        # every server's state under the test's own home (the shell's PREFECT_HOME would share a database across runs)
        self.env = {**os.environ, "RSTAR2_HOME": str(home), "PYTHONPATH": str(ROOT),
                    "PREFECT_HOME": str(home / "prefect"),
                    "PREFECT_MEMO_STORE_PATH": str(home / "prefect" / "memo_store.toml"),
                    "PREFECT_API_URL": f"http://127.0.0.1:{self.pp}/api",
                    "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{self.mp}"}
        self.log = (home / f"serve-{self.pp}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "rstar2.cli.main", "serve", "--prefect-port", str(self.pp),
                                      "--mlflow-port", str(self.mp), "--out-dir", str(runs)], cwd=ROOT,
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        # this test's Prefect client talks to serve's server; later tests in this process get their own again
        monkeypatch.setenv("PREFECT_API_URL", self.env["PREFECT_API_URL"])
        _until("serve registers the deployments", self._deployed, 600, 1)

    def _deployed(self) -> bool:
        """The last deployment of prefect.yaml is registered (asked of the API: a `prefect` command costs seconds)."""
        assert self.proc.poll() is None, f"serve exited: {self.proc.returncode}"
        try:
            with urllib.request.urlopen(f"{self.env['PREFECT_API_URL']}/deployments/name/evaluate/on-checkpoint",
                                        timeout=5) as r:
                return r.status == 200
        except OSError:  # not up yet, or not registered yet (404)
            return False

    def kill_prefect_server(self) -> None:
        """SIGKILL of serve's Prefect server process, as an out-of-memory kill would end it."""
        server = [p for p in psutil.Process(self.proc.pid).children()
                  if "server" in p.cmdline() and any("prefect" in a for a in p.cmdline())]
        assert len(server) == 1, [p.cmdline() for p in psutil.Process(self.proc.pid).children()]
        server[0].kill()

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient
        return SyncPrefectClient(self.env["PREFECT_API_URL"])

    def stop(self, sig: signal.Signals) -> list[psutil.Process]:
        started = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(sig)
        self.proc.wait(timeout=BOUND_S)
        return started


def test_interrupted_serve_leaves_nothing_and_the_run_is_retried(tmp_path, monkeypatch):
    """SIGTERM while the campaign trains, then a second `serve` retries it to completion; SIGINT stops that one."""
    interrupt, then = signal.SIGTERM, signal.SIGINT
    # a short home: Ray's AF_UNIX socket paths under it must stay below 108 bytes
    home, runs = Path(tempfile.mkdtemp(prefix="rs2-", dir="/tmp")), tmp_path / "runs"
    params = {"params": {"preset": "tiny", "overrides": SMOKE + [f"out_dir={runs}"], "run_name": "svc"}}
    run = runs / "svc"

    first = Serve(home, runs, monkeypatch)
    try:
        with first.client() as c:
            dep = c.read_deployment_by_name("campaign/tiny-cpu")
            fr = c.create_flow_run_from_deployment(dep.id, parameters=params)

            def first_checkpoint():
                assert not c.read_flow_run(fr.id).state.is_final(), "the campaign ended before its first checkpoint"
                return list(run.glob("checkpoints/*/step-*/COMMITTED.json"))
            _until("the first checkpoint", first_checkpoint, 1800, 1)
    except BaseException:
        first.stop(interrupt)  # a failed test leaves no servers behind either
        raise
    t0 = time.monotonic()
    started = first.stop(interrupt)
    assert time.monotonic() - t0 < BOUND_S
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"
    assert supervisor.port_holder(first.pp) is None and supervisor.port_holder(first.mp) is None

    second = Serve(home, runs, monkeypatch)
    try:
        from prefect.states import Scheduled
        with second.client() as c:
            assert c.read_flow_run(fr.id).state.is_final()
            c.set_flow_run_state(fr.id, Scheduled(), force=True)  # what the UI's Retry does
            _until("the retried campaign runs", lambda: c.read_flow_run(fr.id).state.is_running(), 600, 2)
            second.kill_prefect_server()  # serve starts it again; the worker and the flow run ride it out
            state = _until("the retried campaign", lambda: (s := _state(c, fr.id)) and s.is_final() and s, 1800, 2)
            assert state.is_completed(), state
            assert "the Prefect server exited (code -9); starting it again" in second.output()
            on_ckpt = _by_name(c, "evaluate/on-checkpoint")
            evals = _until("the triggered evaluations settle", lambda: (e := c.read_flow_runs(
                deployment_filter=on_ckpt)) and all(r.state.is_final() for r in e) and e, 900, 2)
        # one burst (the whole campaign) -> at most one evaluation run, in each serve's life
        assert len(evals) <= 2, [(e.name, e.state) for e in evals]
        newest = sorted(run.glob("checkpoints/*/step-*"))[-1]
        client = mlflow.MlflowClient(second.env["MLFLOW_TRACKING_URI"])
        exp = client.get_experiment_by_name(config.load("tiny", SMOKE).experiment).experiment_id
        model = client.search_logged_models([exp], f"tags.`rstar2.core.checkpoint` = '{newest}'")
        assert "eval_pass1" in {m.key for m in model[0].metrics}
    finally:
        started = second.stop(then)
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert supervisor.port_holder(second.pp) is None and supervisor.port_holder(second.mp) is None


def _state(c, run_id):
    """The flow run's state; None while the Prefect server does not answer (it is being started again)."""
    import httpx
    try:
        return c.read_flow_run(run_id).state
    except (httpx.HTTPError, OSError):
        return None


def _by_name(c, name: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    return DeploymentFilter(id=DeploymentFilterId(any_=[c.read_deployment_by_name(name).id]))
