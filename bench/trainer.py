"""`rstar2 bench trainer`: our SFT and GRPO-RoC update against the host's GEMM roofline (bench/roofline.py) and our
update against TRL's GRPOTrainer on the same work, for two shapes (bench/trainer_shapes.py), in one run.

Same work on both sides: the same model (random init of one config, same seed), the same prompts and completions (a
recorded RL-step batch, `kept.parquet`: what RoC kept), the same loss tokens (tool responses masked: TRL's `env_mask`),
one optimizer step over the whole batch, the same clip (0.2 / 0.28, token-mean "dapo" loss, no KL), lr, grad-clip and
precision. TRL gets the batch through its `rollout_func` hook, so nothing is generated; its update time is
on_step_begin -> on_step_end minus its (replayed) generate-and-score. Each side runs in its own subprocess (its own
peak memory), one after the other. tokens/s = gradient-receiving tokens / update seconds; the first step is warm-up.
Peak memory = the process's peak RSS during the update steps (CPU) or peak allocated (CUDA). SFT is timed through
rstar2.training.sft.fit on the batch's sequences as transcripts (prompt masked, the response's loss tokens trained),
with the preset's batch tokens and layout; its tokens/s counts every token, as an SFT run reports it.
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

from rstar2.bench import roofline
from rstar2.bench import trainer_shapes as shapes
from rstar2.bench.profile import ORDER, where_time_goes

COLUMNS = ("problem_id", "reward", "prompt_ids", "response_ids", "loss_mask")


# ----------------------------------------------------------------------------- preparation (parent process)
def prepare(batch: Path, model: Path | None, out: Path, seed: int = 0, shape: str = "tiny") -> dict:
    """Write the bench inputs under `out`: the batch restricted to groups of the common size (TRL needs one group
    size), and a model directory (the given one, or a random init of the shape's config)."""
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
        shapes.write_model(shape, model, seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    top = int(max(df["prompt_ids"].list.max().max(), df["response_ids"].list.max().max()))
    if top >= vocab:
        raise ValueError(f"{batch} holds token id {top}, beyond {model}'s vocabulary of {vocab}: a batch recorded with "
                         "another tokenizer (pass --batch recorded with this model, or leave --model out)")
    return {"batch": str(out / "batch.parquet"), "model": str(model), "group_size": g, "rows": df.height,
            "loss_tokens": int(df["loss_mask"].list.sum().sum()),
            "tokens": int((df["prompt_ids"].list.len() + df["response_ids"].list.len()).sum())}


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
    from rstar2.core.config import TrainerCfg
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
                      "counted_tokens": m["update_loss_tokens"],
                      "fed_tokens": m["update_fed_tokens"], "peak_mb": m["update_peak_mem_mb"], "base_mb": base,
                      "cpu_util": (time.process_time() - c0) / m["update_s"], "loss": m["loss"]})
    if spec.get("profile"):
        steps[-1]["profile"] = where_time_goes(lambda: tr.update(spec["batch"]))
    return steps


