"""Three faults in one campaign, and the run they leave is the run without them. An engine actor's process is killed
with SIGKILL as RL starts: its trajectories finish on the other engine, and the next weight sync starts it again. The
trainer actor's process is killed about when its first update runs: it is started again in its state before the
update, which is redone. Then the campaign's own process is killed with SIGKILL in the middle of an RL step and
retried (what the Prefect UI's Retry does: the same flow with the same parameters): it resumes from the last committed
checkpoint with the trainer's state and the same data order — no step lost, none done twice. It ends as the same
campaign run without faults from the same SFT model: the same kept rollouts, per-step figures and held-out pass@1, to
the last digit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import polars as pl
import psutil
import pytest

from rstar2.run import checkpoint, steps
pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=1",
         "stages.0.steps=3", "stages.0.prompts_per_step=3", "rollout.group_size=4", "rollout.max_response_tokens=160",
         "eval.max_response_tokens=160", "world.max_positions=512",
         "roc.drop_all_equal=false"]  # every step updates, so the optimizer step count shows whether state came back


# what a run must repeat: the health line's figures and the RoC and update figures behind them. Not logprob_gap: the
# engine's log-probs of the same sampled tokens move at the 1e-8 level with how turns are batched together (measured:
# a mean gap of 5.60e-7 against 5.50e-7 for the same step's tokens, rolled out on one engine and on two), so the two
# runs' gaps are compared as noise, not to the digit
FIGURES = ["reward_mean", "tool_error_rate", "format_violation_rate", "response_len_mean", "grad_norm", "loss",
           "entropy", "roc_kept"]


def _campaign(out: Path, log: Path, name: str = "kr", *extra: str) -> subprocess.Popen:
    sets = [a for s in SMOKE + [f"out_dir={out}"] for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "rstar2.cli.main", "campaign", "--preset", "tiny", "--run-name", name,
                             *sets, *extra], cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _is_actor(p: psutil.Process, cls: str) -> bool:
    try:
        return bool(p.cmdline()[:1]) and p.cmdline()[0].startswith(f"ray::{cls}")
    except psutil.Error:
        return False


def _figures(client: mlflow.MlflowClient, summary: dict) -> dict[str, list[float]]:
    stage = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")[0]
    return {k: [m.value for m in sorted(client.get_metric_history(stage.info.run_id, k), key=lambda m: m.step)]
            for k in FIGURES + ["logprob_gap"]}


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"campaign exited ({proc.returncode}) before {path}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.5)


def test_a_killed_campaign_resumes_from_its_last_checkpoint_when_retried(tmp_path):
    out, log = tmp_path / "runs", tmp_path / "campaign.log"
    run = out / "kr"
    proc = _campaign(out, log)
    # an engine killed once the SFT evaluation is written: RL's first rollout runs on the other one
    _wait_for(run / "eval" / "sft-test.parquet", proc, log)
    engines = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_actor(p, "EngineActor")]
    assert len(engines) == 2, [p.cmdline()[:1] for p in psutil.Process(proc.pid).children(recursive=True)]
    engines[0].kill()
    # the trainer killed once step 1's kept batch is written: about when its update runs
    _wait_for(run / "stage1" / "step-0000" / "kept.parquet", proc, log)
    trainers = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_actor(p, "PolicyTrainer")]
    assert len(trainers) == 1
    trainers[0].kill()
    # SIGKILL in the middle of step 2: step 1 is committed, step 2's rollouts are written, its update is not
    _wait_for(run / "stage1" / "step-0001" / "rollouts.parquet", proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "engine 0 died" in log.read_text()  # and was started again by the step's weight sync
    assert "trainer died" in log.read_text()  # and was started again in its state before the update
    first = checkpoint.manifest(run / "checkpoints" / "stage1" / "step-0001")
    assert checkpoint.latest(run / "checkpoints" / "stage1").name == "step-0001"

    retry = _campaign(out, log)
    assert retry.wait(timeout=900) == 0, log.read_text()[-3000:]

    ckpts = checkpoint.committed(run / "checkpoints" / "stage1")
    assert [c.name for c in ckpts] == ["step-0001", "step-0002", "step-0003"]
    assert checkpoint.manifest(ckpts[0])["committed_at"] == first["committed_at"]  # step 1 was not done again
    # the trainer's state came back: its optimizer step counts on from the checkpoint instead of restarting at 0
    assert [checkpoint.manifest(c)["optimizer_step"] for c in ckpts] == [1, 2, 3]
    train = str(run / "world" / "train.parquet")
    for step in range(3):  # the data order is the uninterrupted run's
        want = [p["problem_id"] for p in steps.select_prompts(train, step, 3, seed=0)]
        got = pl.read_parquet(run / "stage1" / f"step-{step:04d}" / "rollouts.parquet")["problem_id"]
        assert got.unique(maintain_order=True).to_list() == want
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    stage = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
    assert len(stage) == 1  # the retry logged into the same stage run
    assert [m.step for m in client.get_metric_history(stage[0].info.run_id, "reward_mean")] == [1, 2, 3]

    # the fault changed nothing: the same campaign uninterrupted, from the killed run's SFT model
    ref = _campaign(out, log, "ref", "--sft-checkpoint", str(run / "sft"))
    assert ref.wait(timeout=900) == 0, log.read_text()[-3000:]
    ref_summary = json.loads((out / "ref" / "summary.json").read_text())
    for step in range(3):
        kept = [pl.read_parquet(r / "stage1" / f"step-{step:04d}" / "kept.parquet")
                .select("problem_id", "sample_idx", "response_ids", "reward") for r in (run, out / "ref")]
        assert kept[0].equals(kept[1]), f"step {step}: the kept rollouts differ"
    got, want = _figures(client, summary), _figures(client, ref_summary)
    assert all(len(v) == 3 for v in want.values()), want
    assert {k: got[k] for k in FIGURES} == {k: want[k] for k in FIGURES}
    assert max(got["logprob_gap"] + want["logprob_gap"]) < 1e-5  # both runs sampled from the trainer's weights
    assert summary["pass1_rl"] == ref_summary["pass1_rl"]
