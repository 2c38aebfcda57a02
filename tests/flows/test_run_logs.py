"""A run's lines in its Prefect logs (what the UI's Logs tab shows), read back through Prefect's client (Prefect test
harness, MLflow on SQLite): the stage flow's log-step task logs each step's health line at INFO and the collapse alert
at WARNING; a progress line reported from a worker thread lands in the run that opened the bar; a failing task's
error is there at ERROR. The flow is the stage flow's logging loop alone (flows/train_stage.py runs it between its
steps); tests/ui/test_prefect_ui.py looks at the lines of a real campaign's stage run."""

import logging
import threading

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from rstar2.core import progress, tracking
from rstar2.tasks import costs, track

# format violations flat at 0.10 for three steps, then 0.30 twice: noise floor 0.02, start 0.10, so step 5 (0.30 >=
# 0.10 + 2 x 0.02 for the last 2 steps) fires and step 4 does not (only one step of the rise)
ROWS = [{"step": s, "reward_mean": r, "format_violation_rate": f, "tool_error_rate": 0.05}
        for s, r, f in [(1, 0.25, 0.10), (2, 0.5, 0.10), (3, 0.5, 0.10), (4, 0.125, 0.30), (5, 0.0, 0.30)]]


def _logs(flow_run_id) -> list[tuple[str, int, str]]:
    """(logger, level, message) of the flow run's logs, oldest first, once this process has sent all it holds."""
    APILogWorker.drain_all()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [(log.name, log.level, log.message) for log in sorted(logs, key=lambda log: log.timestamp)]


def test_a_stage_run_s_logs_hold_its_health_lines_alert_and_progress(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    exp = tracking.setup("run-logs", str(tmp_path))
    runs = (tracking.create_run(exp, "stage-st"), tracking.create_run(exp, "campaign"))

    @flow(name="stage-logs")
    def stage():
        since = costs.mark()
        for i in range(len(ROWS)):
            _, since = track.log_step(ROWS[:i + 1], 10, "st", runs, since)
        with progress.bar("rollout step 6", every_s=0) as update:
            worker = threading.Thread(target=update, args=(3, 4))  # as the agent loop reports
            worker.start()
            worker.join()

    state = stage(return_state=True)
    assert state.is_completed()
    logs = [(name, level, message) for name, level, message in _logs(state.state_details.flow_run_id)
            if name.startswith("rstar2")]
    assert logs[:5] == [
        ("rstar2.tasks.track", logging.INFO, "[st] step 11 | reward 0.250 | fmt-viol 0.100 | tool-err 0.050 | len - "
                                             "| grad - | clip-hi - | clip-lo - | entropy -"),
        ("rstar2.tasks.track", logging.INFO, "[st] step 12 | reward 0.500 | fmt-viol 0.100 | tool-err 0.050 | len - "
                                             "| grad - | clip-hi - | clip-lo - | entropy -"),
        ("rstar2.tasks.track", logging.INFO, "[st] step 13 | reward 0.500 | fmt-viol 0.100 | tool-err 0.050 | len - "
                                             "| grad - | clip-hi - | clip-lo - | entropy -"),
        ("rstar2.tasks.track", logging.INFO, "[st] step 14 | reward 0.125 | fmt-viol 0.300 | tool-err 0.050 | len - "
                                             "| grad - | clip-hi - | clip-lo - | entropy -"),
        ("rstar2.tasks.track", logging.INFO, "[st] step 15 | reward 0.000 | fmt-viol 0.300 | tool-err 0.050 | len - "
                                             "| grad - | clip-hi - | clip-lo - | entropy -")]
    assert logs[5] == ("rstar2.tasks.track", logging.WARNING,
                       "[st] ALERT collapse at step 15: format_violation_rate 0.10 -> 0.30 (noise 0.02)")
    assert len(logs) == 7 and logs[6][:2] == ("rstar2.core.progress", logging.INFO)
    assert logs[6][2].startswith("[rollout step 6] 3/4 (75 %), ")


def test_a_failing_task_s_error_is_in_its_run_s_logs():
    @task(name="fails")
    def fails():
        raise ValueError("the planted failure")

    @flow(name="failing")
    def failing():
        fails()

    state = failing(return_state=True)
    assert state.is_failed()
    errors = [m for _, level, m in _logs(state.state_details.flow_run_id) if level == logging.ERROR]
    assert any("ValueError: the planted failure" in m for m in errors), errors
