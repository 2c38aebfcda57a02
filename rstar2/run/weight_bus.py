"""Weights by collective broadcast (trainer.weight_sync: collective), the mechanism of vLLM's RLHF examples.

Trainer rank 0 and every engine worker join a process group of their own: gloo on CPUs, NCCL (RCCL on ROCm) on GPUs,
through the same code. It is never torch's default group, which DeepSpeed and vLLM own. Rank 0 casts the weights to
the engines' dtype and broadcasts them in buckets of at most `bucket_bytes`. Each engine worker loads a bucket's
tensors as it arrives (vLLM's in-place reload takes an iterator), so neither side holds a second copy of the model.
The tensor list (names, shapes, dtypes) goes ahead through the group's key-value store.

    group rank 0: the sender;   first_rank(e) + w: worker w of engine e (its tensor-parallel rank)

A group lives as long as its members: the controller opens a new one (a new port) whenever an engine or the trainer
was started again, and a process keeps one group at a time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Bus:
    """Where a group meets and how it sends: the store's host and port (on the sender's node), the group size, the
    collective backend, the bucket size, the engines' dtype (the sender casts floating tensors to it)."""
    host: str
    port: int
    size: int
    backend: str = "gloo"  # "gloo" | "nccl"
    bucket_bytes: int = 64 * 2**20
    dtype: str = "float32"
    timeout_s: float = 120.0


@dataclass(frozen=True)
class Incoming:
    """What an engine receives in one sync: the bus, the sync's key, and its first worker's group rank."""
    bus: Bus
    key: int
    first_rank: int


_GROUPS: dict[tuple[str, int], tuple[dist.Store, dist.ProcessGroup]] = {}  # this process's group (one at a time)


def _join(bus: Bus, rank: int) -> tuple[dist.Store, dist.ProcessGroup]:
    """This process's store client (the sender hosts the store) and group for `bus`, made on first use: every member
    makes it in its first sync, and construction waits for all of them. A new bus replaces the group of an old one."""
    where = (bus.host, bus.port)
    if where not in _GROUPS:
        _GROUPS.clear()
        timeout = timedelta(seconds=bus.timeout_s)
        store = dist.TCPStore(bus.host, bus.port, bus.size, is_master=rank == 0, timeout=timeout)
        if bus.backend == "gloo":
            group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, bus.size, timeout)
        elif bus.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, bus.size, opts)
        else:
            raise ValueError(f"weight bus backend {bus.backend!r}: gloo or nccl")
        _GROUPS[where] = (store, group)
    return _GROUPS[where]


def device_of(bus: Bus, device: torch.device | str) -> torch.device:
    """Where a member's buffers live: host memory for gloo, the member's accelerator for NCCL."""
    return torch.device("cpu") if bus.backend == "gloo" else torch.device(device)


def buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors of one dtype, at most `bucket_bytes` each (a larger tensor is a bucket alone).
    meta: (name, shape, dtype) per tensor, in sending order; both sides cut the same buckets from it."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = math.prod(shape) * getattr(torch, dt).itemsize
        if not out or dt != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += nbytes
    return out


def send(bus: Bus, key: int, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict:
    """Rank 0: broadcast `weights` (name, tensor) to every engine worker, floating tensors cast to bus.dtype.
    Returns {"sync_bytes", "sync_buckets"}."""
    store, group = _join(bus, 0)
    at, cast = device_of(bus, device), getattr(torch, bus.dtype)
    named = [(n, t.detach()) for n, t in weights]
    meta = [(n, list(t.shape), bus.dtype if t.is_floating_point() else str(t.dtype).removeprefix("torch."))
            for n, t in named]
    if key > 0:
        store.delete_key(f"meta/{key - 1}")  # every member read it: the last sync's broadcasts completed
    store.set(f"meta/{key}", json.dumps(meta))
    parts = buckets(meta, bus.bucket_bytes)
    sizes = [sum(math.prod(meta[i][1]) * getattr(torch, meta[i][2]).itemsize for i in idx) for idx in parts]
    # a bucket of one tensor already as sent goes without a copy; the others are packed into two buffers in turn
    # (reused: no fresh pages each bucket), one on its way while the next is packed
    as_is = [named[idx[0]][1] if len(idx) == 1 and _sendable(named[idx[0]][1], at, meta[idx[0]][2]) else None
             for idx in parts]
    packed = max((n for n, t in zip(sizes, as_is) if t is None), default=0)
    buffers = [torch.empty(packed, dtype=torch.uint8, device=at) for _ in range(2)]
    in_flight: list[dist.Work | None] = [None, None]
    for k, (idx, size, tensor) in enumerate(zip(parts, sizes, as_is)):
        slot = k % 2
        if in_flight[slot] is not None:
            in_flight[slot].wait()
        if tensor is not None:
            flat = tensor.reshape(-1)                                                          # (numel,)
        else:
            flat = buffers[slot][:size].view(getattr(torch, meta[idx[0]][2]))                  # (Σ numel,)
            torch.cat([_cast(named[i][1], at, cast).reshape(-1) for i in idx], out=flat)
        in_flight[slot] = group.broadcast(flat, 0)
    for work in in_flight:
        if work is not None:
            work.wait()
    return {"sync_bytes": sum(sizes), "sync_buckets": len(parts)}


def receive(sync: Incoming, worker_rank: int, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's side of `send`: (name, tensor) pairs, each bucket's as it arrives. Consume it whole (the
    sender waits for every member in every bucket)."""
    store, group = _join(sync.bus, sync.first_rank + worker_rank)
    at = device_of(sync.bus, device)
    meta = json.loads(store.get(f"meta/{sync.key}"))
    parts = buckets(meta, sync.bus.bucket_bytes)

    def post(idx: list[int]) -> tuple[torch.Tensor, dist.Work]:
        flat = torch.empty(sum(math.prod(meta[i][1]) for i in idx), dtype=getattr(torch, meta[idx[0]][2]), device=at)
        return flat, group.broadcast(flat, 0)

    upcoming = post(parts[0]) if parts else None
    for k, idx in enumerate(parts):
        flat, work = upcoming
        work.wait()
        upcoming = post(parts[k + 1]) if k + 1 < len(parts) else None  # arrives while this one is loaded
        offset = 0
        for i in idx:
            name, shape, _ = meta[i]
            n = math.prod(shape)
            yield name, flat[offset:offset + n].view(shape)
            offset += n


def close() -> None:
    """Leave this process's group (its peers changed, or the run ends)."""
    _GROUPS.clear()


def _sendable(t: torch.Tensor, device: torch.device, dtype: str) -> bool:
    return t.is_contiguous() and t.device == device and t.dtype == getattr(torch, dtype)


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)
