"""Headless Chromium against the local Prefect UI: the deployments of prefect.yaml are listed, a finished campaign's
RL-step flow run opens with its DAG, and the stage's flow run shows its step's health line in its logs; screenshots
land in $RSTAR2_UI_SHOTS (default .rstar2/ui-shots).

Needs Debian's `chromium`; run it with `bash infra/dev.sh ui-test` (installs chromium if missing). It starts its own
Prefect server on a free port, registers the deployments, runs a 1-step tiny campaign against it, then looks."""

import html
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2.cli import supervisor

pytestmark = pytest.mark.ui
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=1",
         "stages.0.steps=1", "stages.0.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=128",
         "eval.max_response_tokens=128", "world.max_positions=512"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_port):
    port = free_port()
    home = tmp_path_factory.mktemp("prefect-home")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "RSTAR2_ROOT": str(ROOT)}
    proc = subprocess.Popen([supervisor._bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=(home / "server.log").open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        supervisor.wait_prefect(f"http://127.0.0.1:{port}/api", 180)
        supervisor.register_deployments(env)
        out = tmp_path_factory.mktemp("runs")
        sets = [a for s in SMOKE + [f"out_dir={out}"] for a in ("--set", s)]
        subprocess.run([sys.executable, "-m", "rstar2.cli.main", "campaign", "--preset", "tiny", "--run-name", "ui",
                        *sets], env=env, cwd=ROOT, check=True, timeout=1200)
        yield f"http://127.0.0.1:{port}", env
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_ui_lists_the_deployments(server, chromium, shots):
    """Every deployment of prefect.yaml is on the deployments page or, past its first page, on its own page."""
    import yaml
    from prefect.client.orchestration import SyncPrefectClient

    url, _ = server
    want = {d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    with SyncPrefectClient(f"{url}/api") as client:
        registered = {d.name: d.id for d in client.read_deployments()}
    assert want <= set(registered)
    dom = chromium(f"{url}/deployments", "--dump-dom")
    listed = {n for n in want if n in dom}
    assert len(listed) >= 5, listed  # the page rendered (it shows the first 10 rows)
    for name in want - listed:
        assert name in chromium(f"{url}/deployments/deployment/{registered[name]}", "--dump-dom"), name
    chromium(f"{url}/deployments", f"--screenshot={shots / 'deployments.png'}")
    assert (shots / "deployments.png").stat().st_size > 10_000


def test_the_ui_opens_a_finished_campaign_and_its_step_dag(server, chromium, shots):
    """The stage's flow run page draws each step as a task run enclosing its DAG."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    url, _ = server
    with SyncPrefectClient(f"{url}/api") as client:
        campaign = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["tiny"])))
        step = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["stage1-step-0"])))
        stage = step and client.read_flow_run(step[0].flow_run_id)
    assert campaign and campaign[0].state.is_completed() and step
    dom = chromium(f"{url}/runs/flow-run/{campaign[0].id}", "--dump-dom")
    assert "Completed" in dom and "tiny" in dom
    dom = chromium(f"{url}/runs/task-run/{step[0].id}", "--dump-dom")
    assert "stage1-step-0" in dom
    chromium(f"{url}/runs/flow-run/{stage.id}", f"--screenshot={shots / 'rl-step-dag.png'}")
    chromium(f"{url}/runs/flow-run/{campaign[0].id}", f"--screenshot={shots / 'campaign.png'}")
    assert (shots / "rl-step-dag.png").stat().st_size > 10_000


def test_the_stage_run_s_page_shows_its_step_lines(server, chromium, shots):
    """The stage's flow run holds its step's health line (INFO, logger rstar2.tasks.track) in its Prefect logs, and
    the run's page shows it in its Logs tab."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, TaskRunFilter, TaskRunFilterName

    url, _ = server
    with SyncPrefectClient(f"{url}/api") as client:
        step = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["stage1-step-0"])))
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[step[0].flow_run_id])))
    health = [log for log in logs if log.name == "rstar2.tasks.track"]
    assert len(health) == 1 and health[0].level == logging.INFO, [(log.name, log.message) for log in logs]
    line = health[0].message
    assert re.fullmatch(r"\[stage1\] step 1 \| reward [\d.]+ \| fmt-viol [\d.]+ \| tool-err [\d.-]+ \| len \d+ \| .*",
                        line), line
    page = f"{url}/runs/flow-run/{step[0].flow_run_id}?tab=Logs"
    dom = chromium(page, "--dump-dom")
    assert line in html.unescape(re.sub(r"<[^>]+>", "", dom)), line
    chromium(page, f"--screenshot={shots / 'stage-logs.png'}")
    assert (shots / "stage-logs.png").stat().st_size > 10_000
