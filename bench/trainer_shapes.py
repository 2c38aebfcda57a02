"""The two shapes `rstar2 bench trainer` measures: the tiny world's ~3M model on a recorded RL step, and SmolLM2-135M's
llama shape (the smollm2-gsm preset's `world.arch`) on a batch of that preset's lengths. Both models are random inits
of their config: speed depends on the shapes, not on the weights."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data" / "trainer"  # a recorded tiny-world RL step: kept.parquet + tokenizer
SHAPES = ("tiny", "smollm2")


@dataclass(frozen=True)
class Shape:
    name: str
    preset: str             # the preset that trains it (its trainer.dtype is what the bench runs by default)
    sft_batch_tokens: int   # the preset's sft.batch_tokens
    sft_packed: bool        # the preset's sft.packed
    micro_batch_tokens: int  # the RL update's token budget per micro-batch


TINY = Shape("tiny", "tiny", 1536, False, 2048)
SMOLLM2 = Shape("smollm2", "smollm2-gsm", 2048, True, 4096)


def shape(name: str) -> Shape:
    return {"tiny": TINY, "smollm2": SMOLLM2}[name]


def write_model(name: str, out: Path, seed: int = 0) -> None:
    """A random init of the shape's config, with a tokenizer (the tiny world's: both benches only need its pad id)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if name == "tiny":
        mc = AutoConfig.from_pretrained(DATA)
    else:
        from rstar2.core import config
        from rstar2.run import plan

        mc = plan.model_config(config.load(SMOLLM2.preset))
        mc.pad_token_id = mc.eos_token_id = 2
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(mc, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast.from_pretrained(DATA).save_pretrained(out)


def write_batch(name: str, out: Path, seed: int = 0) -> Path:
    """The shape's RL-step batch: the recorded tiny step, or a smollm2-gsm-like one: 2 prompts x 8 rollouts, a
    ~330-token prompt, 120-260 response tokens of which a ~25-token tool response is masked, rewards mixed in each
    group (so every advantage is non-zero), ids drawn from the model's vocabulary."""
    if name == "tiny":
        return DATA / "kept.parquet"
    import polars as pl

    from rstar2.core import config
    from rstar2.run import plan

    vocab = plan.model_config(config.load(SMOLLM2.preset)).vocab_size
    rng = random.Random(seed)
    rows = []
    for p in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(300, 360))]
        for k in range(8):
            n = rng.randint(120, 260)
            cut = rng.randint(40, n - 40)
            mask = [1] * cut + [0] * 25 + [1] * (n - cut - 25)
            rows.append({"problem_id": f"p{p}", "sample_idx": k, "reward": float(k % 2), "prompt_ids": prompt,
                         "response_ids": [rng.randrange(3, vocab) for _ in range(n)], "loss_mask": mask,
                         "truncated": False})
    path = out / "smollm2-batch.parquet"
    pl.DataFrame(rows).write_parquet(path)
    return path
