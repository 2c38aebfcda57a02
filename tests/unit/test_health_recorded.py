"""The collapse alert (rstar2/evaluation/health.py) on recorded runs: the health lines that tiny campaigns printed, kept
in tests/data/health/ as they were printed (one file per campaign; a run starts at its step 1). No healthy run fires it;
a recorded collapse fires it within 3 steps of its start."""

import re
from pathlib import Path

import pytest

from rstar2.evaluation.health import first_collapse

RECORDED = Path(__file__).parents[1] / "data" / "health"
LINE = re.compile(r"step (\d+) \| reward ([\d.]+) \| fmt-viol ([\d.]+) \| tool-err ([\d.]+)")
START = re.compile(r"# collapse of run (\d+) starts at step (\d+)")


def runs(path: Path) -> list[list[dict]]:
    """The per-step metrics of each run of a recorded file (a step 1 opens a run)."""
    out: list[list[dict]] = []
    for m in LINE.finditer(path.read_text()):
        step, reward, fmt, tool = int(m[1]), *map(float, m.group(2, 3, 4))
        if step == 1:
            out.append([])
        out[-1].append({"step": step, "reward_mean": reward, "format_violation_rate": fmt, "tool_error_rate": tool})
    return out


def files(kind: str) -> list[Path]:
    return sorted(RECORDED.glob(f"{kind}-*.txt"))


@pytest.mark.parametrize("path", files("healthy"), ids=lambda p: p.stem)
def test_no_healthy_recorded_run_fires(path):
    recorded = runs(path)
    assert recorded and all(len(r) == 16 for r in recorded)
    assert [first_collapse(r) for r in recorded] == [None] * len(recorded)


@pytest.mark.parametrize("path", files("collapse"), ids=lambda p: p.stem)
def test_a_recorded_collapse_fires_within_3_steps_of_its_start(path):
    recorded = runs(path)
    starts = {int(r): int(s) for r, s in START.findall(path.read_text())}  # run index -> the step it starts at
    assert starts, f"{path.name} names no collapse start"
    for i, start in starts.items():
        fired = first_collapse(recorded[i])
        assert fired is not None, f"run {i} of {path.name} never fired"
        step = recorded[i][fired[0]]["step"]
        assert start <= step <= start + 3, f"run {i} fired at step {step}, its collapse starts at step {start}"
