"""Statistics of evaluations and of runs repeated over seeds.

Two sources of noise, kept apart:
- within one evaluation, problems: pass@1 is a mean over problems of each problem's mean over its k samples, and its
  standard error is taken over problems (the samples of a problem are correlated, so they stay inside it);
- between RL runs, seeds: the same SFT model and evaluation split, only the RL seed changes (rollout sampling, data
  order, RoC draws, the trainer's seed). A gain is "beyond noise" when its 95 % interval over seeds excludes 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import t as student_t


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples, c of them correct (Chen et al. 2021, Codex, Eq. 1):

        pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)

    the product form never forms the binomials (stable for large n). Needs 1 <= k <= n; the mean over problems is
    the caller's. pass@1 = c / n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks_upto(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, 2, 4, ... <= n."""
    return [2 ** i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def pass1_with_se(rewards_by_problem: Sequence[Sequence[float]]) -> tuple[float, float]:
    """pass@1 and its standard error, clustered by problem:

        m_p = mean_j r_pj            (problem p's mean over its samples j)
        pass@1 = mean_p m_p,   SE = sd(m_1..m_P, ddof=1) / sqrt(P)

    SE is NaN for a single problem (no spread to measure)."""
    means = np.array([np.mean(r) for r in rewards_by_problem], dtype=float)  # (P,)
    if means.size == 0:
        raise ValueError("pass@1 of no problems")
    se = float(np.std(means, ddof=1) / math.sqrt(means.size)) if means.size > 1 else math.nan
    return float(means.mean()), se


def evaluation_stats(rewards_by_problem: Sequence[Sequence[float]], ks: Sequence[int] | None = None) -> dict:
    """An evaluation's figures: pass1, pass1_se, pass_at_{k} for `ks` (default: k = 1, 2, 4, ... up to the fewest
    samples of a problem; each k at most that), problems, samples (per problem, the fewest). Rewards are 0/1 (a
    sample is correct when reward > 0)."""
    pass1, se = pass1_with_se(rewards_by_problem)
    n = min(len(r) for r in rewards_by_problem)
    counts = [(len(r), int(np.sum(np.asarray(r) > 0))) for r in rewards_by_problem]
    at_k = {f"pass_at_{k}": float(np.mean([pass_at_k(ni, c, k) for ni, c in counts]))
            for k in sorted(set(ks or ks_upto(n)))}
    return {"pass1": pass1, "pass1_se": se, **at_k, "problems": len(counts), "samples": n}


def t_quantile(df: float, q: float = 0.975) -> float:
    """Student's t quantile t_q(df) (scipy)."""
    if not 0.5 <= q < 1:
        raise ValueError(f"q must be in [0.5, 1), got {q}")
    if not df >= 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return float(student_t.ppf(q, df))


def seed_summary(values: Sequence[float]) -> dict:
    """One figure over n seeds: mean, min, max, n, sd (ddof=1) and the 95 % interval for the mean,

        mean +- t_0.975(n-1) * sd / sqrt(n)

    With n = 1 there is no spread to measure: the interval is [value, value] and half_width is NaN."""
    x = np.asarray(values, dtype=float)  # (n,)
    if x.size == 0:
        raise ValueError("seed_summary of no values")
    mean = float(x.mean())
    if x.size == 1:
        sd = half = math.nan
        lo = hi = mean
    else:
        sd = float(x.std(ddof=1))
        half = t_quantile(x.size - 1) * sd / math.sqrt(x.size)
        lo, hi = mean - half, mean + half
    return {"mean": mean, "min": float(x.min()), "max": float(x.max()), "n": int(x.size), "sd": sd,
            "half_width": half, "ci95": [lo, hi]}


def compare(a_values: Sequence[float], b_values: Sequence[float]) -> dict:
    """Difference of means a - b over seeds with its 95 % interval (Welch: unequal variances),

        d = mean(a) - mean(b),   s2 = var(a)/n_a + var(b)/n_b   (var with ddof=1)
        df = s2^2 / ((var(a)/n_a)^2/(n_a-1) + (var(b)/n_b)^2/(n_b-1))   (Welch-Satterthwaite)
        d +- t_0.975(df) sqrt(s2)

    beyond_noise: the interval excludes 0. With fewer than 2 seeds on a side there is no interval: ci95 None,
    beyond_noise False. Equal values on both sides (s2 = 0): the interval is [d, d]."""
    a, b = np.asarray(a_values, dtype=float), np.asarray(b_values, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("compare needs at least one value on each side")
    d = float(a.mean() - b.mean())
    out = {"diff": d, "n_a": int(a.size), "n_b": int(b.size), "df": math.nan, "ci95": None, "beyond_noise": False}
    if a.size < 2 or b.size < 2:
        return out
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    s2 = float(va + vb)
    if s2 == 0:
        return {**out, "ci95": [d, d], "beyond_noise": d != 0}
    df = s2 ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    half = t_quantile(df) * math.sqrt(s2)
    return {**out, "df": float(df), "ci95": [d - half, d + half], "beyond_noise": bool(d - half > 0 or d + half < 0)}


# added to both rates of a ratio: a rate of 0 stays finite; below the resolution of ~500 trajectories
RATE_PSEUDO = 0.005


def paired_log_ratio(a_values: Sequence[float], b_values: Sequence[float], pseudo: float = RATE_PSEUDO) -> dict:
    """A paired comparison of two rates (a_i, b_i from the same seed: the same SFT model, data order and sampling
    seed) on the scale they differ on, their ratio:

        r_i = ln((a_i + pseudo) / (b_i + pseudo)),   mean(r) +- t_0.975(n-1) sd(r) / sqrt(n)
        ratio = exp(mean(r)),  ci95 = exp(interval)

    `lower`: the whole interval below 1 (a lower than b beyond the seeds' noise); `higher` likewise above. Pairing
    removes what the two arms share (the seed's draw); the log scale makes a seed whose rates are both high weigh as
    much as one whose rates are both low, where a difference of rates spreads with their level. Needs 2+ pairs."""
    a, b = np.asarray(a_values, dtype=float), np.asarray(b_values, dtype=float)
    if a.size != b.size:
        raise ValueError(f"paired_log_ratio needs one b per a, got {a.size} and {b.size}")
    out = {"ratio": math.nan, "ci95": None, "n": int(a.size), "lower": False, "higher": False}
    if a.size < 2:
        return out
    r = np.log((a + pseudo) / (b + pseudo))  # (n,)
    s = seed_summary(r)
    lo, hi = (math.exp(x) for x in s["ci95"])
    return {**out, "ratio": math.exp(s["mean"]), "ci95": [lo, hi], "lower": hi < 1, "higher": lo > 1}


def curve_band(runs: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float, float, int]]:
    """Per-step curves of several runs (seeds) as one: (step, mean, min, max, n) at every step some run logged,
    over the runs that logged it (a run that ended its stage early has no point there)."""
    by_step: dict[int, list[float]] = {}
    for pts in runs:
        for s, v in pts:
            by_step.setdefault(int(s), []).append(float(v))
    return [(s, float(np.mean(v)), float(np.min(v)), float(np.max(v)), len(v)) for s, v in sorted(by_step.items())]
