"""The preflight (rstar2/run/preflight.py, `rstar2 check`): the one room-to-answer rule (rstar2.rollout.trajectory.fits)
on hand-worked lengths, what a table keeps and drops, where the dropped ids go (the world's URIs, the suites), the
context taken from the model's own config, and the command's table, exit codes and --json."""

import json
import os
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from rstar2.core import config
from rstar2.rollout import trajectory
from rstar2.rollout.chat import ChatFormat
from rstar2.run import preflight
from rstar2.world import build
from rstar2.world.tokenizer import CHAT_TEMPLATE, IM_END, PAD, SPECIAL_TOKENS


@pytest.fixture(scope="module")
def chat():
    """The tiny world's chat format on a byte-level tokenizer: every byte of the text is one token and every special
    token one id, so a question of k ASCII letters adds exactly k tokens to its prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["x"], trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token=IM_END, pad_token=PAD)
    tok.chat_template = CHAT_TEMPLATE
    return ChatFormat.of(tok, "bytes")


def _base(chat) -> int:
    """The prompt's tokens around an empty question (system prompt, tools, turn markers)."""
    return len(trajectory.prompt_ids(chat, [""])[0])


def _problems(*questions: str) -> pl.DataFrame:
    return pl.DataFrame({"problem_id": [f"p{i}" for i in range(len(questions))], "prompt": list(questions),
                         "answer": ["1"] * len(questions), "source": ["t"] * len(questions)})


def test_the_rule_is_prompt_plus_the_whole_budget_within_the_context():
    limits = trajectory.RolloutLimits(max_response_tokens=384, max_model_len=1024)
    assert trajectory.fits(640, limits) and trajectory.fits(0, limits)  # 640 + 384 = 1024: exactly full fits
    assert not trajectory.fits(641, limits)  # one token more leaves 383 of the 384
    # a 1,027-token prompt: too long for the 1,024, fits its model's 2,048
    assert not trajectory.fits(1027, trajectory.RolloutLimits(max_response_tokens=384, max_model_len=1024))
    assert trajectory.fits(1027, trajectory.RolloutLimits(max_response_tokens=384, max_model_len=2048))
    assert trajectory.fits(10**6, trajectory.RolloutLimits(max_response_tokens=384))  # no context given: no limit


def test_a_question_of_k_letters_adds_k_tokens_and_the_boundary_is_exact(chat):
    b = _base(chat)
    assert [len(x) - b for x in trajectory.prompt_ids(chat, ["", "abc", "x" * 10])] == [0, 3, 10]
    # room for a 10-letter question
    limits = trajectory.RolloutLimits(max_response_tokens=20, max_model_len=b + 10 + 20)
    f = preflight.fit(_problems("x" * 9, "x" * 10, "x" * 11, "y" * 40), chat, limits)
    assert f.problems == 4 and f.kept["problem_id"].to_list() == ["p0", "p1"] and f.dropped_ids == ["p2", "p3"]
    assert f.max_prompt_tokens == b + 40


def test_the_rollout_refuses_what_the_preflight_drops_with_the_same_rule(chat):
    b = _base(chat)
    limits = trajectory.RolloutLimits(max_response_tokens=20, max_model_len=b + 30)
    trajs = trajectory.make_trajs(chat, [{"problem_id": "ok", "prompt": "x" * 10, "answer": "1"}], 2, limits)
    assert [(t.problem_id, len(t.prompt_ids), t.budget) for t in trajs] == [("ok", b + 10, 20)] * 2
    with pytest.raises(ValueError, match=f"problem long: a prompt of {b + 11} tokens leaves no room for 20 response "
                                         f"tokens in a context of {b + 30}.*rstar2 check"):
        trajectory.make_trajs(chat, [{"problem_id": "long", "prompt": "x" * 11, "answer": "1"}], 1, limits)


def test_a_tables_row_warns_with_the_dropped_ids_and_fails_only_when_nothing_is_left(chat):
    b = _base(chat)
    limits = trajectory.RolloutLimits(max_response_tokens=10, max_model_len=b + 15)
    whole = preflight.fit_row("t", preflight.fit(_problems("a", "bb"), chat, limits), limits)
    assert whole.status == preflight.OK and whole.figures["kept"] == 2 and whole.figures["dropped_ids"] == []
    some = preflight.fit_row("t", preflight.fit(_problems("a", "x" * 16), chat, limits), limits)
    assert some.status == preflight.WARN and some.figures["dropped_ids"] == ["p1"] and "dropped 1: p1" in some.detail
    none = preflight.fit(_problems("x" * 16, "y" * 17), chat, limits)
    assert preflight.fit_row("t", none, limits).status == preflight.FAIL  # nothing to train or evaluate on
    assert preflight.fit_row("t", none, limits, required=False).status == preflight.WARN  # a split the run never uses
    assert preflight.require({"checks": [{"check": "t", "status": "warn", "detail": ""}]})
    with pytest.raises(preflight.PreflightError, match="train prompts: none fit"):
        preflight.require({"checks": [{"check": "train prompts", "status": "fail", "detail": "none fit"}]})


