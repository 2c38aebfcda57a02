"""`analyze-entropy` on a hand-built run directory (flow under the Prefect test harness, a real MLflow store, real
model directories): it finds the last RL step's rollouts, the SFT model the run started from (recorded by its SFT
evaluation, here outside the run as in an ablation) and the newest RL checkpoint, and reports both on the same
tokens."""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rstar2.core import checkpoint, config


def _model_dir(path: Path, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                      initializer_range=0.5)
    vocab = {w: i for i, w in enumerate(["<pad>", *[f"w{i}" for i in range(1, 40)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def write(d: Path) -> None:
        Qwen2ForCausalLM(cfg).save_pretrained(str(d))
        PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(str(d))

    return str(checkpoint.commit(path, write, {"step": seed}))


def test_analyze_entropy_compares_the_start_of_rl_with_its_end(tmp_path, monkeypatch):
    from rstar2.flows.analyze_entropy import EntropyParams, analyze_entropy

    monkeypatch.chdir(tmp_path)  # the preset's out_dir "runs" is relative
    run = tmp_path / "runs" / "r"
    cfg = config.load("tiny")
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(cfg.model_dump_json())
    sft = _model_dir(tmp_path / "runs" / "shared" / "sft", 0)
    (run / "eval" / f"sft-{cfg.eval.split}.json").write_text(json.dumps({"model_dir": sft, "result": {}}))
    _model_dir(run / "checkpoints" / "stage1" / "step-0001", 1)
    last = _model_dir(run / "checkpoints" / "stage1" / "step-0002", 2)
    rows = [{"prompt_ids": [3, 4], "response_ids": [5, 6, 7, 8, 9, 10, 11], "loss_mask": [1, 1, 0, 0, 1, 1, 1]},
            {"prompt_ids": [2, 4], "response_ids": [12, 13, 14], "loss_mask": [1, 1, 1]}]
    for step in ("step-0000", "step-0001"):
        (run / "stage1" / step).mkdir(parents=True)
        pl.DataFrame(rows if step == "step-0001" else rows[1:]).write_parquet(run / "stage1" / step / "scored.parquet")

    res = analyze_entropy(EntropyParams(run_name="r", window=2, top_frac=0.25))
    assert res["trajectories"].endswith("stage1/step-0001/scored.parquet") and res["checkpoints"] == [sft, last]
    sft_f, rl_f = res["by_checkpoint"]["sft"], res["by_checkpoint"]["stage1/step-0002"]
    # model tokens w5 w6 | w9 w10 (the first 2 after the tool response) w11 | w12 w13 w14; the same for both
    for f in (sft_f, rl_f):
        assert (f["tokens"], f["reflection"]["tokens"], f["reasoning"]["tokens"], f["trajectories"]) == (8, 2, 6, 2)
        assert f["high_tokens"] == 2 and f["reflection"]["high_tokens"] + f["reasoning"]["high_tokens"] == 2
    assert sft_f["entropy_mean"] != rl_f["entropy_mean"]  # two different models on the same tokens

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    logged = json.loads(Path(client.download_artifacts(res["mlflow_run_id"], "entropy.json")).read_text())
    assert logged["sft"]["reflection"]["tokens"] == 2
    hist = client.get_metric_history(res["mlflow_run_id"], "entropy/reflection_share_of_high")
    assert sorted((m.step, m.value) for m in hist) == [(0, pytest.approx(sft_f["reflection"]["share_of_high"])),
                                                       (1, pytest.approx(rl_f["reflection"]["share_of_high"]))]
    assert {a.path for a in client.list_artifacts(res["mlflow_run_id"], "entropy")} == {
        "entropy/entropy_share_of_high.png", "entropy/entropy_high_rate.png"}


def test_a_run_without_rollouts_or_config_is_refused_with_one_clear_error(tmp_path, monkeypatch):
    from rstar2.core.layout import RunLayout
    from rstar2.flows.analyze_entropy import EntropyParams, last_rollouts, run_paths

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        run_paths(EntropyParams(run_name="nothing"))
    with pytest.raises(ValueError, match="no RL step's rollouts"):
        last_rollouts(config.load("tiny"), RunLayout.at(tmp_path))
