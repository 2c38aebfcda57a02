import polars as pl
import pytest
import torch

from rstar2 import checkpoint, config
from rstar2.trainer import PolicyTrainer
from rstar2.world import build


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    cfg = config.load("tiny", ["world.n_sft=60", "world.n_train=12", "world.n_test=6", "world.hidden=32",
                               "world.ffn=64", "world.layers=2", "world.heads=2", "world.kv_heads=1",
                               "world.vocab_size=600"])
    return build.build(cfg, tmp_path_factory.mktemp("world"))["init_model"]


def batch(path, rewards):
    rows = [dict(problem_id=f"p{i // 4}", reward=r, prompt_ids=[5, 6, 7], response_ids=[8 + i % 3, 9, 10, 11],
                 loss_mask=[1, 1, 0, 1], truncated=False) for i, r in enumerate(rewards)]
    pl.DataFrame(rows).write_parquet(path)
    return str(path)


def test_update_moves_weights_and_checkpoint_round_trips(tiny_model, tmp_path):
    cfg = config.TrainerCfg(lr=1e-3, warmup_steps=1)
    tr = PolicyTrainer(tiny_model, cfg, seed=0)
    before = [p.detach().clone() for p in tr.model.parameters()]
    m = tr.update(batch(tmp_path / "b.parquet", [1, 0, 0, 1, 0, 1, 1, 1]))
    assert m["update_tokens"] > 0 and torch.isfinite(torch.tensor(m["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    path = tr.save(str(tmp_path / "ck" / "step-0001"), {"step": 1})
    assert checkpoint.manifest(path)["optimizer_step"] == 1
    again = PolicyTrainer(path, cfg, seed=0)
    again.load_state(path)
    assert again.step == 1
    for a, b in zip(tr.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_all_equal_rewards_give_no_update(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, weight_decay=0.0), seed=0)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.update(batch(tmp_path / "b.parquet", [1, 1, 1, 1]))  # zero advantage everywhere: Adam sees zero grads
    for a, b in zip(before, tr.model.parameters()):
        assert torch.equal(a, b)
