"""`rstar2 bench trainer --device cuda`: our SFT and GRPO-RoC update against the GPU's GEMM roofline, and TRL's
GRPOTrainer on the same recorded batch and model, on the GPU (bf16); the figures (tokens/s, their share of the
roofline, peak memory, speedup) are recorded."""

import json

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.gpu


def test_bench_trainer_on_cuda_against_trl(tmp_path, figures):
    from rstar2.cli.main import app

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "trainer", "--shapes", "tiny", "--device", "cuda", "--dtype", "bfloat16",
                                   "--layouts", "bucket,pack", "--steps", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())["shapes"]["tiny"]
    names = [r["name"] for r in result["runs"]]
    assert names == ["rstar2 SFT", "rstar2 update (bucket)", "rstar2 update (pack)", "TRL GRPOTrainer"]
    assert all(r["tokens_per_s"] > 0 and r["peak_mb"] > 0 and r["of_roofline"] > 0 for r in result["runs"])
    figures("bench_trainer_cuda", {"speedup_vs_trl": result["speedup_vs_trl"],
                                   "peak_mb_ratio_vs_trl": result["peak_mb_ratio_vs_trl"],
                                   **{r["name"]: round(r["tokens_per_s"]) for r in result["runs"]},
                                   **{f"{r['name']} x roofline": round(r["of_roofline"], 2) for r in result["runs"]}})
