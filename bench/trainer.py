"""`rstar2 bench trainer`: our GRPO-RoC update against TRL's GRPOTrainer on the same work, in one run.

Same work on both sides: the same model (random init of one config, same seed), the same prompts and completions (a
recorded RL-step batch, `kept.parquet`: what RoC kept), the same loss tokens (tool responses masked: TRL's `env_mask`),
one optimizer step over the whole batch, the same clip (0.2 / 0.28, token-mean "dapo" loss, no KL), lr, grad-clip and
precision. TRL gets the batch through its `rollout_func` hook, so nothing is generated; its update time is
on_step_begin -> on_step_end minus its (replayed) generate-and-score. Each side runs in its own subprocess (its own
peak memory), one after the other. tokens/s = gradient-receiving tokens / update seconds; the first step is warm-up.
Peak memory = the process's peak RSS during the update steps (CPU) or peak allocated (CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

DATA = Path(__file__).parent / "data" / "trainer"  # a recorded tiny-world RL step: kept.parquet + tokenizer
COLUMNS = ("problem_id", "reward", "prompt_ids", "response_ids", "loss_mask")


# ----------------------------------------------------------------------------- preparation (parent process)
def prepare(batch: Path, model: Path | None, out: Path, seed: int = 0) -> dict:
    """Write the bench inputs under `out`: the batch restricted to groups of the common size (TRL needs one group
    size), and a model directory (the given one, or a random init of the recorded config)."""
    import polars as pl

    df = pl.read_parquet(batch)
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{batch} is not an RL-step batch: missing columns {missing}")
    sizes = df.group_by("problem_id").len()
    g = int(sizes["len"].mode().sort()[-1])
    df = df.filter(pl.col("problem_id").is_in(sizes.filter(pl.col("len") == g)["problem_id"].implode()))
    if "truncated" not in df.columns:
        df = df.with_columns(truncated=pl.lit(False))
    df.sort("problem_id", maintain_order=True).write_parquet(out / "batch.parquet")
    if model is None:
        model = out / "model"
        _random_model(DATA, model, seed)
    return {"batch": str(out / "batch.parquet"), "model": str(model), "group_size": g, "rows": df.height,
            "loss_tokens": int(df["loss_mask"].list.sum().sum()),
            "tokens": int((df["prompt_ids"].list.len() + df["response_ids"].list.len()).sum())}


def _random_model(src: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(out)


# ----------------------------------------------------------------------------- workers (one subprocess each)
def _mem_reset(spec: dict) -> float:
    """Start a fresh peak-memory window on the bench's device (CUDA allocator or the process's RSS) and return the
    memory held now: the base that the update's own memory is measured from."""
    import torch

    from rstar2.training import device
    d = torch.device(spec["device"])
    device.reset_peak_memory(d)
    return device.peak_memory_mb(d)


def _peak(spec: dict) -> float:
    import torch

    from rstar2.training import device
    return device.peak_memory_mb(torch.device(spec["device"]))


def _enough(steps: list[dict], spec: dict) -> bool:
    """Stop once `steps` clean steps (beyond the warm-up) are in, or after `max_steps` in all."""
    clean = [s for s in steps[1:] if s["cpu_util"] >= spec["clean_util"]]
    return len(clean) >= spec["steps"] or len(steps) >= spec["max_steps"]


def worker_ours(spec: dict) -> list[dict]:
    from rstar2.run.config import TrainerCfg
    from rstar2.training.trainer import PolicyTrainer

    cfg = TrainerCfg(lr=spec["lr"], warmup_steps=1, dtype=spec["dtype"], layout=spec["layout"],
                     micro_batch_tokens=spec["micro_batch_tokens"], device=spec["device"])
    tr = PolicyTrainer(spec["model"], cfg, seed=0)
    steps: list[dict] = []
    while not _enough(steps, spec):
        base = _mem_reset(spec)
        c0 = time.process_time()
        m = tr.update(spec["batch"])
        steps.append({"update_s": m["update_s"], "loss_tokens": m["update_loss_tokens"],
                      "fed_tokens": m["update_fed_tokens"], "peak_mb": m["update_peak_mem_mb"], "base_mb": base,
                      "cpu_util": (time.process_time() - c0) / m["update_s"], "loss": m["loss"]})
    return steps


