"""Human-readable reports: sampled trajectories as markdown (Prefect UI artifact) and the ablation / stage comparison
plots (matplotlib PNGs logged to MLflow): reward, pass@1, tool-error rate among positives, response length and the
entropy at sampled tokens vs step."""

from __future__ import annotations

from pathlib import Path

import polars as pl

CURVES = {"reward_mean": "reward (mean)", "pass1_train": "pass@1 (train batch)",
          "tool_error_rate_pos": "tool-error rate among positive trajectories",
          "response_len_mean": "response length (tokens)", "entropy": "entropy at sampled tokens (nats)"}


def _clip(text: str, n: int) -> str:
    text = text.replace("```", "'''")
    return text if len(text) <= n else text[: n // 2] + "\n…\n" + text[-n // 2:]


def trajectory_markdown(scored_uri: str, n: int = 3, seed: int = 0, max_chars: int = 1200) -> str:
    """A few rollouts of one step, positives and negatives: tool calls, tool output, answer and reward."""
    df = pl.read_parquet(scored_uri)
    if df.height == 0:
        return "_no trajectories_"
    pos, neg = df.filter(pl.col("reward") > 0), df.filter(pl.col("reward") <= 0)
    take = lambda d, k: d.sample(n=min(k, d.height), seed=seed) if d.height else d  # noqa: E731
    picked = pl.concat([take(pos, (n + 1) // 2), take(neg, n // 2)])
    parts = []
    for r in picked.iter_rows(named=True):
        parts.append(
            f"### {r['problem_id']} (sample {r['sample_idx']}): reward {r['reward']:.0f}, gold {r['gold']}\n"
            f"turns {r['num_turns']}, tool calls {r['num_tool_calls']} {list(r['tool_statuses'])}, "
            f"truncated {r['truncated']}, p_err {r['p_err']:.2f}, p_format {r['p_format']:.2f}\n\n"
            f"```\n{_clip(r['response_text'], max_chars)}\n```\n")
    return "\n".join(parts)


def comparison_plots(histories: dict[str, dict[str, list[tuple[int, float]]]], out_dir: str,
                     title: str) -> list[str]:
    """One PNG per curve; `histories[label][metric] = [(step, value), ...]`, one line per label (stage/variant)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in CURVES.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, curves in histories.items():
            pts = sorted(curves.get(metric, []))
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=name)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        path = out / f"{metric}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def per_step_rows(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> list[dict]:
    """One row per (variant, step) with every curve's value at that step."""
    rows = []
    for name, by_metric in curves.items():
        steps = sorted({s for pts in by_metric.values() for s, _ in pts})
        values = {m: dict(pts) for m, pts in by_metric.items()}
        rows += [{"variant": name, "step": s, **{m: round(values[m][s], 4) for m in by_metric if s in values[m]}}
                 for s in steps]
    return rows


def per_step_markdown(rows: list[dict]) -> str:
    if not rows:
        return "_no steps_"
    cols = ["variant", "step", *CURVES]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
