"""Token-entropy analysis of the policy (paper §5, "what RL teaches": high-entropy tokens).

The paper looks at the top 20 % highest-entropy tokens of the policy on its own trajectories and finds two kinds:
  forking tokens:    inside the model's reasoning, where it hesitates, plans or decides to check (as in CoT RL);
  reflection tokens: right after a tool response, where the model reads the environment's feedback (success output or
                     an error) and decides what to do with it; these are specific to agentic RL.
The paper names no window for "right after"; here a token is a reflection token when it is among the first `window`
model tokens of a turn that follows a tool response (default 8: the tiny world's post-tool sentence, e.g. "The code
printed the result.", is about that long). Every other model token is reasoning (a forking token when high-entropy).

Entropies come from the trainer's own forward (rstar2.training.batching: loss positions only, the same
`entropy_from_logits` as the training metric) on trajectories a run already sampled, so two checkpoints are compared on
the same tokens."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from rstar2.evaluation.report import save_figure
from rstar2.training.batching import collate, loss_token_logprobs, token_budget_batches

REFLECTION, REASONING = "reflection", "reasoning"  # the classes of model tokens (tool and prompt tokens have none)


def token_classes(loss_mask: Sequence[int], window: int) -> list[str | None]:
    """Per position of one sequence (prompt + response): None for a token the model did not write (mask 0: prompt,
    tool response, chat headers), REFLECTION for the first `window` model tokens after a tool response (a mask-0 span
    that follows model tokens), else REASONING."""
    out: list[str | None] = []
    seen_model, since_tool = False, None  # since_tool: model tokens since the last tool response (None: none yet)
    for i, m in enumerate(loss_mask):
        if not m:
            if seen_model and (i == 0 or loss_mask[i - 1]):
                since_tool = 0  # a tool response starts after model tokens
            out.append(None)
            continue
        seen_model = True
        if since_tool is not None and since_tool < window:
            out.append(REFLECTION)
            since_tool += 1
        else:
            out.append(REASONING)
    return out


@torch.no_grad()
def sequence_entropies(model, ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]], pad_id: int,
                       max_tokens: int) -> list[np.ndarray]:
    """Per sequence, the policy's entropy (nats) at each model token (mask 1, position >= 1), in order: the
    trainer's forward (bucket layout, LM head on those positions only)."""
    model.eval()
    device = next(model.parameters()).device
    out: list[np.ndarray | None] = [None] * len(ids)
    for idx in token_budget_batches([len(s) for s in ids], max_tokens):
        mb = collate(ids, loss_mask, idx, pad_id, packed=False).to(device)
        _, ent = loss_token_logprobs(model, mb, with_entropy=True, entropy_grad=False)
        ent = ent.cpu()                                                                          # (N,)
        for i in idx:
            sel = mb.seq == i
            order = torch.argsort(mb.tok[sel])
            out[i] = ent[sel][order].numpy()
    return out  # type: ignore[return-value]


def high_entropy_figures(entropies: Sequence[np.ndarray], classes: Sequence[Sequence[str | None]],
                         tokens: Sequence[Sequence[str]], top_frac: float = 0.2, top_n: int = 10) -> dict:
    """The top `top_frac` highest-entropy model tokens (threshold: the (1 - top_frac) quantile over all of them)
    split by class. `entropies[i]`, `classes[i]` (model positions only, in order) and `tokens[i]` (their strings)
    align. Figures: tokens and mean entropy per class; the threshold; per class its share of the high-entropy tokens
    and its high-entropy rate (how many of its own tokens are high-entropy; 'top_frac' for a class with no
    preference); the `top_n` most frequent strings of each class's high-entropy tokens."""
    ent = np.concatenate([np.asarray(e, dtype=float) for e in entropies]) if entropies else np.zeros(0)
    cls = np.array([c for cs in classes for c in cs], dtype=object)
    tok = [t for ts in tokens for t in ts]
    if not (ent.size == cls.size == len(tok)):
        raise ValueError(f"entropies ({ent.size}), classes ({cls.size}) and tokens ({len(tok)}) do not align")
    if ent.size == 0:
        raise ValueError("no model tokens to analyse")
    thr = float(np.quantile(ent, 1.0 - top_frac))
    high = ent >= thr
    n_high = int(high.sum())
    out = {"tokens": int(ent.size), "entropy_mean": float(ent.mean()), "threshold": thr, "high_tokens": n_high}
    for c in (REASONING, REFLECTION):
        m = cls == c
        hm = high & m
        out[c] = {"tokens": int(m.sum()), "entropy_mean": float(ent[m].mean()) if m.any() else float("nan"),
                  "high_tokens": int(hm.sum()), "share_of_high": float(hm.sum() / n_high),
                  "high_rate": float(hm.sum() / m.sum()) if m.any() else float("nan"),
                  "top_strings": Counter(tok[j] for j in np.flatnonzero(hm)).most_common(top_n)}
    return out


