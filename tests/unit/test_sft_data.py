import random

import polars as pl
import pytest

from rstar2 import reward, roc, template as T
from rstar2.tool_parser import parse_tool_calls
from rstar2.world import problems, sft_data


def _assistant(segs):
    return "".join(t for t, train in segs if train)


@pytest.fixture(scope="module")
def prob():
    return problems.generate(3, {"test": 6})["test"].row(0, named=True)


def test_clean_transcript_is_correct_and_well_formed(prob):
    segs = sft_data.transcript(prob["prompt"], prob["answer"], prob["solution_code"], "clean", random.Random(0))
    assert segs[0] == (T.build_prompt(prob["prompt"]), False) and segs[1][1] and not segs[2][1]
    first_turn = segs[1][0]
    call = parse_tool_calls(first_turn).calls[0]
    assert call.arguments["code"] == prob["solution_code"]
    final = segs[-1][0]
    assert reward.extract_answer(final) == prob["answer"]
    assert roc.count_answer_blocks(_assistant(segs)) == (1, False)


def test_noise_modes(prob):
    r = random.Random(0)
    no_tool = sft_data.transcript(prob["prompt"], prob["answer"], prob["solution_code"], "no_tool", r)
    assert len(no_tool) == 2 and T.TOOL_CALL_OPEN not in no_tool[1][0]
    buggy = sft_data.transcript(prob["prompt"], prob["answer"], prob["solution_code"], "buggy_fix", r)
    assert "Tool call failure" in buggy[2][0] and [t for _, t in buggy] == [False, True, False, True, False, True]
    slips = {sft_data.transcript(prob["prompt"], prob["answer"], prob["solution_code"], "format_slip",
                                 random.Random(s))[-1][0] for s in range(30)}
    extracted = {reward.extract_answer(s) for s in slips}
    assert None in extracted and prob["answer"] in extracted  # some slips lose the reward, "twice" keeps it


def test_mix_is_respected_and_validated():
    probs = problems.generate(0, {"sft": 400})["sft"]
    df = sft_data.build(probs, {"clean": 3, "no_tool": 1}, seed=0)
    share = (df["mode"] == "clean").mean()
    assert 0.65 < share < 0.85 and set(df["mode"]) == {"clean", "no_tool"}
    with pytest.raises(ValueError, match="SFT mix"):
        sft_data.build(probs, {"telepathy": 1.0}, seed=0)


def test_mix_by_kind_overrides_the_default_for_that_kind_only():
    probs = problems.generate(0, {"sft": 600})["sft"]
    df = sft_data.build(probs, {"clean": 1.0}, seed=0, mix_by_kind={"mod": {"no_tool": 1.0}})
    df = df.join(probs.select("problem_id", "source"), on="problem_id")
    assert set(df.filter(pl.col("source") == "mod")["mode"]) == {"no_tool"}
    assert set(df.filter(pl.col("source") != "mod")["mode"]) == {"clean"}
    with pytest.raises(ValueError, match="SFT mix"):
        sft_data.build(probs, {"clean": 1.0}, seed=0, mix_by_kind={"mod": {"no_tool": 0.0}})


def test_every_mode_restates_the_problems_numbers_before_choosing_the_tool():
    prompt, code = "What is the product of 47 and 83?", "print(47 * 83)"
    for mode in sft_data.MODES:
        first_turn = sft_data.transcript(prompt, "3901", code, mode, random.Random(0))[1][0]
        assert first_turn.startswith("\nThe numbers are 47, 83. I ")
    one = sft_data.transcript("How many positive divisors does 7190 have?", "8", "n = 7190", "clean", random.Random(0))
    assert one[1][0].startswith("\nThe number is 7190. I will compute this with Python.")
