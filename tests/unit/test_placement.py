"""rstar2.rollout.placement on a real local Ray cluster (CPU bundles): the groups hold the expected bundles, actors
started with an engine's or a rank's options run inside its group, a cluster without the asked resources is refused with
a clear error, and `remove` frees the groups."""

import pytest
import ray
from ray.util import placement_group_table

from rstar2.core import config
from rstar2.rollout import cluster, placement


@pytest.fixture(scope="module")
def local_ray():
    cluster.init()
    yield
    ray.shutdown()


@ray.remote
class Where:
    def group(self) -> str | None:
        pg = ray.util.get_current_placement_group()
        return pg.id.hex() if pg else None


def _cfg(*more):
    return config.load("tiny", ["engine.num_engines=2", *more])


def test_bundles_by_role():
    eng, tr = placement.bundles(_cfg("trainer.backend=deepspeed", "trainer.world_size=3"), gpu=True)
    assert eng == [{"GPU": 1}] * 2 and tr == [{"GPU": 1}] * 3
    tp = _cfg("engine.tensor_parallel_size=4", "placement.engine_resources={rollout: 1}")
    assert placement.bundles(tp, gpu=True)[0] == [{"GPU": 1, "rollout": 1}] * 8  # one bundle per GPU of each engine
    shared, same = placement.bundles(_cfg("placement.colocate=true", "trainer.backend=deepspeed",
                                          "trainer.world_size=2"), gpu=False)
    assert shared is same and shared == [{"CPU": placement.CPU_SLIVER}] * 2


@pytest.mark.e2e  # a local Ray cluster: ~30 s to start
def test_actors_land_in_their_groups_and_stop_removes_them(local_ray):
    place = placement.reserve(_cfg(), gpu=False, name="t-sep")
    assert placement_group_table(place.engines)["bundles"] == {0: {"CPU": 0.01}, 1: {"CPU": 0.01}}
    assert placement_group_table(place.trainer)["bundles"] == {0: {"CPU": 0.01}}
    engines = [Where.options(**place.engine_options(i)).remote() for i in range(2)]
    rank = Where.options(**place.rank_options(0)).remote()
    assert ray.get([e.group.remote() for e in engines]) == [place.engines.id.hex()] * 2
    assert ray.get(rank.group.remote()) == place.trainer.id.hex()
    for a in engines + [rank]:
        ray.kill(a)
    groups = list(place.groups)
    place.remove()
    assert [placement_group_table(pg)["state"] for pg in groups] == ["REMOVED", "REMOVED"]


@pytest.mark.e2e  # a local Ray cluster: ~30 s to start
def test_an_evaluation_reserves_engines_only_until_a_trainer_is_added(local_ray):
    place = placement.reserve(_cfg(), gpu=False, name="t-eval", with_trainer=False)
    assert place.trainer is None and len(place.groups) == 1
    place.add_trainer(_cfg(), "t-eval")
    assert len(place.groups) == 2 and placement_group_table(place.trainer)["state"] == "CREATED"
    place.remove()


@pytest.mark.e2e  # a local Ray cluster: ~30 s to start
def test_a_cluster_without_the_asked_resources_is_refused(local_ray):
    cfg = _cfg("placement.engine_resources={rollout: 1}")  # no node was started with --resources '{"rollout": 1}'
    with pytest.raises(RuntimeError, match="could not place the bundles"):
        placement.reserve(cfg, gpu=False, name="t-none", timeout_s=2)
    assert not [pg for pg in placement_group_table().values() if pg["name"].startswith("t-none")
                and pg["state"] != "REMOVED"]


def test_tensor_parallel_engines_need_gpus():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs GPUs"):
        placement.reserve(_cfg("engine.tensor_parallel_size=2"), gpu=False, name="t-tp")
