"""`rstar2 bench trainer`'s roofline (bench/roofline.py): the linear layers of a llama/qwen decoder, worked by hand,
and the whole command on the tiny shape, its figures in the JSON against a roofline measured in the same run, with
`--profile`'s time by kind of work (bench/profile.py: ops named by hand)."""

import json

import pytest
import torch
from transformers import LlamaConfig
from typer.testing import CliRunner

from rstar2.bench import profile, roofline
from rstar2.training import numerics


def test_the_linear_layers_of_smollm2s_shape():
    mc = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49216)
    shapes = {name: (i, o, c) for name, i, o, c in roofline.linear_shapes(mc)}
    assert shapes == {"q": (576, 576, 30), "k": (576, 192, 30), "v": (576, 192, 30), "o": (576, 576, 30),
                      "gate": (576, 1536, 30), "up": (576, 1536, 30), "down": (1536, 576, 30)}
    # 30 x (2 x 576^2 + 2 x 576 x 192 + 3 x 576 x 1536) = 106.2M parameters in products, the embedding apart
    assert sum(i * o * c for i, o, c in shapes.values()) == 106_168_320


def test_a_qwen3_shape_whose_heads_are_wider_than_its_hidden_size():
    from transformers import Qwen3Config

    mc = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936)
    shapes = {name: (i, o) for name, i, o, _ in roofline.linear_shapes(mc)}
    assert shapes["q"] == (1024, 2048) and shapes["k"] == (1024, 1024) and shapes["o"] == (2048, 1024)


def test_a_roofline_counts_body_and_head_tokens_apart():
    r = {"body_s_per_token": 2e-3, "head_s_per_token": 1e-3}
    # 1,000 fed tokens through the body (2 s), 400 loss tokens through the head (0.4 s); 400 counted: 400 / 2.4 s
    assert roofline.tokens_per_s(r, 1000, 400, 400) == pytest.approx(400 / 2.4)


def test_bench_trainer_reports_tokens_per_second_against_the_roofline(tmp_path):
    from rstar2.cli.main import app

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "trainer", "--shapes", "tiny", "--no-trl", "--steps", "1",
                                   "--max-steps", "2", "--sft-steps", "1", "--profile", "--json", str(out)])
    assert res.exit_code == 0, res.output
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    # the tiny preset's numerics: trainer.dtype auto, settled by this host's bf16 units
    assert tiny["dtype"] == numerics.choose("auto", torch.device("cpu")).dtype
    assert set(tiny["roofline"]) == {"float32", "bfloat16"}
    assert all(r["gemm_gflop_per_s"] > 1 for r in tiny["roofline"].values())
    assert [r["name"] for r in tiny["runs"]] == ["rstar2 SFT", "rstar2 update (pack)"]
    for r in tiny["runs"]:
        assert r["tokens_per_s"] > 0 and \
            r["of_roofline"] == pytest.approx(r["tokens_per_s"] / r["roofline_tokens_per_s"])
    assert "x roofline" in res.output
    for r in tiny["runs"]:  # --profile: one more step's time by kind, the kinds covering all of it
        shares = r["profile"]["shares"]
        assert list(shares) == list(profile.ORDER) and sum(shares.values()) == pytest.approx(1.0)
        assert shares["products"] > 0.05 and shares["attention"] > 0 and r["profile"]["wall_s"] > 0
    assert "where a step's time goes" in res.output


def test_ops_are_put_in_their_kind_by_name():
    kinds = {op: profile.kind_of(op) for op in (
        "aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::copy_",
        "aten::_to_copy", "aten::_log_softmax_backward_data", "aten::_fused_adamw_", "Optimizer.step#AdamW.step",
        "aten::linalg_vector_norm", "aten::mul", "aten::silu_backward", "aten::rsqrt", "aten::view",
        "autograd::engine::evaluate_function: MmBackward0", "aten::mm_something_else")}
    assert kinds == {
        "aten::mm": "products", "aten::addmm": "products",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention", "aten::copy_": "casts",
        "aten::_to_copy": "casts", "aten::_log_softmax_backward_data": "loss", "aten::_fused_adamw_": "optimizer",
        "Optimizer.step#AdamW.step": "optimizer", "aten::linalg_vector_norm": "optimizer",
        "aten::mul": profile.OTHER, "aten::silu_backward": profile.OTHER, "aten::rsqrt": profile.OTHER,
        "aten::view": profile.OUTSIDE, "autograd::engine::evaluate_function: MmBackward0": profile.OUTSIDE,
        "aten::mm_something_else": profile.OTHER}  # an aten fragment names one op, not a prefix
    # 0.3 s of products and 0.1 s of a view in a 0.5 s call: 60 % products; the view and the 0.1 s no op took, 40 %
    shares = profile.shares({"aten::mm": 3e5, "aten::view": 1e5}, 0.5)
    assert shares["products"] == pytest.approx(0.6) and shares[profile.OUTSIDE] == pytest.approx(0.4)


def test_bench_trainer_refuses_a_batch_of_another_vocabulary_in_one_line(tmp_path):
    from rstar2.bench import trainer_shapes
    from rstar2.cli.main import app

    trainer_shapes.write_model("tiny", tmp_path / "tiny")
    batch = trainer_shapes.write_batch("smollm2", tmp_path)  # ids of a 49,216-token vocabulary
    res = CliRunner().invoke(app, ["bench", "trainer", "--shapes", "tiny", "--model", str(tmp_path / "tiny"),
                                   "--batch", str(batch), "--no-trl"])
    out = " ".join(res.output.split())  # the console wraps long lines
    assert res.exit_code == 2 and "beyond" in out and "vocabulary of 1432" in out
    assert "Traceback" not in res.output


def test_bench_trainer_refuses_an_unknown_shape_in_one_line():
    from rstar2.cli.main import app

    res = CliRunner().invoke(app, ["bench", "trainer", "--shapes", "gpt5"])
    assert res.exit_code == 2 and "--shapes takes tiny, smollm2" in res.output
