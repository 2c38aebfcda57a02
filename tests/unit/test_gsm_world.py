"""The word-problem world (rstar2.world.gsm) from reasoning-gym's gsm_symbolic templates: a worked solution's lines
read as arithmetic (reference values worked by hand on lines in the templates' own styles), a solution as Python
that prints its answer, and splits whose `test` templates are never trained on."""

import pytest

from rstar2.data import clean
from rstar2.world import gsm, sft_data

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("line, expected", [
    ("   • He has 3 times as many kiwi, so 35 × 3 = 105 kiwi", ("35 * 3", 105.0)),
    ("So James responds to 160-48=112 emails per day", ("160-48", 112.0)),
    ("he earns $40/day * 35 days/month = $1400/month", ("40 * 35", 1400.0)),
    ("The brokerage fee is $410,000 x 7/100 = $28,700.", ("410000 * 7/100", 28700.0)),
    ("they need to collect 105 - 51 signatures. 105 - 51 = 54 signatures", ("105 - 51", 54.0)),
    ("First find the total: (12 + 3)(2) = 30 cookies", ("(12 + 3) * (2)", 30.0)),
    ("the chance is 50% * 50% = 25%", None),  # read as 0.25, not its stated 25: left out
    ("James receives 48=48 emails that don't require a response", None),  # no computation
    ("Thus, W = 2 episodes.", None),
    ("We know that y = x + 50, and y + x = 154.", None),
])
def test_a_worked_line_as_arithmetic(line, expected):
    assert gsm.step_expression(line) == expected


def test_a_solution_as_python_reads_earlier_steps_from_their_variables():
    question = "Sophia sliced an apple into 33 pieces. She ate 3 slice, her cousin ate 5 more than her."
    cot = ("Her cousin ate 3 + 5 = 8 slices\nTogether with her friend they ate 8 + 10 = 18\n"
           "In all 3 + 8 + 18 = 29 slices\n#### 29")
    code = gsm.solution_code(question, cot, "29")
    # 8 and 18 were computed, so they are read from x1 and x2; 3 and 10 are numbers as written
    assert code == "x1 = 3 + 5\nx2 = x1 + 10\nx3 = 3 + x1 + x2\nprint(round(x3))"
    assert gsm.run(code) == "29"
    assert gsm.solution_code(question, cot, "30") is None  # steps that do not reach the answer: no solution
    assert gsm.solution_code(question, "Sophia ate them all.\n#### 29", "29") is None


def test_splits_hold_out_whole_templates():
    sizes = {"sft": 40, "train": 60, "val": 20, "test": 30}
    splits = gsm.generate(0, sizes, held_out=0.2)
    trained, held = gsm.split_templates(0, 0.2)
    assert len(held) == 17 and len(trained) == 68 and not set(held) & set(trained)
    assert {k: v.height for k, v in splits.items()} == sizes
    of = {k: {int(s.split("/")[1]) for s in v["source"]} for k, v in splits.items()}
    assert of["test"] <= set(held) and all(of[k] <= set(trained) for k in ("sft", "train", "val"))
    prompts = [p for v in splits.values() for p in v["prompt"]]
    assert len(set(prompts)) == len(prompts)  # disjoint by prompt text
    assert all(clean.is_integer(a) for v in splits.values() for a in v["answer"])
    for row in splits["sft"].iter_rows(named=True):  # every SFT problem's code prints its answer
        assert gsm.run(row["solution_code"]) == row["answer"]
    again = gsm.generate(0, sizes, held_out=0.2)
    assert all(again[k].equals(splits[k]) for k in sizes)  # a function of the seed
    assert gsm.split_templates(1, 0.2)[1] != held


def test_transcripts_open_their_reasoning_where_the_template_does_not():
    import random

    msgs = sft_data.transcript("What is 2 + 3?", "5", "print(2 + 3)", "clean", random.Random(0), opens_reason=False)
    said = [m for m in msgs if m["role"] == "assistant"]
    assert all(m["content"].startswith("<reason>\n") for m in said)
    assert said[0]["content"].endswith("</reason>") and said[0]["tool_calls"]  # the template puts the call after it
    assert said[1]["content"].endswith("\\boxed{5}.\n</answer>")
