"""LoRA in the trainer (trainer.lora, rstar2.core.adapter): a fresh adapter serves the base model exactly, only the
adapter trains, checkpoints hold the adapter alone and resume bit-identically, the KL reference is the base with the
adapter off, the adapted layers' frozen weights sit in the compute dtype, and the adapter fingerprint an engine is
checked against changes with every update."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rstar2.core import adapter, config, fingerprint
from rstar2.training.trainer import PolicyTrainer
from tests.unit.test_trainer import REWARDS, TINY, assert_same_as_never_stopped, batch

LORA = config.LoraCfg(rank=4, alpha=8)
CFG = config.TrainerCfg(lr=1e-2, warmup_steps=1, mini_batches=2, micro_batch_tokens=48, lora=LORA)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rstar2.world import build

    return build.build(config.load("tiny", TINY), tmp_path_factory.mktemp("world"))["init_model"]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def adapter_params(tr):
    return {k: v.detach().clone() for k, v in tr.model.named_parameters() if v.requires_grad}


def test_a_fresh_adapter_is_the_base_model_and_only_it_trains(tiny_model, tmp_path):
    full = PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0)
    tr = PolicyTrainer(tiny_model, CFG, seed=0)
    ids = list(range(20, 40))
    assert torch.equal(logits(full.model, ids), logits(tr.model, ids))  # B = 0: exactly the base
    frozen = {k: v.detach().clone() for k, v in tr.model.named_parameters() if not v.requires_grad}
    trained = adapter_params(tr)
    assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained)
    n_adapter = sum(v.numel() for v in trained.values())
    assert n_adapter == tr.adapted.get_nb_trainable_parameters()[0]
    assert sum(p.numel() for g in tr.backend.opt.param_groups for p in g["params"]) == n_adapter
    m = tr.update(batch(tmp_path / "b.parquet", REWARDS))
    assert m["grad_norm"] > 0
    after = dict(tr.model.named_parameters())
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())  # the base never moves
    assert any(not torch.equal(v, after[k]) for k, v in trained.items())
    assert not torch.equal(logits(full.model, ids), logits(tr.model, ids))


def test_the_checkpoint_is_the_adapter_and_resumes_bit_identically(tiny_model, tmp_path):
    uris = [batch(tmp_path / f"b{k}.parquet", REWARDS, seed=k) for k in range(3)]
    ck = tmp_path / "ck" / "step-0002"
    tr = PolicyTrainer(tiny_model, CFG, seed=0)
    for u in uris[:2]:
        tr.update(u)
    tr.save(str(ck), {"stage": "s1", "step": 2, "global_step": 2})
    assert adapter.is_adapter(ck) and not list(ck.glob("model*.safetensors"))  # no base weights in it
    assert adapter.base_of(ck) == tiny_model and adapter.rank_of(ck) == 4
    base_bytes = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
    assert adapter.nbytes(ck) < 0.2 * base_bytes
    del tr
    torch.manual_seed(12345), random.seed(12345), np.random.seed(12345)
    resumed = PolicyTrainer(str(ck), CFG.model_copy(update={"lora": None}), seed=7)  # a run resumes from the checkpoint
    resumed.load_state(str(ck))
    m = resumed.update(uris[2])
    assert_same_as_never_stopped(tiny_model, uris, m, resumed, CFG, adapter_params)  # the adapter, bit for bit


def test_kl_reference_is_the_base_with_the_adapter_off(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, CFG.model_copy(update={"kl_coef": 0.1, "mini_batches": 1}), seed=0)
    assert tr.ref is None  # no second copy of the model
    base = PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0)
    tr.update(batch(tmp_path / "b.parquet", REWARDS))
    ids = list(range(20, 40))
    with tr._reference() as ref:
        assert torch.equal(logits(ref, ids), logits(base.model, ids))
    assert not torch.equal(logits(tr.model, ids), logits(base.model, ids))  # the adapter is back on after it
    m = tr.update(batch(tmp_path / "b2.parquet", REWARDS, seed=1))
    assert m["kl"] > 0


def test_frozen_adapted_weights_are_held_in_the_compute_dtype(tiny_model):
    tr = PolicyTrainer(tiny_model, CFG.model_copy(update={"dtype": "bfloat16"}), seed=0)
    dtypes = {k: v.dtype for k, v in tr.model.named_parameters()}
    assert {dtypes[k] for k in dtypes if k.endswith("base_layer.weight")} == {torch.bfloat16}
    assert {dtypes[k] for k in dtypes if ".lora_" in k or "norm" in k or "embed" in k} == {torch.float32}


def test_the_adapter_fingerprint_follows_every_update(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, CFG.model_copy(update={"mini_batches": 1}), seed=0)
    before = adapter.payload(tr.adapted)
    fp0 = adapter.fingerprint_of_tensors(before["tensors"], before["config"], torch.bfloat16)
    tr.update(batch(tmp_path / "b.parquet", REWARDS))
    ck = tr.save(str(tmp_path / "ck" / "step-0001"), {"step": 1})
    fp1 = adapter.fingerprint_of_dir(ck, "bfloat16")
    assert fp0 != fp1 and adapter.comparable(fp0, fp1)  # same modules, new values
    assert fingerprint.of_checkpoint(ck, "bfloat16") == fp1  # what the engines' check expects of an adapter dir
    after = adapter.payload(tr.adapted)
    assert adapter.fingerprint_of_tensors(after["tensors"], after["config"], torch.bfloat16) == fp1
    copy = adapter.write(after, tmp_path / "sent")  # the memory sync's copy, as an engine writes it
    assert adapter.fingerprint_of_dir(copy, "bfloat16") == fp1 and adapter.fingerprint_of_dir(copy, "float32") != fp1


def test_bad_adapter_directories_are_one_clear_error(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, CFG, seed=0)
    ck = tr.save(str(tmp_path / "ck" / "step-0001"), {"step": 1})
    moved = shutil.copytree(ck, tmp_path / "moved")  # a checkpoint whose base is no longer there
    cfg = adapter.config_of(moved)
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / adapter.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="base model .*gone.* is not a model directory"):
        PolicyTrainer(str(moved), CFG, seed=0)
    with pytest.raises(ValueError, match="trainer.lora trains adapters with the torch backend"):
        config.TrainerCfg(lora=LORA, backend="deepspeed")
    with pytest.raises(ValueError, match="rank"):
        config.LoraCfg(rank=0)
