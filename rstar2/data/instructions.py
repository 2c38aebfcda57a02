"""Instruction sentences that public problem sets put around the problem in the user turn (verl's preprocessing,
DAPO, Qwen-math / DeepSeek prompts). Our chat template carries its own instruction, so an imported problem keeps only
the problem: each phrasing is stripped where it stands as a whole sentence or paragraph at the start or the end of
the text (case-insensitive, any whitespace), repeatedly, and every strip is counted for the import report."""

from __future__ import annotations

import re

DAPO_HEAD = "Solve the following math problem step by step."  # also how `formats.detect` tells DAPO's files apart

# The one list of known phrasings, each as written by the dataset or recipe it comes from.
INSTRUCTIONS = (
    "Let's think step by step and output the final answer within \\boxed{}.",  # verl examples/data_preprocess/math
    "Let's think step by step and output the final answer after \"####\".",  # verl examples/data_preprocess/gsm8k
    "Please output the final answer within \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",  # Qwen2.5-Math, DeepSeek-R1
    "Put your final answer within \\boxed{}.",
    DAPO_HEAD,  # DAPO-Math-17k's head paragraph, first sentence ...
    "The last line of your response should be of the form Answer: $Answer (without quotes) where $Answer is the "
    "answer to the problem.",  # ... and second sentence
    "Remember to put your answer on its own line after \"Answer:\".",  # DAPO-Math-17k's tail paragraph
    "Answer: $Answer",  # the answer-line template itself, when a prompt spells it out on a line of its own
)


def _pattern(phrase: str) -> str:
    """The phrasing as a regex body: its words escaped, any whitespace run between them."""
    return r"\s+".join(re.escape(w) for w in phrase.split())


_HEADS = [(p, re.compile(r"\s*" + _pattern(p) + r"(?=\s|$)", re.IGNORECASE)) for p in INSTRUCTIONS]
_TAILS = [(p, re.compile(r"(?:^|(?<=\s))" + _pattern(p) + r"\s*$", re.IGNORECASE)) for p in INSTRUCTIONS]
_MID_SENTENCE = re.compile(r"[\w,]\s*$")  # text before a phrasing that ends inside a sentence: not a whole sentence


def _ends_a_sentence(before: str) -> bool:
    """Whether a phrasing after `before` starts a sentence or paragraph of its own (not `... and put your ...`)."""
    gap = before[len(before.rstrip()):]
    return not before.strip() or "\n" in gap or not _MID_SENTENCE.search(before)


def strip(text: str) -> tuple[str, list[str]]:
    """`text` without the known instruction phrasings at its start and end, and the phrasings stripped (in order)."""
    stripped: list[str] = []
    changed = True
    while changed:
        changed = False
        for phrase, head in _HEADS:
            if m := head.match(text):
                text, changed = text[m.end():], True
                stripped.append(phrase)
        for phrase, tail in _TAILS:
            if (m := tail.search(text)) and _ends_a_sentence(text[:m.start()]):
                text, changed = text[:m.start()], True
                stripped.append(phrase)
    return text.strip(), stripped
