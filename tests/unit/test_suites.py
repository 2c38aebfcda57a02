"""Evaluation suites: the loaders on small files in the common local layouts (AIME 2024/2025, HMMT, MATH-500,
GPQA-Diamond), their errors, the eval config's checks, and the figures reported per suite."""

import json
import math

import polars as pl
import pytest

from rstar2.core import config
from rstar2.core.config import SuiteCfg
from rstar2.data import suites
from rstar2.evaluation import report, stats


def _write(path, rows):
    if path.suffix == ".parquet":
        pl.DataFrame(rows).write_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_aime_layouts_both_spellings(tmp_path):
    a24 = _write(tmp_path / "aime24.parquet",
                 [{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 33, "Solution": "..."}])
    a25 = _write(tmp_path / "aime25.jsonl", [{"problem": "Find y.", "answer": "070", "id": 4}])
    df = suites.load(SuiteCfg(name="aime24", path=a24, answer_type="integer"))
    assert df.select("problem_id", "prompt", "answer", "source").to_dicts() == [
        {"problem_id": "2024-I-1", "prompt": "Find x.", "answer": "33", "source": "aime24"}]
    assert suites.load(SuiteCfg(name="aime25", path=a25, answer_type="integer"))["answer"].to_list() == ["70"]


def test_math500_and_hmmt_keep_latex_answers(tmp_path):
    rows = [{"problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.", "solution": "... $\\boxed{\\frac{5}{6}}$",
             "answer": "\\frac{5}{6}", "subject": "Algebra", "level": 2, "unique_id": "test/algebra/1.json"}]
    df = suites.load(SuiteCfg(name="math500", path=_write(tmp_path / "math500.jsonl", rows), answer_type="math"))
    assert df["problem_id"].to_list() == ["test/algebra/1.json"] and df["answer"].to_list() == ["\\frac{5}{6}"]
    hmmt = _write(tmp_path / "hmmt.parquet",
                  [{"problem": "p", "answer": "2\\sqrt{3}"}, {"problem": "q", "answer": "5"}])
    assert suites.load(SuiteCfg(name="hmmt", path=hmmt))["problem_id"].to_list() == ["hmmt-000000", "hmmt-000001"]


def test_gpqa_options_are_shuffled_with_the_seed_and_the_letter_follows_the_correct_one(tmp_path):
    rows = [{"Question": f"Which is right ({i})?", "Correct Answer": "right", "Incorrect Answer 1": "w1",
             "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3", "Record ID": f"r{i}"} for i in range(8)]
    cfg = SuiteCfg(name="gpqa", path=_write(tmp_path / "gpqa.parquet", rows), answer_type="choice")
    df = suites.load(cfg, seed=0)
    for prompt, letter in zip(df["prompt"], df["answer"]):
        assert f"({letter}) right" in prompt and prompt.count("\n(") == 4
    assert len(set(df["answer"])) > 1  # the correct option is not always in the same place
    assert df.equals(suites.load(cfg, seed=0)) and not df["answer"].equals(suites.load(cfg, seed=1)["answer"])


def test_a_suite_missing_a_column_or_with_the_wrong_answers_is_one_clear_error(tmp_path):
    no_answer = _write(tmp_path / "aime.jsonl", [{"Problem": "Find x."}])
    with pytest.raises(ValueError, match=r"aime\.jsonl: the plain layout needs the answer column"
                                         r".*it has \['Problem'\]"):
        suites.load(SuiteCfg(name="aime", path=no_answer, answer_type="integer"))
    gpqa = _write(tmp_path / "gpqa.jsonl", [{"Question": "q", "Correct Answer": "a", "Incorrect Answer 1": "b",
                                             "Incorrect Answer 2": "c"}])
    with pytest.raises(ValueError, match=r"gpqa\.jsonl: the choice layout needs the Incorrect Answer 3 column"):
        suites.load(SuiteCfg(name="gpqa", path=gpqa, answer_type="choice"))
    latex = _write(tmp_path / "m.jsonl", [{"problem": "p", "answer": "\\frac{1}{2}"}])
    with pytest.raises(ValueError, match=r"suite m .*m\.jsonl.*not, e\.g\. \['\\\\frac\{1\}\{2\}'\] "
                                         r"\(use answer_type: math\)"):
        suites.load(SuiteCfg(name="m", path=latex, answer_type="integer"))
    empty = _write(tmp_path / "e.jsonl", [{"problem": "p", "answer": None}])
    with pytest.raises(ValueError, match=r"suite e .*e\.jsonl\): 1 unreadable row"):
        suites.load(SuiteCfg(name="e", path=empty))


