"""DeepSpeed ZeRO-2/3 backend of rstar2.training.trainer: one process per rank (Ray actors,
rstar2/training/trainer_group.py).

Where it runs. On GPUs: one rank per GPU, NCCL. On a CPU-only machine (CI, this project's laptops) the same code runs
as N rank processes on DeepSpeed's own CPU accelerator (picked automatically when no GPU is visible) with the gloo
process group it falls back to without oneCCL: gloo is in every torch build, needs nothing installed, and ZeRO's
reduce-scatter / all-gather run on it unchanged, so the ZeRO-2/3 partitioning tested on CPU is the one a GPU run uses.
The first start JIT-compiles DeepSpeed's shared-memory comm op (about a minute, cached in TORCH_EXTENSIONS_DIR).

deepspeed is optional (`pip install .[cuda]`); without it, asking for this backend raises one clear error. The trainer
keeps the micro-batch loop, so DeepSpeed runs with `managed_gradient_accumulation: false`: backward() only
accumulates, step() reduces across ranks, clips and updates (a variable number of micro-batches per step is fine).
The torch AdamW and the warm-up schedule come from rstar2/training/optim.py, as the torch backend's do; DeepSpeed's bf16
mode keeps fp32 master weights in the optimizer. Under ZeRO-3 the model is built inside `deepspeed.zero.Init`
(transformers' HfDeepSpeedConfig route): each rank holds only its partition from the start, never a full fp32 copy.
Checkpoints: DeepSpeed's own sharded state (every rank writes its part) plus HF weights gathered on rank 0 for the
engines; `full_state_dict` is the same gather, for the in-memory weight sync.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from rstar2.core.config import TrainerCfg
from rstar2.core.net import free_port
from rstar2.training.optim import adamw, lr_lambda


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("trainer.backend=deepspeed needs the deepspeed package (pip install '.[cuda]' or "
                          "'deepspeed>=0.19'); on one CPU or GPU use trainer.backend=torch") from e
    return deepspeed


def ds_config(cfg: TrainerCfg, device: torch.device) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # the trainer owns the boundary: step() after its micro-batches
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "contiguous_gradients": True,
                              "overlap_comm": device.type == "cuda"},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
    }


def init_distributed(rank: int, world: int, master: tuple[str, int] | None) -> None:
    """Join the ranks' process group (before the model is built: ZeRO-3 partitions it as it is created)."""
    ds = import_deepspeed()
    addr, port = master or ("127.0.0.1", free_port(""))
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")  # under Ray every rank sees its own GPU as device 0
    ds.init_distributed(rank=rank, world_size=world, verbose=False)


@contextlib.contextmanager
def partitioned_construction(cfg: TrainerCfg, device: torch.device):
    """Under ZeRO-3, transformers' from_pretrained inside this block builds the model inside `deepspeed.zero.Init` and
    loads the weights straight into the partitions (nothing otherwise). Transformers finds the handle through a global
    weak reference, so it is released when the block ends: a live one would make every later model of the process be
    built partitioned (on an H100, the trainer bench after a ZeRO-3 trainer in one process saved an empty model)."""
    if cfg.zero_stage != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    handle = HfDeepSpeedConfig(ds_config(cfg, device))  # noqa: F841 (kept alive for the block)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


class DeepSpeedBackend:
    adapted = None  # LoRA trains under the torch backend only (TrainerCfg refuses deepspeed with lora)

    def __init__(self, model: torch.nn.Module, cfg: TrainerCfg, device: torch.device, rank: int):
        ds = import_deepspeed()
        self.ds, self.cfg, self.rank = ds, cfg, rank
        self._warmup = lr_lambda(cfg)
        self.engine, self.opt, _, self.sched = ds.initialize(
            model=model, optimizer=adamw(model.parameters(), cfg.lr, cfg.weight_decay, device),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, self._warmup),
            config=ds_config(cfg, device))

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def reset_optimizer(self) -> None:
        base = self.engine.basic_optimizer  # the torch AdamW under ZeRO's wrapper
        base.state.clear()  # Adam moments and step counts are re-created on the next step
        self.sched = self.engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(base, self._warmup)

    def forward_starts(self) -> None:
        """What `engine.forward` does first, for the trainer's forward that calls the module's parts directly (the
        LM head on loss tokens only): ZeRO closes the previous backward, so the next one accumulates into its
        gradients instead of overwriting them (measured: without it ZeRO-3 kept only the last micro-batch's)."""
        self.engine.optimizer.clear_backward_seen_flag()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> float:
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        return float(gn) if gn is not None else float("nan")

    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def state_dict(self) -> dict:
        return {}  # optimizer and schedule live in DeepSpeed's own checkpoint (write)

    def load_state_dict(self, sd: dict, ckpt_dir: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(ckpt_dir / "deepspeed"), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{ckpt_dir}: no DeepSpeed state (was it written by the torch backend?)")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective (every rank calls it): the whole model's weights on CPU, on rank 0; None on the others.
        Under ZeRO-3 each parameter is all-gathered from its partitions."""
        params = list(self.module.parameters())
        gather = self.ds.zero.GatheredParameters(params, modifier_rank=None) if self.cfg.zero_stage == 3 else \
            contextlib.nullcontext()
        with gather:
            if self.rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def write(self, tmp: Path, rank: int) -> None:
        """Collective: every rank writes its shard; rank 0 also writes HF weights (gathered under ZeRO-3)."""
        self.engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
        sd = self.full_state_dict()
        if sd is not None:
            self.module.save_pretrained(str(tmp), state_dict=sd, safe_serialization=True)
