"""Long phases report progress in a log too (no terminal): a line at most every `every_s` seconds, none for a phase
shorter than that."""

from rstar2.core import progress
def test_a_log_gets_a_line_per_interval(monkeypatch, capsys):
    clock = iter([0.0, 10.0, 61.0, 90.0, 125.0])  # start, then one reading per update
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.bar("SFT", every_s=60) as update:  # pytest's captured stderr is no terminal
        update(1, 100, 2.5)  # 10 s: too soon
        update(40, 100, 0.91234)  # 61 s: a line
        update(60, 100)  # 90 s: 29 s after the last line
        update(100, 100, 0.2)  # 125 s: a line
    assert capsys.readouterr().err.splitlines() == ["[SFT] 40/100 (40 %), loss 0.912, 61 s",
                                                     "[SFT] 100/100 (100 %), loss 0.200, 125 s"]


def test_a_short_phase_prints_nothing(capsys):
    with progress.bar("rollout step 1") as update:
        for i in range(10):
            update(i + 1, 10)
    assert capsys.readouterr().err == ""
