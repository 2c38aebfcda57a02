"""The runs of `rstar2 chaos` (rstar2.cli.chaos): the reference, then each row of faults from the same SFT model,
each started, driven (a fault injected at its point), retried while it stops with an error, and checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

from rstar2.cli.chaos.checks import differences, results, verdict
from rstar2.cli.chaos.faults import Fault, Run, Unready, fault_table
from rstar2.cli.chaos.servers import servers_up, start_row_servers
from rstar2.core import checkpoint, config, tracking
from rstar2.core.layout import RunLayout

# the shrunken campaign: three RL steps of a few prompts; every step updates (drop_all_equal off), so the optimizer
# step count shows whether the trainer's state came back
SHRINK = ["stages.0.steps=3", "stages.0.prompts_per_step=3", "rollout.group_size=4", "eval.samples=1",
          "roc.drop_all_equal=false"]
# and for the tiny world (no world.base_model): fewer problems, shorter answers. Its SFT stays the preset's: a weaker
# model earns no reward, so its updates are zero and a wrong trainer state after a fault would go unseen
SHRINK_TINY_WORLD = ["world.n_train=40", "world.n_test=20", "rollout.max_response_tokens=160",
                     "eval.max_response_tokens=160", "world.max_positions=512"]
TIMEOUT_S = 1800.0  # one run of the shrunken campaign, at most


def campaign_cmd(preset: str, overrides: list[str], out: Path, name: str, sft: Path | None) -> list[str]:
    sets = [a for s in overrides + [f"out_dir={out}"] for a in ("--set", s)]
    return [sys.executable, "-m", "rstar2.cli.main", "campaign", "--preset", preset, "--run-name", name, *sets,
            *(["--sft-checkpoint", str(sft)] if sft else [])]


def _start(run: Run, cmd: list[str]) -> None:
    env = {**os.environ, **run.env}
    run.proc = subprocess.Popen(cmd, stdout=run.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)


def _drive(run: Run, pending: list[Fault], struck: dict[str, str], deadline: float) -> None:
    """Wait for the run to end, injecting the first pending fault once it is due."""
    while run.alive():
        if time.monotonic() > deadline:
            os.killpg(run.proc.pid, signal.SIGKILL)
            raise TimeoutError(f"{run.layout.name} ran past {TIMEOUT_S:.0f} s")
        f = pending[0] if pending else None  # a row's faults strike in turn: each after the one before it
        if f is not None and f.due(run) and run.alive():
            try:
                struck[f.name] = f.inject(run)
                pending.remove(f)
                if f.stops_run:  # dead before the next fault is armed (one armed meanwhile would be mended away)
                    run.proc.wait(timeout=60)
                continue
            except Unready:
                pass
            except psutil.Error as e:  # the process ended between finding it and the signal
                struck[f.name] = f"could not be injected: {e}"
                pending.remove(f)
        servers_up(run, due_only=True)
        time.sleep(0.05)


def run_row(run: Run, cmd: list[str], faults: list[Fault]) -> dict:
    """One row: the run with its faults, retried (at most once per fault) while it stops with an error. Returns how it
    went."""
    struck: dict[str, str] = {}
    committed_before: dict[str, str] = {}
    t0, attempts = time.monotonic(), 0
    pending = list(faults)
    try:
        for f in faults:
            f.prepare(run)
        for attempts in range(1, len(faults) + 2):
            _start(run, cmd)
            _drive(run, pending, struck, t0 + TIMEOUT_S)
            if run.proc.returncode == 0 or attempts == len(faults) + 1:
                break
            committed_before |= {c.name: checkpoint.manifest(c)["committed_at"]
                                for c in checkpoint.committed(run.layout.checkpoints(run.stage))}
            for f in faults:
                f.mend(run)
            servers_up(run)  # the servers come back before the retry
        servers_up(run)  # and before the run's records are read
    finally:
        for f in faults:
            f.cleanup(run)
    return {"returncode": run.proc.returncode, "attempts": attempts, "struck": struck,
            "not_injected": [f.name for f in pending], "committed_before_retry": committed_before,
            "wall_s": round(time.monotonic() - t0, 1)}



DEFAULT_ROWS = ["none", "engine", "executor", "server", "trainer", "flow", "disk", "mlflow", "prefect"]


def parse_rows(rows: list[str], known: dict[str, Fault]) -> list[list[str]]:
    """`a+b` puts faults a and b in one run (a row); each name must be known."""
    parsed = [r.split("+") for r in rows]
    unknown = sorted({n for r in parsed for n in r} - set(known))
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return parsed


def run_chaos(preset: str, overrides: list[str], rows: list[str], outage_s: float, sft: Path | None = None,
              say: Callable[[str], None] = print) -> dict:
    """The reference run (from `sft`, a committed SFT model, when given; else it trains its own), then each row from
    the same SFT model; returns every figure the table shows (see the module docstring)."""
    known = fault_table(outage_s)
    plan = parse_rows(rows, known)
    if sft is not None and not checkpoint.is_committed(Path(sft)):
        raise ValueError(f"--sft-checkpoint {sft} is not a committed checkpoint (no {checkpoint.MARKER})")
    cfg = config.load(preset, overrides)
    sets = SHRINK + ([] if cfg.world.base_model else SHRINK_TINY_WORLD) + list(overrides)  # the user's win
    cfg = config.load(preset, sets)
    stage = cfg.stages[0].name
    out = Path(cfg.out_dir).resolve() / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    uri = tracking.store_uri(str(out))

    ref = Run(RunLayout.of(out, "ref"), stage, out / "ref.log")
    say(f"reference run (no faults) -> {ref.layout.top}")
    ref_row = run_row(ref, campaign_cmd(preset, sets, out, "ref", sft), [])
    if ref_row["returncode"] != 0:
        raise RuntimeError(f"the reference run failed (exit {ref_row['returncode']}); its log: {ref.log}")
    want = results(ref.layout, stage, uri)
    sft = sft or ref.layout.sft
    report = {"preset": preset, "overrides": sets, "out_dir": str(out), "reference": {
        "wall_s": ref_row["wall_s"], "pass1": want["pass1"], "steps": want["steps"]}, "rows": []}
    for faults in plan:
        name = "+".join(faults)
        run = Run(RunLayout.of(out, name), stage, out / f"{name}.log",
                  state={"sft": sft, "split": cfg.eval.split, "outage_s": outage_s, "servers": {}})
        say(f"row {name}: {', '.join(known[f].point for f in faults)} -> {run.layout.top}")
        try:
            row_uri, row_sets = start_row_servers(run, faults, out, cfg.sandbox, uri, sets)
            row = run_row(run, campaign_cmd(preset, row_sets, out, name, sft), [known[f] for f in faults])
            got = results(run.layout, stage, row_uri)
            row["differences"] = differences(got, want, row.pop("committed_before_retry"))
        except (RuntimeError, OSError, TimeoutError) as e:
            row = {"returncode": None, "attempts": 0, "struck": {}, "not_injected": faults, "wall_s": None,
                   "differences": [str(e)]}
        finally:
            for server in run.state["servers"].values():
                server.stop()
        row.update(faults=faults, point={f: known[f].point for f in faults}, log=str(run.log))
        row["verdict"] = verdict(row)
        say(f"row {name}: {row['verdict']}" + "".join(f"\n  {d}" for d in row["differences"]))
        report["rows"].append(row)
    report["all_recovered"] = all(r["verdict"] in ("recovered", "retried") for r in report["rows"])
    return report