def worker_trl(spec: dict) -> list[dict]:
    import polars as pl
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    df = pl.read_parquet(spec["batch"])
    rows: dict[str, list[dict]] = {}
    for r in df.iter_rows(named=True):
        rows.setdefault(str(r["problem_id"]), []).append(r)
    served: dict[str, int] = {}

    def rollout_func(prompts, trainer):  # replays the recorded batch: each prompt's completions in order
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "recorded_reward": []}
        for p in prompts:
            k = served.get(p, 0)
            r = rows[p][k % len(rows[p])]
            served[p] = k + 1
            out["prompt_ids"].append(list(r["prompt_ids"]))
            out["completion_ids"].append(list(r["response_ids"]))
            out["logprobs"].append([0.0] * len(r["response_ids"]))
            out["env_mask"].append(list(r["loss_mask"]))
            out["recorded_reward"].append(float(r["reward"]))
        return out

    def recorded(completions, recorded_reward, **kwargs):
        return recorded_reward

    n, g = df.height, spec["group_size"]
    mb = max(d for d in range(1, min(spec["trl_micro_batch"], n) + 1) if n % d == 0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    args = GRPOConfig(
        output_dir=spec["tmp"], per_device_train_batch_size=mb, gradient_accumulation_steps=n // mb,
        num_generations=g, max_completion_length=int(df["response_ids"].list.len().max()), beta=0.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, learning_rate=spec["lr"], max_grad_norm=1.0,
        bf16=spec["dtype"] == "bfloat16", use_cpu=spec["device"] == "cpu", report_to="none", save_strategy="no",
        seed=0, max_steps=spec["max_steps"], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=recorded, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": list(rows)}), rollout_func=rollout_func)
    gen_s = [0.0]
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            gen_s[0] += time.perf_counter() - t

    trainer._generate_and_score_completions = timed
    steps: list[dict] = []
    loss_tokens = int(df["loss_mask"].list.sum().sum())
    fed = n * (int(df["prompt_ids"].list.len().max()) + int(df["response_ids"].list.len().max()))

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            gen_s[0] = 0.0
            self.base, self.t0, self.c0 = _mem_reset(spec), time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            wall = time.perf_counter() - self.t0
            steps.append({"update_s": wall - gen_s[0], "loss_tokens": loss_tokens, "fed_tokens": fed,
                          "peak_mb": _peak(spec), "base_mb": self.base, "generate_s": gen_s[0],
                          "cpu_util": (time.process_time() - self.c0) / wall})
            if _enough(steps, spec):
                control.should_training_stop = True

    trainer.add_callback(Clock())
    trainer.train()
    return steps


# ----------------------------------------------------------------------------- parent: run, summarise, print
def _run_worker(side: str, spec: dict) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "rstar2.bench.trainer", side, f.name], capture_output=True,
                          text=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1"})
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench worker '{side}' failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(name: str, steps: list[dict], clean_util: float) -> dict:
    """Median over clean steps (the process had its cores: CPU time / wall >= clean_util), else over all after the
    warm-up; on a shared machine the other processes' load otherwise decides the figure."""
    timed = steps[1:] or steps  # the first step is warm-up
    clean = [s for s in timed if s["cpu_util"] >= clean_util]
    timed = clean or timed
    tps = [s["loss_tokens"] / s["update_s"] for s in timed]
    return {"name": name, "steps": len(timed), "clean": bool(clean), "tokens_per_s": statistics.median(tps),
            "tokens_per_s_best": max(tps),
            "update_s": statistics.median(s["update_s"] for s in timed), "loss_tokens": timed[0]["loss_tokens"],
            "fed_tokens": timed[0]["fed_tokens"], "peak_mb": max(s["peak_mb"] for s in timed),
            "update_mem_mb": max(s["peak_mb"] - s["base_mb"] for s in timed),
            "cpu_util": statistics.median(s["cpu_util"] for s in timed)}


def command(
    batch: Optional[Path] = typer.Option(None, help="recorded RL-step batch (kept.parquet); default: the tiny-world "
                                                    "step shipped in bench/data"),
    model: Optional[Path] = typer.Option(None, help="HF model dir; default: random init of the batch's tiny model"),
    steps: int = typer.Option(3, help="clean update steps to time per side (after one warm-up step)"),
    max_steps: int = typer.Option(12, help="give up waiting for clean steps after this many"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16 (autocast), both sides"),
    layouts: str = typer.Option("bucket,pack", help="our micro-batch layouts to run, comma-separated"),
    micro_batch_tokens: int = typer.Option(2048, help="our token budget per micro-batch (2048: fastest and leanest here)"),
    trl_micro_batch: int = typer.Option(16, help="TRL per-device batch (sequences; the rest is accumulation)"),
    trl: bool = typer.Option(True, help="also run TRL (needs the bench extra: pip install '.[bench]')"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here"),
):
    """Our GRPO-RoC update vs TRL's GRPOTrainer: same model, batch, loss tokens and precision; tokens/s and peak
    memory."""
    from rstar2.run import progress
    from rich.table import Table

    console = progress.console()  # the environment defaults are applied by the CLI (cli/main.py); the workers inherit them
    if dtype not in ("float32", "bfloat16"):
        console.print(f"[red]error:[/red] --dtype must be float32 or bfloat16, got {dtype!r}")
        raise typer.Exit(2)
    batch = batch or DATA / "kept.parquet"
    if not batch.is_file():
        console.print(f"[red]error:[/red] no batch at {batch}")
        raise typer.Exit(2)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        try:
            info = prepare(batch, model, Path(tmp))
        except (ValueError, OSError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2)
        import torch

        threads = torch.get_num_threads()
        clean_util = 0.9 * threads if device == "cpu" else 0.0
        spec = {**info, "steps": steps, "max_steps": max_steps, "clean_util": clean_util, "dtype": dtype, "micro_batch_tokens": micro_batch_tokens, "lr": 1e-6,
                "trl_micro_batch": trl_micro_batch, "device": device, "tmp": tmp}
        rows = []
        for layout in [x.strip() for x in layouts.split(",") if x.strip()]:
            rows.append(summarise(f"rstar2 ({layout})", _run_worker("ours", {**spec, "layout": layout}), clean_util))
        if trl:
            rows.append(summarise("TRL GRPOTrainer", _run_worker("trl", spec), clean_util))
    table = Table(title=f"trainer update: {info['rows']} sequences ({info['rows'] // info['group_size']} prompts x "
                        f"{info['group_size']}), {info['loss_tokens']:,} loss tokens of {info['tokens']:,}, {dtype}, "
                        f"{device}, median of {steps} clean steps ({threads} threads)")
    for col in ("trainer", "tokens/s", "best", "update s", "fed tokens", "peak MB", "update MB", "CPU util", "clean"):
        table.add_column(col, justify="right" if col != "trainer" else "left")
    for r in rows:
        table.add_row(r["name"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_best']:,.0f}", f"{r['update_s']:.2f}",
                      f"{r['fed_tokens']:,}", f"{r['peak_mb']:,.0f}", f"{r['update_mem_mb']:,.0f}",
                      f"{r['cpu_util']:.2f}", "yes" if r["clean"] else "[red]no[/red]")
    console.print(table)
    result = {"batch": str(batch), "dtype": dtype, "device": device, "threads": threads, **{k: info[k] for k in (
        "rows", "group_size", "loss_tokens", "tokens")}, "runs": rows}
    trl_row = next((r for r in rows if r["name"].startswith("TRL")), None)
    if trl_row:
        ours = max((r for r in rows if r is not trl_row), key=lambda r: r["tokens_per_s"])
        result["speedup_vs_trl"] = ours["tokens_per_s"] / trl_row["tokens_per_s"]
        result["peak_mb_ratio_vs_trl"] = ours["peak_mb"] / trl_row["peak_mb"]
        console.print(f"best rstar2 ({ours['name']}) vs TRL: {result['speedup_vs_trl']:.2f}x tokens/s, "
                      f"peak memory {result['peak_mb_ratio_vs_trl']:.2f}x")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {json_path}")
    return result


if __name__ == "__main__":  # worker entry: python -m rstar2.bench.trainer {ours|trl} SPEC.json
    side, spec_path = sys.argv[1], sys.argv[2]
    out = (worker_ours if side == "ours" else worker_trl)(json.loads(Path(spec_path).read_text()))
    print("RESULT " + json.dumps(out), flush=True)
