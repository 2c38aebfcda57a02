"""The entropy analysis (rstar2/evaluation/entropy.py): token classes on a hand-built trajectory, entropies against a
softmax computed by hand from the model's logits, and the high-entropy split on hand-picked values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rstar2.evaluation import entropy
from rstar2.evaluation.entropy import REASONING as F
from rstar2.evaluation.entropy import REFLECTION as R

N = None  # a token the model did not write


def test_token_classes_hand_built_trajectory():
    # prompt(3) | model turn 1 (3) | tool response (2) | model turn 2 (4) | tool response (1) | model turn 3 (1)
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]
    assert entropy.token_classes(mask, window=2) == [N, N, N, F, F, F, N, N, R, R, F, F, N, R]
    # a wider window than the turn: the whole turn is reflection; the prompt is never a tool response
    assert entropy.token_classes(mask, window=5) == [N, N, N, F, F, F, N, N, R, R, R, R, N, R]
    assert entropy.token_classes([0, 0, 1, 1], window=3) == [N, N, F, F]


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                      initializer_range=0.5)  # wide weights: entropies far apart, not all near log(V)
    return Qwen2ForCausalLM(cfg).eval()


def test_sequence_entropies_match_softmax_by_hand():
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (9, 5, 12)]
    mask = [[0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1]]
    # a budget of 20 tokens: two micro-batches ([5, 9] right-padded to 9, then [12])
    got = entropy.sequence_entropies(model, ids, mask, pad_id=0, max_tokens=20)
    spread = []
    for s, m, e in zip(ids, mask, got):
        with torch.no_grad():
            z = model(torch.tensor([s])).logits[0].double()                                # (L, V)
        want = []
        for t in range(1, len(s)):
            if m[t]:  # token t is predicted by the logits at t - 1
                p = [math.exp(v - max(z[t - 1].tolist())) for v in z[t - 1].tolist()]
                p = [x / sum(p) for x in p]
                want.append(-sum(x * math.log(x) for x in p if x > 0))
        assert len(e) == len(want) == sum(m[1:])
        np.testing.assert_allclose(e, want, atol=1e-4)
        spread += want
    assert max(spread) - min(spread) > 0.1  # the check compares distinct values, not one constant


def test_high_entropy_split_hand_picked():
    # 10 model tokens, entropies 0..9: the 0.8 quantile is 7.2, so the top 20 % are the tokens with 8 and 9
    ents = [np.array([0.0, 9.0, 1.0, 2.0, 3.0]), np.array([8.0, 4.0, 5.0, 6.0, 7.0])]
    classes = [[F, F, F, R, R], [R, F, F, F, F]]
    strings = [["a", "But", "b", "c", "d"], ["Wait", "e", "f", "g", "h"]]
    f = entropy.high_entropy_figures(ents, classes, strings, top_frac=0.2)
    assert f["tokens"] == 10 and f["high_tokens"] == 2 and f["threshold"] == pytest.approx(7.2)
    assert f[F]["share_of_high"] == 0.5 and f[R]["share_of_high"] == 0.5
    assert f[R]["tokens"] == 3 and f[R]["high_rate"] == pytest.approx(1 / 3)   # 8 of {2, 3, 8}
    assert f[F]["high_rate"] == pytest.approx(1 / 7)                           # 9 of the other seven
    assert f[R]["entropy_mean"] == pytest.approx((2 + 3 + 8) / 3)
    assert f[F]["top_strings"] == [("But", 1)] and f[R]["top_strings"] == [("Wait", 1)]
    with pytest.raises(ValueError, match="do not align"):
        entropy.high_entropy_figures(ents, classes, [["a"]], top_frac=0.2)


def _tokenizer():
    vocab = {w: i for i, w in enumerate(["<pad>", *[f"w{i}" for i in range(1, 40)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_analyze_aligns_classes_strings_and_entropies():
    model, tok = _model(), _tokenizer()
    rows = [{"prompt_ids": [3, 4], "response_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [1, 1, 0, 0, 1, 1]},
            {"prompt_ids": [2, 4], "response_ids": [11, 12, 13], "loss_mask": [1, 1, 1]}]
    f = entropy.analyze(model, tok, rows, window=1, top_frac=0.25, max_tokens=64)
    # model tokens: w5 w6 | w9 (reflection: first after the tool) w10 | w11 w12 w13
    assert f["tokens"] == 7 and f[R]["tokens"] == 1 and f[F]["tokens"] == 6
    ents = entropy.sequence_entropies(model, [[3, 4, 5, 6, 7, 8, 9, 10]], [[0, 0, 1, 1, 0, 0, 1, 1]], 0, 64)[0]
    assert f[R]["entropy_mean"] == pytest.approx(float(ents[2]), abs=1e-6)
    top = [(s, n) for c in (F, R) for s, n in f[c]["top_strings"]]  # the strings are the tokens' own
    assert sum(n for _, n in top) == f["high_tokens"] == 2 and {s for s, _ in top} <= {"w5", "w6", "w9", "w10",
                                                                                        "w11", "w12", "w13"}
    rows_md = entropy.markdown({"sft": f, "rl": f})
    assert rows_md.count("| sft |") == 1 and "reflection tokens" in rows_md