def test_eval_config_checks_pass_k_and_suite_names():
    cfg = config.load("tiny", ["eval.samples=4", "eval.pass_k=[1, 4]", "eval.top_p=0.95"])
    assert cfg.eval.pass_k == [1, 4] and cfg.eval.top_p == 0.95 and cfg.eval.suites == []
    with pytest.raises(ValueError, match=r"eval.pass_k \[8\] must lie in 1..eval.samples \(4\)"):
        config.load("tiny", ["eval.samples=4", "eval.pass_k=[1, 8]"])
    with pytest.raises(ValueError, match="names must be unique"):
        config.load("tiny", ["eval.suites=[{name: a, path: x}, {name: a, path: y}]"])
    with pytest.raises(ValueError, match="name"):
        config.load("tiny", ["eval.suites=[{name: 'a/b', path: x}]"])
    big = config.load("qwen3-14b")
    assert (big.eval.samples, big.eval.temperature, big.eval.max_turns, big.eval.pass_k) == (16, 0.6, 30, [1, 4, 16])
    assert [s.answer_type for s in big.eval.suites] == ["integer", "integer", "math", "choice"]


def test_figures_per_suite_with_the_chosen_k():
    # problem 1: 3 of 4 correct, problem 2: 1 of 4. pass@1 = (0.75 + 0.25) / 2 = 0.5; SE = sd(0.75, 0.25) / sqrt 2
    # = 0.35355 / 1.41421 = 0.25. pass@2: 1 - C(1,2)/C(4,2) = 1 and 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5 -> 0.75
    res = stats.evaluation_stats([[1, 1, 1, 0], [0, 0, 1, 0]], ks=[2, 4])
    assert res["pass1"] == 0.5 and math.isclose(res["pass1_se"], 0.25)
    assert res["pass_at_2"] == 0.75 and res["pass_at_4"] == 1.0 and "pass_at_1" not in res
    rows = report.suite_rows({"aime": res, "math": {**res, "pass1": 0.1}})
    assert [r["suite"] for r in rows] == ["aime", "math"] and list(rows[0])[:5] == ["suite", "pass1", "pass1_se",
                                                                                  "pass_at_2", "pass_at_4"]
    assert report.suite_table({"aime": res}, "t").row_count == 1


def test_evaluate_refuses_a_directory_that_is_not_a_model(tmp_path):
    from typer.testing import CliRunner

    from rstar2.cli.main import app

    res = CliRunner().invoke(app, ["evaluate", "--model", str(tmp_path), "--set", f"out_dir={tmp_path}"])
    assert res.exit_code == 2 and "is not a Hugging Face model directory (it has no config.json)" in res.output


def test_json_documents_of_records_and_champs_file(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"question": "What is 2 + 2?", "answer": 4},
                                   {"question": "And 3 + 3?", "answer": 6}], indent=2))
    df = suites.load(SuiteCfg(name="l", path=str(as_list), answer_type="integer"))
    assert df["answer"].to_list() == ["4", "6"] and df["problem_id"].n_unique() == 2
    # CHAMP's layout: problems keyed by identifier, `_text` and `_answer`, nested fields beside them
    champ = tmp_path / "v0.json"
    champ.write_text(json.dumps({"problems": {
        "P_Sequence_1": {"identifier": "P_Sequence_1", "_text": "Sum 1..n?", "_answer": "n(n+1)/2",
                         "solution": {"steps": [{"_text": "pair them"}]}},
        "P_Sequence_2": {"identifier": "P_Sequence_2", "_text": "Sum 1..10?", "_answer": "55", "solution": {}}},
        "concepts": {}}, indent=1))
    df = suites.load(SuiteCfg(name="champ", path=str(champ)))
    assert df.select("problem_id", "prompt", "answer").rows() == [("P_Sequence_1", "Sum 1..n?", "n(n+1)/2"),
                                                                  ("P_Sequence_2", "Sum 1..10?", "55")]
    (tmp_path / "bad.json").write_text(json.dumps({"answer": 3, "note": "x"}, indent=1))  # one object, no records
    with pytest.raises(ValueError, match="bad.json: a JSON document of records"):
        suites.load(SuiteCfg(name="b", path=str(tmp_path / "bad.json")))


def test_a_suite_from_an_installed_package_and_a_seeded_subset():
    champ = SuiteCfg(name="champ", path="pkg:champ_dataset/dataset_files/v0.json", answer_type="math")
    whole = suites.load(champ)
    assert whole.height == 270 and whole["problem_id"].str.starts_with("P_").all()
    part = suites.load(champ.model_copy(update={"max_problems": 20}), seed=3)
    assert part.height == 20 and set(part["problem_id"]) <= set(whole["problem_id"])
    assert part.equals(suites.load(champ.model_copy(update={"max_problems": 20}), seed=3))  # a function of the seed
    with pytest.raises(ValueError, match="no installed package 'not_a_package'"):
        suites.load(SuiteCfg(name="x", path="pkg:not_a_package/x.json"))
