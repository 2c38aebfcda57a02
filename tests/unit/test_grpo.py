"""GRPO-RoC loss pieces (rstar2/training/grpo.py) against hand-worked values and a literal per-token reference."""

import math

import pytest
import torch

from rstar2.training.grpo import entropy_from_logits, group_advantages, kl_penalty, policy_loss


# ---------------------------------------------------------------- advantages (Eq. 7)
def test_advantages_hand_worked():
    # [1,0,0,1]: mean 0.5, deviations ±0.5, unbiased var = 4*0.25/3 = 1/3, std = 0.57735 -> ±0.5/0.57735 = ±0.8660
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv, torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254]), atol=1e-5, rtol=0)
    # [1,0,0,0]: mean 0.25, var = (0.75² + 3*0.25²)/3 = 0.75/3 = 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)


def test_advantages_groups_interleaved_singleton_and_equal():
    r = torch.tensor([1.0, 5.0, 0.0, 1.0, 0.0, 3.0, 3.0, 1.0])
    g = torch.tensor([10, 99, 10, 10, 10, 4, 4, 7])     # arbitrary, non-contiguous ids
    adv = group_advantages(r, g)
    s = 0.8660254
    # group 10 = [1,0,1,0] -> ±0.866; 99 and 7 are singletons -> 0; group 4 all equal -> 0/(0+eps) = 0
    torch.testing.assert_close(adv, torch.tensor([s, 0, -s, s, -s, 0, 0, 0]), atol=1e-5, rtol=0)


def test_advantages_match_loop_reference():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(64, generator=gen, dtype=torch.float64)
    g = torch.randint(0, 6, (64,), generator=gen)
    ref = torch.empty_like(r)
    for k in g.unique():
        sel = g == k
        ref[sel] = (r[sel] - r[sel].mean()) / (r[sel].std() + 1e-6)   # torch.std: unbiased, as verl
    torch.testing.assert_close(group_advantages(r, g), ref)


# ---------------------------------------------------------------- policy loss (Eq. 6)
def _reference_loss(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip, num_tokens):
    """Literal per-token loop: max(-A r, -A clip(r)), dual-capped for A < 0, summed and divided by num_tokens."""
    total, count = 0.0, 0
    B, T = logp.shape
    for i in range(B):
        A = float(adv[i])
        for t in range(T):
            if mask[i, t] == 0:
                continue
            r = math.exp(max(-20.0, min(20.0, float(logp[i, t]) - float(old_logp[i, t]))))
            loss = max(-A * r, -A * min(max(r, 1 - eps_low), 1 + eps_high))
            if dual_clip is not None and A < 0:
                loss = min(loss, -A * dual_clip)
            total += loss
            count += 1
    return total / (num_tokens if num_tokens is not None else count)


def _random_batch(seed, B=6, T=11):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.6   # ratios well beyond both clips
    logp[0, 0] = old[0, 0] + 30.0                                              # exercises the ±20 clamp
    adv = torch.randn(B, generator=gen, dtype=torch.float64) * 2
    mask = (torch.rand(B, T, generator=gen) > 0.3).double()
    return logp, old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("num_tokens", [None, 100])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_matches_reference(dual_clip, num_tokens, seed):
    logp, old, adv, mask = _random_batch(seed)
    loss, _ = policy_loss(logp, old, adv, mask, dual_clip=dual_clip, num_tokens=num_tokens)
    ref = _reference_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip, num_tokens)
    assert abs(loss.item() - ref) < 1e-6


def test_global_num_tokens_makes_accumulation_exact():
    logp, old, adv, mask = _random_batch(3, B=8)
    full = logp.clone().requires_grad_()
    loss, _ = policy_loss(full, old, adv, mask, dual_clip=3.0)
    loss.backward()
    acc = logp.clone().requires_grad_()
    n = mask.sum()                                       # global count for the whole batch
    total = sum(policy_loss(acc[s], old[s], adv[s], mask[s], dual_clip=3.0, num_tokens=n)[0]
                for s in (slice(0, 3), slice(3, 8)))     # two uneven micro-batches
    total.backward()
    torch.testing.assert_close(total, loss)
    torch.testing.assert_close(acc.grad, full.grad)


def test_masked_tokens_get_exactly_zero_gradient():
    logp, old, adv, mask = _random_batch(4)
    logp = logp.clone()
    logp[mask == 0] = float("-inf")                      # garbage on padding / tool tokens must not leak
    logp.requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    assert (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).any()


def _one_token_grad(ratio, A, dual_clip=None):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([A], dtype=torch.float64),
                              torch.ones(1, 1), dual_clip=dual_clip)
    loss.backward()
    return logp.grad.item(), stats


def test_clipping_gradients():
    g, s = _one_token_grad(1.5, +1.0)                    # 1.5 > 1.28, A > 0: clipped, constant -> no gradient
    assert g == 0 and s["clip_frac_high"] == 1 and s["clip_frac_low"] == 0
    g, s = _one_token_grad(0.5, +1.0)                    # A > 0, ratio low: unclipped, d(-A r)/dlogp = -A r = -0.5
    assert g == pytest.approx(-0.5) and s["clip_frac_high"] == 0 and s["clip_frac_low"] == 0
    g, s = _one_token_grad(0.5, -1.0)                    # A < 0, 0.5 < 0.8: clipped -> no gradient
    assert g == 0 and s["clip_frac_low"] == 1
    g, _ = _one_token_grad(5.0, -1.0)                    # A < 0, ratio 5: -A r = 5 is the max -> gradient 5
    assert g == pytest.approx(5.0)
    g, s = _one_token_grad(5.0, -1.0, dual_clip=3.0)     # dual clip caps the loss at -A c = 3 -> no gradient
    assert g == 0 and s["dual_clip_frac"] == 1


def test_stats_values():
    logp = torch.log(torch.tensor([[1.0, 2.0, 1.0]]))
    loss, s = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
    # tokens: r = 1 (loss -1), r = 2 clipped to 1.28 (loss -1.28); masked third token ignored
    assert loss.item() == pytest.approx(-(1 + 1.28) / 2)
    assert s["clip_frac_high"].item() == pytest.approx(0.5) and s["ratio_mean"].item() == pytest.approx(1.5)
    assert s["approx_kl"].item() == pytest.approx((0 + (2 - 1 - math.log(2))) / 2)


def test_empty_mask_is_zero_not_nan():
    loss, _ = policy_loss(torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0


# ---------------------------------------------------------------- regularisers
def test_kl_and_entropy():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.ones(1, 2)
    assert kl_penalty(logp, logp, mask).item() == 0.0
    # token 1: d = log(ref/π) = -log 2; k1 = log 2, k3 = 1/2 - 1 + log 2; token 2: 0.  Mean over 2 tokens.
    assert kl_penalty(logp, ref, mask, "k1").item() == pytest.approx(math.log(2) / 2)
    assert kl_penalty(logp, ref, mask, "k3").item() == pytest.approx((0.5 - 1 + math.log(2)) / 2)
    assert kl_penalty(logp, ref, mask, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2 / 2)
    ent = entropy_from_logits(torch.zeros(2, 3, 8))      # uniform over 8 -> log 8
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(8)))