def analyze(model, tokenizer, rows: Sequence[dict], window: int, top_frac: float, max_tokens: int,
            top_n: int = 10) -> dict:
    """high_entropy_figures of `model` on trajectories `rows` (prompt_ids, response_ids, loss_mask per row, as the
    rollout tables hold them)."""
    ids = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in rows]
    mask = [[0] * len(r["prompt_ids"]) + [int(m) for m in r["loss_mask"]] for r in rows]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ents = sequence_entropies(model, ids, mask, pad, max_tokens)
    classes, strings = [], []
    for s, m in zip(ids, mask):
        pos = [t for t in range(1, len(s)) if m[t]]                   # the positions sequence_entropies covers
        cs = token_classes(m, window)
        classes.append([cs[t] for t in pos])
        strings.append([tokenizer.decode([s[t]]) for t in pos])
    return {**high_entropy_figures(ents, classes, strings, top_frac, top_n), "trajectories": len(rows),
            "window": window, "top_frac": top_frac}


def comparison_rows(by_checkpoint: dict[str, dict]) -> list[dict]:
    """One row per checkpoint (label -> analyze's figures): the table in the terminal, MLflow and Prefect."""
    rows = []
    for label, f in by_checkpoint.items():
        rows.append({"checkpoint": label, "tokens": f["tokens"], "entropy_mean": round(f["entropy_mean"], 4),
                     "threshold": round(f["threshold"], 4),
                     **{f"{c}_{k}": round(f[c][k], 4) for c in (REASONING, REFLECTION)
                        for k in ("tokens", "entropy_mean", "share_of_high", "high_rate")}})
    return rows


def markdown(by_checkpoint: dict[str, dict]) -> str:
    """The comparison table and each checkpoint's most frequent high-entropy strings, as markdown."""
    rows = comparison_rows(by_checkpoint)
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    for label, f in by_checkpoint.items():
        for c, kind in ((REASONING, "forking"), (REFLECTION, "reflection")):
            top = ", ".join(f"`{s!r}` {n}" for s, n in f[c]["top_strings"]) or "_none_"
            lines.append(f"\n**{label}, {kind} tokens** (high-entropy {c} tokens, most frequent): {top}")
    return "\n".join(lines)


def plots(by_checkpoint: dict[str, dict], out_dir: str) -> list[str]:
    """Two PNGs: each class's share of the high-entropy tokens, and each class's high-entropy rate, per checkpoint."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels, paths = list(by_checkpoint), []
    for key, ylabel in (("share_of_high", "share of the top-entropy tokens"),
                        ("high_rate", "fraction of the class's tokens in the top-entropy set")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        x = np.arange(len(labels))
        for k, (c, kind) in enumerate(((REASONING, "forking (reasoning)"), (REFLECTION, "reflection (after tool)"))):
            ax.bar(x + (k - 0.5) * 0.38, [by_checkpoint[lb][c][key] for lb in labels], 0.38, label=kind)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(f"high-entropy tokens: {ylabel}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        paths.append(save_figure(fig, out / f"entropy_{key}.png"))
    return paths
