"""`rstar2 chaos` end to end: a shrunken tiny campaign without faults (the reference, with its own SFT); then the same
campaign from that SFT model with every fault of the matrix in one run, in turn: an engine actor's process killed
(SIGKILL) while step 1 rolls out, a sandbox executor killed, the sandbox's HTTP server killed (this row's code runs
there) and started again 3 s later, the trainer actor killed before step 1's update, the Prefect server restarted in
step 2, the campaign's whole process group killed in step 2 (retried, as the Prefect UI's Retry does), the
checkpoints' own small filesystem filled after step 1 (one clear error, then retried with room) and the MLflow
tracking server stopped for 5 s. The run must end as the reference (which also shows a run to be a function of its
seeds on one host): per-step figures, kept rollouts and held-out pass@1 to the digit, each step in MLflow once,
every checkpoint whole and none written twice, the optimizer step counting on.

The SFT here is a few seconds' (240 transcripts, half an epoch): its model earns no reward, so its updates are zero and
the figures alone could not tell a wrong trainer state; the optimizer step count at each checkpoint does. The command's
own default keeps the preset's SFT (docs/faults.md)."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.e2e
SMOKE = ["world.n_sft=240", "sft.epochs=0.5", "world.n_test=4", "stages.0.steps=2"]  # every fault strikes by step 2


def test_every_fault_in_one_run_leaves_the_run_without_faults(tmp_path):
    from rstar2.cli.main import app

    # in this order each strikes while the campaign runs: a campaign that starts while its Prefect server is down
    # stops at once (Prefect's client fails fast on a first connection), so the restart comes before the flow's kill
    faults = (["engine", "executor", "server", "trainer", "prefect", "flow"] + (["disk"] if os.geteuid() == 0 else [])
              + ["mlflow"])
    sets = [a for s in SMOKE + [f"out_dir={tmp_path / 'runs'}"] for a in ("--set", s)]
    res = CliRunner().invoke(app, ["chaos", "--preset", "tiny", *sets, "--row", "+".join(faults),
                                   "--outage-s", "5", "--json", str(tmp_path / "chaos.json")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "chaos.json").read_text())
    (row,) = report["rows"]
    assert row["differences"] == [] and row["verdict"] == "retried", row
    assert list(row["struck"]) == faults and row["not_injected"] == []
    assert row["attempts"] == 2 + ("disk" in faults)  # the flow's SIGKILL and the full disk each stopped the run
    log = Path(row["log"]).read_text()
    assert "engine 0 died" in log or "engine 1 died" in log  # and was started again at the next weight sync
    assert "trainer died" in log  # and was started again in its state before the update, which was redone
    if "disk" in faults:
        assert "the disk filled up while it was written" in log and "nothing was committed" in log
