"""Headless Chromium against a local MLflow server (`mlflow server` on 127.0.0.1, what `rstar2 serve` starts) over an
ablation's runs: two recorded tiny campaigns (tests/ui/recorded.py: their per-step figures and held-out pass@1, logged
through rstar2.core.tracking, with the report's plots), since a test-sized campaign learns nothing and would draw flat
lines. The experiment page lists the variants and the report; the report's plots are served as PNGs whose curves
move; the variants' runs open side by side in the compare view and their reward over steps in the metric view, with
the figures worked by hand below. Screenshots land in $RSTAR2_UI_SHOTS (default .rstar2/ui-shots). Run with
`bash infra/dev.sh ui-test`."""

import io
import json
import re
import urllib.parse
import urllib.request

import numpy as np
import pytest

from rstar2.cli import supervisor
from tests.ui import recorded

pytestmark = pytest.mark.ui
# per-step reward, mean over each variant's seeds (tests/data/health/): full-sft's 3 seeds end at step 16 on 0.668,
# 0.707, 0.574 (mean 0.64967) and are lowest at step 2 (0.273, 0.363, 0.340: 0.32533); weak-sft's 2 seeds end on
# 0.152, 0.238 (0.195), lowest at step 5 (0.082, 0.137: 0.1095), highest at step 11 (0.195, 0.277: 0.236)
REWARD = {  # run: its latest, min and max with their steps, as the metric view's table prints them
    "abl-full-sft": ("0.6496666666666666 (step=16)", "0.3253333333333333 (step=2)", "0.6496666666666666 (step=16)"),
    "abl-weak-sft": ("0.195 (step=16)", "0.10950000000000001 (step=5)", "0.23600000000000002 (step=11)")}
# held-out pass@1: the SFT model's at step 0, after RL the seeds' mean at step 16 (0.775, 0.765, 0.751: 0.76367;
# 0.355, 0.266: 0.3105), as the files' headers recorded them
PASS1 = {"abl-full-sft": [(0, 0.48), (16, 0.7636666666666666)], "abl-weak-sft": [(0, 0.242), (16, 0.3105)]}


def _api(url: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory, free_port):
    out = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the recorded runs go to the store the server serves
        logged = recorded.log_ablation(out, "rstar2-tiny", "abl")
    port = free_port()
    proc = supervisor.start_mlflow(port, out, out / "mlflow-server.log")
    try:
        yield f"http://127.0.0.1:{port}", logged["experiment_id"]
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


def _variants(url: str, exp: str) -> dict[str, str]:
    """The variants' campaign runs: name -> run id."""
    return {name: run["info"]["run_id"] for name, run in _by_name(_runs(url, exp)).items() if name in REWARD}