def test_budgets_are_the_largest_stage_and_the_evaluations():
    cfg = config.load("tiny-stages", ["eval.max_response_tokens=200"])
    assert preflight.budgets(cfg) == (384, 200)  # stage1-short 256, stage2-long and stage3-hard 384
    assert preflight.budgets(config.load("tiny", ["stages=[]"])) == (384, 512)  # no stage: rollout.max_response_tokens


def test_dropped_ids_reach_the_world_uris_and_the_suites(tmp_path):
    cfg = config.load("tiny")
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    before = build.uris(cfg, tmp_path)
    assert before["train"] == str(tmp_path / "train.parquet") and "fit" not in before  # no preflight ran yet
    (tmp_path / "fit-train.parquet").write_bytes(b"")
    (tmp_path / "fit.json").write_text(json.dumps({"dropped": {"train": ["p1"], "suite:aime": ["a2"]},
                                                  "sources": {"train": build.file_sha256(tmp_path / "train.parquet")}}))
    found = build.uris(cfg, tmp_path)
    assert found["train"] == str(tmp_path / "fit-train.parquet") and found["test"] == str(tmp_path / "test.parquet")
    assert found["fit"] == str(tmp_path / "fit.json")
    assert build.uris(cfg, tmp_path, fitted=False)["train"] == str(tmp_path / "train.parquet")  # what the check reads
    (tmp_path / "train.parquet").write_bytes(b"new rows")  # the split changed after the preflight: it is read whole
    assert build.uris(cfg, tmp_path)["train"] == str(tmp_path / "train.parquet")
    (tmp_path / "train.parquet").write_bytes(b"")  # the content it read, whatever the file's times say: kept rows
    os.utime(tmp_path / "train.parquet", ns=(10**18, 10**18))
    assert build.uris(cfg, tmp_path)["train"] == str(tmp_path / "fit-train.parquet")
    suite = pl.DataFrame({"problem_id": ["a1", "a2", "a3"], "prompt": ["x"] * 3, "answer": ["1"] * 3})
    assert preflight.exclude(suite, found["fit"], "suite:aime")["problem_id"].to_list() == ["a1", "a3"]
    assert preflight.exclude(suite, found["fit"], "suite:other").height == 3
    assert preflight.exclude(suite, None, "suite:aime").height == 3  # no preflight ran: the suite as it is


def _model_dir(path: Path, positions: int) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": positions}))
    return str(path)


def test_with_base_model_the_context_is_the_models_unless_set_with_it(tmp_path):
    model = _model_dir(tmp_path / "m", 2048)
    own = [f"world.base_model={model}", "sft.enabled=false"]
    assert config.load("tiny").world.max_positions == 1024  # the tiny world's own model
    assert config.load("tiny", own).world.max_positions == 2048  # tiny's 1,024 was another model's
    assert config.load("tiny", own + ["world.max_positions=512"]).world.max_positions == 512  # set after the model
    assert config.load("tiny", ["world.max_positions=512"] + own).world.max_positions == 2048  # set before it
    both = tmp_path / "mine.yaml"
    both.write_text(f"base: tiny\nworld: {{base_model: {model}, max_positions: 4096}}\nsft: {{enabled: false}}\n")
    assert config.load(str(both)).world.max_positions == 4096  # the preset that names the model sets it
    only = tmp_path / "only.yaml"
    only.write_text(f"base: tiny\nworld: {{base_model: {model}}}\nsft: {{enabled: false}}\n")
    assert config.load(str(only)).world.max_positions == 2048
    resolved = tmp_path / "config.json"
    resolved.write_text(config.load("tiny", own).model_dump_json())
    assert config.load(str(resolved)).world.max_positions == 2048  # a run's resolved config keeps its context
    away = ["world.base_model=/nowhere/model", "world.arch={model_type: qwen3, max_position_embeddings: 40960}",
            "sft.enabled=false"]
    assert config.load("tiny", away).world.max_positions == 40960  # not on this machine: world.arch's
    assert config.load("qwen3-14b").world.max_positions == 32768  # named with its model in the same preset


def _own_model_world(tmp_path: Path, model: str, questions: list[str]) -> list[str]:
    train = tmp_path / "train.parquet"
    _problems(*questions).write_parquet(train)
    return [f"out_dir={tmp_path / 'runs'}", f"world.base_model={model}", f"world.train_data={train}",
            f"world.test_data={train}", "sft.enabled=false", "rollout.max_response_tokens=48",
            "eval.max_response_tokens=48", "stages=[{name: rl, steps: 1, prompts_per_step: 2}]"]


