"""Decontamination: a training problem is dropped when it shares a word n-gram with an evaluation problem (the
n-gram overlap test of GPT-3's and the paper's decontamination), or when a whole evaluation problem shorter than n
words, but of at least MIN_CONTAINED_WORDS (see there why), occurs inside it as a contiguous word sequence (an eval
problem followed by an instruction sentence, or introduced by a phrase, has no n-gram to share); a shorter one only
when the training problem is that problem. Words are those of the normalised text (`dedup.key`: case and
punctuation dropped, so LaTeX keeps its command names and numbers: `Compute $\\dbinom{31}{28}$.` is the four words
`compute dbinom 31 28`)."""

from __future__ import annotations

from collections import Counter

from rstar2.data.dedup import key

# An evaluation problem of fewer words than this is contaminating only when a training problem equals it whole.
# One to three normalised words are mostly a verb and an expression (`evaluate i 11` for `Evaluate $i^{11}$.`), and
# such a sequence opens other, different problems too (`Evaluate $i^{11} + i^{111}$.`): containment would drop them.
# From four words on (short MATH-500 problems such as `Compute $\dbinom{31}{28}$.`, `compute dbinom 31 28`) the
# sequence names the expression and its arguments: finding it inside a training problem means the problem is there.
MIN_CONTAINED_WORDS = 4


def words(text: str) -> tuple[str, ...]:
    return tuple(key(text).split())


class Index:
    """The evaluation problems, for `hit`: the word n-grams of those of n words or more; the word sequences of the
    shorter ones, each filed under its rarest word among the suite problems (an anchor like `dbinom` or `242`, not
    `find` or `the`), so a training text is scanned once and a word is compared with the few sequences it anchors;
    and the whole texts of those under MIN_CONTAINED_WORDS words."""

    def __init__(self, problems: dict[str, str], n: int, min_words: int = MIN_CONTAINED_WORDS):
        self.n = n
        self.ngrams: dict[tuple[str, ...], str] = {}
        self.anchored: dict[str, list[tuple[int, tuple[str, ...], str]]] = {}  # word -> (its index, sequence, id)
        self.whole: dict[tuple[str, ...], str] = {}
        short = []
        for pid, text in problems.items():
            w = words(text)
            if len(w) >= n:
                for i in range(len(w) - n + 1):
                    self.ngrams.setdefault(w[i:i + n], pid)
            elif len(w) >= min_words:
                short.append((w, pid))
            elif w:
                self.whole.setdefault(w, pid)
        spread = Counter(x for w, _ in short for x in set(w))  # in how many short suite problems each word occurs
        for w, pid in short:
            at = min(range(len(w)), key=lambda i, w=w: (spread[w[i]], i))  # the rarest word, the first of equals
            self.anchored.setdefault(w[at], []).append((at, w, pid))

    def hit(self, text: str) -> tuple[str, str] | None:
        """How `text` matches an evaluation problem and that problem's id: ("equals", id) for a whole short problem,
        ("contains", id) for a short problem inside it, ("overlaps", id) for a shared n-gram; None when clean. A text
        with no anchor word and no shared n-gram is settled by two set tests run in C (`isdisjoint`)."""
        w = words(text)
        if w in self.whole:
            return "equals", self.whole[w]
        if not self.anchored.keys().isdisjoint(w):
            for i, x in enumerate(w):
                for at, seq, pid in self.anchored.get(x, ()):
                    if i >= at and w[i - at:i - at + len(seq)] == seq:
                        return "contains", pid
        if len(w) >= self.n and not self.ngrams.keys().isdisjoint(zip(*(w[k:] for k in range(self.n)))):
            for i in range(len(w) - self.n + 1):
                if (pid := self.ngrams.get(w[i:i + self.n])) is not None:
                    return "overlaps", pid
        return None
