import random

import polars as pl
import pytest

from rstar2 import reward
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.tool_parser import parse_tool_calls
from rstar2.training import roc
from rstar2.world import problems, sft_data
from rstar2.world.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

TINY = ChatFormat.from_template(CHAT_TEMPLATE, SPECIAL_TOKENS, "the tiny world's template")


def transcript(*args, **kw) -> list[tuple[str, bool]]:
    """A transcript as SFT sees it: the world's template renders its messages into (text, trainable) segments."""
    return TINY.segments(sft_data.transcript(*args, **kw))


def _modes(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame([{"problem_id": r["problem_id"], "mode": r["mode"]} for r in rows])


def _assistant(segs):
    return "".join(t for t, train in segs if train)


@pytest.fixture(scope="module")
def prob():
    return problems.generate(3, {"test": 6})["test"].row(0, named=True)


def test_clean_transcript_is_correct_and_well_formed(prob):
    segs = transcript(prob["prompt"], prob["answer"], prob["solution_code"], "clean", random.Random(0))
    assert segs[0] == (TINY.prompt(prob["prompt"]), False) and segs[1][1] and not segs[2][1]
    first_turn = segs[1][0]
    call = parse_tool_calls(first_turn, TINY.tool_call_open, TINY.tool_call_close).calls[0]
    assert call.arguments["code"] == prob["solution_code"]
    final = segs[-1][0]
    assert reward.extract_answer(final) == prob["answer"]
    assert roc.count_answer_blocks(_assistant(segs)) == (1, False)


def test_noise_modes(prob):
    r = random.Random(0)
    no_tool = transcript(prob["prompt"], prob["answer"], prob["solution_code"], "no_tool", r)
    assert len(no_tool) == 2 and "<tool_call>" not in no_tool[1][0]
    buggy = transcript(prob["prompt"], prob["answer"], prob["solution_code"], "buggy_fix", r)
    assert "Tool call failure" in buggy[2][0] and [t for _, t in buggy] == [False, True, False, True, False, True]
    slips = {transcript(prob["prompt"], prob["answer"], prob["solution_code"], "format_slip",
                        random.Random(s))[-1][0] for s in range(30)}
    extracted = {reward.extract_answer(s) for s in slips}
    assert None in extracted and prob["answer"] in extracted  # some slips lose the reward, "twice" keeps it


def test_recover_transcripts_fail_then_fix_through_the_real_sandbox(service):
    """Every problem kind's recover transcript: its first call fails in the real sandbox (status error) and the
    tool reply SFT shows is the one the rollout makes of that result (same cap), the reflection names the mistake,
    and the second call is the solution, which succeeds and prints the answer."""
    from rstar2.rollout.tool_parser import format_tool_response
    from rstar2.sandbox import ExecRequest

    cap = 256  # rollout.tool_response_chars of the tiny presets
    probs = problems.generate(1, {"test": 2 * len(problems.KINDS)})["test"]
    assert set(probs["source"]) == set(problems.KINDS)
    for p in probs.iter_rows(named=True):
        msgs = sft_data.transcript(p["prompt"], p["answer"], p["solution_code"], "recover", random.Random(0),
                                   tool_chars=cap)
        calls = [m["tool_calls"][0]["function"]["arguments"]["code"] for m in msgs if m.get("tool_calls")]
        replies = [m["content"] for m in msgs if m["role"] == "tool"]
        assert calls[1] == p["solution_code"] and calls[0] == calls[1].replace("print(", "prnt(", 1)
        results = [service.run(ExecRequest(c)) for c in calls]
        assert [r.status for r in results] == ["error", "ok"] and results[1].stdout == p["answer"] + "\n"
        assert replies[0] == format_tool_response(results[0], cap), p["source"]
        assert replies[0].endswith("NameError: name 'prnt' is not defined\n")
        reflection = [m["content"] for m in msgs if m["role"] == "assistant"][1]
        assert reflection.startswith("\nThe code failed: prnt is not defined.")
        assert reward.extract_answer(msgs[-1]["content"]) == p["answer"]
        assert [roc.p_err([r.status for r in results]), roc.count_answer_blocks(msgs[-1]["content"])] == \
            [0.5, (1, False)]


def test_mix_is_respected_and_validated():
    probs = problems.generate(0, {"sft": 400})["sft"]
    df = _modes(sft_data.build(probs, {"clean": 3, "no_tool": 1}, seed=0))
    share = (df["mode"] == "clean").mean()
    assert 0.65 < share < 0.85 and set(df["mode"]) == {"clean", "no_tool"}
    with pytest.raises(ValueError, match="SFT mix"):
        sft_data.build(probs, {"telepathy": 1.0}, seed=0)


def test_mix_by_kind_overrides_the_default_for_that_kind_only():
    probs = problems.generate(0, {"sft": 600})["sft"]
    df = _modes(sft_data.build(probs, {"clean": 1.0}, seed=0, mix_by_kind={"mod": {"no_tool": 1.0}}))
    df = df.join(probs.select("problem_id", "source"), on="problem_id")
    assert set(df.filter(pl.col("source") == "mod")["mode"]) == {"no_tool"}
    assert set(df.filter(pl.col("source") != "mod")["mode"]) == {"clean"}
    with pytest.raises(ValueError, match="SFT mix"):
        sft_data.build(probs, {"clean": 1.0}, seed=0, mix_by_kind={"mod": {"no_tool": 0.0}})


def test_every_mode_restates_the_problems_numbers_before_choosing_the_tool():
    prompt, code = "What is the product of 47 and 83?", "print(47 * 83)"
    for mode in sft_data.MODES:
        first_turn = transcript(prompt, "3901", code, mode, random.Random(0))[1][0]
        assert first_turn.startswith("\nThe numbers are 47, 83. I ")
    one = transcript("How many positive divisors does 7190 have?", "8", "n = 7190", "clean", random.Random(0))
    assert one[1][0].startswith("\nThe number is 7190. I will compute this with Python.")


def test_the_tiny_worlds_sft_numerics_did_not_change(tmp_path):
    """The world's transcripts as chat messages, rendered by its template into the tokenizer's corpus and into SFT's
    token ids, masks and batches: the same as when the format was hard-coded (golden values from that code, on
    this world: 24 transcripts of every mode, half with the system prompt)."""
    import json
    import zlib

    from rstar2.core import config
    from rstar2.training import sft, transcripts
    from rstar2.training.batching import token_budget_batches
    from rstar2.world import build

    cfg = config.load("tiny", ["seed=5", "world.n_sft=24", "world.n_train=4", "world.n_val=2", "world.n_test=2",
                               "world.vocab_size=600", "world.hidden=32", "world.layers=1", "world.heads=2",
                               "world.kv_heads=1", "world.ffn=64", "sft.system_prompt_frac=0.5",
                               "sft.mix={clean: 1, buggy_fix: 1, no_tool: 1, format_slip: 1}"])
    uris = build.build(cfg, tmp_path / "world")
    ids, masks = sft.tokenize(ChatFormat.load(uris["init_model"]), transcripts.read(uris["sft_data"]))
    batches = token_budget_batches([len(x) for x in ids], cfg.sft.batch_tokens, random.Random(cfg.seed))
    crc = lambda x: zlib.crc32(json.dumps(x).encode())  # noqa: E731
    assert (len(ids), sum(map(len, ids)), sum(map(sum, masks))) == (24, 7932, 1761)
    assert (crc(ids), crc(masks)) == (25071860, 1252357514)
    assert batches == [[18, 15], [11, 20, 13], [9, 17, 16, 23], [2, 0, 4, 6, 14, 12, 1, 3], [5, 10], [7, 21, 22],
                       [19, 8]]
