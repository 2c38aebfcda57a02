"""`rstar2 sft` on any chat model: transcripts in the common messages layout (rstar2.training.transcripts), rendered
with the model's own template, a few steps on the Qwen-shaped fixture, bucketed or packed, and a loadable model
directory out. Bad input is one clear error naming the file and line."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rstar2.cli.main import app
from rstar2.core import checkpoint
from rstar2.core.config import SFTCfg
from rstar2.rollout.chat import ChatFormat, prompt_messages
from rstar2.rollout.template import TOOL_NAME
from rstar2.training import transcripts


def _rows(n: int) -> list[dict]:
    """Two-turn transcripts with a tool call; the arguments as a JSON string (OpenAI's layout) in every other one."""
    rows = []
    for i in range(n):
        a, b = 10 + i, 7
        args = {"code": f"print({a} * {b})", "input": ""}
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": json.dumps(args) if i % 2 else args}}
        rows.append({"messages": prompt_messages(f"What is {a} * {b}?", system=False) + [
            {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
            {"role": "tool", "content": f"Tool call success\nstdout: {a * b}\n"},
            {"role": "assistant", "content": f"<answer>\\boxed{{{a * b}}}</answer>"}]})
    return rows


def _sft(tmp_path, model, data, out, *sets):
    return CliRunner().invoke(app, ["sft", "--data", str(data), "--model", str(model), "--out", str(out),
                                    "--json", str(tmp_path / "res.json"), "--set", "trainer.device=cpu",
                                    *[x for s in sets for x in ("--set", s)]])


@pytest.mark.e2e  # trains a Qwen-vocabulary model through the CLI: ~10 s each
@pytest.mark.parametrize("packed", [False, True])
def test_rstar2_sft_trains_a_chat_model_and_writes_a_loadable_model(tmp_path, qwen_model_dir, packed):
    data, out = tmp_path / "sft.jsonl", tmp_path / "out"
    transcripts.write(_rows(8), data)
    res = _sft(tmp_path, qwen_model_dir, data, out, "sft.epochs=1", "sft.batch_tokens=512", f"sft.packed={packed}")
    assert res.exit_code == 0, res.output
    figures = json.loads((tmp_path / "res.json").read_text())
    assert figures["steps"] >= 2 and figures["final_loss"] == figures["final_loss"]  # 2 batches an epoch at least
    assert checkpoint.is_committed(out) and ChatFormat.load(out).end_of_turn == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    before = load_file(str(qwen_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(model.model.embed_tokens.weight.detach(), before)


@pytest.mark.e2e
def test_sft_with_lora_trains_adapters_only_and_saves_them_merged(tmp_path, qwen_model_dir):
    """sft.lora: the base frozen, only the adapters train; the model saved is base + adapter merged, a plain HF
    directory: layers with adapters moved, those without (embeddings, norms) are the base's bit for bit."""
    data, out = tmp_path / "sft.jsonl", tmp_path / "out"
    transcripts.write(_rows(8), data)
    res = _sft(tmp_path, qwen_model_dir, data, out, "sft.epochs=2", "sft.batch_tokens=512", "sft.lr=1e-2",
               "sft.lora={rank: 8, alpha: 16, targets: [q_proj, v_proj, down_proj]}")
    assert res.exit_code == 0, res.output
    assert not (out / "adapter_config.json").exists()
    before, after = load_file(str(qwen_model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in moved)
    assert AutoModelForCausalLM.from_pretrained(str(out)) is not None


def test_rstar2_sft_refuses_bad_input_with_one_clear_error(tmp_path, qwen_model_dir):
    data = tmp_path / "bad.jsonl"
    good = json.dumps(_rows(1)[0])
    cases = {
        "{not json": "bad.jsonl:2: Expecting property name",
        json.dumps({"text": "hi"}): "bad.jsonl:2: expected an object with a non-empty 'messages' list",
        json.dumps({"messages": prompt_messages("q")}): "bad.jsonl:2: no assistant message",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}):
            "bad.jsonl:2: message 0: expected an object whose 'role'",
        json.dumps({"messages": prompt_messages("q") + [{"role": "assistant", "content": "",
                                                         "tool_calls": [{"f": 1}]}]}):
            "bad.jsonl:2: message 2: a tool call needs",
    }
    for line, error in cases.items():
        data.write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=error):
            transcripts.read(data)
    res = _sft(tmp_path, qwen_model_dir, data, tmp_path / "out")
    assert res.exit_code == 2 and "bad.jsonl:2: message 2: a tool call needs" in res.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    res = _sft(tmp_path, qwen_model_dir, data, tmp_path / "full")
    assert res.exit_code == 2 and "exists and is not empty" in res.output
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_shared_openings_by_hand():
    from rstar2.training.sft import MIN_SHARED, shared_openings

    head = list(range(100, 100 + MIN_SHARED + 8))  # an untrained opening of 40 tokens the first three share
    ids = [head + [1, 2, 3], head + [1, 9, 9, 9], head[:-2] + [5, 6], [7] * 50]
    masks = [[0] * (len(head) + 1) + [1, 1], [0] * (len(head) + 2) + [1, 1], [0] * len(head) + [1], [0] * 49 + [1]]
    lens, groups = shared_openings(ids, masks)
    # the common opening of all three is head[:-2] (38 tokens); the fourth shares nothing: a group of its own
    assert lens == [MIN_SHARED + 6] * 3 + [0] and groups == [0, 0, 0, 1]


def test_a_shared_opening_is_computed_once_and_changes_no_loss(qwen_model_dir):
    """The packed rows with the opening stored once give the loss of the same transcripts packed whole."""
    from rstar2.training import sft
    from rstar2.training.batching import collate, loss_token_logprobs, use_varlen_attention

    chat = ChatFormat.load(qwen_model_dir)
    ids, masks = sft.tokenize(chat, [r["messages"] for r in _rows(4)])
    lens, groups = sft.shared_openings(ids, masks)
    assert len(set(groups)) == 1 and lens[0] >= sft.MIN_SHARED  # the system turn with the tools block
    model = AutoModelForCausalLM.from_pretrained(str(qwen_model_dir), dtype=torch.float32)
    use_varlen_attention(model)
    shared, whole = collate(ids, masks, [0, 1, 2, 3], 0, True, lens), collate(ids, masks, [0, 1, 2, 3], 0, True)
    assert shared.ids.shape[1] == whole.ids.shape[1] - 3 * lens[0]  # stored once for the four
    with torch.no_grad():
        a, b = loss_token_logprobs(model, shared)[0], loss_token_logprobs(model, whole)[0]
    assert torch.allclose(a, b, atol=1e-4)


def test_wsd_holds_the_lr_and_a_formed_skill_ends_the_cycle_early(qwen_model_dir):
    """decay_frac < 1 holds the lr until the budget's last share (WSD); with decay_at_target the held phase ends once
    the slow loss average reaches target_loss, and the cycle ends one decay later: 3 steps + 5 of decay, not 20."""
    from rstar2.training import optim, sft

    hold = optim.schedule(1, 4, 0.0, stable_steps=2)  # warm-up 1 step, held 2, a cosine over 4 down to 0
    assert [hold(s) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    chat = ChatFormat.load(qwen_model_dir)
    ids, masks = sft.tokenize(chat, [r["messages"] for r in _rows(8)])
    per_epoch = sft.batches_per_epoch(ids, masks, 256, False)

    def run(decay_at_loss):
        model = AutoModelForCausalLM.from_pretrained(str(qwen_model_dir), dtype=torch.float32)
        totals = []
        s = SFTCfg(epochs=20.5 / per_epoch, lr=1e-3, batch_tokens=256, warmup_frac=0.1, decay_frac=0.25,
                   target_loss=decay_at_loss, decay_at_target=decay_at_loss is not None)
        res = sft.fit(model, ids, masks, s, seed=0, dtype="float32", pad_id=0,
                      on_progress=lambda step, total, loss: totals.append(total))
        return res.steps, totals

    steps, totals = run(None)  # never formed: the whole budget, its last 5 steps the decay
    assert steps == 20 and set(totals) == {20}
    steps, totals = run(1e9)  # formed at once: the held phase ends after the warm-up's 2 steps and one more
    assert steps == 8 and totals[:2] == [20, 20] and set(totals[2:]) == {8}
