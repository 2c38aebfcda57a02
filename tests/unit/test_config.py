import pytest

from rstar2 import config


def test_presets_load_and_override():
    assert {"tiny", "qwen3-14b"} <= set(config.list_presets())
    cfg = config.load("tiny", ["rollout.group_size=4", "stages.0.steps=3"])
    assert cfg.rollout.group_size == 4 and cfg.stages[0].steps == 3
    big = config.load("qwen3-14b")
    assert big.rollout.group_size == 16 and big.trainer.lr == 1e-6 and len(big.stages) == 3
    assert big.rollout_for(big.stages[1]).max_response_tokens == 12288


def test_bad_input_gives_one_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'nope'; available: .*tiny"):
        config.load("nope")
    with pytest.raises(ValueError, match="must look like"):
        config.load("tiny", ["rollout.group_size"])
    with pytest.raises(Exception, match="group_sise"):
        config.load("tiny", ["rollout.group_sise=3"])  # typos are errors, not silent defaults