def test_the_experiment_page_lists_the_variants_and_the_report(mlflow_ui, chromium, shots):
    url, exp = mlflow_ui
    runs = _by_name(_runs(url, exp))
    assert {"abl-full-sft", "abl-weak-sft", "abl"} <= set(runs)
    tags = {t["key"]: t["value"] for t in runs["abl-weak-sft"]["data"]["tags"]}
    assert tags.get("ablation") == "weak-sft"
    kind = _api(url, "experiments/get", experiment_id=exp)["experiment"]["tags"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in kind
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and b"<html" in r.read().lower()
    page = f"{url}/#/experiments/{exp}/runs?workflowType=machine_learning"  # the runs table, not the GenAI overview
    dom = chromium(page, "--dump-dom")
    assert "abl-full-sft" in dom and "abl-weak-sft" in dom
    chromium(page, f"--screenshot={shots / 'mlflow-experiment.png'}")
    assert (shots / "mlflow-experiment.png").stat().st_size > 10_000


def _line_rows(png: bytes, rgb: tuple[float, float, float]) -> np.ndarray:
    """Where a PNG draws a line of colour `rgb` (matplotlib's opaque line colour, not its bands): per pixel column
    that has it, its mean row, as a fraction of the image's height (0 at the top)."""
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    mask = np.abs(img - np.array(rgb)).max(axis=-1) < 0.02
    return np.array([np.nonzero(mask[:, c])[0].mean() for c in np.nonzero(mask.any(axis=0))[0]]) / img.shape[0]


def _spread(rows: np.ndarray) -> float:
    """How far a line moves up and down: its rows' 10th to 90th percentile (the legend's sample is a few columns)."""
    return float(np.percentile(rows, 90) - np.percentile(rows, 10))


def test_the_report_plots_are_served_and_their_curves_move(mlflow_ui, chromium, shots):
    url, exp = mlflow_ui
    report = _by_name(_runs(url, exp))["abl"]["info"]["run_id"]
    plots = [f["path"] for f in _api(url, "artifacts/list", run_id=report, path="plots").get("files", [])]
    assert "plots/reward_mean.png" in plots  # and no empty chart among them (report.comparison_plots writes none)
    for p in plots:
        with urllib.request.urlopen(f"{url}/get-artifact?{urllib.parse.urlencode({'path': p, 'run_uuid': report})}",
                                    timeout=30) as r:
            png = r.read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", p
        if p == "plots/reward_mean.png":
            # one line per variant (matplotlib's first two colours): each climbs or dips over its steps (a flat
            # line's spread is a pixel or two) and the two lie apart (full-sft's 0.33-0.65 above 0.11-0.24)
            full, weak = _line_rows(png, (0.122, 0.467, 0.706)), _line_rows(png, (1.0, 0.498, 0.055))
            assert _spread(full) > 0.15 and _spread(weak) > 0.05, (_spread(full), _spread(weak))
            assert np.median(full) + 0.2 < np.median(weak)  # rows count down from the top: higher reward, smaller row
    chromium(f"{url}/#/experiments/{exp}/runs/{report}/artifacts/plots/reward_mean.png?workflowType=machine_learning",
             f"--screenshot={shots / 'mlflow-ablation-plot.png'}")


def test_the_variants_compare_side_by_side(mlflow_ui, chromium, shots):
    """The compare view: MLflow's parallel-coordinates plot opens on the parameters that differ (the override that
    made the variant) and the first shared metric; its table gives each run's latest figures, which differ."""
    url, exp = mlflow_ui
    variants = _variants(url, exp)
    ids = [variants["abl-full-sft"], variants["abl-weak-sft"]]
    compare = (f"{url}/#/compare-runs?runs={json.dumps(ids)}&experiments={json.dumps([exp])}"
               "&workflowType=machine_learning")
    dom = chromium(compare, "--dump-dom")
    axes = re.findall(r'class="axis-title"[^>]*>([^<]+)<', dom)
    assert "overrides" in axes and "reward_mean" in axes, axes
    text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    # the metrics table: eval_pass1 and reward_mean, each run's latest value to 3 digits
    assert "eval_pass1 reward_mean 0.764 0.311 0.65 0.195" in text, text[text.find("Metrics"):][:300]
    chromium(compare, f"--screenshot={shots / 'mlflow-compare.png'}")
    assert (shots / "mlflow-compare.png").stat().st_size > 10_000


def test_the_metric_view_draws_the_variants_reward_over_steps(mlflow_ui, chromium, shots):
    """MLflow's metric view of both variants: one line each, and its table of latest, min and max with their steps
    (worked by hand above); the held-out pass@1 it would draw for eval_pass1, from the same API."""
    url, exp = mlflow_ui
    variants = _variants(url, exp)
    ids = json.dumps([variants["abl-full-sft"], variants["abl-weak-sft"]])
    page = (f'{url}/#/metric/reward_mean?runs={ids}&metric="reward_mean"&experiments={json.dumps([exp])}'
            '&plot_metric_keys=["reward_mean"]&x_axis=step')
    dom = chromium(page, "--dump-dom")
    lines = set(re.findall(r'class="js-line" d="([^"]+)"', dom))
    assert len(lines) == 2 and all(d.count("L") == 15 for d in lines), lines  # 16 steps each
    text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    for name, (latest, low, high) in REWARD.items():
        assert f"{name} {latest} {low} {high}" in text, text[text.find("Latest"):][:400]
    chromium(page, f"--screenshot={shots / 'mlflow-reward-steps.png'}")
    for name, points in PASS1.items():
        history = _api(url, "metrics/get-history", run_id=variants[name], metric_key="eval_pass1")["metrics"]
        got = sorted((int(m["step"]), m["value"]) for m in history)
        assert [s for s, _ in got] == [s for s, _ in points] and [v for _, v in got] == pytest.approx(
            [v for _, v in points]), got
