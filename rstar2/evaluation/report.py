"""Human-readable reports: sampled trajectories as markdown (Prefect UI artifact), the ablation / stage comparison
plots (matplotlib PNGs logged to MLflow): reward, pass@1, tool-error rate among positives, response length and the
entropy at sampled tokens vs step, and the figures of a campaign over RL seeds and of an ablation's variants against
its baseline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from rstar2.evaluation import stats

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


Curves = dict[str, list[tuple[int, float]]]  # metric -> [(step, value), ...] of one run


def comparison_plots(histories: dict[str, Curves | list[Curves]], out_dir: str, title: str) -> list[str]:
    """One PNG per curve that some label has data for (an empty chart is not written), one line per label
    (stage/variant); `histories[label]` is one run's curves, or a list of runs (its seeds): then the line is their
    mean per step with a min-max band (stats.curve_band)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in CURVES.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, runs in histories.items():
            runs = runs if isinstance(runs, list) else [runs]
            band = stats.curve_band([r.get(metric, []) for r in runs])
            if not band:
                continue
            steps, mean, lo, hi, _ = (list(col) for col in zip(*band))
            if len(runs) == 1:
                ax.plot(steps, mean, marker=".", label=name)
                continue
            line, = ax.plot(steps, mean, marker=".", label=f"{name}: mean of {len(runs)} seeds, min-max")
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.vlines(steps, lo, hi, color=line.get_color(), alpha=0.5)  # the range also shows at a lone step
        if not ax.lines:  # no run logged this curve
            plt.close(fig)
            continue
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out / f"{metric}.png"))
    return paths


