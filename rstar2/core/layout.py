"""A run's directory and its world's, named in one place, and the run reference that flows and tasks pass instead of
loose values.

`RunLayout` is the only code that builds or parses a run's paths, `WorldLayout` a world directory's:

    <top>/config.json  world/  sft/  eval/<name>.json|.parquet  summary.json  suites/  plots/
    <root>/<stage>/step-NNNN/{rollouts,scored,kept,carry}.parquet one RL step's tables (carry: partial rollouts)
    <root>/checkpoints/<stage>/step-NNNN/                         committed RL checkpoints (rstar2.core.checkpoint)
    <root>/stages/<stage>/                                         a finished stage's end record
    <root>/mining/<stage>/<checkpoint>/                            a mined hard set
    <root>/eval/<name>.json|.parquet                              evaluation records and samples

    <world>/{sft_problems,train,val,test}.parquet   the generated problem tables
    <world>/data-<split>.parquet  data_sources.json  a split brought in from world.<split>_data; from what
    <world>/fit-<split>.parquet  fit.json            the preflight's kept rows of a split that lost prompts; its record
    <world>/sft_data.jsonl  tokenizer/  init_model/   SFT transcripts; the tiny world's tokenizer and initial model

`top` is the campaign's run directory; `root` is where one RL seed keeps its stages: `top` itself for a single seed,
`top/seed-<rl_seed>` with several (world, SFT model and SFT evaluation stay shared at the top).

`RunRef` is what every flow and task knows of its run: its layout, its world's files, its MLflow ids and the name of the
Controller that owns its actors (rstar2.tasks.run.controller finds it in the driver). It is small and JSON-serialisable,
so Prefect records it as a parameter and draws the edges between the tasks that use it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

STEP_PREFIX = "step-"  # a committed step's directory: step-0001, step-0002, ...
SEED_PREFIX = "seed-"
# one RL step's tables: its rollout; scored (rewards, RoC penalties); kept (RoC's G of 2G); a partial rollout's carry
ROLLOUTS, SCORED, KEPT, CARRY = "rollouts.parquet", "scored.parquet", "kept.parquet", "carry.parquet"


# a world directory's files (rstar2.world.build makes them, rstar2.run.preflight writes the fit-* ones)
SFT_DATA, INIT_MODEL, TOKENIZER = "sft_data.jsonl", "init_model", "tokenizer"
FIT = "fit.json"  # the preflight's record: the context and the prompt ids it dropped
SOURCES = "data_sources.json"  # per imported split: its source file, content hash and what loading dropped
IMPORTED, FITTED = "data-{}.parquet", "fit-{}.parquet"  # a split brought in from world.<split>_data; its kept rows


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:04d}"


class WorldLayout(BaseModel):
    """The files of one world directory (see the module's docstring)."""
    model_config = ConfigDict(frozen=True)

    dir: Path

    def table(self, name: str) -> Path:
        """A generated problem table: sft_problems, train, val or test."""
        return self.dir / f"{name}.parquet"

    def imported(self, split: str) -> Path:
        """The split brought in from world.<split>_data."""
        return self.dir / IMPORTED.format(split)

    def fitted(self, split: str) -> Path:
        """The rows of `split` the preflight kept (prompts that fit the context)."""
        return self.dir / FITTED.format(split)

    @property
    def sft_data(self) -> Path:
        return self.dir / SFT_DATA

    @property
    def init_model(self) -> Path:
        return self.dir / INIT_MODEL

    @property
    def tokenizer(self) -> Path:
        return self.dir / TOKENIZER

    @property
    def fit(self) -> Path:
        return self.dir / FIT

    @property
    def sources(self) -> Path:
        return self.dir / SOURCES


class RunLayout(BaseModel):
    model_config = ConfigDict(frozen=True)

    top: Path  # the campaign's run directory
    root: Path  # where this RL seed's stages, checkpoints and evaluations live (`top` for a single seed)
    world_dir: Path | None = None  # a world shared from elsewhere (default: <top>/world)

    @classmethod
    def at(cls, top: str | Path, world_dir: str | Path | None = None) -> "RunLayout":
        top = Path(top).resolve()
        return cls(top=top, root=top, world_dir=Path(world_dir).resolve() if world_dir else None)

    @classmethod
    def of(cls, out_dir: str | Path, run_name: str) -> "RunLayout":
        """The run `run_name` under `out_dir` (the config's out_dir and the run's name)."""
        return cls.at(Path(out_dir) / run_name)

    def for_seed(self, rl_seed: int, seeds: int) -> "RunLayout":
        """One RL seed's layout: the run itself for a single seed, else `seed-<rl_seed>/` inside it."""
        root = self.top if seeds == 1 else self.top / f"{SEED_PREFIX}{rl_seed}"
        return self.model_copy(update={"root": root})

    def seeds(self) -> list[int]:
        """The RL seeds that have a directory of their own (a campaign over several seeds), in order."""
        return sorted(int(p.name.removeprefix(SEED_PREFIX)) for p in self.top.glob(f"{SEED_PREFIX}*")
                      if p.is_dir() and p.name.removeprefix(SEED_PREFIX).isdigit())

    @property
    def name(self) -> str:
        """The directory's name in MLflow and in actor names: the run's, `<run>-seed-<k>` for one of its seeds."""
        return self.top.name if self.root == self.top else f"{self.top.name}-{self.root.name}"

    # the shared top
    @property
    def world(self) -> Path:
        return self.world_dir or self.top / "world"

    @property
    def world_files(self) -> WorldLayout:
        return WorldLayout(dir=self.world)

    @property
    def sft(self) -> Path:
        return self.top / "sft"

    @property
    def config(self) -> Path:
        return self.top / "config.json"

    @property
    def summary(self) -> Path:
        return self.top / "summary.json"

    @property
    def suites(self) -> Path:
        return self.top / "suites"

    @property
    def plots(self) -> Path:
        return self.top / "plots"

    # one seed's RL
    def step_dir(self, stage: str, step: int) -> Path:
        """Step `step` (0-based, as the stage counts them) of `stage`: its rollout, scored and kept tables."""
        return self.root / stage / step_name(step)

    def step_table(self, stage: str, step: int, table: str) -> Path:
        """One of step `step`'s tables (ROLLOUTS, SCORED, KEPT, CARRY)."""
        return self.step_dir(stage, step) / table

    def step_tables(self, stage: str, table: str) -> list[Path]:
        """`table` (e.g. SCORED) of every step of `stage` that wrote one, oldest first."""
        return sorted((self.root / stage).glob(f"{STEP_PREFIX}*/{table}"))

    @staticmethod
    def beside(table_uri: str | Path, table: str) -> Path:
        """Table `table` (e.g. SCORED) of the step whose table `table_uri` is."""
        return Path(table_uri).with_name(table)

    def step_eval(self, stage: str, step: int) -> Path:
        """Where a periodic evaluation (eval.every) after step `step` of `stage` keeps its samples and record."""
        return self.step_dir(stage, step) / "eval"

    def checkpoints(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def checkpoint(self, stage: str, step: int) -> Path:
        """The checkpoint committed after `step` steps of `stage` (1-based: the first step's is step-0001)."""
        return self.checkpoints(stage) / step_name(step)

    @staticmethod
    def checkpoints_of(checkpoint: str | Path) -> Path:
        """The directory of the stage's checkpoints that `checkpoint` is one of."""
        return Path(checkpoint).parent

    def stage_marker(self, stage: str) -> Path:
        return self.root / "stages" / stage

    def mining(self, stage: str, checkpoint: str | Path) -> Path:
        return self.root / "mining" / stage / Path(checkpoint).name

    def analysis(self) -> Path:
        return self.root / "analysis"

    def eval_out(self, name: str) -> Path:
        """An evaluation's samples (`<out>.parquet`, or `<out>/<suite>.parquet`) and its record (`<out>.json`)."""
        return self.root / "eval" / name

    @staticmethod
    def eval_out_of(samples_uri: str | Path) -> Path:
        """An evaluation's out (see `eval_out`) from its samples' table, `<out>.parquet`."""
        return Path(samples_uri).with_suffix("")

    def eval_records(self, split: str) -> list[Path]:
        return sorted((self.root / "eval").glob(f"*-{split}.json"))

    def sft_record(self, split: str) -> Path:
        """The SFT evaluation's record: which model the run's RL started from (shared at the top)."""
        return self.top / "eval" / f"sft-{split}.json"

    # parsing paths back
    @staticmethod
    def of_checkpoint(path: str | Path) -> "RunLayout":
        """The layout a committed RL checkpoint (`<root>/checkpoints/<stage>/step-N`) belongs to."""
        p = Path(path).resolve()
        if not (p.name.startswith(STEP_PREFIX) and p.parent.parent.name == "checkpoints"):
            raise ValueError(f"{p} is not an RL checkpoint of a run (<run>/checkpoints/<stage>/{STEP_PREFIX}N)")
        root = p.parent.parent.parent
        return RunLayout(top=RunLayout.top_of(root), root=root)

    @staticmethod
    def config_of(model_dir: str | Path) -> Path | None:
        """The resolved config (`<top>/config.json`) of the run a model directory belongs to (its SFT model or any
        seed's RL checkpoint), or None for a model outside a run."""
        p = Path(model_dir).resolve()
        for d in [p, *p.parents][1:5]:
            if (d / "config.json").is_file() and (d / "world").is_dir():
                return d / "config.json"
        return None

    @staticmethod
    def top_of(run_dir: str | Path) -> Path:
        """A run's top directory from the run directory or one of its seed directories."""
        d = Path(run_dir).resolve()
        return d.parent if d.name.startswith(SEED_PREFIX) and (d.parent / "config.json").is_file() else d

    @staticmethod
    def step_tables_pattern(out_dir: str, table: str) -> str:
        """A glob of one table of every RL step of the single-seed runs under `out_dir` whose stages are named
        stage*: `runs/*/stage*/step-*/rollouts.parquet`."""
        return f"{out_dir}/*/stage*/{STEP_PREFIX}*/{table}"

    @staticmethod
    def label(model_dir: str | Path, sep: str = "/") -> str:
        """A model's short name: `stage1/step-0016` for an RL checkpoint (with `sep`), else the directory's name."""
        p = Path(model_dir)
        return f"{p.parent.name}{sep}{p.name}" if p.name.startswith(STEP_PREFIX) else p.name


class WorldPaths(BaseModel):
    """A built world's files (rstar2.world.build.uris): problem tables, SFT transcripts, the initial model, and the
    preflight's record of what did not fit (`fit`). `val`/`test` are absent for real assets without them."""
    model_config = ConfigDict(frozen=True)

    sft_problems: str
    train: str
    val: str | None = None
    test: str | None = None
    sft_data: str
    init_model: str
    fit: str | None = None

    def split(self, name: str) -> str:
        """The table evaluation runs on; one clear error when the world lacks it."""
        uri = getattr(self, name, None) if name in ("train", "val", "test") else None
        if uri is None:
            raise ValueError(f"eval.split={name!r}, but this world has no {name} split (real assets: set "
                             f"world.{name}_data)")
        return uri


class RunRef(BaseModel):
    """The one run-level value flows and tasks take."""
    model_config = ConfigDict(frozen=True)

    layout: RunLayout
    world: WorldPaths | None  # None: a flow that needs no world (a model evaluated on eval.suites only)
    experiment_id: str
    mlflow_run_id: str  # the MLflow run this flow's figures go to (the campaign's, a seed's, an evaluation's)
    controller_id: str  # the name prefix of the run's actors: rstar2.tasks.run.controller finds its Controller

    def for_seed(self, rl_seed: int, seeds: int, mlflow_run_id: str) -> "RunRef":
        return self.model_copy(update={"layout": self.layout.for_seed(rl_seed, seeds), "mlflow_run_id": mlflow_run_id})

    def needs_world(self) -> WorldPaths:
        if self.world is None:
            raise ValueError(f"run {self.layout.name} was opened without a world")
        return self.world
