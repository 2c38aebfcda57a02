"""Exact and near-duplicate problems. Exact: the same text after normalisation (case, whitespace, punctuation).
Near: word-shingle Jaccard similarity at or above a threshold, found with MinHash + LSH banding (candidate pairs
only, so 17K problems take seconds, not the 150M comparisons of all pairs) and confirmed on the exact shingle sets."""

from __future__ import annotations

import re
import zlib

import numpy as np

_PRIME = (1 << 61) - 1


def key(text: str) -> str:
    """Normalised text for exact matching: lowercase, punctuation dropped, whitespace runs as one space."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def shingles(text: str, n: int) -> set[str]:
    """The word n-grams of the normalised text (the whole text when it is shorter than n words)."""
    words = key(text).split()
    return {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _signatures(sets: list[set[str]], num_perm: int, seed: int) -> np.ndarray:
    """MinHash signatures (len(sets), num_perm): min over a set's items of (a*h + b) mod p per permutation."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 29, num_perm, dtype=np.uint64)  # h < 2^32, so a*h + b < 2^62: no uint64 overflow
    b = rng.integers(0, _PRIME, num_perm, dtype=np.uint64)
    sig = np.empty((len(sets), num_perm), dtype=np.uint64)
    for i, s in enumerate(sets):
        h = np.array([zlib.crc32(x.encode()) for x in s], dtype=np.uint64)[:, None]  # (items, 1), < 2^32
        sig[i] = ((h * a + b) % np.uint64(_PRIME)).min(axis=0)
    return sig


def near_duplicates(texts: list[str], threshold: float, n: int = 3, num_perm: int = 64, bands: int = 16,
                    seed: int = 0) -> dict[int, int]:
    """Index -> the earlier index it nearly duplicates (word n-gram Jaccard >= threshold); the first of each group is
    kept. LSH: a pair is compared when its signatures agree on one band of num_perm/bands rows."""
    sets = [shingles(t, n) for t in texts]
    if not sets:
        return {}
    sig = _signatures(sets, num_perm, seed)
    rows = num_perm // bands
    dup: dict[int, int] = {}
    buckets: dict[tuple[int, bytes], list[int]] = {}
    for i in range(len(sets)):
        cands = {j for band in range(bands)
                 for j in buckets.setdefault((band, sig[i, band * rows:(band + 1) * rows].tobytes()), [])}
        match = min((j for j in cands if jaccard(sets[i], sets[j]) >= threshold), default=None)
        if match is not None:
            dup[i] = match
            continue  # a duplicate is not a bucket member: later rows match the kept one
        for band in range(bands):
            buckets[(band, sig[i, band * rows:(band + 1) * rows].tobytes())].append(i)
    return dup
