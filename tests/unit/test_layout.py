"""The layout is the design: each floor imports only the floors below it, and modules never import each other in a
circle. Read from the source with `ast`, imports at any depth included (inside functions, under `if`, in `try`).

    cli/     the command line, `rstar2 serve`, env defaults    may import flows, tasks, bench, rstar2
    flows/   Prefect flows                                     may import tasks, rstar2
    tasks/   Prefect tasks                                     may import rstar2
    bench/   benchmarks and the rollout simulator              may import rstar2
    rstar2/  the library (no Prefect, no command line)         imports none of the above

Inside the library the folders stack the same way, each importing only itself and the folders below it (LIBRARY):

    run/         orchestration: controller, steps, preflight, plan, runstate, ablations, mining, solve
    evaluation/  pass@k statistics, reports, health, entropy, export
    world/       the tiny world and GSM-style word problems, SFT transcripts, the initial model
    training/    trainer, GRPO, RoC, SFT, batching, numerics
    models/      pretrained models brought in (GGUF, tool templates)
    reward       the verifier (rstar2/reward.py)
    rollout/     engines, the agent loop, chat templates, trajectories
    data/        problem tables: schema, layouts, cleaning, answer parsing
    sandbox/     isolated code execution
    core/        config, layout, atomic commits and checkpoints, tracking, progress, weight bus, LoRA adapters
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"rstar2": {"rstar2"}, "tasks": {"tasks", "rstar2"}, "flows": {"flows", "tasks", "rstar2"},
           "bench": {"bench", "rstar2"}, "cli": {"cli", "flows", "tasks", "bench", "rstar2"}}
FORBIDDEN_THIRD_PARTY = {"rstar2": {"prefect", "prefect_ray", "typer"}}  # no orchestration, no command line


APPS = ("cli", "flows", "tasks", "bench")  # folders beside rstar2/ in the repository, installed as rstar2.<folder>
LIBRARY = ("core", "sandbox", "data", "rollout", "reward", "models", "training", "world", "evaluation", "run")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages."""
    mods = {}
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = ("rstar2", *parts) if pkg in APPS else parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _floor(module: str) -> str:
    """The floor a module is on: its folder in the repository (rstar2.flows.campaign -> flows)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rstar2" and len(parts) > 1 and parts[1] in APPS else parts[0]


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module `name` imports, anywhere in the file; `from a import b` counts as a.b when that is a module."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_each_floor_imports_only_the_floors_below():
    bad = []
    for mod, deps in _graph().items():
        floor = _floor(mod)
        for dep in deps:
            if dep.split(".")[0] in APPS:  # importable from a checkout's root, absent from an install
                bad.append(f"{mod} imports {dep} by its folder's name (rstar2.{dep})")
            top = _floor(dep)
            if (top in ALLOWED and top not in ALLOWED[floor]) or top in FORBIDDEN_THIRD_PARTY.get(floor, ()):
                bad.append(f"{mod} imports {dep}")
    assert not bad, "imports against the layout:\n" + "\n".join(sorted(bad))


def _library_folder(module: str) -> str | None:
    """The library folder a module is in (rstar2.run.steps -> run, rstar2.reward -> reward); None outside them."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rstar2" and len(parts) > 1 and parts[1] in LIBRARY else None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a library folder to one above it in LIBRARY."""
    bad = []
    for mod, deps in graph.items():
        here = _library_folder(mod)
        for dep in deps:
            there = _library_folder(dep)
            if here and there and LIBRARY.index(there) > LIBRARY.index(here):
                bad.append(f"{mod} ({here}) imports {dep} ({there}), a folder above it")
    return sorted(bad)


def test_the_library_folders_stack():
    assert _upward(_graph()) == [], "imports that run back up:\n" + "\n".join(_upward(_graph()))


def test_a_planted_upward_import_is_caught():
    graph = _graph()
    assert set(LIBRARY) == {_library_folder(m) for m in graph} - {None}, "a library folder missing from LIBRARY"
    graph["rstar2.core.checkpoint"] = graph["rstar2.core.checkpoint"] | {"rstar2.run.controller"}
    graph["rstar2.data.clean"] = graph["rstar2.data.clean"] | {"rstar2.reward"}
    assert _upward(graph) == ["rstar2.core.checkpoint (core) imports rstar2.run.controller (run), a folder above it",
                              "rstar2.data.clean (data) imports rstar2.reward (reward), a folder above it"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue  # outside the project
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_checks_see_what_they_look_for():
    """The walk finds function-level and relative imports, and the cycle search finds a circle."""
    g = _graph()
    assert "rstar2.flows.campaign" in g["rstar2.cli.runs"]  # in a function
    assert "rstar2.training.deepspeed_backend" in g["rstar2.training.trainer"]
    assert "rstar2.sandbox.api" in g["rstar2.sandbox"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_relative_imports_resolve_against_their_package(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    init, mod = tmp_path / "pkg" / "sub" / "__init__.py", tmp_path / "pkg" / "sub" / "m.py"
    init.write_text("from .m import f\n")
    mod.write_text("from . import n\nfrom ..top import g\ndef h():\n    from pkg import other\n")
    known = {"pkg", "pkg.sub", "pkg.sub.m", "pkg.sub.n", "pkg.top", "pkg.other"}
    assert _imports("pkg.sub", init, known) == {"pkg.sub.m"}
    assert _imports("pkg.sub.m", mod, known) == {"pkg.sub.n", "pkg.top", "pkg.other"}


def test_the_library_shows_the_pipeline():
    """rstar2/'s top level is a few folders (each opening with a docstring that says what it owns) and modules."""
    entries = [p for p in (ROOT / "rstar2").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 12, sorted(p.name for p in entries)
    packages = [p for p in entries if (p / "__init__.py").is_file()]
    undocumented = [p.name for p in packages if ast.get_docstring(ast.parse((p / "__init__.py").read_text())) is None]
    assert len(packages) >= 6 and not undocumented


def test_the_command_line_starts_without_torch():
    """The sandbox image holds the CLI (`rstar2 sandbox serve`) and no torch, peft, transformers or vLLM: importing the
    command line must not import them (a module-level `import torch` in a module the CLI reaches broke that image)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'peft', 'transformers', 'vllm'):\n"
            "            raise ImportError('not in the sandbox image: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import rstar2.cli.main\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
