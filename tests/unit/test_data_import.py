"""`rstar2 data import`: every count of its report on a file written here (malformed rows, non-integer answers, exact
and near duplicates, a contaminated problem, a repeated id), the layouts it reads, and its errors."""

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from rstar2.data import clean, dedup, formats, importer, schema

AIME = ("Let ABCD be a rhombus whose diagonals intersect at the origin and whose vertices lie on the hyperbola "
        "x^2/20 - y^2/24 = 1. Find the greatest real number that is less than BD^2 for all such rhombi.")
BAG = ("A bag contains 5 red balls, 7 blue balls and 9 green balls. Three balls are drawn at random without "
       "replacement. How many different color combinations of the three drawn balls are possible in total?")
ROWS = [
    {"id": "p1", "problem": "Find the number of positive integers n less than 1000 such that n^2 ends in 76.",
     "answer": "042"},                                                                  # kept, answer 42
    {"id": "m1", "problem": "What is 2+2?", "answer": None},                           # missing field
    {"id": "m2", "problem": "   ", "answer": "3"},                                     # missing field
    {"id": "f1", "problem": "Compute one half plus one third.", "answer": "\\frac{5}{6}"},  # non-integer
    {"id": "f2", "problem": "What is seven halves?", "answer": "3.5"},                 # non-integer
    {"id": "e1", "problem": "find the number of positive integers  n less than 1000 such that n^2 ends in 76",
     "answer": "42"},                                                                  # exact duplicate of p1
    {"id": "b1", "problem": BAG, "answer": 10},                                        # kept (an int in JSON)
    {"id": "b2", "problem": BAG.replace("in total?", "altogether?"), "answer": "10"},  # near duplicate of b1
    {"id": "c1", "problem": "Consider the following. " + AIME, "answer": "480"},      # contaminated (AIME)
    {"id": "p1", "problem": "How many primes are there below 100?", "answer": "25"},  # repeated id p1
    {"id": "q1", "problem": "How many primes are there between 100 and 200?", "answer": "\\boxed{21}"},  # kept, 21
    {"id": "t1", "problem": "What is ten times one hundred?", "answer": "1,000"},     # kept, 1000
]


def _jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return path


def test_every_count_of_the_report(tmp_path):
    src = _jsonl(tmp_path / "mixed.jsonl", ROWS, ("{not json",))  # one unparsable line
    df, rep = importer.import_problems(str(src), suites={"aime24/0": AIME}, decontam_ngram=13)
    assert rep.format == "plain" and rep.rows_in == 13
    assert rep.dropped == {"missing_field": 2, "unparsable": 1, "non_integer": 2, "exact_duplicate": 1,
                           "near_duplicate": 1, "contaminated": 1, "duplicate_id": 1}
    assert rep.rows_out == 4 == df.height and rep.rows_in == rep.rows_out + sum(rep.dropped.values())
    assert dict(zip(df["problem_id"], df["answer"])) == {"p1": "42", "b1": "10", "q1": "21", "t1": "1000"}
    assert df.columns == ["problem_id", "prompt", "answer", "source"] and set(df["source"]) == {"mixed"}
    assert rep.examples["near_duplicate"] == ["b2 ~ b1"] and rep.examples["exact_duplicate"] == ["e1 repeats p1"]
    assert rep.examples["contaminated"] == ["c1 overlaps aime24/0"] and "line 13" in rep.examples["unparsable"][0]
    assert rep.examples["missing_field"][0].startswith("row 1 (m1): no answer")


def test_eval_split_keeps_non_integer_answers_and_no_suites_means_no_decontamination(tmp_path):
    src = _jsonl(tmp_path / "mixed.jsonl", ROWS)
    df, rep = importer.import_problems(str(src), split="eval")
    assert rep.dropped["non_integer"] == 0 and rep.dropped["contaminated"] == 0
    assert {"f1", "f2", "c1"} <= set(df["problem_id"]) and rep.rows_out == 12 - 2 - 1 - 1 - 1