def test_check_command_takes_the_models_context_drops_and_counts_and_writes_json(tmp_path, qwen_model_dir):
    from rstar2.cli.main import app

    questions = ["What is 2 + 3?", "Compute 12 * 34.", "seven " * 3000]  # the last cannot fit 2,048 tokens
    args = ["check", "--json", str(tmp_path / "check.json")]
    res = CliRunner().invoke(app, args + [x for o in _own_model_world(tmp_path, str(qwen_model_dir), questions)
                                          for x in ("--set", o)])
    assert res.exit_code == 0, res.output
    assert "rstar2 check 'tiny': context 2048 tokens" in res.output and "dropped 1: p2" in res.output
    out = json.loads((tmp_path / "check.json").read_text())
    assert out["ok"] and out["context"] == 2048 and out["dropped"]["train"] == ["p2"]
    checks = {c["check"]: c for c in out["checks"]}
    assert checks["context"]["figures"]["model_max_positions"] == 2048 and checks["context"]["status"] == "ok"
    assert checks["train prompts"]["status"] == "warn" and checks["train prompts"]["figures"]["kept"] == 2
    assert [checks[k]["status"] for k in ("model and template", "plan", "sandbox")] == ["ok"] * 3
    world = tmp_path / "runs" / "tiny" / "world"
    kept = pl.read_parquet(build.uris(config.load("tiny", _own_model_world(tmp_path, str(qwen_model_dir), questions)),
                                      world)["train"])
    assert kept["problem_id"].to_list() == ["p0", "p1"]  # what RL and evaluation read


def test_check_command_exits_1_when_the_run_cannot_start(tmp_path, qwen_model_dir):
    from rstar2.cli.main import app

    base = _own_model_world(tmp_path, str(qwen_model_dir), ["What is 2 + 3?"])
    for bad, failed in ((["world.max_positions=4096"], "context"),  # beyond the model's 2,048
                        (["world.max_positions=64"], "train prompts")):  # no prompt leaves room for 48 tokens
        res = CliRunner().invoke(app, ["check", "--json", str(tmp_path / "c.json")] +
                                 [x for o in base + bad for x in ("--set", o)])
        assert res.exit_code == 1, res.output
        assert "cannot start" in res.output
        out = json.loads((tmp_path / "c.json").read_text())
        assert not out["ok"] and {c["check"]: c["status"] for c in out["checks"]}[failed] == "fail"
    res = CliRunner().invoke(app, ["check", "--set", "rollout.group_sise=3"])
    assert res.exit_code == 2 and "group_sise" in res.output  # a bad config is one error, not a table


def test_a_given_sft_model_is_the_one_checked_its_context_and_its_commit(tmp_path, qwen_model_dir):
    """`--sft-checkpoint` (as `campaign --sft-checkpoint`): the engines serve that model, so its context is the one
    world.max_positions must fit, and it must be committed; refused in the table, before anything starts."""
    import shutil

    from rstar2.cli.main import app
    from rstar2.core import checkpoint

    base = _own_model_world(tmp_path, str(qwen_model_dir), ["What is 2 + 3?"])  # the base model's context: 2,048

    def sft_model(name: str, positions: int) -> Path:
        def write(d: Path) -> None:
            shutil.copytree(qwen_model_dir, d, dirs_exist_ok=True)
            cfg_path = d / "config.json"
            cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "max_position_embeddings": positions}))
        return checkpoint.commit(tmp_path / name, write, {"kind": "sft"})

    def check(model: Path) -> dict:
        res = CliRunner().invoke(app, ["check", "--sft-checkpoint", str(model), "--json", str(tmp_path / "c.json")] +
                                 [x for o in base for x in ("--set", o)])
        out = json.loads((tmp_path / "c.json").read_text())
        assert res.exit_code == (0 if out["ok"] else 1), res.output
        return {c["check"]: c for c in out["checks"]}

    short = check(sft_model("short", 1024))  # trained at a shorter context than the world's 2,048
    assert short["context"]["status"] == "fail" and "max_position_embeddings 1024" in short["context"]["detail"]
    assert "SFT transcripts" not in short  # a given SFT model: its transcripts are not needed
    ok = check(sft_model("same", 2048))
    assert ok["context"]["status"] == "ok" and str(tmp_path / "same") in ok["model and template"]["detail"]
    loose = tmp_path / "loose"
    shutil.copytree(qwen_model_dir, loose)  # a model directory, never committed
    bad = check(loose)
    row = bad["model and template"]
    assert row["status"] == "fail" and "not a committed checkpoint" in row["detail"]
