"""Ray placement groups for a run's actors: one bundle per GPU (or a sliver of CPU on a machine without GPUs), so the
engines' and the trainer ranks' devices are reserved together, packed on few nodes or spread over many
(placement.strategy), before any actor starts.

Separate GPUs (default): an engines group of num_engines x tensor_parallel_size bundles and a trainer group of
world_size bundles. Colocated (placement.colocate): one group whose every GPU holds a trainer rank and an engine's
share, each taking half of the bundle's GPU; the engines sleep while the trainer updates. An engine of one GPU
runs in its actor's own process; a tensor-parallel engine's actor takes no GPU itself and vLLM's Ray executor puts
its workers on the engine's bundles (VLLM_RAY_BUNDLE_INDICES, VLLM_RAY_PER_WORKER_GPUS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rstar2.core.config import RunCfg

CPU_SLIVER = 0.01  # a CPU-only bundle must hold something; actors take num_cpus=0 inside it (they take turns)
SHARED = 0.5  # colocated: the trainer rank's and the engine's share of one GPU


@dataclass
class Placement:
    gpu: bool
    colocate: bool
    tp: int
    engines: PlacementGroup
    trainer: PlacementGroup | None  # None: engines only (an evaluation) until `add_trainer`
    groups: list[PlacementGroup] = field(default_factory=list)
    strategy: str = "PACK"

    def engine_options(self, index: int) -> dict:
        """Ray actor options for engine `index`: its first bundle, and its workers' bundles when tensor-parallel."""
        first = index * self.tp
        strategy = PlacementGroupSchedulingStrategy(self.engines, placement_group_bundle_index=first,
                                                    placement_group_capture_child_tasks=self.tp > 1)
        share = SHARED if self.colocate else 1
        if not self.gpu or self.tp == 1:
            return {"num_cpus": 0, "num_gpus": share if self.gpu else 0, "scheduling_strategy": strategy}
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(first + k) for k in range(self.tp)),
               "VLLM_RAY_PER_WORKER_GPUS": str(share)}
        return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": strategy, "runtime_env": {"env_vars": env}}

    def rank_options(self, rank: int) -> dict:
        """Ray actor options for trainer rank `rank` (its own GPU, or half of one shared with an engine)."""
        strategy = PlacementGroupSchedulingStrategy(self.trainer, placement_group_bundle_index=rank)
        return {"num_cpus": 0, "num_gpus": (SHARED if self.colocate else 1) if self.gpu else 0,
                "scheduling_strategy": strategy}

    def add_trainer(self, cfg: RunCfg, name: str, timeout_s: float = 600.0) -> None:
        if self.trainer is None:
            self.trainer = _ready([placement_group(bundles(cfg, self.gpu)[1], strategy=self.strategy,
                                                   name=f"{name}-trainer")], timeout_s)[0]
            self.groups.append(self.trainer)

    def remove(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []


def bundles(cfg: RunCfg, gpu: bool) -> tuple[list[dict], list[dict]]:
    """The engines' and the trainer's bundles (the same list when colocated)."""
    unit = {"GPU": 1} if gpu else {"CPU": CPU_SLIVER}
    p = cfg.placement
    engine = [{**unit, **p.engine_resources} for _ in range(cfg.engine.num_engines * cfg.engine.tensor_parallel_size)]
    trainer = [{**unit, **p.trainer_resources} for _ in range(cfg.trainer.world_size)]
    if p.colocate:
        shared = [{**unit, **p.engine_resources, **p.trainer_resources} for _ in range(max(len(engine), len(trainer)))]
        return shared, shared
    return engine, trainer

def reserve(cfg: RunCfg, gpu: bool, name: str, with_trainer: bool = True, timeout_s: float = 600.0) -> Placement:
    """Create the run's placement groups (named `<name>-engines` / `-trainer` / `-shared`) and wait until the cluster
    has placed every bundle; a cluster too small for them raises after `timeout_s`. Without the trainer (an
    evaluation) only the engines' bundles are reserved, unless colocated."""
    if cfg.engine.tensor_parallel_size > 1 and not gpu:
        raise ValueError("engine.tensor_parallel_size > 1 needs GPUs (vLLM's CPU backend runs an engine in one "
                         "process)")
    strategy = cfg.placement.strategy.upper()
    eng, tr = bundles(cfg, gpu)
    if cfg.placement.colocate:
        groups = _ready([placement_group(eng, strategy=strategy, name=f"{name}-shared")], timeout_s)
        return Placement(gpu, True, cfg.engine.tensor_parallel_size, groups[0], groups[0], groups, strategy)
    groups = _ready([placement_group(eng, strategy=strategy, name=f"{name}-engines")]
                    + ([placement_group(tr, strategy=strategy, name=f"{name}-trainer")] if with_trainer else []),
                    timeout_s)
    return Placement(gpu, False, cfg.engine.tensor_parallel_size, groups[0], groups[1] if with_trainer else None,
                     groups, strategy)


def _ready(groups: list[PlacementGroup], timeout_s: float) -> list[PlacementGroup]:
    try:
        ray.get([pg.ready() for pg in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        wanted = [pg.bundle_specs for pg in groups]
        for pg in groups:
            remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster could not place the bundles {wanted} within {timeout_s:.0f} s "
                           f"(it has {ray.cluster_resources()})") from None
    return groups
