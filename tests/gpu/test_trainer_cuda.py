"""The DeepSpeed trainer on a CUDA device with a random Qwen3 of Qwen3-0.6B's shape (bf16, gradient checkpointing): an
update moves the weights, and a save -> restore -> next update is bit-identical to never having stopped (deterministic
algorithms on, as cuBLAS and the embedding backward are otherwise free to reorder sums), under ZeRO-2 and ZeRO-3."""

import pytest
import torch

from rstar2.core import config
from rstar2.training.trainer import PolicyTrainer
from tests.unit.test_trainer import batch

pytestmark = pytest.mark.gpu

REWARDS = [1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]


@pytest.fixture
def deterministic():
    """Deterministic kernels, and SDPA's math kernel for attention: on CUDA its backward is the only deterministic
    one here (under warn_only=True flash attention takes its non-deterministic backward and cuDNN's always is, as
    PyTorch's attention_backward.cu says: an H200 run warned of cuDNN's, and passed with nothing making it so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def released():
    """After the check no ZeRO-3 handle is left: a live one makes every later model of the process be built inside
    `deepspeed.zero.Init` (an H100 run of the trainer bench after this check, in one pytest process, saved an empty
    model before the trainer released it)."""
    yield
    from transformers.integrations import is_deepspeed_zero3_enabled

    torch.cuda.empty_cache()
    assert not is_deepspeed_zero3_enabled(), "a ZeRO-3 handle outlived its trainer's construction"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_update_and_bit_identical_resume_on_cuda(qwen06b, tmp_path, deterministic, released, figures, stage):
    cfg = config.TrainerCfg(lr=1e-4, warmup_steps=1, micro_batch_tokens=64, dtype="bfloat16", backend="deepspeed",
                            zero_stage=stage, gradient_checkpointing=True, device="cuda")
    b1 = batch(tmp_path / "b1.parquet", REWARDS, seed=1)
    b2 = batch(tmp_path / "b2.parquet", REWARDS, seed=2)
    a = PolicyTrainer(qwen06b, cfg, seed=0)
    w0 = a.full_state_dict()
    m1 = a.update(b1)
    assert m1["update_tokens"] > 0
    w1 = a.full_state_dict()
    assert any(not torch.equal(w1[k], w0[k]) for k in w0)  # the update is real
    ckpt = a.save(str(tmp_path / "step-1"), {"step": 1})
    m2 = a.update(b2)
    uninterrupted = a.full_state_dict()
    # the first update also pays one-time costs (CUDA kernels' first launches, the optimizer states' allocation);
    # the second is the steady state, its peak with the Adam states resident
    figures(f"trainer_zero{stage}_0.6b_first_update_s", round(m1["update_s"], 3))
    figures(f"trainer_zero{stage}_0.6b_update_s", round(m2["update_s"], 3))
    figures(f"trainer_zero{stage}_0.6b_update_tokens", m2["update_tokens"])
    figures(f"trainer_zero{stage}_0.6b_peak_mb", round(max(m1["update_peak_mem_mb"], m2["update_peak_mem_mb"])))
    del a
    torch.cuda.empty_cache()

    b = PolicyTrainer(ckpt, cfg, seed=0)  # a resumed run starts from the checkpoint's weights, then takes the state
    assert b.load_state(ckpt)["step"] == 1
    b.update(b2)
    resumed = b.full_state_dict()
    diff = {k: float((resumed[k].float() - v.float()).abs().max()) for k, v in uninterrupted.items()
            if not torch.equal(resumed[k], v)}
    assert not diff, (f"{len(diff)} of {len(uninterrupted)} tensors differ after resume (max |delta|, first 8): "
                      f"{dict(list(diff.items())[:8])}")