def save_figure(fig, path: Path) -> str:
    """Write a matplotlib figure as the project's plots are written (tight layout, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


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


def mean_curves(runs: list[Curves]) -> Curves:
    """Several runs' (seeds') curves as one: the mean per step over the runs that logged it."""
    return {m: [(step, mean) for step, mean, *_ in stats.curve_band([r.get(m, []) for r in runs])]
            for m in sorted({m for r in runs for m in r})}


def seed_aggregate(sft: dict, by_seed: list[dict]) -> dict:
    """A campaign's figures over its RL seeds: one SFT evaluation `sft`, one final evaluation per seed (`by_seed`,
    each with rl_seed, pass1, pass1_se, pass_at_{k}), all on the same split. Gain of seed s: pass1_s - pass1_sft
    (the SFT model is shared, so the spread over seeds is the RL's); its mean, min, max and 95 % interval over seeds
    (stats.seed_summary). pass1_se is the mean of the seeds' standard errors (the noise of one evaluation)."""
    runs = [{**s, "pass1_gain": s["pass1"] - sft["pass1"]} for s in by_seed]
    ks = sorted(int(k.removeprefix("pass_at_")) for k in sft if k.startswith("pass_at_"))
    return {**_over_runs(runs), "pass1_sft": sft["pass1"], "pass1_sft_se": sft["pass1_se"],
            **{f"pass_at_{k}_sft": sft[f"pass_at_{k}"] for k in ks},
            **{f"pass_at_{k}_rl": float(np.mean([s[f"pass_at_{k}"] for s in by_seed])) for k in ks
               if all(f"pass_at_{k}" in s for s in by_seed)}}


def _over_runs(runs: list[dict]) -> dict:
    """pass@1 after RL and the gain over runs (each with pass1, pass1_gain, pass1_se, rl_seed): mean, min, max and
    95 % interval (stats.seed_summary); pass1_se is the mean of the runs' standard errors."""
    rl = [float(r["pass1"]) for r in runs]
    over_rl, gain = stats.seed_summary(rl), stats.seed_summary([float(r["pass1_gain"]) for r in runs])
    return {"seeds": len(runs), "rl_seeds": [r["rl_seed"] for r in runs],
            "pass1_rl": over_rl["mean"], "pass1_rl_by_seed": rl, "pass1_rl_min": over_rl["min"],
            "pass1_rl_max": over_rl["max"], "pass1_rl_ci95": over_rl["ci95"],
            "pass1_se": float(np.mean([r["pass1_se"] for r in runs])),
            "pass1_gain": gain["mean"], "pass1_gain_mean": gain["mean"], "pass1_gain_min": gain["min"],
            "pass1_gain_max": gain["max"], "pass1_gain_ci95": gain["ci95"], "by_seed": runs}


def world_aggregate(worlds: dict[int, dict]) -> dict:
    """A campaign's figures over world seeds x RL seeds: `worlds` maps a world seed to that world's campaign summary
    (seed_aggregate's keys). Each world has its own SFT model (a draw, as on another host), so a run's gain is
    measured from its own world's SFT evaluation. Two spreads:

        runs:   every gain g_wr (K worlds x N RL seeds): mean, min, max, 95 % interval (stats.seed_summary, as if
                independent; gains of one world share its SFT model, so this interval is narrower than the truth)
        worlds: the K world means  m_w = mean_r g_wr: their 95 % interval (t with K-1 df) is the honest one for the
                mean gain of a new world"""
    runs = [{"world_seed": w, "rl_seed": s["rl_seed"], "pass1_sft": summ["pass1_sft"], "pass1": s["pass1"],
             "pass1_gain": s["pass1_gain"]} for w, summ in sorted(worlds.items()) for s in summ["by_seed"]]
    gains = stats.seed_summary([r["pass1_gain"] for r in runs])
    world_means = stats.seed_summary([summ["pass1_gain"] for _, summ in sorted(worlds.items())])
    return {"world_seeds": sorted(worlds), "rl_seeds": sorted({r["rl_seed"] for r in runs}), "runs": runs,
            "pass1_gain_mean": gains["mean"], "pass1_gain_min": gains["min"], "pass1_gain_max": gains["max"],
            "pass1_gain_sd": gains["sd"], "pass1_gain_ci95": gains["ci95"],
            "pass1_gain_worlds_ci95": world_means["ci95"],
            "pass1_sft_by_world": {str(w): summ["pass1_sft"] for w, summ in sorted(worlds.items())},
            "pass1_gain_by_world": {str(w): summ["pass1_gain"] for w, summ in sorted(worlds.items())}}


def pool_worlds(worlds: dict[int, dict]) -> dict:
    """One variant's campaign summaries over world seeds (`worlds`: world seed -> seed_aggregate's keys) as one
    summary of the same keys over all its K x N runs, world by world, each run's gain from its own world's SFT model.
    pass1_sft is the worlds' mean. Run i of two variants pooled over the same worlds and RL seeds starts from the
    same SFT model with the same rl_seed, so the ablation's paired statistics stay paired."""
    runs = [{**s, "world_seed": w} for w, summ in sorted(worlds.items()) for s in summ["by_seed"]]
    return {**_over_runs(runs), "world_seeds": sorted(worlds),
            "pass1_sft": float(np.mean([summ["pass1_sft"] for summ in worlds.values()])),
            "pass1_sft_by_world": {str(w): summ["pass1_sft"] for w, summ in sorted(worlds.items())},
            "steps": max(summ["steps"] for summ in worlds.values()),
            "wall_s": float(sum(summ["wall_s"] for summ in worlds.values()))}


def ablation_summary(results: dict[str, dict]) -> dict:
    """An ablation's figures from its variants' campaign summaries (seed_aggregate's keys): per variant the mean,
    min, max and 95 % interval over seeds of held-out pass@1 after RL and of the gain; and every variant against the
    first (the baseline): the difference of pass@1 after RL with its Welch 95 % interval and whether it is beyond
    the noise of the seeds (stats.compare). The variants share one SFT model, so this is also the gain's difference."""
    r4 = lambda v: None if v is None else round(float(v), 4)  # noqa: E731
    rows = []
    for v, s in results.items():
        gains = stats.seed_summary([g["pass1_gain"] for g in s["by_seed"]])
        rows.append({"variant": v, "seeds": s["seeds"], "pass1_sft": r4(s["pass1_sft"]), "pass1_rl": r4(s["pass1_rl"]),
                     "pass1_rl_min": r4(s["pass1_rl_min"]), "pass1_rl_max": r4(s["pass1_rl_max"]),
                     "pass1_rl_ci95": [r4(x) for x in s["pass1_rl_ci95"]], "pass1_se": r4(s["pass1_se"]),
                     "gain": r4(gains["mean"]), "gain_min": r4(gains["min"]), "gain_max": r4(gains["max"]),
                     "gain_ci95": [r4(x) for x in gains["ci95"]], "steps": s["steps"], "wall_s": round(s["wall_s"])})
    (base, b), *others = results.items()
    comparisons = []
    for v, s in others:
        c = stats.compare(s["pass1_rl_by_seed"], b["pass1_rl_by_seed"])
        comparisons.append({"variant": v, "baseline": base, "diff": r4(c["diff"]),
                            "ci95": c["ci95"] and [r4(x) for x in c["ci95"]], "beyond_noise": c["beyond_noise"],
                            "seeds": [c["n_a"], c["n_b"]]})
    return {"variants": rows, "comparisons": comparisons}


LAST_STEPS_FIGURES = ("tool_error_rate_pos", "response_len_mean", "reward_mean", "pass1_train", "entropy")
RATES = ("tool_error_rate_pos",)  # compared seed by seed as a ratio (stats.paired_log_ratio): the ablation's statistic


def last_steps_summary(curves: dict[str, list[Curves]], last: int) -> dict:
    """The training figures at the end of RL, per variant (`curves[variant]`: one set of curves per seed): a seed's
    value is its mean over its last `last` logged steps (NaN points left out); over the seeds, the mean, min, max and
    95 % interval (stats.seed_summary). Each variant against the first: the difference with its Welch interval
    (stats.compare) and whether the two variants' own 95 % intervals are apart (do not overlap); for the RATES, also
    seed by seed (seed i of every variant starts from the one SFT model with the same rl_seed) their ratio with its
    95 % interval (stats.paired_log_ratio): the statistic the ablation concludes on, as it holds on hosts whose seeds
    spread widely (unpaired intervals need the spread to be small)."""
    def per_seed(runs: list[Curves], metric: str) -> list[float]:
        out = []
        for r in runs:
            vals = [v for _, v in sorted(r.get(metric, []))[-last:] if v == v]
            if vals:
                out.append(float(np.mean(vals)))
        return out

    r4 = lambda v: None if v is None or v != v else round(float(v), 4)  # noqa: E731 - NaN as null in the JSON
    variants: dict[str, dict] = {}
    for v, runs in curves.items():
        variants[v] = {}
        for m in LAST_STEPS_FIGURES:
            xs = per_seed(runs, m)
            if xs:
                s = stats.seed_summary(xs)
                variants[v][m] = {"mean": r4(s["mean"]), "min": r4(s["min"]), "max": r4(s["max"]),
                                  "ci95": [r4(x) for x in s["ci95"]], "seeds": s["n"], "by_seed": [r4(x) for x in xs]}
    (base, b), *others = variants.items()
    vs: dict[str, dict] = {}
    for v, figs in others:
        vs[v] = {}
        for m in figs.keys() & b.keys():
            c = stats.compare(per_seed(curves[v], m), per_seed(curves[base], m))
            (lo, hi), (blo, bhi) = figs[m]["ci95"], b[m]["ci95"]
            vs[v][m] = {"baseline": base, "diff": r4(c["diff"]), "ci95": c["ci95"] and [r4(x) for x in c["ci95"]],
                        "beyond_noise": c["beyond_noise"],  # one seed has no interval: never "apart"
                        "intervals_apart": figs[m]["seeds"] > 1 and b[m]["seeds"] > 1 and bool(hi < blo or bhi < lo)}
            if m in RATES and figs[m]["seeds"] == b[m]["seeds"]:  # seed i of both arms: one SFT model, one rl_seed
                p = stats.paired_log_ratio(figs[m]["by_seed"], b[m]["by_seed"])
                vs[v][m]["paired_ratio"] = {"ratio": r4(p["ratio"]), "ci95": p["ci95"] and [r4(x) for x in p["ci95"]],
                                            "lower": p["lower"], "higher": p["higher"]}
    return {"steps": last, "variants": variants, "vs_baseline": vs}


def last_steps_rows(summary: dict) -> list[dict]:
    """last_steps_summary as table rows: one per (variant, figure), the interval as text, and against the baseline."""
    rows = []
    for v, figs in summary["variants"].items():
        for m, f in figs.items():
            c = summary["vs_baseline"].get(v, {}).get(m)
            vs = "" if c is None else f"{c['diff']:+} (intervals {'apart' if c['intervals_apart'] else 'overlap'})"
            if c and (p := c.get("paired_ratio")) and p["ci95"]:
                vs += f"; paired ratio {p['ratio']} [{p['ci95'][0]}, {p['ci95'][1]}]"
            rows.append({"variant": v, "figure": m, "mean": f["mean"], "min": f["min"], "max": f["max"],
                         "ci95": f"[{f['ci95'][0]}, {f['ci95'][1]}]", "seeds": f["seeds"], "vs_baseline": vs})
    return rows


def suite_rows(results: dict[str, dict]) -> list[dict]:
    """One row per evaluation suite: pass@1 (avg@k) and its standard error over problems, pass@k, problems, samples."""
    return [{"suite": name, **{k: r[k] for k in ("pass1", "pass1_se") if k in r},
             **{k: r[k] for k in sorted((k for k in r if k.startswith("pass_at_")),
                                        key=lambda k: int(k.removeprefix("pass_at_")))},
             "problems": r.get("problems"), "samples": r.get("samples")} for name, r in results.items()]


def suite_table(results: dict[str, dict], title: str):
    """The suites x metrics table of one checkpoint (rich)."""
    from rich.table import Table

    rows = suite_rows(results)
    table = Table(title=f"{title} (pass@1 = avg@k ± standard error over problems; pass@k unbiased)")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for c in cols:
        table.add_column(c.replace("pass_at_", "pass@"), justify="left" if c == "suite" else "right")
    for r in rows:
        table.add_row(*["-" if r.get(c) is None else f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                        for c in cols])
    return table