def worker_sft(spec: dict) -> list[dict]:
    """SFT steps through rstar2.training.sft.fit on the batch's sequences as transcripts: one warm-up call of a step,
    then calls of `sft_steps` steps, each timed whole (a fresh optimizer each: fit's own)."""
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    from rstar2.core.config import SFTCfg
    from rstar2.training import sft

    df = pl.read_parquet(spec["batch"])
    ids = [list(p) + list(r) for p, r in zip(df["prompt_ids"], df["response_ids"])]
    masks = [[0] * len(p) + list(m) for p, m in zip(df["prompt_ids"], df["loss_mask"])]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(spec["device"])
    n_batches = sft.batches_per_epoch(ids, masks, spec["sft_batch_tokens"], spec["sft_packed"])
    steps: list[dict] = []
    while not _enough(steps, spec):
        n = 1 if not steps else spec["sft_steps"]
        base = _mem_reset(spec)
        c0 = time.process_time()
        s = SFTCfg(epochs=(n + 0.5) / n_batches, lr=1e-5, batch_tokens=spec["sft_batch_tokens"], warmup_frac=0.0,
                   packed=spec["sft_packed"])
        r = sft.fit(model, ids, masks, s, seed=len(steps), dtype=spec["dtype"], pad_id=0)
        steps.append({"update_s": r.wall_s, "counted_tokens": round(r.tokens_per_s * r.wall_s),  # every token
                      "loss_tokens": r.loss_tokens, "fed_tokens": r.fed_tokens, "peak_mb": _peak(spec), "base_mb": base,
                      "cpu_util": (time.process_time() - c0) / r.wall_s})
    if spec.get("profile"):  # one more call of the timed calls' steps
        steps[-1]["profile"] = where_time_goes(lambda: sft.fit(model, ids, masks, s, seed=0, dtype=spec["dtype"],
                                                               pad_id=0))
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
            steps.append({"update_s": wall - gen_s[0], "loss_tokens": loss_tokens, "counted_tokens": loss_tokens,
                          "fed_tokens": fed,
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
    tps = [s["counted_tokens"] / s["update_s"] for s in timed]
    return {"name": name, "steps": len(timed), "clean": bool(clean), "tokens_per_s": statistics.median(tps),
            "tokens_per_s_best": max(tps),
            "update_s": statistics.median(s["update_s"] for s in timed), "loss_tokens": timed[0]["loss_tokens"],
            "counted_tokens": timed[0]["counted_tokens"],
            "fed_tokens": timed[0]["fed_tokens"], "peak_mb": max(s["peak_mb"] for s in timed),
            "update_mem_mb": max(s["peak_mb"] - s["base_mb"] for s in timed),
            "cpu_util": statistics.median(s["cpu_util"] for s in timed),
            **({"profile": s["profile"] for s in steps if "profile" in s})}


def command(
    shapes_: str = typer.Option("tiny,smollm2", "--shapes", help="model shapes, comma-separated: tiny (the tiny "
                                "world's ~3M model on a recorded RL step), smollm2 (SmolLM2-135M's llama shape)"),
    batch: Optional[Path] = typer.Option(None, help="recorded RL-step batch (kept.parquet) for one shape; default: "
                                                    "the shape's own (bench/trainer_shapes.py)"),
    model: Optional[Path] = typer.Option(None, help="HF model dir for one shape; default: random init of its config"),
    steps: int = typer.Option(3, help="clean steps to time per trainer (after one warm-up step)"),
    max_steps: int = typer.Option(8, help="give up waiting for clean steps after this many"),
    dtype: str = typer.Option("preset", help="preset (each shape's preset's trainer.dtype, auto settled on this "
                                             "host), auto, float32 or bfloat16 (autocast), every trainer"),
    layouts: str = typer.Option("pack", help="our update's micro-batch layouts, comma-separated (bucket, pack)"),
    micro_batch_tokens: Optional[int] = typer.Option(None, help="our update's tokens per micro-batch (default: the "
                                                               "shape's preset's, 2,048 tiny, 4,096 smollm2)"),
    sft_steps: int = typer.Option(4, help="SFT steps per timed call"),
    trl_micro_batch: int = typer.Option(16, help="TRL per-device batch (sequences; the rest is accumulation)"),
    trl: bool = typer.Option(True, help="also run TRL (needs the bench extra: pip install '.[bench]')"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    profile: bool = typer.Option(False, help="also run one more step of each of our trainers under torch's profiler: "
                                             "its time by kind of work (bench/profile.py)"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here"),
):
    """SFT and GRPO-RoC update tokens/s against the host's GEMM roofline at each shape (fp32 and bf16), and our
    update against TRL's GRPOTrainer on the same work."""
    from rstar2.core import progress

    # the environment defaults are applied by the CLI (cli/bench.py); the workers inherit them
    console = progress.console()
    names = [x.strip() for x in shapes_.split(",") if x.strip()]
    bad = [n for n in names if n not in shapes.SHAPES] or \
        ([] if dtype in ("preset", "auto", "float32", "bfloat16") else [dtype])
    if bad or not names or ((batch or model) and len(names) != 1):
        console.print(f"[red]error:[/red] --shapes takes {', '.join(shapes.SHAPES)} (one of them with --batch or "
                      f"--model) and --dtype preset, auto, float32 or bfloat16; got {shapes_!r}, --dtype {dtype!r}")
        raise typer.Exit(2)
    if batch is not None and not batch.is_file():
        console.print(f"[red]error:[/red] no batch at {batch}")
        raise typer.Exit(2)
    import torch

    threads = torch.get_num_threads()
    clean_util = 0.9 * threads if device == "cpu" else 0.0
    result = {"device": device, "threads": threads, "shapes": {}}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
            try:
                info = prepare(batch or shapes.write_batch(name, Path(tmp)), model, Path(tmp), shape=name)
            except (ValueError, OSError) as e:
                console.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2)
            result["shapes"][name] = _shape(name, info, dtype, device, steps, max_steps, clean_util, layouts,
                                            micro_batch_tokens, sft_steps, trl_micro_batch, trl, profile, tmp)
    _print(console, result, steps)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {json_path}")
    return result


def _shape(name: str, info: dict, dtype: str, device: str, steps: int, max_steps: int, clean_util: float,
           layouts: str, micro_batch_tokens: int | None, sft_steps: int, trl_micro_batch: int, trl: bool,
           profile: bool, tmp: str) -> dict:
    """One shape: its roofline in both dtypes, then SFT, our update per layout and TRL's, each in its own process."""
    import torch
    from transformers import AutoConfig

    from rstar2.training import numerics

    mc = AutoConfig.from_pretrained(info["model"])
    sh = shapes.shape(name)
    if dtype == "preset":
        from rstar2.core import config

        dtype = config.load(sh.preset).trainer.dtype
    choice = numerics.choose(dtype, torch.device(device))
    micro = micro_batch_tokens or sh.micro_batch_tokens
    roof = {dt: roofline.measure(mc, micro, dt, device) for dt in numerics.DTYPES}
    spec = {**info, "steps": steps, "max_steps": max_steps, "clean_util": clean_util, "dtype": choice.dtype,
            "micro_batch_tokens": micro, "lr": 1e-6, "trl_micro_batch": trl_micro_batch,
            "device": device, "tmp": tmp, "sft_steps": sft_steps, "sft_batch_tokens": sh.sft_batch_tokens,
            "sft_packed": sh.sft_packed, "profile": profile}
    runs = [summarise("rstar2 SFT", _run_worker("sft", spec), clean_util)]
    for layout in [x.strip() for x in layouts.split(",") if x.strip()]:
        runs.append(summarise(f"rstar2 update ({layout})", _run_worker("ours", {**spec, "layout": layout}),
                              clean_util))
    if trl:
        runs.append(summarise("TRL GRPOTrainer", _run_worker("trl", spec), clean_util))
    for r in runs:  # the roofline of the same work: these fed tokens through the body, these loss tokens the head
        r["roofline_tokens_per_s"] = roofline.tokens_per_s(roof[choice.dtype], r["fed_tokens"], r["loss_tokens"],
                                                           r["counted_tokens"])
        r["of_roofline"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]
    out = {"dtype": choice.dtype, "dtype_reason": choice.reason, "roofline": roof,
           **{k: info[k] for k in ("rows", "group_size", "loss_tokens", "tokens")}, "runs": runs}
    trl_row = next((r for r in runs if r["name"].startswith("TRL")), None)
    if trl_row:
        ours = max((r for r in runs if "update" in r["name"]), key=lambda r: r["tokens_per_s"])
        out["speedup_vs_trl"] = ours["tokens_per_s"] / trl_row["tokens_per_s"]
        out["peak_mb_ratio_vs_trl"] = ours["peak_mb"] / trl_row["peak_mb"]
    return out


def _print(console, result: dict, steps: int) -> None:
    from rich.table import Table

    roof = Table(title=f"GEMM roofline at each shape's own products ({result['threads']} threads, {result['device']})")
    for col in ("shape", "dtype", "GEMM GFLOP/s", "body us/token", "head us/token"):
        roof.add_column(col, justify="right" if col not in ("shape", "dtype") else "left")
    for name, sh in result["shapes"].items():
        for dt, r in sh["roofline"].items():
            roof.add_row(name, dt, f"{r['gemm_gflop_per_s']:,.0f}", f"{r['body_s_per_token'] * 1e6:.1f}",
                         f"{r['head_s_per_token'] * 1e6:.1f}")
    console.print(roof)
    table = Table(title=f"trainers, median of {steps} clean steps: tokens/s against the roofline of the same work in "
                        "the dtype used (SFT counts every token, the updates their loss tokens)")
    for col in ("shape", "trainer", "dtype", "tokens/s", "roofline", "x roofline", "step s", "fed tokens",
                "peak MB", "CPU util", "clean"):
        table.add_column(col, justify="left" if col in ("shape", "trainer", "dtype") else "right")
    for name, sh in result["shapes"].items():
        for r in sh["runs"]:
            table.add_row(name, r["name"], sh["dtype"], f"{r['tokens_per_s']:,.0f}",
                          f"{r['roofline_tokens_per_s']:,.0f}", f"{r['of_roofline']:.2f}", f"{r['update_s']:.2f}",
                          f"{r['fed_tokens']:,}", f"{r['peak_mb']:,.0f}", f"{r['cpu_util']:.2f}",
                          "yes" if r["clean"] else "[red]no[/red]")
    console.print(table)
    profiled = [(name, r) for name, sh in result["shapes"].items() for r in sh["runs"] if "profile" in r]
    if profiled:
        where = Table(title="where a step's time goes (torch profiler, one more step; % of its wall time)")
        for col in ("shape", "trainer", "step s", *ORDER):
            where.add_column(col, justify="left" if col in ("shape", "trainer") else "right")
        for name, r in profiled:
            p = r["profile"]
            where.add_row(name, r["name"], f"{p['wall_s']:.2f}", *(f"{100 * p['shares'][k]:.0f}" for k in ORDER))
        console.print(where)
    for name, sh in result["shapes"].items():
        console.print(f"{name}: {sh['dtype']} ({sh['dtype_reason']})" + (
            f"; best rstar2 update vs TRL: {sh['speedup_vs_trl']:.2f}x tokens/s, peak memory "
            f"{sh['peak_mb_ratio_vs_trl']:.2f}x" if "speedup_vs_trl" in sh else ""))


if __name__ == "__main__":  # worker entry: python -m rstar2.bench.trainer {ours|trl} SPEC.json
    side, spec_path = sys.argv[1], sys.argv[2]
    out = {"ours": worker_ours, "sft": worker_sft, "trl": worker_trl}[side](json.loads(Path(spec_path).read_text()))
    print("RESULT " + json.dumps(out), flush=True)
