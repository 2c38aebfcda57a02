"""The run layout (rstar2.core.layout) is the only code that builds or parses a run's paths, and flows and tasks take
few parameters: the run reference and the config sections they use."""

import ast
import inspect
from pathlib import Path

import pytest

from rstar2.core.layout import RunLayout, RunRef, WorldPaths

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("rstar2", "flows", "tasks")


def test_paths_of_one_seed_and_of_several(tmp_path):
    one = RunLayout.at(tmp_path / "r")
    assert one.checkpoint("stage1", 3) == tmp_path / "r" / "checkpoints" / "stage1" / "step-0003"
    assert one.step_dir("stage1", 0) == tmp_path / "r" / "stage1" / "step-0000"
    seed = one.for_seed(2, seeds=3)
    assert seed.checkpoint("s", 12) == tmp_path / "r" / "seed-2" / "checkpoints" / "s" / "step-0012"
    assert seed.world == one.world == tmp_path / "r" / "world" and seed.sft == one.sft
    assert seed.name == "r-seed-2" and one.name == "r" and one.for_seed(2, seeds=1) == one


def test_a_checkpoint_is_parsed_back_to_its_run(tmp_path):
    top = RunLayout.at(tmp_path / "r")
    top.top.mkdir(parents=True)
    top.config.write_text("{}")
    for layout in (top, top.for_seed(1, seeds=2)):
        ckpt = layout.checkpoint("stage2", 7)
        assert RunLayout.of_checkpoint(ckpt) == layout.model_copy(update={"world_dir": None})
        assert RunLayout.label(ckpt) == "stage2/step-0007" and RunLayout.label(ckpt, "-") == "stage2-step-0007"
    assert RunLayout.label(top.sft) == "sft"
    with pytest.raises(ValueError, match="not an RL checkpoint"):
        RunLayout.of_checkpoint(top.sft)


def test_the_run_reference_round_trips_through_json(tmp_path):
    world = WorldPaths(sft_problems="a", train="t", test="x", sft_data="d", init_model="m")
    ref = RunRef(layout=RunLayout.at(tmp_path), world=world, experiment_id="1", mlflow_run_id="2", controller_id="c")
    assert RunRef.model_validate_json(ref.model_dump_json()) == ref
    assert world.split("test") == "x"
    with pytest.raises(ValueError, match="no val split"):
        world.split("val")


def _path_parts(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that build or parse a path (`p / "x"`, `Path(..., "x")`, `.joinpath`, `.glob`, `.startswith`)
    and f-strings, with their line numbers."""
    found = []
    for n in ast.walk(tree):
        parts = []
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            parts = [n.left, n.right]
        elif isinstance(n, ast.Call) and (getattr(n.func, "id", None) == "Path" or getattr(n.func, "attr", None) in
                                          ("joinpath", "glob", "rglob", "startswith", "removeprefix")):
            parts = list(n.args)
        elif isinstance(n, ast.JoinedStr):
            parts = n.values
        found += [(n.lineno, p.value) for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
    return found


def test_no_run_path_is_built_outside_the_layout():
    found = []
    for layer in LAYERS:
        for f in sorted((ROOT / layer).rglob("*.py")):
            if f == ROOT / "rstar2" / "core" / "layout.py":
                continue
            tree = ast.parse(f.read_text())
            rel = f.relative_to(ROOT)
            found += [f"{rel}:{n.lineno}: parents[...]" for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                      and isinstance(n.value, ast.Attribute) and n.value.attr == "parents"]
            found += [f"{rel}:{line}: {s!r}" for line, s in _path_parts(tree)
                      if s.strip("/") == "checkpoints" or "step-" in s and "step-to-step" not in s]
    assert not found, "run paths built outside rstar2/core/layout.py:\n" + "\n".join(found)


def _flows_and_tasks():
    import importlib

    for layer in ("flows", "tasks"):
        for f in sorted((ROOT / layer).glob("*.py")):
            mod = importlib.import_module(f"rstar2.{layer}.{f.stem}")
            for name, obj in vars(mod).items():
                fn = getattr(obj, "fn", None)
                if fn is not None and getattr(obj, "__module__", mod.__name__) == mod.__name__ and \
                        type(obj).__name__ in ("Flow", "Task"):
                    yield f"{layer}.{f.stem}.{name}", fn


def test_no_flow_or_task_takes_more_than_five_parameters_nor_the_controller():
    """The controller is found from the run reference (its actor handles cannot be a parameter Prefect records)."""
    sigs = {name: inspect.signature(fn) for name, fn in _flows_and_tasks()}
    assert len(sigs) > 30  # every flow and task was found
    assert not {k: len(s.parameters) for k, s in sigs.items() if len(s.parameters) > 5}
    assert not [f"{k}({p})" for k, s in sigs.items() for p in s.parameters.values()
                if "Controller" in str(p.annotation)]
