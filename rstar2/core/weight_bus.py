"""Weights by collective broadcast (trainer.weight_sync: collective), the mechanism of vLLM's RLHF examples.

Trainer rank 0 and every engine worker join a bus of their own: a process group (gloo on CPUs, NCCL, or RCCL on ROCm,
on GPUs, through the same code) and its key-value store, never torch's default group (DeepSpeed and vLLM own that).
Rank 0 casts the weights to the engines' dtype and sends them in buckets of at most `bucket_bytes`; each engine worker
loads a bucket's tensors as it arrives (vLLM's in-place reload takes an iterator). The tensor list (names, shapes,
dtypes) goes ahead through the store. The buckets travel one of two ways:
- by the group's broadcast. Neither side holds a second copy of the model.
- through shared memory, on CPUs, when every member shares the sender's memory (its node, its container), as NCCL
  goes through shared memory between the GPUs of one node and vLLM's CPU communicator between its workers. The sender
  writes each bucket once into a segment in /dev/shm and every engine loads from it in place; the group carries only
  a one-byte signal per bucket and a closing barrier, so a member that dies still fails the others' next call at
  once. No socket copies (a gloo broadcast moves ~1.5 GB/s on two cores) and no fresh pages per sync (a copy into
  fresh pages runs at a tenth of a copy into warm ones). The segment holds one copy of the weights as sent for the
  bus's life, as the memory path's object store holds one per sync. It is offered when a bus opens, if it takes at
  most half the free room in /dev/shm, and used only when every member maps it; otherwise the group broadcasts.

    member rank 0: the sender;   first_rank(e) + w: worker w of engine e (its tensor-parallel rank)

A bus lives as long as its members: the controller opens a new one (a new port) whenever an engine or the trainer
was started again, and a process keeps one bus at a time.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"  # where a shared segment lives (a tmpfs on Linux)


@dataclass(frozen=True)
class Bus:
    """Where a bus meets and how it sends: the store's host and port (on the sender's node), the number of members,
    the collective backend, the bucket size, the engines' dtype (the sender casts floating tensors to it), whether
    shared memory is offered (gloo only)."""
    host: str
    port: int
    size: int
    backend: str = "gloo"  # "gloo" | "nccl"
    bucket_bytes: int = 64 * 2**20
    dtype: str = "float32"
    timeout_s: float = 120.0
    shared_memory: bool = True


@dataclass(frozen=True)
class Incoming:
    """What an engine receives in one sync: the bus, the sync's key, and its first worker's member rank."""
    bus: Bus
    key: int
    first_rank: int


@dataclass
class _Member:
    """This process's membership of a bus: the store client (the sender hosts the store), the group, and the shared
    segment (bytes after its head) when the buckets go through it: the group then carries only the signals, so a
    member that dies fails its peers' next call at once, as in a broadcast."""
    store: dist.Store
    group: dist.ProcessGroup
    shared: torch.Tensor | None = None


_MEMBERS: dict[tuple[str, int], _Member] = {}  # this process's bus (one at a time)
_NONCE = 16  # bytes of a segment's head that name it: the random part of its file name
_LINE = 64  # a cache line: where each bucket of a segment starts (any dtype's alignment)
_HEAD = _LINE  # bytes before a segment's buckets: its nonce, then padding to a cache line


def _join(bus: Bus, rank: int, nbytes: int = 0) -> _Member:
    """This process's membership of `bus`, made on first use: every member makes it in its first sync, and
    construction waits for all of them. A new bus replaces the membership of an old one. The sender (rank 0) sizes
    the shared segment it offers: `nbytes`, its first sync's (see `_offer`)."""
    where = (bus.host, bus.port)
    if where not in _MEMBERS:
        _MEMBERS.clear()
        timeout = timedelta(seconds=bus.timeout_s)
        store = dist.TCPStore(bus.host, bus.port, bus.size, is_master=rank == 0, timeout=timeout)
        shared = _offer(store, bus, nbytes) if rank == 0 else _take(store, rank)
        _MEMBERS[where] = _Member(store, _group(bus, store, rank, timeout), shared)
    return _MEMBERS[where]


def _group(bus: Bus, store: dist.Store, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    if bus.backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, bus.size, timeout)
    if bus.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, bus.size, opts)
    raise ValueError(f"weight bus backend {bus.backend!r}: gloo or nccl")


def _offer(store: dist.Store, bus: Bus, nbytes: int) -> torch.Tensor | None:
    """The sender's side: a segment of `nbytes` in /dev/shm (gloo only), its head a nonce; it is kept when every
    member answers that it mapped it, else None. Its file is unlinked once all have answered (their mappings outlive
    it), so a crash leaves nothing behind in /dev/shm."""
    path, segment = _segment(nbytes) if bus.backend == "gloo" and bus.shared_memory else (None, None)
    store.set("offer", path or "")
    try:
        answers = [store.get(f"took/{r}") for r in range(1, bus.size)]
    finally:
        if path is not None:
            os.unlink(path)
    shared = segment is not None and all(a == b"1" for a in answers)
    store.set("shared", "1" if shared else "0")
    return segment[_HEAD:] if shared else None


