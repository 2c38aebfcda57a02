"""`rstar2 bench sync`: how long new weights take to reach a live vLLM engine, by trainer.weight_sync path.

For random Qwen2 models of three sizes (the tiny world's tokenizer and chat template; layers widened), one engine
runs as a Ray actor (as in a run) and the bench process plays the trainer holding the updated state dict:
  disk:   commit a checkpoint the way a run does (safetensors weights, fsync, SHA-256 manifest: rstar2.core.checkpoint),
          then the engine reloads it from the directory;
  memory: the state dict goes once into Ray's object store and the engine reloads from it (no file);
  collective: the bench process sends the state dict to the engine's worker over a bus of their own, in buckets of
          `bucket_mb`, and the engine loads each bucket as it arrives (rstar2.core.weight_bus): through shared memory,
          as a run on one node does (`collective_s`), and by gloo broadcast, as across nodes (`collective_gloo_s`).
          A bus's first sync also opens it; it is reported apart (`collective_first_s`, shared memory).
  LoRA (`--lora-rank`, trainer.lora): a second engine serves the model with LoRA enabled and takes a rank-r adapter on
          every linear layer: `lora_disk_s` commits the adapter as a run's checkpoint does and the engine loads it from
          the directory, `lora_memory_s` sends it through the object store (what the memory and collective modes do
          under LoRA); each sync ends with the engine's adapter fingerprint checked against the checkpoint's.
Each figure is the median of `repeats` syncs of freshly perturbed weights.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

SRC = Path(__file__).parent / "data" / "trainer"  # config and tokenizer of the tiny world
SIZES = {  # name: (hidden, layers, ffn, heads, kv heads)
    "3M": (256, 4, 704, 4, 2),
    "25M": (512, 8, 1536, 8, 4),
    "100M": (768, 12, 3072, 12, 4),
}


def random_model(out: Path, hidden: int, layers: int, ffn: int, heads: int, kv: int) -> int:
    """A random-init model directory vLLM can serve; returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from rstar2.world.tokenizer import CHAT_TEMPLATE

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(SRC)
    cfg.update(dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn, num_attention_heads=heads,
                    num_key_value_heads=kv, layer_types=["full_attention"] * layers))
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out, safe_serialization=True)
    tok = PreTrainedTokenizerFast.from_pretrained(SRC)
    tok.chat_template = CHAT_TEMPLATE  # the world's tool-calling template (the engine checks it runs the agent loop)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def measure(model_dir: Path, work: Path, repeats: int, bucket_mb: int) -> dict:
    import ray
    import torch
    from safetensors.torch import load_file

    from rstar2.core import checkpoint, weight_bus
    from rstar2.core.layout import step_name
    from rstar2.core.net import free_port
    from rstar2.rollout.engine_actor import EngineActor
    from rstar2.rollout.vllm_backend import EngineSpec

    spec = EngineSpec(model_dir=str(model_dir), max_model_len=512, dtype="float32", kv_cache_bytes=16 * 2**20)
    engine = ray.remote(num_cpus=0)(EngineActor).remote(spec)
    ray.get(engine.info.remote())
    base = load_file(str(model_dir / "model.safetensors"))
    times: dict[str, list[float]] = {"disk_write_s": [], "disk_reload_s": [], "disk_s": [], "memory_s": [],
                                     "collective_s": [], "collective_gloo_s": []}
    shared, gloo = (weight_bus.Bus("127.0.0.1", free_port(), size=2, bucket_bytes=bucket_mb * 2**20, dtype="float32",
                                   shared_memory=s) for s in (True, False))
    new_weights = [{k: v + 1e-3 * torch.randn_like(v) for k, v in base.items()} for _ in range(2)]  # a trainer's
    try:
        for i in range(repeats):
            sd = new_weights[i % 2]
            t0 = time.perf_counter()
            ckpt = checkpoint.commit(work / step_name(i), lambda d: _write(d, sd, model_dir), {"step": i})
            t1 = time.perf_counter()
            ray.get(engine.load_weights.remote(str(ckpt)))
            t2 = time.perf_counter()
            ray.get(engine.load_weights.remote(ray.put(sd), f"memory-{i}"))
            t3 = time.perf_counter()
            for k, v in (("disk_write_s", t1 - t0), ("disk_reload_s", t2 - t1), ("disk_s", t2 - t0),
                         ("memory_s", t3 - t2), ("collective_s", _collective(engine, shared, i, sd))):
                times[k].append(v)
        weight_bus.close()  # the engine's worker leaves the shared bus when it joins the next one
        times["collective_gloo_s"] = [_collective(engine, gloo, i, new_weights[i % 2]) for i in range(repeats)]
    finally:
        weight_bus.close()
        ray.kill(engine)
    first = times["collective_s"][0]
    if repeats > 1:  # a bus's first sync also opened it
        times["collective_s"], times["collective_gloo_s"] = times["collective_s"][1:], times["collective_gloo_s"][1:]
    return {**{k: statistics.median(v) for k, v in times.items()}, "collective_first_s": first}


