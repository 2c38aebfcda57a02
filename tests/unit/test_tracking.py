"""The MLflow store follows each campaign's out_dir unless the user set MLFLOW_TRACKING_URI."""

import os

import pytest

from rstar2.core import tracking


def test_each_out_dir_gets_its_own_store_in_one_process(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking.setup("a", str(tmp_path / "one"))
    assert "MLFLOW_TRACKING_URI" not in os.environ  # mlflow.set_tracking_uri exports it; setup must not leak it
    tracking.setup("b", str(tmp_path / "two"))
    assert tracking.client().tracking_uri == f"sqlite:///{(tmp_path / 'two' / 'mlflow.db').resolve()}"
    assert (tmp_path / "one" / "mlflow.db").exists() and (tmp_path / "two" / "mlflow.db").exists()


def test_a_user_store_wins_over_out_dir(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracking.setup("a", str(tmp_path / "one"))
    assert tracking.client().tracking_uri == uri and os.environ["MLFLOW_TRACKING_URI"] == uri


def test_a_tracking_server_chooses_where_artifacts_go(tmp_path, monkeypatch):
    """Against `mlflow server --serve-artifacts` the experiment names no artifact location (the server's own: uploads
    through it), while a local store keeps them under out_dir. The client is recorded, not a server started."""
    made = {}

    class Recorder:
        def __init__(self, uri):
            self.tracking_uri = uri

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location=None, tags=None):
            made[self.tracking_uri] = artifact_location
            return "1"

    monkeypatch.setattr(tracking.mlflow, "MlflowClient", Recorder)
    monkeypatch.setattr(tracking.mlflow, "set_tracking_uri", lambda uri: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    tracking.setup("a", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tracking.setup("a", str(tmp_path))
    assert made == {"http://127.0.0.1:5000": None,
                    f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}": (tmp_path / "mlartifacts").resolve().as_uri()}


def test_a_table_is_logged_once(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_id = tracking.create_run(tracking.setup("t", str(tmp_path)), "r")
    for value in (0.5, 0.7):  # a retried evaluation logs its table again: MLflow would append the row
        tracking.log_table(run_id, [{"suite": "aime", "pass1": value}], "eval/final-test.json")
    table = json.loads(Path(tracking.client().download_artifacts(run_id, "eval/final-test.json", str(tmp_path)))
                       .read_text())
    assert table == {"columns": ["suite", "pass1"], "data": [["aime", 0.5]]}


def test_ending_ends_the_run_as_the_block_ends(monkeypatch):
    """rstar2.tasks.track.ending: FINISHED when the block ends, FAILED when it raises (re-raised), nothing when the run
    is another flow's."""
    from rstar2.tasks import track

    ended = []
    monkeypatch.setattr(track, "end_run", lambda run_id, status="FINISHED": ended.append((run_id, status)))
    with track.ending("a"):
        pass
    with pytest.raises(KeyboardInterrupt):
        with track.ending("b"):
            raise KeyboardInterrupt
    with pytest.raises(ValueError):
        with track.ending("c", owns_run=False):
            raise ValueError("boom")
    with track.ending("d", owns_run=False):
        pass
    assert ended == [("a", "FINISHED"), ("b", "FAILED")]


def test_a_resumed_stage_logs_the_committed_steps_mlflow_never_got_once(tmp_path, monkeypatch):
    """A process killed between step 2's checkpoint commit and its MLflow write: the retry finds step 2 committed (its
    figures in the manifest) but not logged, and logs it, once; steps 1 and 3 are not logged again."""
    from rstar2.tasks import track

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    exp = tracking.setup("resume", str(tmp_path))
    parent = tracking.create_run(exp, "campaign")
    stage = tracking.create_run(exp, "stage-stage1", parent)
    rows = [{"step": s, "reward_mean": 0.1 * s, "tool_error_rate_pos": 0.0, "loss": -s} for s in (1, 2, 3)]
    for row in (rows[0], rows[2]):
        tracking.log_metrics(stage, {k: v for k, v in row.items() if k != "step"}, 10 + row["step"])
    assert track.log_unlogged_steps.fn(rows, 10, "stage1", (stage, parent)) == [12]
    assert track.log_unlogged_steps.fn(rows, 10, "stage1", (stage, parent)) == []  # nothing twice
    history = tracking.client().get_metric_history(stage, "loss")
    assert sorted((m.step, m.value) for m in history) == [(11, -1), (12, -2), (13, -3)]
    assert [(m.step, m.value) for m in tracking.client().get_metric_history(parent, "reward_mean")] == [(12, 0.2)]


def test_a_run_found_again_with_other_settings_is_one_error_naming_them(tmp_path, monkeypatch):
    from rstar2.core import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracking.setup("changed", str(tmp_path))
    run = tracking.find_or_create_run(exp, "r", "runs/r")
    tracking.log_params(run, {"world": {"n_sft": 240}, "seed": 0})
    tracking.log_params(tracking.find_or_create_run(exp, "r", "runs/r"), {"world": {"n_sft": 240}, "seed": 0})
    with pytest.raises(tracking.ChangedParams, match=r"started with other settings \(world.n_sft 240 -> 200\)"):
        tracking.log_params(tracking.find_or_create_run(exp, "r", "runs/r"), {"world": {"n_sft": 200}, "seed": 0})
