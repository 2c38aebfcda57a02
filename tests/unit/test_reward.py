"""Outcome reward (paper Eq. 3): answer extraction, Math-Verify equivalence, and the Verifier that runs the check in
the sandbox service under its own timeout."""

import time

import pytest

from rstar2.reward import VERIFY_CODE, Verifier, extract_answer, verify_one


def resp(answer_block: str, reasoning: str = "work") -> str:
    return f"{reasoning}</reason>\n<answer>{answer_block}</answer><|im_end|>"


def test_extract_answer_cases():
    assert extract_answer(resp("The answer is \\boxed{42}.")) == "42"
    assert extract_answer("\\boxed{42} </reason> <answer>42</answer>") is None  # boxed outside <answer>
    assert extract_answer(resp("\\boxed{1}, no: \\boxed{2}")) == "2"  # last boxed
    assert extract_answer(resp("\\boxed{\\frac{1}{2}}")) == "\\frac{1}{2}"  # nested braces
    assert extract_answer("<reason>\\boxed{5}</reason>") is None  # no answer tag
    assert extract_answer("<answer>\\boxed{5}") is None  # answer block never closed
    assert extract_answer(resp("\\boxed{1}") + "<reason>\\boxed{9}</reason><answer>\\boxed{7}</answer>") == "7"


@pytest.mark.parametrize("pred,gold,expected", [
    ("42", "42", 1.0),
    ("41", "42", 0.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("1,000", "1000", 1.0),
    ("2\\sqrt{2}", "\\sqrt{8}", 1.0),
    (None, "42", 0.0),
    ("", "42", 0.0),
])
def test_verify_one(pred, gold, expected):
    assert verify_one(pred, gold, timeout_s=2) == expected


def test_verify_one_refuses_worker_threads():
    import threading
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, verify_one, "1", "1", 1)))
    t.start()
    t.join()
    assert errors


HANG_ON_MARKER = VERIFY_CODE.replace("\nitems = json.loads", """
_verify = verify_one
def verify_one(pred, gold, timeout_s):
    while pred == "HANG":  # as a C-level computation that ignores SIGALRM would
        pass
    return _verify(pred, gold, timeout_s)
items = json.loads""")


def test_verifier_batch_in_order_with_truncation(service):
    v = Verifier(service, timeout_s=5.0)
    responses = [resp("\\boxed{4}"), resp("\\boxed{5}"), resp("\\boxed{\\frac{1}{2}}"), resp("\\boxed{4}"),
                 "\\boxed{4} but no answer block"]
    golds = ["4", "4", "0.5", "4", "4"]
    truncated = [False, False, False, True, False]
    assert v.score(responses, golds, truncated) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert v.last_statuses == {"ok": 3}  # the truncated and the answerless ones never reach the sandbox
    assert Verifier(service, timeout_s=5.0, chunk=2).score(responses, golds, truncated) == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_verifier_survives_pathological_input(service):
    v = Verifier(service, timeout_s=2.5, code=HANG_ON_MARKER)  # margin for a niced run on a loaded machine
    v.score([resp("\\boxed{1}")], ["1"], [False])  # warm executor: the timing below is the items' own
    t0 = time.monotonic()
    scores = v.score([resp("\\boxed{3}"), resp("\\boxed{HANG}"), resp("\\boxed{9^{9^{9^{9}}}}"),
                      resp("\\boxed{7}")], ["3", "3", "5", "7"], [False] * 4)
    assert scores == [1.0, 0.0, 0.0, 1.0]  # the chunk timed out; redone one by one, only HANG is lost
    assert v.last_statuses["timeout"] >= 1 and v.last_statuses["ok"] >= 2 and time.monotonic() - t0 < 20
    assert v.score([resp("\\boxed{2}")], ["2"], [False]) == [1.0]  # the service keeps answering
