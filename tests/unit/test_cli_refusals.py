"""Commands refuse what cannot run with one line and exit 2, before anything starts."""

from typer.testing import CliRunner

from rstar2.cli.main import app


def test_an_ablation_over_several_worlds_refuses_one_shared_sft_model():
    res = CliRunner().invoke(app, ["ablation", "--sft-checkpoint", "some/sft", "--world-seeds", "2"])
    assert res.exit_code == 2 and "drop --sft-checkpoint" in res.output


def test_the_step_simulator_refuses_a_malformed_split():
    res = CliRunner().invoke(app, ["bench", "step", "--split", "48"])
    assert res.exit_code == 2 and "--split takes two GPU counts" in res.output


def test_solve_refuses_a_model_without_tool_support_in_one_line_with_the_way_forward(smollm2_plain):
    res = CliRunner().invoke(app, ["solve", "--checkpoint", str(smollm2_plain), "What is 12 times 7?"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "ignores `tools`" in lines[0] and "rstar2 model add-tools" in lines[0]


def test_model_commands_refuse_what_they_cannot_do(smollm2_dir, tmp_path):
    res = CliRunner().invoke(app, ["model", "add-tools", "--model", str(smollm2_dir), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "already handles tools" in res.output and not (tmp_path / "x").exists()
    res = CliRunner().invoke(app, ["model", "convert", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "missing.gguf: no such file" in res.output
