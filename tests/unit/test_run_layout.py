"""The run and world layouts (rstar2.core.layout) are the only code that builds or parses a run's or a world's paths,
and flows and tasks take few parameters: the run reference and the config sections they use."""

import ast
import inspect
from pathlib import Path

import pytest

from rstar2.core import layout
from rstar2.core.layout import RunLayout, RunRef, WorldLayout, WorldPaths

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("rstar2", "tasks", "flows", "cli", "bench")
# the directories and files only the layouts name: a run's, and a world's (names, and templates of f-strings)
NAMES = {"checkpoints", "world", "sft", layout.SFT_DATA, layout.INIT_MODEL, layout.TOKENIZER, layout.FIT,
         layout.SOURCES}
TEMPLATES = {layout.IMPORTED, layout.FITTED}


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
    for run in (top, top.for_seed(1, seeds=2)):
        ckpt = run.checkpoint("stage2", 7)
        assert RunLayout.of_checkpoint(ckpt) == run.model_copy(update={"world_dir": None})
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


def test_a_worlds_files(tmp_path):
    world = RunLayout.at(tmp_path / "r").world_files
    assert world == WorldLayout(dir=tmp_path / "r" / "world")
    assert world.table("sft_problems") == tmp_path / "r" / "world" / "sft_problems.parquet"
    assert world.imported("test") == tmp_path / "r" / "world" / "data-test.parquet"
    assert world.fitted("train") == tmp_path / "r" / "world" / "fit-train.parquet"
    assert (world.sft_data.name, world.init_model.name, world.tokenizer.name, world.fit.name, world.sources.name) == \
        ("sft_data.jsonl", "init_model", "tokenizer", "fit.json", "data_sources.json")
    assert RunLayout.at(tmp_path, world_dir=tmp_path / "w").world_files.dir == tmp_path / "w"


def test_a_steps_tables_a_checkpoints_stage_and_an_evaluations_record_from_their_paths(tmp_path):
    run = RunLayout.at(tmp_path / "r")
    rolled = run.step_table("stage1", 3, layout.ROLLOUTS)
    assert RunLayout.beside(str(rolled), layout.SCORED) == tmp_path / "r" / "stage1" / "step-0003" / "scored.parquet"
    assert RunLayout.checkpoints_of(run.checkpoint("s", 2)) == tmp_path / "r" / "checkpoints" / "s"
    assert RunLayout.eval_out_of(f"{run.eval_out('sft-test')}.parquet") == tmp_path / "r" / "eval" / "sft-test"


def _template(f: ast.JoinedStr) -> str:
    """An f-string with `{}` for each value: f"fit-{split}.parquet" -> "fit-{}.parquet"."""
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in f.values)


def _path_parts(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that build or parse a path (`p / "x"`, `Path(..., "x")`, `.joinpath`, `.glob`, `.startswith`,
    `.with_name`), f-strings' pieces, and the templates of f-strings that build a path, with their line numbers."""
    found = []
    for n in ast.walk(tree):
        parts = []
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            parts = [n.left, n.right]
        elif isinstance(n, ast.Call) and (getattr(n.func, "id", None) == "Path" or getattr(n.func, "attr", None) in
                                          ("joinpath", "glob", "rglob", "startswith", "removeprefix", "with_name")):
            parts = list(n.args)
        elif isinstance(n, ast.JoinedStr):
            parts = n.values
        found += [(n.lineno, p.value) for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
        found += [(n.lineno, _template(p)) for p in parts if isinstance(p, ast.JoinedStr)]
    return found


def _layouts_name(s: str) -> bool:
    """Whether a path piece names what only the layouts name: a step, the checkpoints, a run's or a world's parts
    (a segment of a path piece with slashes: "/world/train.parquet")."""
    return "step-" in s and "step-to-step" not in s or bool(set(s.strip("/").split("/")) & NAMES) or s in TEMPLATES


def _parents_of_a_path(tree: ast.AST) -> list[int]:
    """`x.parents[i]`: walking up from a path (a source file's own place, `Path(__file__)...parents[i]`, is not)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "parents" and "__file__" not in ast.unparse(n.value.value)]


def _outside_the_layouts(source: str, rel: str) -> list[str]:
    tree = ast.parse(source)
    return [f"{rel}:{line}: parents[...]" for line in _parents_of_a_path(tree)] + \
        [f"{rel}:{line}: {s!r}" for line, s in _path_parts(tree) if _layouts_name(s)]


def test_the_guard_finds_a_planted_path():
    planted = ('p = run_dir / "checkpoints" / f"step-{i}"\nw = Path(out, "sft_data.jsonl")\n'
               'k = out / f"fit-{split}.parquet"\nu = f"{run_dir}/world/train.parquet"\nr = d.parents[2]\n'
               'ROOT = Path(__file__).resolve().parents[1]\nm = model / "config.json"\n')
    assert sorted(_outside_the_layouts(planted, "x.py")) == [  # lines 6 and 7 are no run's paths
        "x.py:1: 'checkpoints'", "x.py:1: 'step-'", "x.py:1: 'step-{}'", "x.py:2: 'sft_data.jsonl'",
        "x.py:3: 'fit-{}.parquet'", "x.py:4: '/world/train.parquet'", "x.py:5: parents[...]"]


def test_no_run_path_is_built_outside_the_layout():
    found = []
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f != ROOT / "rstar2" / "core" / "layout.py":
                found += _outside_the_layouts(f.read_text(), str(f.relative_to(ROOT)))
    assert not found, "run or world paths built outside rstar2/core/layout.py:\n" + "\n".join(found)


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
