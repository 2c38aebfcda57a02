"""SFT in cycles (rstar2.training.sft.train_with): while a cycle's loss ends above sft.target_loss, the next starts from
the model the last one saved, its batches in the order of the next seed, up to sft.max_cycles; with no target, one
cycle exactly as configured. `train` itself is replaced by a recorder: this is the logic around it."""

from pathlib import Path

import pytest

from rstar2.core import config
from rstar2.training import sft


def _cycles(monkeypatch, losses: list[float], *sets: str):
    calls, it = [], iter(losses)

    def train(model_dir, data, out_dir, s, **kw):
        calls.append((model_dir, kw["seed"], s.epochs))
        kw["on_progress"](100, 100, 0.5)  # a cycle's last step
        return sft.SFTResult(steps=100, final_loss=next(it), tokens_per_s=1000.0, wall_s=10.0)

    monkeypatch.setattr(sft, "train", train)
    cfg = config.load("tiny", ["seed=5", "sft.epochs=1.5", *sets])
    shown = []
    res = sft.train_with(cfg, Path("/init"), Path("/data.jsonl"), Path("/out"), lambda *a: shown.append(a))
    assert shown == [(100 * (c + 1), 100 * (c + 1), 0.5) for c in range(len(calls))]  # steps count on over cycles
    return res, calls


def test_without_a_target_one_cycle_as_configured(monkeypatch):
    res, calls = _cycles(monkeypatch, [0.9], "sft.target_loss=null", "sft.max_cycles=3")
    assert calls == [(Path("/init"), 5, 1.5)]
    assert (res.steps, res.final_loss, res.cycle_losses) == (100, 0.9, [0.9])


def test_a_loss_above_the_target_trains_another_cycle_from_the_saved_model(monkeypatch):
    res, calls = _cycles(monkeypatch, [0.20, 0.13, 0.11], "sft.target_loss=0.16", "sft.max_cycles=3")
    assert calls == [(Path("/init"), 5, 1.5), (Path("/out"), 6, 1.5)]  # stops once 0.13 <= 0.16
    assert (res.steps, res.final_loss, res.cycle_losses, res.wall_s) == (200, 0.13, [0.20, 0.13], 20.0)
    assert res.tokens_per_s == pytest.approx(1000.0)


def test_max_cycles_bounds_the_cycles(monkeypatch):
    res, calls = _cycles(monkeypatch, [0.3, 0.3, 0.3], "sft.target_loss=0.16", "sft.max_cycles=2")
    assert [c[1] for c in calls] == [5, 6] and res.cycle_losses == [0.3, 0.3]


def test_a_loss_at_the_target_ends_the_sft(monkeypatch):
    _, calls = _cycles(monkeypatch, [0.16, 0.1], "sft.target_loss=0.16", "sft.max_cycles=2")
    assert len(calls) == 1


def test_max_cycles_below_one_is_refused():
    with pytest.raises(ValueError, match="max_cycles"):
        config.load("tiny", ["sft.max_cycles=0"])