def measure_lora(model_dir: Path, work: Path, repeats: int, rank: int) -> dict:
    """An adapter's syncs into a LoRA-enabled engine: disk (commit + load) and memory (object store), median seconds,
    and the adapter file's MB."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rstar2.core import adapter, checkpoint
    from rstar2.core.config import LoraCfg
    from rstar2.rollout.engine_actor import EngineActor
    from rstar2.rollout.vllm_backend import EngineSpec

    spec = EngineSpec(model_dir=str(model_dir), max_model_len=512, dtype="float32", kv_cache_bytes=16 * 2**20,
                      lora_rank=rank)
    engine = ray.remote(num_cpus=0)(EngineActor).remote(spec)
    ray.get(engine.info.remote())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    wrapped = adapter.attach(model, LoraCfg(rank=rank, alpha=2 * rank), str(model_dir))
    disk, memory = [], []
    try:
        for i in range(repeats):
            for p in adapter.trainable(model):  # a trainer's update
                p.data.add_(1e-3 * torch.randn_like(p))
            t0 = time.perf_counter()
            ckpt = checkpoint.commit(work / f"lora-{i}", lambda d: wrapped.save_pretrained(str(d)), {"step": i})
            ray.get(engine.load_weights.remote(str(ckpt)))
            t1 = time.perf_counter()
            sent = adapter.payload(wrapped)
            t2 = time.perf_counter()
            ray.get(engine.load_weights.remote(ray.put(sent), f"lora-memory-{i}"))
            t3 = time.perf_counter()
            served = ray.get(engine.fingerprint.remote())[1]
            if served != adapter.fingerprint_of_dir(ckpt, "float32"):
                raise RuntimeError(f"the engine serves another adapter than {ckpt}")
            disk.append(t1 - t0)
            memory.append(t3 - t2)
    finally:
        ray.kill(engine)
    return {"lora_rank": rank, "lora_mb": adapter.nbytes(ckpt) / 2**20, "lora_disk_s": statistics.median(disk),
            "lora_memory_s": statistics.median(memory)}


def _collective(engine, bus, key: int, sd: dict) -> float:
    """Seconds from the send's start until the engine has loaded every bucket."""
    import ray

    from rstar2.core import weight_bus

    t0 = time.perf_counter()
    load = engine.load_weights.remote(weight_bus.Incoming(bus, key, 1), f"collective-{key}")
    weight_bus.send(bus, key, sd.items())
    ray.get(load)
    return time.perf_counter() - t0


def _write(d: Path, sd: dict, model_dir: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text((model_dir / "config.json").read_text())


def command(sizes: str = typer.Option(",".join(SIZES), help="model sizes to run, comma-separated"),
            repeats: int = typer.Option(3, help="syncs per size and path (the median is reported)"),
            bucket_mb: int = typer.Option(64, help="collective: the most one bucket holds, MiB"),
            lora_rank: int = typer.Option(16, min=0, help="LoRA: an adapter of this rank on every linear layer, synced "
                                                          "into a LoRA-enabled engine (0: skip)"),
            json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Weight sync into a live vLLM engine: disk (commit + reload), memory (Ray object store), collective (in
    buckets, through shared memory and by gloo broadcast), three model sizes."""
    from rich.table import Table

    from rstar2.core import progress
    from rstar2.rollout import cluster

    console = progress.console()
    names = [s.strip() for s in sizes.split(",") if s.strip()]
    bad = [s for s in names if s not in SIZES]
    if bad:
        console.print(f"[red]error:[/red] unknown --sizes {bad}; known: {', '.join(SIZES)}")
        raise typer.Exit(2)
    cluster.init()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        for name in names:
            d = Path(tmp) / name
            d.mkdir()
            n = random_model(d / "model", *SIZES[name])
            figures = measure(d / "model", d, repeats, bucket_mb)
            if lora_rank:
                figures.update(measure_lora(d / "model", d, repeats, lora_rank))
            rows.append({"size": name, "params": n, "mb_fp32": n * 4 / 2**20, **figures})
            console.print(f"{name}: done")
    table = Table(title="weight sync into one vLLM engine (median seconds; MB of fp32 weights)")
    # disk = commit + reload; coll.: through shared memory (one node), its first sync (it also opens the bus) apart;
    # gloo: the same by gloo broadcast (across nodes)
    # LoRA: the adapter's MB, its disk sync (commit + load) and memory sync, and the memory sync against full weights'
    lora = ("LoRA MB", "LoRA disk", "LoRA mem", "LoRA/mem") if lora_rank else ()
    for col in ("size", "params", "MB", "commit", "reload", "disk", "memory", "coll.", "coll. 1st", "gloo",
                "mem/disk", "coll/disk", "gloo/disk", *lora):
        table.add_column(col, justify="right")
    for r in rows:
        for path in ("memory", "collective", "collective_gloo"):
            r[f"{path}_over_disk"] = r[f"{path}_s"] / r["disk_s"]
        cells = []
        if lora_rank:
            r["lora_memory_over_memory"] = r["lora_memory_s"] / r["memory_s"]
            cells = [f"{r['lora_mb']:.1f}", f"{r['lora_disk_s']:.3f}", f"{r['lora_memory_s']:.3f}",
                     f"{r['lora_memory_over_memory']:.2f}x"]
        table.add_row(r["size"], f"{r['params'] / 1e6:.1f}M", f"{r['mb_fp32']:.0f}", f"{r['disk_write_s']:.3f}",
                      f"{r['disk_reload_s']:.3f}", f"{r['disk_s']:.3f}", f"{r['memory_s']:.3f}",
                      f"{r['collective_s']:.3f}", f"{r['collective_first_s']:.3f}", f"{r['collective_gloo_s']:.3f}",
                      f"{r['memory_over_disk']:.2f}x", f"{r['collective_over_disk']:.2f}x",
                      f"{r['collective_gloo_over_disk']:.2f}x", *cells)
    console.print(table)
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))
