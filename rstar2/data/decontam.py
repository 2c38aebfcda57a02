"""Decontamination: a training problem that shares a word n-gram with any evaluation problem is dropped (the n-gram
overlap test of GPT-3's and the paper's decontamination; a problem shorter than n words must match a whole suite
problem's text)."""

from __future__ import annotations

from rstar2.data.dedup import key, shingles


class Index:
    """The word n-grams of the evaluation problems, for `hit`."""

    def __init__(self, problems: dict[str, str], n: int):
        self.n, self.owner = n, {}
        for pid, text in problems.items():
            for g in shingles(text, n):
                self.owner.setdefault(g, pid)

    def hit(self, text: str) -> str | None:
        """The id of an evaluation problem `text` overlaps, or None. A text shorter than n words counts only when it
        equals a whole short evaluation problem (its one shingle is that text)."""
        if len(key(text).split()) < self.n:
            return self.owner.get(key(text))
        return next((self.owner[g] for g in shingles(text, self.n) if g in self.owner), None)