def test_dapo_layout_from_parquet(tmp_path):
    head = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")  # DAPO-Math-17k's own
    tail = 'Remember to put your answer on its own line after "Answer:".'
    rows = [{"data_source": "math_dapo",
             "prompt": [{"role": "user", "content": f"{head}\n\nWhat is {i} + {i}?\n\n{tail}"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"id-{i}"}} for i in (3, 40)]
    rows.append({"data_source": "math_dapo", "prompt": [{"role": "system", "content": "hi"}], "ability": "MATH",
                 "reward_model": {"ground_truth": "1", "style": "x"}, "extra_info": {"index": "id-x"}})  # no user turn
    pl.DataFrame(rows).write_parquet(tmp_path / "dapo.parquet")
    df, rep = importer.import_problems(str(tmp_path / "dapo.parquet"))
    assert rep.format == "dapo" and rep.dropped["unparsable"] == 1 and rep.rows_out == 2
    assert df.to_dicts()[0] == {"problem_id": "id-3", "prompt": "What is 3 + 3?", "answer": "6", "source": "math_dapo"}


def test_solution_layout_takes_the_last_balanced_box(tmp_path):
    rows = [{"problem": "Simplify.", "solution": "First \\boxed{1}, then finally \\boxed{\\frac{1}{2}}."},
            {"problem": "Count.", "solution": "So there are $\\boxed{012}$ ways."},
            {"problem": "Nothing boxed.", "solution": "The answer is 5."}]
    _jsonl(tmp_path / "math.jsonl", rows)
    df, rep = importer.import_problems(str(tmp_path / "math.jsonl"), split="eval")
    assert rep.format == "solution" and rep.dropped["unparsable"] == 1
    assert df["answer"].to_list() == ["\\frac{1}{2}", "12"] and df["problem_id"].to_list() == ["math-000000",
                                                                                               "math-000001"]


def test_a_file_in_no_known_format_names_the_file_and_its_columns(tmp_path):
    _jsonl(tmp_path / "odd.jsonl", [{"text": "x", "label": 1}])
    with pytest.raises(ValueError, match=r"odd\.jsonl: no known problem layout in columns \['text', 'label'\]"):
        importer.import_problems(str(tmp_path / "odd.jsonl"))
    (tmp_path / "odd.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"odd\.csv: unknown file type '\.csv'"):
        importer.import_problems(str(tmp_path / "odd.csv"))
    with pytest.raises(ValueError, match=r"f\.jsonl: the plain layout needs the answer column "
                                         r"\(one of answer, Answer, _answer\)"):
        formats.require(pl.DataFrame({"problem": ["x"]}), "plain", "f.jsonl")


@pytest.mark.parametrize("raw, norm", [("042", "42"), ("\\boxed{12}", "12"), ("$-7$", "-7"), ("1,000", "1000"),
                                       ("+5", "5"), ("12.0", "12"), ("\\text{B}", "B"),
                                       ("\\frac{1}{2}", "\\frac{1}{2}"),
                                       ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"), ("0.5", "0.5")])
def test_normalise_answer(raw, norm):
    assert clean.normalise_answer(raw) == norm


def test_exact_checks_of_integer_and_choice_answers():
    assert clean.matches("042", "42", "integer") == 1.0 and clean.matches("\\frac{84}{2}", "42", "integer") == 0.0
    assert clean.matches("(B)", "B", "choice") == 1.0 and clean.matches("\\text{b}", "B", "choice") == 1.0
    assert clean.matches("C", "B", "choice") == 0.0 and clean.matches(None, "B", "choice") == 0.0


def test_near_duplicates_follow_the_jaccard_threshold():
    a = "one two three four five six seven eight nine ten eleven twelve"
    b = a.replace("twelve", "dozen")  # 10 3-gram shingles each, 9 shared: Jaccard 9/11 = 0.818
    assert dedup.jaccard(dedup.shingles(a, 3), dedup.shingles(b, 3)) == pytest.approx(9 / 11)
    assert dedup.near_duplicates([a, b, "something else entirely here"], 0.8) == {1: 0}
    assert dedup.near_duplicates([a, b], 0.85) == {}


def test_schema_validate_names_the_file():
    good = pl.DataFrame({"problem_id": ["a", "b"], "prompt": ["x", "y"], "answer": ["1", "2"]})
    assert schema.validate(good, "d/own.parquet")["source"].to_list() == ["own", "own"]
    with pytest.raises(ValueError, match=r"own\.parquet lacks column\(s\) \['answer'\]"):
        schema.validate(good.drop("answer"), "own.parquet")
    with pytest.raises(ValueError, match=r"own\.parquet: 1 malformed row.*\['b'\]"):
        schema.validate(good.with_columns(prompt=pl.Series(["x", " "])), "own.parquet")


def test_cli_writes_the_table_the_report_and_logs_the_dataset_to_mlflow(tmp_path):
    import mlflow

    from rstar2.cli.main import app

    suite = _jsonl(tmp_path / "aime24.jsonl", [{"Problem": AIME, "Answer": 480}])
    src = _jsonl(tmp_path / "mixed.jsonl", ROWS)
    out = tmp_path / "out" / "train.parquet"
    sets = [f"out_dir={tmp_path}", f"eval.suites=[{{name: aime24, path: {suite}, answer_type: integer}}]"]
    res = CliRunner().invoke(app, ["data", "import", str(src), "--out", str(out), "--json", str(tmp_path / "r.json"),
                                   *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == 0, res.output
    assert "rows out" in res.output and "near duplicate" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["rows_out"] == 4 and rep["dropped"]["contaminated"] == 1
    assert pl.read_parquet(out)["problem_id"].to_list() == ["p1", "b1", "q1", "t1"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("rstar2-tiny").experiment_id],
                             "tags.kind = 'data-import'")[0]
    assert run.inputs.dataset_inputs[0].dataset.name == "train" and run.data.metrics["dropped_near_duplicate"] == 1
    bad = CliRunner().invoke(app, ["data", "import", str(tmp_path / "r.json"), "--out", str(out)])
    assert bad.exit_code == 2 and "r.json: a JSON document of records is a list of objects" in bad.output
