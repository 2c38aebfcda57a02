"""kv_aware's length model: how much KV a running trajectory is expected to hold as it goes on (paper §3.2's
load-balanced scheduler), learned from the trajectories of previous batches."""

from __future__ import annotations

from collections import deque

import numpy as np


class LengthEstimator:
    """How much KV a running trajectory is expected to hold as it goes on, from recently finished ones.

    A trajectory at response length l after k turns holds l + h tokens after h more of its tokens if it is still
    running then, and nothing once it has ended (its KV is freed). Its expected footprint over the next h tokens:
        G(h) = (l + h) * P(L > l + h | L > l, more than k turns)
    over the reference window of finished trajectories (final response length L, turns). Running trajectories
    advance one token per engine step together, so the sum of an engine's G is its expected KV h steps ahead with
    no new admission, and the peak of that sum is what kv_aware admits against: with heavy-tailed lengths most
    trajectories end before the long ones peak, so this admits far more than reserving final (or maximum) lengths,
    and it still sees the long ones coming. Sparse data: drop the turn condition, then fall back to a prior (a
    share of the budget). Vectors are on a grid of h (`grid(scale)`).

    `commit()` moves the trajectories finished in the batch just done into the reference window: estimates use
    whole batches only, because within a batch the first to finish are the short ones (a biased sample)."""

    POINTS = 49

    def __init__(self, window: int = 4096, prior_frac: float = 0.5, min_samples: int = 16):
        self.window, self.prior_frac, self.min_samples = window, prior_frac, min_samples
        self._ref: deque[tuple[int, int]] = deque(maxlen=window)
        self._batch: list[tuple[int, int]] = []
        self._tables: dict | None = None

    def observe(self, final_len: int, turns: int) -> None:
        self._batch.append((final_len, turns))

    def commit(self) -> None:
        if self._batch:
            self._ref.extend(self._batch)
            self._batch = []
            self._tables = None

    @property
    def samples(self) -> int:
        return len(self._ref)

    def grid(self, scale: float) -> np.ndarray:
        """The h grid (tokens ahead) for budgets up to `scale`."""
        return np.linspace(0.0, float(scale), self.POINTS)

    def footprint(self, length: int, turns: int, budget: int, h: np.ndarray, offset: int = 0,
                  block: int = 1) -> np.ndarray:
        """Response KV tokens held after h[j] more tokens, j over the grid: mean and variance, shape [2, POINTS]
        (held or not is a Bernoulli draw with the survival probability)."""
        tables = self._sorted()
        for k in (turns, None):
            lens = tables.get(k)  # sorted final lengths of the finished ones with more than k turns (or all)
            if lens is None:
                continue
            alive_now = len(lens) - np.searchsorted(lens, length, side="right")
            if alive_now >= self.min_samples:
                alive = (len(lens) - np.searchsorted(lens, length + h, side="right")) / alive_now  # [POINTS]
                break
        else:  # prior: ends after the expected remaining length
            rem = max(self.prior_frac * budget - length, 0.5 * (budget - length), 1.0)
            alive = (h < rem).astype(float)
        kv = offset + np.minimum(length + h, budget)
        if block > 1:  # KV is allocated in whole blocks
            kv = np.ceil(kv / block) * block
        return np.stack([kv * alive, kv ** 2 * alive * (1 - alive)])  # [2, POINTS]: mean, variance

    def _sorted(self) -> dict:
        """turns k (or None: any) -> sorted final lengths of the reference trajectories with more than k turns."""
        if self._tables is None:
            lens = np.array([x[0] for x in self._ref], dtype=float)
            turns = np.array([x[1] for x in self._ref], dtype=int)
            self._tables = {k: np.sort(lens if k is None else lens[turns > k])
                            for k in [None, *range(int(turns.max()) if len(turns) else 0)]}
        return self._tables
