"""The boundary between placement policies and the scheduler: a policy reads a read-only view of the books and
returns its decisions, which the scheduler applies. Checked on the source (every policy of rstar2.rollout.policies and
the simulator's oracles), so that a new policy cannot quietly reach into the scheduler's mirrors again."""

import ast
from pathlib import Path

import numpy as np
import pytest

from rstar2.core.config import SchedulerCfg
from rstar2.rollout.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]
# the scheduler's mirrors and mutators: the books a policy must not read or write behind the scheduler's back
FORBIDDEN = {"full", "held", "loads", "sync", "place", "engines", "__dict__", "setflags"}
REFLECTION = {"getattr", "setattr", "delattr", "vars"}


def _policy_code() -> dict[str, list[ast.AST]]:
    """file -> the nodes to check: all of rstar2/rollout/policies.py, and every class in bench/ that subclasses a
    policy."""
    policies = ast.parse((ROOT / "rstar2" / "rollout" / "policies.py").read_text())
    code = {"rstar2/rollout/policies.py": [policies]}
    known = {"Policy"} | {c.name for c in ast.walk(policies) if isinstance(c, ast.ClassDef)
                          and any(isinstance(b, ast.Name) and b.id == "Policy" for b in c.bases)}
    trees = {f"bench/{p.name}": ast.parse(p.read_text()) for p in sorted((ROOT / "bench").glob("*.py"))}
    while True:  # subclasses of subclasses (e.g. of EarlyBinding), across files
        found = {(f, c) for f, t in trees.items() for c in ast.walk(t) if isinstance(c, ast.ClassDef)
                 and c.name not in known and any(_base_name(b) in known for b in c.bases)}
        if not found:
            break
        known |= {c.name for _, c in found}
        for f, c in found:
            code.setdefault(f, []).append(c)
    return code


def _base_name(b: ast.expr) -> str | None:
    return b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _violations(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            private = n.attr.startswith("_") and not (n.attr.startswith("__") and n.attr.endswith("__"))
            if n.attr in FORBIDDEN:
                out.append(f"line {n.lineno}: .{n.attr} (the scheduler's books)")
            elif private and not _is_self(n.value):
                out.append(f"line {n.lineno}: .{n.attr} of another object")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in REFLECTION:
            out.append(f"line {n.lineno}: {n.func.id}()")
        targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else
                   [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and isinstance(x.ctx, (ast.Store, ast.Del)) and not _is_self(x.value):
                    out.append(f"line {x.lineno}: assigns .{x.attr} of another object")
                if isinstance(x, ast.Subscript) and isinstance(x.ctx, (ast.Store, ast.Del)) \
                        and isinstance(x.value, ast.Attribute) and not _is_self(x.value.value):
                    out.append(f"line {x.lineno}: writes into .{x.value.attr} of another object")
    return out


def test_the_policy_code_is_found():
    code = _policy_code()
    classes = {c.name for nodes in code.values() for n in nodes for c in ast.walk(n) if isinstance(c, ast.ClassDef)}
    assert {"Policy", "EarlyBinding", "Static", "RoundRobin", "LeastRequests", "KvAware"} <= classes
    assert {"Oracle", "OracleStatic"} <= classes  # the simulator's, in bench/rollout_sim.py


@pytest.mark.parametrize("path", sorted(_policy_code()))
def test_no_policy_touches_the_schedulers_books(path):
    """No policy reads the scheduler's mirrors or calls its mutators, touches another object's private names, or
    assigns to another object's attributes (an engine's view, a trajectory's): it returns decisions instead."""
    found = sorted({v for n in _policy_code()[path] for v in _violations(n)}, key=lambda v: int(v.split()[1][:-1]))
    assert not found, f"{path}:\n  " + "\n  ".join(found)


def test_the_view_a_policy_gets_is_read_only():
    """A policy's `s` is not the scheduler: its arrays cannot be written through, its trajectories' mapping and its
    settings cannot be replaced, and it follows the books as the scheduler applies placements."""
    s = Scheduler([1000, 2000], SchedulerCfg(), "kv_aware")
    s.submit(0, "a", 10, 100, 0.0)
    view = s.policy.s
    assert not isinstance(view, Scheduler)
    for name in ("alive", "inflight", "admit_kv", "outside_kv", "load_mean"):
        arr = getattr(view, name)
        assert isinstance(arr, np.ndarray) and not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[0] = 0
    with pytest.raises(TypeError):
        view.trajs[1] = view.trajs[0]
    with pytest.raises(AttributeError):
        view.cfg = SchedulerCfg()
    assert s.dispatch(0.0) == [(0, 1)]  # the engine with the most room
    rooms, fits = view.rooms(view.trajs[0], s.policy.footprint(view.trajs[0]))
    assert not rooms.flags.writeable and not fits.flags.writeable and not view.grid.flags.writeable
    assert list(view.inflight) == [0, 1]
