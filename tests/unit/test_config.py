import pytest

from rstar2.core import config


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
    with pytest.raises(Exception, match="sft.decay_at_target needs sft.target_loss"):
        config.load("tiny", ["sft.decay_at_target=true", "sft.target_loss=null"])
    for bad in ("sft.weight_decay=-0.1", "trainer.weight_decay=-1", "sft.min_lr_frac=1.5", "sft.decay_frac=0"):
        with pytest.raises(Exception, match=bad.split("=")[0].split(".")[1]):
            config.load("tiny", [bad])


def test_a_preset_can_start_from_another():
    tiny, staged = config.load("tiny"), config.load("tiny-stages")
    assert staged.name == "tiny-stages" and staged.experiment == tiny.experiment  # one experiment per family
    assert staged.world == tiny.world and staged.sft == tiny.sft and staged.trainer == tiny.trainer  # inherited
    assert [s.name for s in staged.stages] == ["stage1-short", "stage2-long", "stage3-hard"]  # lists replace
    assert staged.stages[0].plateau.window == 3 and staged.stages[2].data == "hard" and staged.stages[2].reset_optimizer
    assert staged.rollout.group_size == tiny.rollout.group_size  # a section merges key by key


def test_a_preset_with_an_unknown_base_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: nope\nname: x\n")
    with pytest.raises(ValueError, match="has base 'nope', which is not a preset"):
        config.load(str(bad))


def test_a_bad_override_path_names_the_missing_part():
    with pytest.raises(ValueError, match=r"cannot set stages.3.steps: no item 3 in a list of 1"):
        config.load("tiny", ["stages.3.steps=4"])
    with pytest.raises(ValueError, match=r"cannot set seed.x: its parent is not a section|seed is not a section"):
        config.load("tiny", ["seed.x=1"])


def test_a_preset_that_inherits_from_itself_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "PRESETS", tmp_path)
    (tmp_path / "a.yaml").write_text("base: b\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: a\nname: b\n")
    with pytest.raises(ValueError, match="inherits from itself"):
        config.load("a")
