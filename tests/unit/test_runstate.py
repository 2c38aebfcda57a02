"""Where a run's RL starts (rstar2.run.runstate): the SFT model, or with sft.enabled off the world's initial model (the
generated one, or world.base_model), never a `<run>/sft` that SFT-off runs do not have."""

from pathlib import Path

from rstar2.core import config
from rstar2.core.layout import RunLayout
from rstar2.run import runstate


def test_rl_starts_from_the_sft_model_or_with_sft_off_from_the_initial_model(tmp_path):
    run = tmp_path / "runs" / "r"
    layout = RunLayout.at(run)
    assert runstate.sft_model(layout, config.load("tiny")) == str(run / "sft")
    off = config.load("tiny", ["sft.enabled=false"])
    assert runstate.sft_model(layout, off) == str(run / "world" / "init_model")
    base = config.load("tiny", ["sft.enabled=false", "world.base_model=/models/qwen"])
    assert runstate.sft_model(layout, base) == "/models/qwen"
    # before any RL checkpoint the run resumes from it (the trainer and engines load it)
    assert runstate.resume_point(layout, off, runstate.sft_model(layout, off)) == \
        (str(Path(run) / "world" / "init_model"), False)


def test_a_checkpoint_s_run_config_is_found_and_a_model_outside_a_run_has_none(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "world").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for model in (run / "sft", run / "checkpoints" / "stage1" / "step-0002", run / "seed-1" / "checkpoints" / "s" /
                  "step-0001"):
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")  # the model's own (Hugging Face) config is not the run's
        assert RunLayout.config_of(model) == run / "config.json"
    (tmp_path / "hf").mkdir()
    assert RunLayout.config_of(tmp_path / "hf") is None


def test_speed_from_the_committed_sft_and_steps(tmp_path):
    import json

    from rstar2.core import checkpoint

    cfg = config.load("tiny", [f"out_dir={tmp_path}", "trainer.dtype=float32",
                                 "stages=[{name: s1, steps: 3, prompts_per_step: 2}]"])
    run = RunLayout.of(tmp_path, "r")
    run.sft.mkdir(parents=True)
    (run.sft / "sft_result.json").write_text(json.dumps({"tokens_per_s": 250.0, "wall_s": 400.0}))
    steps = [{"rollout_s": 100.0, "rollout_tokens_per_s": 200.0, "update_s": 20.0, "update_tokens": 5000},
             {"rollout_s": 60.0, "rollout_tokens_per_s": 300.0, "update_s": 30.0, "update_tokens": 9000},
             {"rollout_s": 50.0, "rollout_tokens_per_s": 100.0, "update_s": 0.0, "skipped": 1}]  # no update: left out
    for i, m in enumerate(steps, 1):
        checkpoint.commit(run.checkpoint("s1", i), lambda d: None, {"metrics": m})
    assert runstate.speed(run, cfg) == {"trainer_dtype": "float32", "sft_tokens_per_s": 250.0, "sft_s": 400.0,
                                        "rl_steps": 2, "rollout_s": 80.0,
                                        "rollout_tokens_per_s": 250.0, "update_s": 25.0,
                                        "update_tokens_per_s": (250 + 300) / 2}
