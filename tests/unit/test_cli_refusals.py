"""Commands refuse what cannot run with one line and exit 2, before anything starts."""

from typer.testing import CliRunner

from rstar2.cli.main import app


def test_an_ablation_over_several_worlds_refuses_one_shared_sft_model():
    res = CliRunner().invoke(app, ["ablation", "--sft-checkpoint", "some/sft", "--world-seeds", "2"])
    assert res.exit_code == 2 and "drop --sft-checkpoint" in res.output


def test_the_step_simulator_refuses_a_malformed_split():
    res = CliRunner().invoke(app, ["bench", "step", "--split", "48"])
    assert res.exit_code == 2 and "--split takes two GPU counts" in res.output
