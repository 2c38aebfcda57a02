"""The GEMM roofline of a training step at a model's own shapes, measured on this host.

A decoder step is, to first order, its matrix products: per layer the q, k, v and o projections and the MLP's gate,
up and down (x W^T forward; dY W and dY^T x backward: three products of the same FLOPs), and the LM head, which the
trainer runs only on the positions that predict a loss token. Each product is timed with torch at the step's own
(tokens x in x out) in the given dtype; the roofline time of a batch is

    t = fed_tokens x Σ_layers t_linear / M  +  loss_tokens x t_head / M          (M: tokens per micro-batch)

and its tokens/s is what a trainer doing nothing but these products would reach. Attention's own products, the
norms, the loss and the optimizer are left out (a few % of the FLOPs at these shapes), so a real step sits below it.
"""

from __future__ import annotations

import time

MIN_REPEATS = 5


def linear_shapes(mc) -> list[tuple[str, int, int, int]]:
    """(name, in, out, count) of a llama/qwen-family decoder's linear layers (the LM head counted apart)."""
    h = mc.hidden_size
    head_dim = getattr(mc, "head_dim", None) or h // mc.num_attention_heads
    q, kv = mc.num_attention_heads * head_dim, mc.num_key_value_heads * head_dim
    n = mc.num_hidden_layers
    return [("q", h, q, n), ("k", h, kv, n), ("v", h, kv, n), ("o", q, h, n),
            ("gate", h, mc.intermediate_size, n), ("up", h, mc.intermediate_size, n),
            ("down", mc.intermediate_size, h, n)]


def gemm_seconds(m: int, k: int, n: int, dtype, device: str = "cpu", min_s: float = 0.25) -> float:
    """Forward (m x k)(k x n) plus the two backward products, (m x n)(n x k) and (k x m)(m x n): the fastest of at
    least MIN_REPEATS timings and `min_s` seconds of them, after a warm-up (a shared host's noise only slows)."""
    import torch

    x, w, dy = (torch.randn(*s, device=device).to(dtype) for s in ((m, k), (n, k), (m, n)))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) <= MIN_REPEATS or time.perf_counter() - start < min_s:
        sync()
        t = time.perf_counter()
        x @ w.T
        dy @ w
        dy.T @ x
        sync()
        times.append(time.perf_counter() - t)
    return min(times[1:])  # the first is warm-up


def measure(mc, micro_tokens: int, dtype: str, device: str = "cpu") -> dict:
    """Seconds per token of the decoder body and of the LM head, forward + backward GEMMs, at `micro_tokens` rows."""
    import torch

    dt = getattr(torch, dtype)
    body = sum(c * gemm_seconds(micro_tokens, i, o, dt, device) for _, i, o, c in linear_shapes(mc))
    head = gemm_seconds(micro_tokens, mc.hidden_size, mc.vocab_size, dt, device)
    flop = 6 * micro_tokens * (sum(c * i * o for _, i, o, c in linear_shapes(mc)) + mc.hidden_size * mc.vocab_size)
    return {"dtype": dtype, "micro_tokens": micro_tokens, "body_s_per_token": body / micro_tokens,
            "head_s_per_token": head / micro_tokens, "gemm_gflop_per_s": flop / (body + head) / 1e9}


def tokens_per_s(r: dict, fed_tokens: int, head_tokens: int, counted_tokens: int) -> float:
    """Roofline tokens/s of a batch: `counted_tokens` (what the trainer's figure counts) over the GEMM time of
    `fed_tokens` through the body and `head_tokens` through the LM head."""
    t = fed_tokens * r["body_s_per_token"] + head_tokens * r["head_s_per_token"]
    return counted_tokens / t
