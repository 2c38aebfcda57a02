"""Micro-batch layouts (rstar2/training/batching.py): budgets, sharding, and log-probs identical to
one-sequence-at-a-time."""

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rstar2.training.batching import (
    collate,
    loss_token_logprobs,
    pack_rows,
    shard,
    token_budget_batches,
    use_varlen_attention,
)


def test_bucket_budget_and_cover():
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(200)]
    batches = token_budget_batches(lengths, 1000)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(max(lengths[i] for i in b) * len(b) <= 1000 for b in batches)
    assert token_budget_batches([5000, 3], 1000) == [[1], [0]]  # too long for the budget: alone, never dropped


def test_pack_budget_and_groups_share_their_prompt():
    rng = random.Random(1)
    groups = [g for g in range(10) for _ in range(8)]
    prompt = {g: rng.randint(20, 60) for g in range(10)}
    plens = [prompt[g] for g in groups]
    lengths = [p + rng.randint(5, 200) for p in plens]
    rows = pack_rows(lengths, 1024, plens, groups)
    assert sorted(i for r in rows for i in r) == list(range(80))
    for r in rows:  # each group in a row pays its prompt once
        cost = sum(lengths[i] - plens[i] for i in r) + sum(prompt[g] for g in {groups[i] for i in r})
        assert cost <= 1024
    plain = pack_rows(lengths, 1024)
    assert all(sum(lengths[i] for i in r) <= 1024 for r in plain) and len(plain) > len(rows)


def test_shard_partitions_and_balances():
    lengths = [random.Random(2).randint(1, 500) for _ in range(37)]
    parts = [shard(lengths, 4, r) for r in range(4)]
    assert sorted(i for p in parts for i in p) == list(range(37))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)


def test_collate_selects_exactly_the_loss_tokens():
    ids = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 14, 15]]        # same 3-token prompt
    mask = [[0, 0, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1]]
    for packed, plens in ((False, None), (True, None), (True, [3, 3])):
        mb = collate(ids, mask, [0, 1], pad_id=0, packed=packed, prompt_lens=plens)
        assert mb.tgt.tolist() == [8, 11, 14, 15] and mb.seq.tolist() == [0, 0, 1, 1] and \
            mb.tok.tolist() == [3, 6, 3, 4]
        flat = mb.ids.view(-1)
        assert flat[mb.src].tolist() == [7, 10, 7, 14]          # each predicted from the token before it
    shared = collate(ids, mask, [0, 1], 0, True, [3, 3])
    assert shared.fed_tokens == 7 + 2 and shared.real_tokens == 12
    assert shared.pos.tolist() == [[0, 1, 2, 3, 4, 5, 6, 3, 4]] and shared.segments == [[(0, 7, 0, 0), (7, 9, 0, 3)]]


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, mask, plens = [], [], []
    for grp in range(3):
        prompt = torch.randint(1, 300, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(2, 30, (1,), generator=g))
            ids.append(prompt + torch.randint(1, 300, (n,), generator=g).tolist())
            mask.append([0] * len(prompt) + (torch.rand(n, generator=g) > 0.3).long().tolist())
            plens.append(len(prompt))
    return ids, mask, plens


@pytest.mark.parametrize("layout", ["bucket", "pack", "pack-shared"])
def test_layouts_match_one_sequence_at_a_time(layout):
    model = _model()
    ids, mask, plens = _data()
    ref = []
    with torch.no_grad():
        for s, m in zip(ids, mask):
            lp = model(input_ids=torch.tensor([s])).logits[0, :-1].log_softmax(-1)
            ref += [lp[t - 1, s[t]].item() for t in range(1, len(s)) if m[t]]
    if layout != "bucket":
        use_varlen_attention(model)
    order = list(range(len(ids)))
    random.Random(3).shuffle(order)
    groups = [i // 4 for i in range(len(ids))]
    if layout == "bucket":
        plan = token_budget_batches([len(ids[i]) for i in order], 120)
    else:
        shared = layout == "pack-shared"
        plan = pack_rows([len(ids[i]) for i in order], 120, [plens[i] for i in order] if shared else None,
                         [groups[i] for i in order] if shared else None)
    got = {}
    with torch.no_grad():
        for p in plan:
            mb = collate(ids, mask, [order[j] for j in p], 0, layout != "bucket",
                         plens if layout == "pack-shared" else None)
            lp, ent = loss_token_logprobs(model, mb, with_entropy=True)
            assert (ent > 0).all()
            for v, s, t in zip(lp.tolist(), mb.seq.tolist(), mb.tok.tolist()):
                got[(s, t)] = v
    flat = [got[(i, t)] for i, m in enumerate(mask) for t in range(1, len(m)) if m[t]]
    torch.testing.assert_close(torch.tensor(flat), torch.tensor(ref), atol=2e-5, rtol=0)
