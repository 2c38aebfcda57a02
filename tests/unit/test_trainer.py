"""The trainer (rstar2/training/trainer.py): the fast update equals a literal full-logits implementation, masking,
options, and full-state resume that is bit-identical to never having stopped."""

import copy
import math
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pytest
import torch

from rstar2.core import checkpoint, config
from rstar2.training import grpo
from rstar2.training.trainer import PolicyTrainer
from rstar2.world import build

TINY = ["world.n_sft=60", "world.n_train=12", "world.n_test=6", "world.hidden=32", "world.ffn=64", "world.layers=2",
        "world.heads=2", "world.kv_heads=1", "world.vocab_size=600"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build.build(config.load("tiny", TINY), tmp_path_factory.mktemp("world"))["init_model"]


def batch(path, rewards, seed=0, truncated=None, logprobs=False):
    """Groups of 4 rollouts of one prompt, of varied lengths: model turn (loss 1), tool response (0), model turn (1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, r in enumerate(rewards):
        if i % 4 == 0:
            prompt = torch.randint(20, 590, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        n_a, n_t, n_b = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 12), (1, 6), (1, 10)))
        resp = torch.randint(20, 590, (n_a + n_t + n_b,), generator=g).tolist()
        row = dict(problem_id=f"p{i // 4}", reward=float(r), prompt_ids=prompt, response_ids=resp,
                   loss_mask=[1] * n_a + [0] * n_t + [1] * n_b, truncated=bool(truncated and truncated[i]))
        if logprobs:
            row["response_logprobs"] = (-torch.rand(n_a + n_t + n_b, generator=g) * 4).tolist()
        rows.append(row)
    pl.DataFrame(rows).write_parquet(path)
    return str(path)


REWARDS = [1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0]


def params(tr):
    return {k: v.detach().clone() for k, v in tr.model.named_parameters()}


def literal_loss(model, df, cfg):
    """The slow reference: full logits for every position of every sequence (one at a time, no padding), log-softmax,
    gather, per-token Eq. 6 loop over loss tokens only, summed over tokens and divided by the batch's token count
    (token-mean), or averaged per sequence and then over sequences (seq-mean-token-mean)."""
    gid = torch.as_tensor(df["problem_id"].cast(pl.Categorical).to_physical().to_list())
    adv = grpo.group_advantages(torch.tensor(df["reward"].to_list()), gid)
    terms, n_tok, seq_means = [], 0, []
    for i, (p, r, m) in enumerate(df.select("prompt_ids", "response_ids", "loss_mask").rows()):
        start = len(terms)
        ids = torch.tensor([p + r])
        logp_all = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)       # (L-1, V)
        mask = [0] * len(p) + list(m)
        for t in range(len(mask) - 1):
            if mask[t + 1]:
                lp = logp_all[t, ids[0, t + 1]]
                ratio = torch.exp(lp - lp.detach())
                A = float(adv[i])
                terms.append(torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)))
                n_tok += 1
        seq_means.append(torch.stack(terms[start:]).mean())
    if cfg.loss_agg == "seq-mean-token-mean":
        return torch.stack(seq_means).mean()
    return torch.stack(terms).sum() / n_tok


@pytest.mark.parametrize("layout,agg", [("bucket", "token-mean"), ("pack", "token-mean"),
                                        ("bucket", "seq-mean-token-mean")])
def test_update_equals_literal_full_logits_reference(tiny_model, tmp_path, layout, agg):
    cfg = config.TrainerCfg(lr=1e-3, warmup_steps=1, weight_decay=0.0, layout=layout, micro_batch_tokens=64,
                            loss_agg=agg)
    tr = PolicyTrainer(tiny_model, cfg, seed=0)
    uri = batch(tmp_path / "b.parquet", REWARDS)
    ref = PolicyTrainer(tiny_model, cfg, seed=0)
    loss = literal_loss(ref.model, pl.read_parquet(uri), cfg)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), cfg.grad_clip)
    ref_grads = {k: p.grad.clone() for k, p in ref.model.named_parameters()}

    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, k=k: grads.__setitem__(k, p.grad.clone()))
             for k, p in tr.model.named_parameters()]
    m = tr.update(uri)
    for h in hooks:
        h.remove()
    assert m["update_loss_tokens"] == sum(sum(x) for x in pl.read_parquet(uri)["loss_mask"].to_list())
    assert m["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert m["grad_norm"] > 0
    # bucket computes some padding; pack computes none and each group's prompt once
    assert (m["fed_per_token"] >= 1) if layout == "bucket" else (m["fed_per_token"] < 1)
    # the hooks saw the last micro-batch's accumulated (pre-clip) grads: compare after the same clipping
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    scale = min(1.0, cfg.grad_clip / (float(norm) + 1e-6))
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k] * scale, g, atol=2e-6, rtol=1e-4)


def test_tool_tokens_carry_no_gradient(tiny_model, tmp_path):
    """No loss term is ever computed on a mask-0 (prompt / tool-response / padding) target: the micro-batch selects
    exactly the mask-1 tokens, each predicted from the hidden state of the token before it."""
    from rstar2.training.batching import collate

    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    mask = [[0, 0, 1, 1, 0, 0, 1], [0, 1, 0, 1]]
    for packed in (False, True):
        mb = collate(ids, mask, [0, 1], pad_id=0, packed=packed)
        assert mb.tgt.tolist() == [7, 8, 11, 13, 15]                 # exactly the mask-1 tokens, in order
        assert mb.seq.tolist() == [0, 0, 0, 1, 1] and mb.tok.tolist() == [2, 3, 6, 1, 3]
        flat = mb.ids.view(-1)
        assert (flat[mb.src] == torch.tensor([6, 7, 10, 12, 14])).all()  # each from the token just before it


def test_masked_tokens_do_not_change_the_update(tiny_model, tmp_path):
    # Two batches identical except for the *ids* of the last tool-response token of row 0 when that token is the very
    # last one (nothing after it reads it as context): the update must be bit-identical.
    cfg = config.TrainerCfg(lr=1e-3, warmup_steps=1)
    rows = pl.read_parquet(batch(tmp_path / "a.parquet", REWARDS)).to_dicts()
    rows[0]["loss_mask"] = rows[0]["loss_mask"][:-1] + [0]
    pl.DataFrame(rows).write_parquet(tmp_path / "a.parquet")
    rows[0]["response_ids"] = rows[0]["response_ids"][:-1] + [(rows[0]["response_ids"][-1] + 1) % 500 + 20]
    pl.DataFrame(rows).write_parquet(tmp_path / "b.parquet")
    a, b = PolicyTrainer(tiny_model, cfg, seed=0), PolicyTrainer(tiny_model, cfg, seed=0)
    a.update(str(tmp_path / "a.parquet"))
    b.update(str(tmp_path / "b.parquet"))
    for (k, p), q in zip(params(a).items(), params(b).values()):
        assert torch.equal(p, q), k


def test_all_equal_rewards_give_no_update(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, weight_decay=0.0), seed=0)
    before = params(tr)
    tr.update(batch(tmp_path / "b.parquet", [1, 1, 1, 1]))  # zero advantage everywhere: Adam sees zero grads
    for k, v in params(tr).items():
        assert torch.equal(before[k], v)


def test_overlong_filter_drops_truncated_rollouts(tiny_model, tmp_path):
    trunc = [i % 3 == 0 for i in range(len(REWARDS))]
    uri = batch(tmp_path / "b.parquet", REWARDS, truncated=trunc)
    masks = pl.read_parquet(uri)["loss_mask"].to_list()
    keep = sum(sum(m) for m, t in zip(masks, trunc) if not t)
    m_on = PolicyTrainer(tiny_model, config.TrainerCfg(overlong_filter=True), seed=0).update(uri)
    m_off = PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0).update(uri)
    assert m_on["update_loss_tokens"] == keep and m_off["update_loss_tokens"] == sum(sum(m) for m in masks)


def test_engine_logprobs_and_tis(tiny_model, tmp_path):
    uri = batch(tmp_path / "b.parquet", REWARDS, logprobs=True)
    with pytest.raises(ValueError, match="response_logprobs"):
        PolicyTrainer(tiny_model, config.TrainerCfg(old_logprobs="engine"), seed=0).update(
            batch(tmp_path / "n.parquet", REWARDS))
    # the engine's log-probs differ from the trainer's: the ratio moves off 1 and the clip binds on some tokens
    m = PolicyTrainer(tiny_model, config.TrainerCfg(old_logprobs="engine"), seed=0).update(uri)
    assert m["ratio_mean"] != pytest.approx(1.0) and m["clip_frac_high"] + m["clip_frac_low"] > 0
    # engine log-probs equal to the trainer's own: "engine" is then exactly "recompute", and TIS weights are 1
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0)
    df = pl.read_parquet(uri)
    df.with_columns(response_logprobs=pl.Series(engine_logprobs(tr.model, df))).write_parquet(tmp_path / "own.parquet")
    runs = {}
    for name, kw in {"recompute": {}, "engine": {"old_logprobs": "engine"}, "tis": {"tis_cap": 2.0}}.items():
        t = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, **kw), seed=0)
        runs[name] = (t.update(str(tmp_path / "own.parquet")), params(t))
    for name in ("engine", "tis"):
        assert runs[name][0]["loss"] == pytest.approx(runs["recompute"][0]["loss"], abs=1e-6)
        for k, v in runs[name][1].items():
            torch.testing.assert_close(v, runs["recompute"][1][k], atol=1e-6, rtol=0)
    assert runs["tis"][0]["tis_clip_frac"] == 0.0  # every weight is 1: none reaches the cap
    # an engine that found every sampled token 4x less likely than the trainer does: π_old/π_engine = 4 > C = 2
    lower = [[x - math.log(4) for x in row] for row in engine_logprobs(tr.model, df)]
    df.with_columns(response_logprobs=pl.Series(lower)).write_parquet(tmp_path / "lower.parquet")
    m = PolicyTrainer(tiny_model, config.TrainerCfg(tis_cap=2.0), seed=0).update(str(tmp_path / "lower.parquet"))
    assert m["tis_clip_frac"] == pytest.approx(1.0)


def engine_logprobs(model, df, shift: int = 0) -> list[list[float]]:
    """What an engine with `model`'s weights records for each row's response tokens (the log-prob of each sampled
    token); `shift`: the log-probs moved that many tokens along the response, as after a token shifted in the stream."""
    out = []
    for p, r in df.select("prompt_ids", "response_ids").rows():
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([p + r])).logits[0, :-1].float().log_softmax(-1)
        got = lp[len(p) - 1:].gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist()
        out.append(got[shift:] + got[:shift])
    return out


def test_the_logprob_gap_is_noise_for_the_trainers_policy_and_stops_planted_mismatches(tiny_model, tmp_path):
    """logprob_gap = mean |log π_old - log π_engine| over loss tokens: ~0 when the engine sampled from the trainer's
    weights; past the cap, and so refused, when the engine kept stale weights, ran another dtype or the tokens are
    shifted against the log-probs."""
    from rstar2.training.trainer import LogprobGapError, check_logprob_gap

    df = pl.read_parquet(batch(tmp_path / "b.parquet", REWARDS))
    ref = PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0).model

    def gap(lps, trainer=None) -> float:
        path = tmp_path / "lp.parquet"
        df.with_columns(response_logprobs=pl.Series(lps)).write_parquet(path)
        return (trainer or PolicyTrainer(tiny_model, config.TrainerCfg(), seed=0)).update(str(path))["logprob_gap"]

    cap = 1e-4  # a cap for an fp32 engine and trainer (measured on this random model: the fp32 gap 6e-9, bf16's 4e-4)
    fresh = gap(engine_logprobs(ref, df))
    assert fresh < cap / 100
    check_logprob_gap({"logprob_gap": fresh}, cap)
    # the engine still has the starting weights while the trainer has taken 3 steps (lr 1e-2)
    moved = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-2, warmup_steps=1), seed=0)
    for k in range(3):
        moved.update(batch(tmp_path / f"m{k}.parquet", REWARDS, seed=k + 1))
    stale = gap(engine_logprobs(ref, df), moved)
    bf16 = gap(engine_logprobs(copy.deepcopy(ref).to(torch.bfloat16), df))
    shifted = gap(engine_logprobs(ref, df, shift=1))
    for planted in (stale, bf16, shifted):
        with pytest.raises(LogprobGapError, match="max_logprob_gap"):
            check_logprob_gap({"logprob_gap": planted}, cap)
    assert min(stale, shifted) > 0.1  # past the default cap too
    check_logprob_gap({}, cap)  # not measured (no engine log-probs): nothing to check
    check_logprob_gap({"logprob_gap": shifted}, None)  # the check turned off


def test_mini_batches_kl_entropy(tiny_model, tmp_path):
    uri = batch(tmp_path / "b.parquet", REWARDS)
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, mini_batches=2, kl_coef=0.1,
                                                     entropy_coef=0.01), seed=0)
    m1 = tr.update(uri)
    assert tr.step == 2 and m1["kl"] >= 0 and m1["entropy"] > 0
    assert 0 < m1["approx_kl"] and m1["ratio_mean"] != 1.0  # the 2nd mini-batch ran on moved weights vs π_old
    m2 = tr.update(uri)
    assert m2["kl"] > 0  # the policy has left the reference
    assert math.isfinite(m2["loss"]) and math.log(600) > m2["entropy"] > 0


def test_entropy_is_measured_without_the_bonus(tiny_model, tmp_path):
    """entropy_coef = 0: the update still reports the entropy of the policy at its sampled (loss) tokens, the
    token-weighted mean over micro-batches, equal to the literal full-logits entropy under the pre-update weights."""
    uri = batch(tmp_path / "b.parquet", REWARDS)
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, micro_batch_tokens=64), seed=0)
    ents = []
    with torch.no_grad():
        for p, r, m in pl.read_parquet(uri).select("prompt_ids", "response_ids", "loss_mask").rows():
            logits = tr.model(input_ids=torch.tensor([p + r])).logits[0, :-1]                    # (L-1, V)
            ent = torch.distributions.Categorical(logits=logits.double()).entropy()            # (L-1,)
            mask = [0] * len(p) + list(m)
            ents += [float(ent[t - 1]) for t in range(1, len(mask)) if mask[t]]
    m = tr.update(uri)
    assert {"grad_norm", "clip_frac_high", "clip_frac_low", "entropy"} <= m.keys()
    assert m["entropy"] == pytest.approx(sum(ents) / len(ents), abs=1e-5)
    assert 0 < m["entropy"] < math.log(600)


def test_gradient_checkpointing_gives_the_same_update(tiny_model, tmp_path):
    uri = batch(tmp_path / "b.parquet", REWARDS)
    out = []
    for ckpt in (False, True):
        tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1, micro_batch_tokens=64,
                                                         gradient_checkpointing=ckpt), seed=0)
        assert tr.model.is_gradient_checkpointing == ckpt
        tr.update(uri)
        out.append(params(tr))
    # recomputed activations are the same numbers: only summation order may differ (fp32 rounding, far below lr)
    assert all(torch.allclose(out[0][k], out[1][k], rtol=0, atol=1e-6) for k in out[0])


def test_reset_optimizer_restarts_warmup(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=4), seed=0)
    uri = batch(tmp_path / "b.parquet", REWARDS)
    assert [tr.update(uri)["lr"] for _ in range(3)] == pytest.approx([5e-4, 7.5e-4, 1e-3])
    tr.reset_optimizer()
    assert tr.update(uri)["lr"] == pytest.approx(5e-4)


def test_lr_schedule_warmup_then_cosine_decay():
    from rstar2.training.optim import lr_lambda

    m = lr_lambda(config.TrainerCfg(warmup_steps=2, decay_steps=4, min_lr_frac=0.1))
    # s=0: warm-up 1/2 at full cosine; s=1: 0.1 + 0.9 (1 + cos(pi/4)) / 2; s=2: halfway; s>=4: the floor
    assert [m(s) for s in (0, 1, 2, 4, 10)] == pytest.approx([0.5, 0.868198, 0.55, 0.1, 0.1], abs=1e-6)
    const = lr_lambda(config.TrainerCfg(warmup_steps=2))  # decay_steps 0: the paper's constant lr
    assert [const(s) for s in (0, 1, 50)] == [0.5, 1.0, 1.0]
    from rstar2.training.optim import schedule  # the SFT's: warm-up 1 step, cosine to 0 over 4
    assert [schedule(1, 4, 0.0)(s) for s in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)


def test_deepspeed_missing_is_one_clear_error(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match="needs the deepspeed package"):
        PolicyTrainer(tiny_model, config.TrainerCfg(backend="deepspeed"), seed=0)
    with pytest.raises(ValueError, match="world_size > 1 needs"):
        config.TrainerCfg(world_size=2)


# ---------------------------------------------------------------- full-state resume
RESUME_CFG = config.TrainerCfg(lr=1e-3, warmup_steps=3, mini_batches=2, micro_batch_tokens=48)


def assert_same_as_never_stopped(tiny_model, uris, resumed_metrics, resumed, cfg=RESUME_CFG, params_of=params):
    """`resumed` (its last update's metrics `resumed_metrics`) against a trainer that ran every batch of `uris` without
    stopping: the same trained weights (`params_of`) and Adam moments, bit for bit, the same lr and step count."""
    never_stopped = PolicyTrainer(tiny_model, cfg, seed=0)
    for u in uris:
        never_stopped.update(u)
    a, b = params_of(never_stopped), params_of(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical weights
    for s1, s2 in zip(never_stopped.backend.opt.state.values(), resumed.backend.opt.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)  # and Adam moments
    assert resumed_metrics["lr"] == never_stopped.backend.lr() and resumed.step == never_stopped.step == 6


def _resume(tiny_model, ck, uri):
    resumed = PolicyTrainer(tiny_model, RESUME_CFG, seed=7)  # everything must come from the checkpoint, not the seed
    meta = resumed.load_state(str(ck))
    assert (meta["stage"], meta["step"], meta["global_step"], resumed.step) == ("s1", 2, 2, 4)
    return resumed, resumed.update(uri)


def test_resume_is_bit_identical(tiny_model, tmp_path):
    """Stop after step k (the trainer object is gone, global RNGs scrambled), resume, run step k+1."""
    uris = [batch(tmp_path / f"b{k}.parquet", REWARDS, seed=k) for k in range(3)]
    ck = tmp_path / "ck" / "step-0002"
    tr = PolicyTrainer(tiny_model, RESUME_CFG, seed=0)
    for u in uris[:2]:
        tr.update(u)
    tr.save(str(ck), {"stage": "s1", "step": 2, "global_step": 2})
    del tr
    torch.manual_seed(12345), random.seed(12345), np.random.seed(12345)
    resumed, m = _resume(tiny_model, ck, uris[2])
    assert_same_as_never_stopped(tiny_model, uris, m, resumed)


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from rstar2.core import config
    from rstar2.training.trainer import PolicyTrainer
    model, ck, *batches = sys.argv[1:]
    tr = PolicyTrainer(model, config.TrainerCfg.model_validate_json(os.environ["CFG"]), seed=0)
    for b in batches[:-1]:
        tr.update(b)
    tr.save(ck, {"stage": "s1", "step": 2, "global_step": 2})
    os.kill(os.getpid(), signal.SIGKILL)  # killed before step k+1, nothing flushed or closed
""")


@pytest.mark.e2e  # a fresh process: ~10 s of imports
def test_resume_after_kill_is_bit_identical(tiny_model, tmp_path):
    uris = [batch(tmp_path / f"b{k}.parquet", REWARDS, seed=k) for k in range(3)]
    ck = tmp_path / "ck" / "step-0002"
    env = {**os.environ, "CFG": RESUME_CFG.model_dump_json(), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, tiny_model, str(ck), *uris], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert checkpoint.manifest(ck)["optimizer_step"] == 4  # 2 RL steps x 2 mini-batches
    resumed, m = _resume(tiny_model, ck, uris[2])
    assert_same_as_never_stopped(tiny_model, uris, m, resumed)


def test_checkpoint_is_loadable_and_refuses_partial(tiny_model, tmp_path):
    tr = PolicyTrainer(tiny_model, config.TrainerCfg(lr=1e-3, warmup_steps=1), seed=0)
    tr.update(batch(tmp_path / "b.parquet", REWARDS))
    path = tr.save(str(tmp_path / "ck" / "step-0001"), {"step": 1})
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)  # what the engines load
    for (k, p), q in zip(tr.model.named_parameters(), hf.parameters()):
        assert torch.equal(p, q), k
    (tmp_path / "ck" / "step-0002").mkdir()
    with pytest.raises(FileNotFoundError):
        tr.load_state(str(tmp_path / "ck" / "step-0002"))