def _take(store: dist.Store, rank: int) -> torch.Tensor | None:
    """A member's side: it maps the offered segment and checks its nonce (the sender's very memory, not a namesake),
    answers, and learns whether every member did."""
    path = store.get("offer").decode()
    segment = None
    if path:
        try:
            mapped = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            segment = mapped if bytes(mapped[:_NONCE].tolist()) == _nonce(path) else None
        except (OSError, RuntimeError):  # another node, or another container's /dev/shm
            segment = None
    store.set(f"took/{rank}", "1" if segment is not None else "0")
    return segment[_HEAD:] if store.get("shared") == b"1" else None


def _segment(nbytes: int) -> tuple[str | None, torch.Tensor | None]:
    """A fresh segment of `nbytes` after its head, its pages reserved (a /dev/shm too small fails here, not with a
    SIGBUS mid-sync): (path, mapping), or (None, None) where there is none to be had."""
    if not os.path.isdir(SHM_DIR):
        return None, None
    room = os.statvfs(SHM_DIR)
    if _HEAD + nbytes > room.f_bavail * room.f_frsize // 2:  # leave the rest to Ray's object store and others
        return None, None
    path = os.path.join(SHM_DIR, f"rstar2-weights-{os.getpid()}-{secrets.token_hex(_NONCE)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:  # a /dev/shm this process may not write
        return None, None
    try:
        os.posix_fallocate(fd, 0, _HEAD + nbytes)
    except OSError:
        os.unlink(path)
        return None, None
    finally:
        os.close(fd)
    segment = torch.from_file(path, shared=True, size=_HEAD + nbytes, dtype=torch.uint8)
    segment[:_NONCE] = torch.frombuffer(bytearray(_nonce(path)), dtype=torch.uint8)
    return path, segment


def _nonce(path: str) -> bytes:
    return bytes.fromhex(path.rsplit("-", 1)[1])


def device_of(bus: Bus, device: torch.device | str) -> torch.device:
    """Where a member's buffers live: host memory for gloo, the member's accelerator for NCCL."""
    return torch.device("cpu") if bus.backend == "gloo" else torch.device(device)


def buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors of one dtype, at most `bucket_bytes` each (a larger tensor is a bucket alone).
    meta: (name, shape, dtype) per tensor, in sending order; both sides cut the same buckets from it."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, entry in enumerate(meta):
        nbytes = _nbytes(entry)
        if not out or entry[2] != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, entry[2]
        out[-1].append(i)
        size += nbytes
    return out


def offsets(sizes: list[int]) -> list[int]:
    """Where each bucket starts in a shared segment: one after another, each at a cache line (any dtype's alignment);
    the last entry is the segment's size."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + -(-n // _LINE) * _LINE)
    return out


def send(bus: Bus, key: int, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict:
    """Rank 0: send `weights` (name, tensor) to every engine worker, floating tensors cast to bus.dtype. Returns once
    the last bucket is sent (through shared memory: once every worker has loaded them), with {"sync_bytes",
    "sync_buckets", "sync_shared": 1 through shared memory, 0 by broadcast}."""
    at, cast = device_of(bus, device), getattr(torch, bus.dtype)
    named = [(n, t.detach()) for n, t in weights]
    meta = [(n, list(t.shape), bus.dtype if t.is_floating_point() else str(t.dtype).removeprefix("torch."))
            for n, t in named]
    parts = buckets(meta, bus.bucket_bytes)
    sizes = [sum(_nbytes(meta[i]) for i in idx) for idx in parts]
    member = _join(bus, 0, offsets(sizes)[-1])
    if key > 0:
        member.store.delete_key(f"meta/{key - 1}")  # every member read it: the last sync completed
    member.store.set(f"meta/{key}", json.dumps(meta))
    tensors = ([_cast(named[i][1], at, cast) for i in idx] for idx in parts)  # bucket by bucket, as sent
    if member.shared is not None:
        _write_shared(member, tensors, sizes)
    else:
        packed = max((n for n, idx in zip(sizes, parts) if len(idx) > 1), default=0)
        _broadcast(member.group, at, tensors, sizes, [meta[idx[0]][2] for idx in parts], packed)
    return {"sync_bytes": sum(sizes), "sync_buckets": len(parts), "sync_shared": int(member.shared is not None)}


def _broadcast(group: dist.ProcessGroup, at: torch.device, tensors: Iterable[list[torch.Tensor]], sizes: list[int],
               dtypes: list[str], packed: int) -> None:
    """Each bucket by the group's broadcast. A bucket of one tensor goes as it is; the others are packed into two
    buffers of `packed` bytes in turn (reused: no fresh pages each bucket), one on its way while the next is packed."""
    buffers = [torch.empty(packed, dtype=torch.uint8, device=at) for _ in range(2)]
    in_flight: list[dist.Work | None] = [None, None]
    for k, (ts, size, dtype) in enumerate(zip(tensors, sizes, dtypes)):
        slot = k % 2
        if in_flight[slot] is not None:
            in_flight[slot].wait()
        if len(ts) == 1:
            flat = ts[0].reshape(-1)                                                           # (numel,)
        else:
            flat = buffers[slot][:size].view(getattr(torch, dtype))                            # (Σ numel,)
            torch.cat([t.reshape(-1) for t in ts], out=flat)
        in_flight[slot] = group.broadcast(flat, 0)
    for work in in_flight:
        if work is not None:
            work.wait()


def _write_shared(member: _Member, tensors: Iterable[list[torch.Tensor]], sizes: list[int]) -> None:
    """Each bucket into its place in the shared segment, announced by a one-byte broadcast as soon as it is written;
    then a barrier: every reader has loaded the last one (the segment is written again only in the next sync)."""
    shared, at, signal = member.shared, offsets(sizes), torch.zeros(1, dtype=torch.uint8)
    if at[-1] > shared.numel():
        raise ValueError(f"this sync's weights ({at[-1]} bytes) outgrew the shared segment sized by the bus's first "
                         f"({shared.numel()} bytes): a model's tensors do not change between syncs")
    for b, ts in enumerate(tensors):
        offset = at[b]
        for t in ts:
            data = t.reshape(-1).view(torch.uint8)                                             # (nbytes,)
            shared[offset:offset + data.numel()].copy_(data)
            offset += data.numel()
        member.group.broadcast(signal, 0).wait()
    member.group.barrier().wait()


def receive(sync: Incoming, worker_rank: int, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's side of `send`: (name, tensor) pairs, each bucket's as it arrives. Consume it whole (the
    sender waits for every member, in every bucket of a broadcast). Shared-memory tensors are views of the segment:
    valid until the next sync, so a loader copies them (vLLM's does)."""
    member = _join(sync.bus, sync.first_rank + worker_rank)
    meta = json.loads(member.store.get(f"meta/{sync.key}"))
    parts = buckets(meta, sync.bus.bucket_bytes)
    if member.shared is not None:
        flats = _read_shared(member, meta, parts)
    else:
        flats = _received(member.group, device_of(sync.bus, device), meta, parts)
    for idx, flat in zip(parts, flats):
        offset = 0
        for i in idx:
            name, shape, _ = meta[i]
            n = math.prod(shape)
            yield name, flat[offset:offset + n].view(shape)
            offset += n
    if member.shared is not None:
        member.group.barrier().wait()  # the sender's signal that every reader is done with the segment


def _received(group: dist.ProcessGroup, at: torch.device, meta: list, parts: list[list[int]]) -> Iterator[torch.Tensor]:
    """Each bucket's flat tensor from the group's broadcast; the next one is on its way while this one is loaded."""
    def post(idx: list[int]) -> tuple[torch.Tensor, dist.Work]:
        flat = torch.empty(sum(math.prod(meta[i][1]) for i in idx), dtype=getattr(torch, meta[idx[0]][2]), device=at)
        return flat, group.broadcast(flat, 0)

    upcoming = post(parts[0]) if parts else None
    for k in range(len(parts)):
        flat, work = upcoming
        work.wait()
        upcoming = post(parts[k + 1]) if k + 1 < len(parts) else None
        yield flat


def _read_shared(member: _Member, meta: list, parts: list[list[int]]) -> Iterator[torch.Tensor]:
    """Each bucket's flat tensor, a view of its place in the shared segment once the sender announces it."""
    sizes, signal = [sum(_nbytes(meta[i]) for i in idx) for idx in parts], torch.zeros(1, dtype=torch.uint8)
    for idx, start, size in zip(parts, offsets(sizes), sizes):
        member.group.broadcast(signal, 0).wait()
        yield member.shared[start:start + size].view(getattr(torch, meta[idx[0]][2]))


def close() -> None:
    """Leave this process's bus (its peers changed, or the run ends)."""
    _MEMBERS.clear()


def _nbytes(entry: tuple[str, list[int], str]) -> int:
    return math.prod(entry[1]) * getattr(torch, entry[2]).itemsize


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """As sent: on the bus's device, floating tensors in the engines' dtype, contiguous (no copy when already so)."""
    return (t.to(device, dtype) if t.is_floating_point() else t.to(device)).contiguous()
