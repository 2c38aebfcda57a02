"""Headless Chromium against a local MLflow server (`mlflow server` on 127.0.0.1, what `rstar2 serve` starts) after a
small GRPO-RoC vs plain-GRPO ablation: the experiment page lists the variants and the report, the report's comparison
plots are served as PNGs, and the variants' runs open side by side in the compare view. Screenshots land in
$RSTAR2_UI_SHOTS (default .rstar2/ui-shots). Run with `bash infra/dev.sh ui-test`."""

import json
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from rstar2.cli import supervisor

pytestmark = pytest.mark.ui
ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=1",
         "stages.0.steps=2", "stages.0.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=128",
         "eval.max_response_tokens=128", "world.max_positions=512"]


def _api(url: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory, free_port):
    out = tmp_path_factory.mktemp("runs")
    sets = [a for s in SMOKE + [f"out_dir={out}"] for a in ("--set", s)]
    subprocess.run([sys.executable, "-m", "rstar2.cli.main", "ablation", "--preset", "tiny", "--name", "abl", "--seeds", "1",
                    "--world-seeds", "1", *sets],
                   cwd=ROOT, check=True, timeout=1800)
    port = free_port()
    proc = supervisor.start_mlflow(port, out, out / "mlflow-server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        exp = _api(url, "experiments/get-by-name", experiment_name="rstar2-tiny")["experiment"]["experiment_id"]
        yield url, exp
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _runs(url: str, exp: str) -> list[dict]:
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", method="POST",
                                 data=json.dumps({"experiment_ids": [exp], "max_results": 100}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["runs"]


def _by_name(runs: list[dict]) -> dict[str, dict]:
    return {run["info"]["run_name"]: run for run in runs}


def test_the_experiment_page_lists_the_variants_and_the_report(mlflow_ui, chromium, shots):
    url, exp = mlflow_ui
    runs = _by_name(_runs(url, exp))
    assert {"abl-roc", "abl-plain-grpo", "abl"} <= set(runs)
    tags = {t["key"]: t["value"] for t in runs["abl-plain-grpo"]["data"]["tags"]}
    assert tags.get("ablation") == "plain-grpo"
    kind = _api(url, "experiments/get", experiment_id=exp)["experiment"]["tags"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in kind
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and b"<html" in r.read().lower()
    page = f"{url}/#/experiments/{exp}/runs?workflowType=machine_learning"  # the runs table, not the GenAI overview
    dom = chromium(page, "--dump-dom")
    assert "abl-roc" in dom and "abl-plain-grpo" in dom
    chromium(page, f"--screenshot={shots / 'mlflow-experiment.png'}")
    assert (shots / "mlflow-experiment.png").stat().st_size > 10_000


def test_the_report_plots_are_served_and_the_variants_compare(mlflow_ui, chromium, shots):
    url, exp = mlflow_ui
    runs = _runs(url, exp)
    report = _by_name(runs)["abl"]["info"]["run_id"]
    plots = [f["path"] for f in _api(url, "artifacts/list", run_id=report, path="plots").get("files", [])]
    assert plots and all(p.endswith(".png") for p in plots)
    for p in plots:
        with urllib.request.urlopen(f"{url}/get-artifact?{urllib.parse.urlencode({'path': p, 'run_uuid': report})}",
                                    timeout=30) as r:
            assert r.read(8) == b"\x89PNG\r\n\x1a\n", p
    assert "plots/reward_mean.png" in plots  # and no empty chart among them (report.comparison_plots writes none)
    chromium(f"{url}/#/experiments/{exp}/runs/{report}/artifacts/plots/reward_mean.png?workflowType=machine_learning",
             f"--screenshot={shots / 'mlflow-ablation-plot.png'}")
    # the variants' runs side by side: MLflow's parallel-coordinates plot opens on the parameters that differ (the
    # variant's config) and the first shared metric, one line per variant
    variants = [r["info"]["run_id"] for r in runs if r["info"]["run_name"] in ("abl-roc", "abl-plain-grpo")]
    assert len(variants) == 2
    compare = (f"{url}/#/compare-runs?runs={json.dumps(variants)}&experiments={json.dumps([exp])}"
               "&workflowType=machine_learning")
    dom = chromium(compare, "--dump-dom")
    axes = re.findall(r'class="axis-title"[^>]*>([^<]+)<', dom)
    assert len(axes) >= 2 and any(a.startswith("roc.") for a in axes), axes  # the config that differs, and a metric
    chromium(compare, f"--screenshot={shots / 'mlflow-compare.png'}")
    assert (shots / "mlflow-compare.png").stat().st_size > 10_000
