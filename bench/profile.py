"""Where a training step's time goes, by kind of work: one call run under torch's profiler, each op's self time (its
own, children apart) put in one kind by its name:

    share(kind) = Σ self time of the kind's ops / wall time of the call     share(framework and Python) = 1 - Σ others

The kinds are what the roofline tells apart (bench/roofline.py): the matrix products it counts, and the work it leaves
out (attention, elementwise work and norms, dtype casts, the loss, the optimizer and gradient clip), and the rest:
the framework's own ops (views, allocation, autograd bookkeeping) with the time no op accounts for (Python).
"""

from __future__ import annotations

import time
from typing import Callable

# (kind, name fragments), first match wins: an `aten::` fragment names one op (any overload), any other is a part of
# the name (the profiler's labels: `Optimizer.step#AdamW.step`, `autograd::engine::evaluate_function: MmBackward0`)
OUTSIDE = "framework and Python"
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adam", "optimizer.", "_foreach_", "linalg_vector_norm", "clip_grad")),
    ("casts", ("aten::copy_", "aten::_to_copy", "aten::to")),
    (OUTSIDE, ("autograd::", "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::t",
               "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
               "aten::as_strided", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach",
               "aten::alias", "aten::contiguous", "aten::result_type")),
)
OTHER = "elementwise and norms"
ORDER = tuple(k for k, _ in KINDS if k != OUTSIDE) + (OTHER, OUTSIDE)


def kind_of(op: str) -> str:
    """The kind an op's name belongs to; any other aten op is elementwise work or a norm (mul, add, silu, rsqrt,
    mean, cat, index_select, ...)."""
    name = op.lower()
    for kind, fragments in KINDS:
        if any(name == f or name.startswith(f + ".") or (not f.startswith("aten::") and f in name)
               for f in fragments):
            return kind
    return OTHER


def shares(self_us: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each kind's share of `wall_s` from ops' self times (microseconds, by op name); what no op accounts for goes
    with the framework's own ops (views, allocation, autograd bookkeeping) as framework and Python."""
    out = dict.fromkeys(ORDER, 0.0)
    for op, us in self_us.items():
        out[kind_of(op)] += us / 1e6 / wall_s
    kernels = sum(v for k, v in out.items() if k != OUTSIDE)
    out[OUTSIDE] = max(0.0, 1.0 - kernels)
    return out


def where_time_goes(call: Callable[[], object]) -> dict:
    """Run `call` once under torch's profiler (CPU ops): its wall seconds and each kind's share of them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        call()
        wall = time.perf_counter() - t
    self_us: dict[str, float] = {}
    for e in prof.key_averages():
        self_us[e.key] = self_us.get(e.key, 0.0) + e.self_cpu_time_total
    return {"wall_s": wall, "shares": shares(self_us, wall)}
