"""The chaos command's checks on hand-made run records: what counts as a difference from the reference run, and each
verdict (the runs themselves are in tests/flows/test_kill_retry.py)."""

import copy

import pytest

from rstar2.cli.chaos import checks, faults, runner


def record(**change) -> dict:
    rec = {"pass1": 0.5, "steps": 3,
           "figures": {**{m: [0.1, 0.2, 0.3] for m in checks.FIGURES}, "logprob_gap": [1e-7, 2e-7, 1e-7]},
           "mlflow_steps": {m: [1, 2, 3] for m in checks.FIGURES + ["logprob_gap"]},
           "kept": ["a", "b", "c"],
           "rollouts": [{"rows": 24, "unique": 24, "keys": k} for k in "xyz"],
           "checkpoints": [{"name": f"step-000{i}", "committed": True, "optimizer_step": i, "committed_at": f"t{i}"}
                           for i in (1, 2, 3)],
           "leftovers": []}
    rec.update(change)
    return rec


def test_the_same_run_differs_in_nothing():
    assert checks.differences(record(), record(), {"step-0001": "t1"}) == []


def test_each_kind_of_difference_is_named():
    ref = record()
    got = copy.deepcopy(ref)
    got["figures"]["grad_norm"][1] = 0.2000001
    assert checks.differences(got, ref, {}) == ["grad_norm per step [0.1, 0.2000001, 0.3] != [0.1, 0.2, 0.3]"]
    cases = {
        "held-out pass@1": record(pass1=0.49),
        "logprob_gap": record(figures={**ref["figures"], "logprob_gap": [1e-7, 0.02, 1e-7]}),
        "MLflow reward_mean steps [1, 2, 2, 3]": record(mlflow_steps={**ref["mlflow_steps"],
                                                                      "reward_mean": [1, 2, 2, 3]}),
        "kept rollouts differ at steps [2]": record(kept=["a", "B", "c"]),
        "step 3: 2 rollouts counted twice": record(rollouts=ref["rollouts"][:2] + [{"rows": 26, "unique": 24,
                                                                                      "keys": "z"}]),
        "step 1: the rollout table holds other": record(rollouts=[{"rows": 23, "unique": 23, "keys": "w"}]
                                                        + ref["rollouts"][1:]),
        "half-written checkpoints or leftovers: ['.tmp-step-0003-1']": record(leftovers=[".tmp-step-0003-1"]),
        "optimizer steps at the checkpoints [1, 1, 2]": record(checkpoints=[
            {**c, "optimizer_step": s} for c, s in zip(ref["checkpoints"], (1, 1, 2))]),
    }
    for want, got in cases.items():
        diffs = checks.differences(got, ref, {})
        assert len(diffs) == 1 and diffs[0].startswith(want), (want, diffs)
    # a checkpoint committed before the retry and committed again after it: a step done twice
    assert checks.differences(record(), ref, {"step-0001": "t0"}) == [
        "checkpoints written again after the retry: ['step-0001']"]


@pytest.mark.parametrize("row, want", [
    ({"returncode": 0, "attempts": 1, "struck": {"engine": "step 1"}, "not_injected": [], "differences": []},
     "recovered"),
    ({"returncode": 0, "attempts": 2, "struck": {"flow": "step 2"}, "not_injected": [], "differences": []},
     "retried"),
    ({"returncode": 0, "attempts": 1, "struck": {"engine": "step 1"}, "not_injected": [], "differences": ["x"]},
     "lost"),
    ({"returncode": 1, "attempts": 2, "struck": {"disk": "step 2"}, "not_injected": [], "differences": []},
     "failed"),
    ({"returncode": 0, "attempts": 1, "struck": {}, "not_injected": ["trainer"], "differences": []}, "failed"),
])
def test_verdicts(row, want):
    assert checks.verdict(row) == want


def test_an_unknown_fault_is_refused_before_anything_runs():
    known = faults.fault_table(60)
    assert runner.parse_rows(["engine+trainer", "flow"], known) == [["engine", "trainer"], ["flow"]]
    with pytest.raises(ValueError, match="unknown fault.*gpu; known: none, engine, executor"):
        runner.parse_rows(["engine+gpu"], known)


def test_the_check_that_stopped_a_run_is_found_under_the_errors_around_it():
    from rstar2.cli.runs import _run_stop
    from rstar2.core.checkpoint import DiskFull

    full = DiskFull(28, "step-0002: the disk filled up while it was written")
    try:
        try:
            raise full
        except DiskFull as e:
            raise RuntimeError("task run failed") from e
    except RuntimeError as wrapped:
        assert _run_stop(wrapped) is full
    assert _run_stop(RuntimeError("something else")) is None


def test_a_refused_or_stopped_campaign_ends_with_one_line_and_anything_else_with_its_traceback(capsys):
    import typer

    from rstar2.cli.runs import _stopped
    from rstar2.core.checkpoint import DiskFull
    from rstar2.run.preflight import PreflightError

    def raising(e: BaseException):
        def run():
            try:
                raise e
            except BaseException as inner:
                raise RuntimeError("flow run failed") from inner  # as Prefect and Ray wrap it
        return run

    refused = PreflightError("preflight failed: context: world.max_positions 1024 exceeds the model's 512")
    for e, line in ((refused, "max_positions 1024 exceeds"), (DiskFull(28, "the disk filled up"), "again to resume")):
        with pytest.raises(typer.Exit) as out:
            _stopped(raising(e))
        assert out.value.exit_code == 1
        assert line in " ".join(capsys.readouterr().out.split())  # rich may wrap the line
    with pytest.raises(RuntimeError, match="flow run failed"):
        _stopped(raising(KeyError("bug")))
    assert _stopped(lambda: {"ok": 1}) == {"ok": 1}


def test_the_executor_fault_finds_the_sandbox_s_executors_by_their_command_line():
    """The executor fault finds zygotes by the program their interpreter runs, whatever options come before it (the
    chaos matrix's executor row was silently not injected when the options changed)."""
    import psutil

    from rstar2.sandbox import SandboxLimits
    from rstar2.sandbox.service import SandboxService

    assert faults._script(["/usr/bin/python3", "-s", "-P", "-S", "/x/zygote.py", "{}"]) == "/x/zygote.py"
    with SandboxService(SandboxLimits(timeout_s=1.5, cpu_s=2, memory_mb=256), slots=1):
        found = [p for p in psutil.Process().children(recursive=True)
                 if faults._script(faults._cmdline(p)).endswith("zygote.py")]
    assert found


def test_a_bf16_trainer_s_gap_is_judged_against_the_reference_s_own():
    ref = record(figures={**record()["figures"], "logprob_gap": [2.1e-3, 3.2e-3, 2.8e-3]})  # bf16 trainer, fp32 engine
    same = copy.deepcopy(ref)
    same["figures"]["logprob_gap"][1] += 3e-8  # the engine's batching noise
    assert checks.differences(same, ref, {}) == []
    stale = copy.deepcopy(ref)
    stale["figures"]["logprob_gap"][1] = 1.9e-2  # an engine one version behind
    assert checks.differences(stale, ref, {})[0].startswith("logprob_gap per step")
