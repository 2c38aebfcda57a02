"""`rstar2 data import` on the layouts users have, through the CLI with exact counts worked by hand: GSM8K's worked
answers, verl's chat prompts with the instruction sentence in the problem's paragraph, DAPO-Math-17k, MATH solutions,
plain tables, JSONL with a byte-order mark or CRLF line ends, Parquet; the instruction phrasings stripped and counted;
an import that keeps nothing; decontamination that finds a short MATH-500 problem inside a training prompt; the same
layouts read as world.train_data. Every report satisfies rows_in == rows_out + sum(dropped)."""

import json
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from rstar2.core import config
from rstar2.data import decontam, formats, importer
from rstar2.world import build

VERL_MATH = "Let's think step by step and output the final answer within \\boxed{}."
PLEASE = "Please output the final answer within \\boxed{}."
QWEN = "Please reason step by step, and put your final answer within \\boxed{}."
PUT = "Put your final answer within \\boxed{}."
DAPO_1ST = "Solve the following math problem step by step."
DAPO_2ND = ("The last line of your response should be of the form Answer: $Answer (without quotes) where $Answer is "
            "the answer to the problem.")
DAPO_HEAD = f"{DAPO_1ST} {DAPO_2ND}"
DAPO_TAIL = 'Remember to put your answer on its own line after "Answer:".'
NATALIA = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One out_dir (one MLflow store) for every import of this module: its schema is made once."""
    return tmp_path_factory.mktemp("runs")


def _jsonl(path: Path, rows: list[dict], newline: str = "\n", bom: bool = False) -> Path:
    path.write_bytes(((("\ufeff" if bom else "") + newline.join(json.dumps(r) for r in rows) + newline)).encode())
    return path


def _verl(i, user: str, truth: str, source: str = "openai/gsm8k") -> dict:
    return {"data_source": source, "prompt": [{"role": "system", "content": "You are a helpful assistant."},
                                              {"role": "user", "content": user}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i}}


def _import(runs: Path, src: Path, *args: str, code: int = 0, suites: str | None = None) -> tuple[str, dict]:
    """`rstar2 data import src` (out: next to src); its output and its --json report, checked for the exit code, no
    traceback, and the invariant that every row read is written or counted under one reason."""
    from rstar2.cli.main import app

    report = src.with_suffix(".report.json")
    sets = [f"out_dir={runs}"] + ([f"eval.suites=[{suites}]"] if suites else [])
    res = CliRunner().invoke(app, ["data", "import", str(src), "--out", str(src.with_suffix(".out.parquet")),
                                   "--json", str(report), *args, *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == code, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    rep = json.loads(report.read_text())
    assert rep["rows_in"] == rep["rows_out"] + sum(rep["dropped"].values())
    return res.output, rep


def _out(src: Path) -> pl.DataFrame:
    return pl.read_parquet(src.with_suffix(".out.parquet"))


def _dropped(rep: dict) -> dict:
    return {k: v for k, v in rep["dropped"].items() if v}


def test_gsm8k_answers_are_what_follows_the_last_marks(tmp_path, runs):
    rows = [{"question": NATALIA, "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
                                            "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
            {"question": "A farm ships 617 crates twice. How many crates is that?", "answer": "617*2=1234\n#### 1,234"},
            {"question": "Tom has 3 apples and buys 2 more. How many now?", "answer": "#### 4 is wrong\n#### 5"},
            {"question": "A rope of 5 m is cut in half. How long is each piece?", "answer": "5/2\n#### 2.5"},
            {"question": "Sam reads 10 pages a day. How many in a week?", "answer": "10*7 = 70 pages"}]  # no ####
    src = _jsonl(tmp_path / "gsm8k.jsonl", rows)
    _, rep = _import(runs, src)
    assert rep["format"] == "gsm8k" and rep["rows_in"] == 5 and rep["rows_out"] == 3
    assert _dropped(rep) == {"unparsable": 1, "non_integer": 1}
    assert rep["examples"]["unparsable"] == ["row 4 (gsm8k-000004): no answer after #### in the answer"]
    out = _out(src)
    assert dict(zip(out["problem_id"], out["answer"])) == {"gsm8k-000000": "72", "gsm8k-000001": "1234",
                                                          "gsm8k-000002": "5"}
    assert out["prompt"][0] == NATALIA and formats.gsm8k_answer("no marks") is None


def test_verl_chat_prompts_lose_the_instruction_sentence_of_their_paragraph(tmp_path, runs):
    rows = [_verl(0, f"Natalia sold 48 clips in April and half as many in May. How many in all? {VERL_MATH}", "72"),
            _verl(1, f"How many sides does a hexagon have?  {PLEASE.upper()}", "6"),  # case and spacing differ
            _verl(2, f"Find the sum of the first ten positive integers.\n{QWEN}", "55", "math"),
            _verl(3, "Compute 3 squared and put your final answer within \\boxed{}.", "9"),  # inside a sentence: kept
            _verl(4, PUT, "1")]  # nothing but the instruction
    src = tmp_path / "verl.parquet"
    pl.DataFrame(rows).write_parquet(src)
    output, rep = _import(runs, src)
    assert rep["format"] == "verl" and rep["rows_in"] == 5 and rep["rows_out"] == 4
    assert _dropped(rep) == {"missing_field": 1}
    assert rep["stripped"] == {VERL_MATH: 1, PLEASE: 1, QWEN: 1, PUT: 1}
    assert "instruction stripped" in output and "Let's think step by step" in output
    out = _out(src)
    assert out["prompt"].to_list() == ["Natalia sold 48 clips in April and half as many in May. How many in all?",
                                       "How many sides does a hexagon have?",
                                       "Find the sum of the first ten positive integers.",
                                       "Compute 3 squared and put your final answer within \\boxed{}."]
    assert out["problem_id"].to_list() == ["0", "1", "2", "3"] and out["source"][2] == "math"


def test_verl_prompts_as_json_strings_in_jsonl(tmp_path, runs):
    rows = [{**r, "prompt": json.dumps(r["prompt"])} for r in
            (_verl(7, f"What is 6 times 7? {VERL_MATH}", "42"), _verl(8, "What is 2 to the 5th power?", "32"))]
    src = _jsonl(tmp_path / "verl.jsonl", rows + [{**rows[0], "prompt": "not a chat list"}])
    _, rep = _import(runs, src)
    assert rep["format"] == "verl" and rep["rows_out"] == 2 and _dropped(rep) == {"unparsable": 1}
    assert rep["stripped"] == {VERL_MATH: 1} and _out(src)["prompt"].to_list() == ["What is 6 times 7?",
                                                                                 "What is 2 to the 5th power?"]


def test_dapo_head_and_tail_paragraphs_and_the_answer_line(tmp_path, runs):
    rows = [_verl(f"d-{i}", user, str(i), "math_dapo") for i, user in (
        (14, f"{DAPO_HEAD}\n\nWhat is 11 plus 3?\n\n{DAPO_TAIL}"),
        (77, f"{DAPO_HEAD}\n\nMultiply 7 by 11.\n\nAnswer: $Answer"))]
    src = _jsonl(tmp_path / "dapo.jsonl", rows)
    _, rep = _import(runs, src)
    assert rep["format"] == "dapo" and rep["rows_out"] == 2 and not _dropped(rep)
    assert rep["stripped"] == {DAPO_1ST: 2, DAPO_2ND: 2, DAPO_TAIL: 1, "Answer: $Answer": 1}
    assert _out(src).select("problem_id", "prompt", "answer").rows() == [("d-14", "What is 11 plus 3?", "14"),
                                                                        ("d-77", "Multiply 7 by 11.", "77")]
    _, as_verl = _import(runs, src, "--format", "verl")  # the same reader under its general name
    assert as_verl["format"] == "verl" and as_verl["stripped"] == rep["stripped"]


def test_math_solutions_and_plain_parquet_tables(tmp_path, runs):
    rows = [{"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$."},
            {"problem": "How many ways can 2 of 5 books be chosen?", "solution": "$\\binom52=\\boxed{10}$."},
            {"problem": "State a fact.", "solution": "Nothing is boxed here."}]
    src = _jsonl(tmp_path / "math.jsonl", rows)
    _, rep = _import(runs, src)
    assert rep["format"] == "solution" and rep["rows_out"] == 1 and _dropped(rep) == {"unparsable": 1,
                                                                                      "non_integer": 1}
    assert _out(src)["answer"].to_list() == ["10"]
    plain = tmp_path / "aime.parquet"
    pl.DataFrame({"ID": ["2024-I-1", "2024-I-2"], "Problem": ["Find the number of divisors of 720.",
                                                              "Find the remainder when 2^10 is divided by 7."],
                  "Answer": [30, 2]}).write_parquet(plain)
    _, rep = _import(runs, plain)
    assert rep["format"] == "plain" and rep["rows_out"] == 2 and not _dropped(rep)
    assert _out(plain).select("problem_id", "answer").rows() == [("2024-I-1", "30"), ("2024-I-2", "2")]


@pytest.mark.parametrize("newline, bom", [("\r\n", False), ("\n", True), ("\r\n", True)])
def test_jsonl_with_a_byte_order_mark_or_crlf_line_ends(tmp_path, runs, newline, bom):
    rows = [{"id": "a", "problem": "What is 12 times 12?", "answer": "144"},
            {"id": "b", "problem": "How many days are in a leap year?", "answer": 366},
            {"id": "c", "problem": "What is half of 9?", "answer": "4.5"}]
    src = _jsonl(tmp_path / "win.jsonl", rows, newline, bom)
    _, rep = _import(runs, src)
    assert rep["rows_in"] == 3 and rep["rows_out"] == 2 and _dropped(rep) == {"non_integer": 1}
    assert _out(src).select("problem_id", "prompt", "answer").rows() == [
        ("a", "What is 12 times 12?", "144"), ("b", "How many days are in a leap year?", "366")]


def test_an_import_that_keeps_nothing_reports_and_exits_1(tmp_path, runs):
    rows = [{"problem": "What is half of 7?", "answer": "3.5"}, {"problem": "Give pi.", "answer": "\\pi"},
            {"problem": "What is 1 + 1?", "answer": ""}]
    src = _jsonl(tmp_path / "none.jsonl", rows)
    output, rep = _import(runs, src, code=1)
    assert rep["rows_in"] == 3 and rep["rows_out"] == 0 and _dropped(rep) == {"missing_field": 1, "non_integer": 2}
    assert "rows out" in output.split("no rows left")[0]  # the report first ...
    lines = [ln for ln in output.splitlines() if "no rows left" in ln]  # ... then one line saying why
    assert len(lines) == 1 and lines[0].startswith("error: no rows left: 3 in, 1 dropped as missing_field, 2 dropped "
                                                   f"as non_integer; {src.with_suffix('.out.parquet')} not written")
    assert not src.with_suffix(".out.parquet").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    output, rep = _import(runs, empty, code=1)
    assert rep["rows_in"] == 0 and f"no rows left: {empty} holds no rows" in output


def test_a_short_math500_problem_inside_a_verl_prompt_is_contaminated(tmp_path, runs):
    math500 = _jsonl(tmp_path / "math500.jsonl", [
        {"problem": "Compute $\\dbinom{31}{28}$.", "answer": "4495",
         "unique_id": "test/counting_and_probability/9.json"},
        {"problem": "Simplify $\\sqrt{242}$.", "answer": "11\\sqrt2", "unique_id": "test/prealgebra/1.json"}])
    rows = [_verl("train-17", f"Compute $\\dbinom{{31}}{{28}}$. {VERL_MATH}", "4495"),  # the problem + instruction
            _verl("train-18", "Here is a counting question. Compute $\\dbinom{31}{28}$ and give it as an integer.",
                  "4495"),  # inside other words: only containment finds it (no 13-gram to share)
            _verl("train-19", "Simplify $\\sqrt{242}$, square the result and add 3.", "245"),  # 3 words: kept
            _verl("train-20", "Simplify $\\sqrt{242}$.", "11\\sqrt2"),  # the 3-word problem itself
            _verl("train-21", "What is the product of 12 and 13?", "156")]
    src = tmp_path / "train.parquet"
    pl.DataFrame(rows).write_parquet(src)
    output, rep = _import(runs, src, "--split", "eval",
                          suites=f"{{name: math500, path: {math500}, answer_type: math}}")
    assert rep["rows_out"] == 2 and _dropped(rep) == {"contaminated": 3}
    assert rep["examples"]["contaminated"] == ["train-17 contains math500/test/counting_and_probability/9.json",
                                               "train-18 contains math500/test/counting_and_probability/9.json",
                                               "train-20 equals math500/test/prealgebra/1.json"]
    assert "train-17 contains math500/test/counting_and_probability/9.json" in output and "1 more" in output
    assert _out(src)["problem_id"].to_list() == ["train-19", "train-21"]


def test_decontamination_rules_by_hand():
    long = " ".join(f"w{k}" for k in range(20))  # a 20-word suite problem: 8 13-grams
    index = decontam.Index({"s/long": long, "s/four": "Compute $\\dbinom{31}{28}$.", "s/three": "Simplify $x$ now."},
                           13)
    assert index.hit("Intro: " + " ".join(f"w{k}" for k in range(5, 18))) == ("overlaps", "s/long")  # w5..w17
    assert index.hit(" ".join(f"w{k}" for k in range(5, 17))) is None  # 12 shared words: no 13-gram
    assert index.hit("so COMPUTE \\dbinom{31}{28} please") == ("contains", "s/four")  # case, punctuation ignored
    assert index.hit("compute dbinom 31 29") is None and index.hit("compute 31 28 dbinom") is None
    assert index.hit("Simplify x now, then double it.") is None and \
        index.hit("simplify: x; now") == ("equals", "s/three")


def test_decontamination_of_20k_rows_against_500_problems_takes_seconds():
    vocab = [f"v{i}" for i in range(2000)] + ["find", "the", "of", "compute", "what", "is"] * 50
    word = lambda i, k: vocab[(i * 7919 + k * 104729) % len(vocab)]  # noqa: E731 - deterministic filler words
    suite = {f"math500/{i}": " ".join(word(i, k) for k in range(4 + i % 40)) for i in range(500)}
    train = [" ".join(word(i + 1000, k) for k in range(60)) for i in range(20000)]
    start = time.perf_counter()
    index = decontam.Index(suite, 13)
    hits = [index.hit(t) for t in train]
    assert time.perf_counter() - start < 20  # about 1-2 s on an idle core; an all-pairs scan would take minutes
    assert len(hits) == 20000


def test_every_layout_reads_as_world_train_data(tmp_path):
    gsm8k = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": NATALIA, "answer": "... #### 72"},
                                             {"question": "How many legs do 3 cats have?", "answer": "3*4\n#### 12"},
                                             {"question": "Half of 5?", "answer": "#### 2.5"}])
    verl = tmp_path / "verl.parquet"
    pl.DataFrame([_verl(0, f"What is 6 times 7? {VERL_MATH}", "42"), _verl(1, PUT, "1")]).write_parquet(verl)
    world = tmp_path / "world"
    world.mkdir()
    cfg = config.load("tiny", [f"world.train_data={gsm8k}", f"world.val_data={verl}", f"out_dir={tmp_path}"])
    record = build.sync_data(cfg, world)
    train, val = pl.read_parquet(world / "data-train.parquet"), pl.read_parquet(world / "data-val.parquet")
    assert train["answer"].to_list() == ["72", "12"] and train["prompt"][0] == NATALIA
    assert val.select("problem_id", "prompt", "answer").rows() == [("0", "What is 6 times 7?", "42")]
    assert {k: record["train"][k] for k in ("format", "rows_in", "dropped_malformed", "dropped_non_integer",
                                            "rows_out")} == {"format": "gsm8k", "rows_in": 3, "dropped_malformed": 0,
                                                             "dropped_non_integer": 1, "rows_out": 2}
    assert (record["val"]["format"], record["val"]["dropped_malformed"], record["val"]["rows_out"]) == ("verl", 1, 1)


def test_every_row_is_written_or_counted(tmp_path):
    """rows_in == rows_out + sum(dropped) for the library call too, on a file mixing the kinds of bad row."""
    lines = [json.dumps({"problem": f"What is {i} plus {i}?", "answer": str(2 * i)}) for i in range(5)]
    lines += ["not json", json.dumps({"problem": "What is 0 plus 0?", "answer": "0"}),  # exact duplicate of row 0
              json.dumps({"problem": "", "answer": "1"}), json.dumps({"problem": "Half?", "answer": "1/2"})]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    _, rep = importer.import_problems(str(src))
    assert rep.rows_in == 9 and rep.rows_out == 5
    assert {k: v for k, v in rep.dropped.items() if v} == {"unparsable": 1, "exact_duplicate": 1, "missing_field": 1,
                                                           "non_integer": 1}
    assert rep.rows_in == rep.rows_out + sum(rep.dropped.values())


def test_a_gsm8k_test_file_is_an_integer_suite(tmp_path):
    from rstar2.core.config import SuiteCfg
    from rstar2.data import suites

    path = _jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": NATALIA, "answer": "24 + 48 = 72\n#### 72"},
                                                  {"question": "How many legs do 3 cats have?", "answer": "#### 12"}])
    df = suites.load(SuiteCfg(name="gsm8k", path=str(path), answer_type="integer"))
    assert df.select("problem_id", "answer").rows() == [("gsm8k_test-000000", "72"), ("gsm8k_test-000001", "12")]
