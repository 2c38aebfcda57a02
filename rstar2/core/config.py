"""One config tree (pydantic). Presets are YAML files in rstar2/presets/; `--set a.b=c` overrides any leaf."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PRESETS = Path(__file__).parent.parent / "presets"


class _Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a preset is an error, not a silent default


class WorldCfg(_Cfg):
    """The locally made world (tiny preset) or paths to real assets (GPU presets)."""
    kinds: list[str] = ["mul", "add", "mod", "range_sum", "divisors", "comb"]
    n_sft: int = 6000
    n_train: int = 2000
    n_val: int = 200  # drawn like train, never trained on: for tuning and stage decisions, so test stays held out
    n_test: int = 200
    vocab_size: int = 2048
    digits_per_token: int = 2  # numbers are cut into chunks of at most this many digits before BPE
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 704
    max_positions: int = 2048  # the context (prompt + response); with base_model, unless set with it (in the
    # preset that names the model or after it), the model's own max_position_embeddings (`_context`)
    base_model: str | None = None  # a HF model dir to start from instead of making a tiny one
    # a pretrained model the world brings in as its initial model instead of making a tiny one: a GGUF file (a path,
    # or `pkg:<module>/<file>` inside an installed distribution) or a HF model dir, converted and given a tool
    # template if it lacks one (rstar2/models/); SFT then trains it on the world's own transcripts
    import_model: str | None = None
    problems: Literal["tiny", "gsm_symbolic"] = "tiny"  # the generator of the world's problems and SFT transcripts:
    # the tiny world's arithmetic kinds, or reasoning-gym's GSM8K templates in natural language (rstar2/world/gsm.py)
    held_out: float = Field(0.2, gt=0, lt=1)  # gsm_symbolic: the share of templates kept for `test` alone
    arch: dict | None = None  # the base model's config.json fields (model_type, hidden_size, ...): the shape `rstar2
    # plan` sizes memory from where base_model is not on this machine (a planning host without the weights)
    # problem tables (Parquet or JSONL in the schema of rstar2/data/schema.py; `rstar2 data import` makes them) used
    # instead of the generator's splits whenever set (rows with a non-integer answer are dropped, and counted)
    train_data: str | None = None
    val_data: str | None = None
    test_data: str | None = None

    @model_validator(mode="after")
    def _one_model(self) -> "WorldCfg":
        if self.base_model and self.import_model:
            raise ValueError("world.base_model and world.import_model both name a model: set one (base_model: a "
                             "HF directory used as it is; import_model: one the world converts and makes tool-aware)")
        return self

    @model_validator(mode="after")
    def _context(self) -> "WorldCfg":
        """With base_model and no max_positions of its own, the context is the model's (its config.json on this
        machine, else world.arch); unknown: the default stays."""
        if self.base_model and "max_positions" not in self.model_fields_set:
            found = model_positions(self.base_model, self.arch)
            if found:
                self.max_positions = found
        return self


def model_positions(base_model: str, arch: dict | None = None) -> int | None:
    """A model's max_position_embeddings: its config.json (or its text_config's), else world.arch's; None: unknown."""
    path = Path(base_model) / "config.json"
    mc = json.loads(path.read_text()) if path.is_file() else (arch or {})
    return mc.get("max_position_embeddings") or (mc.get("text_config") or {}).get("max_position_embeddings")


class LoraCfg(_Cfg):
    """Low-rank adapters (LoRA, Hu et al. 2021, with `peft`): W x + (alpha / rank) B A x on each target linear layer,
    A (rank, in) and B (out, rank); the base weights W frozen, only A and B trained (and checkpointed, and sent to the
    engines). B starts at zero, so a fresh adapter serves the base model exactly."""
    rank: int = Field(16, ge=1, le=512)  # vLLM serves ranks up to 512
    alpha: float = Field(32.0, gt=0)  # the update is scaled by alpha / rank
    # module names (the last part of a linear layer's name, e.g. q_proj), or "all-linear": every linear layer but the
    # output head (peft's)
    targets: list[str] | Literal["all-linear"] = "all-linear"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class SFTCfg(_Cfg):
    enabled: bool = True
    # chat transcripts to SFT on (JSON lines, rstar2.training.transcripts); None: the tiny world's own
    data: str | None = None
    packed: bool = False  # pack transcripts into rows of batch_tokens (false: right-padded buckets of similar length)
    mix: dict[str, float] = {"clean": 0.4, "buggy_fix": 0.15, "no_tool": 0.3, "format_slip": 0.15}
    mix_by_kind: dict[str, dict[str, float]] = {}  # problem kind -> its own mix (noise that depends on the kind)
    system_prompt_frac: float = 1.0  # share of SFT examples that carry the system prompt
    epochs: float = 1.0
    lr: float = 2e-3
    batch_tokens: int = 4096
    warmup_frac: float = 0.04
    weight_decay: float = Field(0.01, ge=0.0)  # AdamW's (betas 0.9, 0.95)
    min_lr_frac: float = Field(0.0, ge=0.0, le=1.0)  # the cosine ends at this share of lr (0: at zero)
    # the cosine's share of the epochs' steps (1: all of them, the paper's; less: the lr is held until then, WSD) and,
    # with decay_at_target, the held phase ends once the loss (averaged over ~50 steps) reaches target_loss: the cycle
    # decays from there and ends early (rstar2.training.sft.fit)
    decay_frac: float = Field(1.0, gt=0.0, le=1.0)
    decay_at_target: bool = False
    # An SFT whose loss ends above target_loss trains another cycle: a fresh schedule and optimizer from the model the
    # last cycle made, its batches in another order, up to max_cycles in all (None: one cycle of `epochs`)
    target_loss: float | None = None
    max_cycles: int = Field(1, ge=1)
    # train low-rank adapters instead of every weight, merged into the model the SFT hands on (None: full weights)
    lora: LoraCfg | None = None

    @model_validator(mode="after")
    def _decay_needs_a_target(self) -> "SFTCfg":
        if self.decay_at_target and self.target_loss is None:
            raise ValueError("sft.decay_at_target needs sft.target_loss (the loss at which the decay starts)")
        return self


class RolloutCfg(_Cfg):
    group_size: int = 8  # G: rollouts kept per prompt after RoC
    oversample: int = 2  # draw oversample * G, keep G (paper: 32 -> 16)
    max_turns: int = 10
    max_response_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    tool_response_chars: int = 256
    tool_enabled: bool = True  # false = the no-tool ablation (tool calls are refused)
    stream_check: int = 16  # trajectories a step checks against the chat template, most tool turns first
    # (rstar2.rollout.stream_check; ~5 ms each on a Qwen template); 0: none
    # 0: the synchronous step (rollout -> update -> weight sync -> next rollout). 1: the engines generate step t+1's
    # rollout with the weights they hold while the trainer updates on step t's; the update corrects for the lag of
    # one version with truncated importance weights (trainer.tis_cap)
    max_staleness: int = Field(0, ge=0, le=1)
    # a step's rollout ends once its quota of groups (stage.prompts_per_step) is complete, on a logical clock;
    # the other groups' trajectories carry over to the next step with their turns (rstar2.rollout.partial). The step
    # keeps partial_extra x the quota more groups in flight (fewer than the quota)
    partial: bool = False
    partial_extra: float = Field(0.25, gt=0, le=1)


class SandboxCfg(_Cfg):
    """The code-execution service (rstar2/sandbox/): where it runs, its limits, and the reward check's timeout."""
    backend: Literal["local", "http", "ray", "docker"] = "local"  # local = in this process
    workers: int = 4  # executor slots (calls at once) per service; 2 per core is the sweet spot
    timeout_s: float = 4.0
    memory_mb: int = 512
    cpu_s: int = 4
    max_processes: int = 64
    max_file_mb: int = 16
    tmpfs_mb: int = 64
    max_output_chars: int = 4000
    queue_size: int = 4096  # calls waiting beyond this block the caller (backpressure)
    require: list[str] = []  # isolation layers that must be active, else the service refuses to start
    urls: list[str] = []  # backend http: `rstar2 sandbox serve` servers
    ray_actors: int = 1  # backend ray: services in the actor group
    docker_image: str = "rstar2-sandbox:latest"  # backend docker: infra/docker/Dockerfile.sandbox
    batch_size: int = 64  # remote backends: calls per batch (paper: up to 64)
    senders: int = 8  # remote backends: batches in flight
    # remote backends: tries per batch, 0.1 s after the first failure and doubling (8: ~25 s in all, past a
    # supervisor's restart of a dead server); then the step fails with SandboxUnavailable
    retries: int = 8
    verify_timeout_s: float = 2.0  # the reward check's own wall-clock limit per answer


class RoCCfg(_Cfg):
    enabled: bool = True  # off = plain GRPO on G rollouts (no oversampling)
    mode: Literal["paper", "release"] = "paper"
    drop_all_equal: bool = True
    min_pos: int = 2
    min_neg: int = 2


class TrainerCfg(_Cfg):
    """GRPO-RoC update (rstar2/training/trainer.py). Paper values: lr 1e-6, 20 warm-up steps, clip 0.2/0.28, no
    KL/entropy."""
    lr: float = 1e-6
    warmup_steps: int = 20  # linear warm-up, then constant ...
    decay_steps: int = Field(0, ge=0)  # ... or a cosine down to min_lr_frac over this many optimizer steps (0: off)
    min_lr_frac: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.01, ge=0.0)
    grad_clip: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None  # verl's clip_ratio_c (3.0 in the release); the paper has none
    kl_coef: float = 0.0  # > 0 keeps a frozen reference policy (the starting weights)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0  # > 0 adds an entropy bonus (the entropy itself is always logged)
    overlong_filter: bool = False  # mask truncated rollouts out of the loss (DAPO); the paper keeps them at reward 0
    old_logprobs: Literal["recompute", "engine"] = "recompute"  # π_old: the trainer's own or the engine's sampling ones
    tis_cap: float | None = None  # truncated importance sampling min(π_old/π_engine, C) (needs engine log-probs)
    # how token losses become the batch loss: "token-mean" is Eq. 6 (1/Σ|o_i|: a long trajectory weighs by its
    # length); "seq-mean-token-mean" gives every trajectory the same weight (verl's loss_agg_mode of that name)
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    mini_batches: int = Field(1, ge=1)  # optimizer steps per RL step (paper: 1, strictly on-policy)
    micro_batch_tokens: int = Field(8192, ge=1)  # tokens per forward/backward (gradient accumulation over them)
    layout: Literal["bucket", "pack"] = "bucket"  # length-sorted padded micro-batches, or packed rows (varlen)
    share_prompts: bool = True  # pack: a group's rollouts store (and compute) their common prompt once
    # the numerics of SFT and the update: fp32, or bf16 autocast (fp32 master weights); auto: bf16 where the device
    # multiplies bf16 in hardware, fp32 elsewhere (rstar2.training.numerics), settled when a run starts and written
    # into its config.json
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    device: str = "auto"
    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: Literal[2, 3] = 2
    world_size: int = Field(1, ge=1)  # trainer ranks (one GPU each; CPU processes without GPUs); > 1 needs deepspeed
    gradient_checkpointing: bool = False  # recompute activations in backward: far less memory, ~1/3 more compute
    # RL trains low-rank adapters on the frozen model it starts from (None: full weights); checkpoints hold the
    # adapter, and a weight sync sends only the adapter to the engines (rstar2.core.adapter)
    lora: LoraCfg | None = None
    # how new weights reach the engines after an update: "disk" reloads the committed checkpoint (needs a filesystem
    # engines and trainer share); "memory" sends rank 0's gathered state dict through Ray's object store;
    # "collective" sends it from rank 0 to every engine worker in buckets (NCCL on GPUs; gloo on CPUs, or shared
    # memory when every engine shares rank 0's node and container)
    weight_sync: Literal["disk", "memory", "collective"] = "disk"
    sync_bucket_mb: int = Field(64, ge=1)  # collective: the most a bucket holds (engines load each as it arrives)
    # the rollout/train mismatch: an update whose batch has a mean |log π_old - log π_engine| over its loss tokens
    # above this stops the step before its checkpoint (engines that missed a weight sync, another dtype, a shifted
    # token); measured every step as `logprob_gap`. None: not measured, and the engines are asked for no log-probs
    max_logprob_gap: float | None = Field(0.1, gt=0)

    @property
    def engine_logprobs(self) -> bool:
        """Whether the update reads the rollout engine's log-probs (so the rollout must record them; otherwise it
        does not ask the engine for any)."""
        return self.old_logprobs == "engine" or self.tis_cap is not None or self.max_logprob_gap is not None

    @model_validator(mode="after")
    def _check(self) -> "TrainerCfg":
        if self.world_size > 1 and self.backend != "deepspeed":
            raise ValueError("trainer.world_size > 1 needs trainer.backend=deepspeed "
                             "(the torch backend is one process)")
        if self.kl_coef and self.backend == "deepspeed" and self.zero_stage == 3:
            raise ValueError("trainer.kl_coef > 0 keeps a full reference model per rank, which ZeRO-3 cannot "
                             "partition: use zero_stage 2 or kl_coef 0")
        if self.lora is not None and self.backend != "torch":
            raise ValueError("trainer.lora trains adapters with the torch backend (one process, one device): set "
                             "trainer.backend=torch (a frozen base needs no ZeRO partitioning of optimizer states)")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"trainer.tis_cap must be >= 1 (a cap on an importance weight), got {self.tis_cap}")
        return self


class CheckpointCfg(_Cfg):
    """RL checkpoints (rstar2/core/checkpoint.py): one committed directory per step."""
    # after each commit, delete a stage's older committed checkpoints beyond the newest keep_last (None: keep all);
    # never the newest, nor one a stage transition or an evaluation still holds (rstar2.core.checkpoint.prune)
    keep_last: int | None = Field(None, ge=1)


class EngineCfg(_Cfg):
    num_engines: int = 1
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs one engine spans (vLLM tensor parallelism; > 1 needs GPUs)
    kv_cache_mb: int = 256
    gpu_memory_utilization: float | None = None
    dtype: str = "bfloat16"
    # CPU: torch threads per engine (None: one, what Ray gives an actor). A model whose steps are bound by its matrix
    # products (~100M parameters) generates faster on every core: engines and trainer take turns, never run at once
    threads: int | None = Field(None, ge=1)
    # KV block in tokens (None: vLLM's default, 16 on GPUs, 128 on CPU). Only whole blocks are prefix-cached:
    # smaller blocks let a trajectory's next turn and a prompt's siblings reuse more KV
    block_size: int | None = Field(None, ge=1)


class PlacementCfg(_Cfg):
    """Where a run's actors go (rstar2/run/controller.py) and the hardware `rstar2 plan` checks it against
    (rstar2/run/plan.py; the campaign refuses a run that does not fit before any actor starts)."""
    strategy: Literal["pack", "spread"] = "pack"  # Ray placement-group strategy for the trainer ranks' and engines'
    # bundles: pack fills a node before the next (NVLink within a node), spread puts each bundle on another node
    colocate: bool = False  # engines and trainer ranks share GPUs: engines sleep (vLLM sleep mode) during the update
    engine_resources: dict[str, float] = {}  # custom Ray resources every engine bundle also asks for, e.g.
    trainer_resources: dict[str, float] = {}  # {rollout: 1}: keeps them on nodes started with `ray start --resources`
    gpus: int = Field(0, ge=0)  # accelerators the run is planned for (0: a CPU machine, sized by its RAM)
    gpu_mem_gb: float = Field(80.0, gt=0)  # memory of one accelerator


class SchedulerCfg(_Cfg):
    """Placement of trajectories on engines (rstar2/rollout/scheduler.py; paper §3.2; figures in bench/README.md)."""
    policy: Literal["kv_aware", "least_requests", "round_robin", "static"] = "kv_aware"
    max_inflight: int = 256  # trajectories per engine at most (vLLM's max_num_seqs); least_requests' only limit
    oversubscribe: float = 1.0  # kv_aware: admit while the peak KV (mean + kv_z sd) <= factor x KV capacity
    kv_z: float = 1.5  # standard deviations of the random future KV the admission keeps room for ...
    kv_tail_slack: float = 0.0  # ... but the queue's rest is admitted at once if it fits within this, on the mean (off:
    # at stage 2 (12K, 750K KV) it brought recompute storms of 12-31 % of decoded tokens; at stage 1, tight KV, +1 %)
    oversubscribe_min: float = 0.7  # the factor shrinks after a preemption or high usage, down to this ...
    oversubscribe_max: float = 1.0  # ... and grows back up to this while usage stays low
    usage_low: float = 0.8  # factor grows while measured KV usage stays below this and admission is blocked
    usage_high: float = 0.95  # ... and shrinks above this, or after a preemption
    grow_when_realized: float = 0.5  # ... grows only once running trajectories hold this share of their reservation
    adapt_interval_s: float = 1.0
    kv_priority: bool = True  # kv_aware: every turn carries its trajectory's start order as vLLM priority
    probes_per_prompt: int = 2  # kv_aware starts this many rollouts of every prompt before ranking by siblings
    estimator_window: int = 4096  # finished trajectories remembered across steps (the length estimate)
    prior_frac: float = 0.5  # expected response length before anything finished: this share of the budget
    hang_timeout_s: float = 120.0  # an engine that answers no probe for this long is treated as dead
    probe_interval_s: float = 5.0


class PlateauCfg(_Cfg):
    """When a stage has plateaued (rstar2/training/transition.py): the last `window` steps gained < `min_delta` on
    `metric`."""
    metric: str = "reward_mean"  # any per-step metric, e.g. eval_pass1 (with eval.every=1) or pass1_train
    window: int = 4
    min_delta: float = 0.01
    min_steps: int = 8


class StageCfg(_Cfg):
    name: str
    steps: int  # the stage's step budget (it may end earlier on a plateau)
    prompts_per_step: int
    max_response_tokens: int | None = None
    max_turns: int | None = None
    data: Literal["train", "hard"] = "train"  # hard = mined from the previous stage's final policy
    reset_optimizer: bool = False
    plateau: PlateauCfg | None = None  # None = always run the whole budget


class MiningCfg(_Cfg):
    """Hard-sample mining before a `data: hard` stage (paper §4.4: problems the policy does not solve k/k)."""
    k: int = 8  # rollouts per training problem
    max_problems: int | None = None  # mine a seeded subset of the training split (CPU budgets)
    temperature: float = 1.0


class SuiteCfg(_Cfg):
    """One evaluation suite: a local file (Parquet or JSONL; layouts in rstar2/data/suites.py) and how its answers
    are checked: integer (exact integer match), math (Math-Verify, as the RL reward) or choice (the option letter)."""
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # in metric names (eval/<name>/pass1) and file names
    path: str
    answer_type: Literal["integer", "math", "choice"] = "math"
    max_problems: int | None = Field(None, ge=1)  # a seeded subset of this many (eval.seed); None: the whole suite


class DataCfg(_Cfg):
    """`rstar2 data import`: duplicate removal and decontamination (rstar2/data/)."""
    near_dup_threshold: float = Field(0.8, gt=0.0, le=1.0)  # word-shingle Jaccard at or above this is a near duplicate
    shingle_words: int = Field(3, ge=1)  # words per shingle for the near-duplicate test
    decontam_ngram: int = Field(13, ge=1)  # a training problem sharing a word n-gram with a suite problem is dropped


class EvalCfg(_Cfg):
    samples: int = 16  # pass@1 averaged over k samples (paper: 16)
    temperature: float = 0.6
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    pass_k: list[int] = []  # unbiased pass@k reported for these k (each <= samples); empty: 1, 2, 4, ... <= samples
    suites: list[SuiteCfg] = []  # evaluate on these files, one table per checkpoint; empty: the world's `split`
    also_split: bool = False  # with suites: the world's `split` too, as the headline (a campaign's before/after)
    max_turns: int = 30
    max_response_tokens: int = 30000
    n_problems: int | None = None  # None = the whole held-out split
    every: int = 0  # also evaluate every N RL steps (0 = only at stage end)
    split: Literal["test", "val"] = "test"  # tune on "val"; report on "test"
    seed: int = 0  # sampling seed: a checkpoint's pass@1 does not depend on when or beside what it is evaluated
    on_checkpoint: bool = True  # the `evaluate/on-checkpoint` deployment evaluates this preset's runs (their newest
    # committed checkpoint); off where its engines would compete with training for the accelerators
    while_training: bool = False  # ... even while the run's campaign is still running (else it waits for the next
    # trigger or the campaign's own final evaluation)

    @model_validator(mode="after")
    def _check(self) -> "EvalCfg":
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval.pass_k {bad} must lie in 1..eval.samples ({self.samples})")
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.suites names must be unique, got {names}")
        return self


class RunCfg(_Cfg):
    name: str = "rstar2"
    seed: int = 0  # the world (problems, tokenizer, initial model) and SFT
    rl_seed: int = 0  # RL alone: rollout sampling, data order, RoC draws, mining, the trainer's torch/mini-batch seed.
    # The seed axis (`campaign --seeds N`) varies it over one world and SFT model; evaluation sampling is eval.seed
    out_dir: str = "runs"
    experiment: str = "rstar2"
    world: WorldCfg = Field(default_factory=WorldCfg)
    sft: SFTCfg = Field(default_factory=SFTCfg)
    rollout: RolloutCfg = Field(default_factory=RolloutCfg)
    sandbox: SandboxCfg = Field(default_factory=SandboxCfg)
    roc: RoCCfg = Field(default_factory=RoCCfg)
    trainer: TrainerCfg = Field(default_factory=TrainerCfg)
    engine: EngineCfg = Field(default_factory=EngineCfg)
    placement: PlacementCfg = Field(default_factory=PlacementCfg)
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg)
    scheduler: SchedulerCfg = Field(default_factory=SchedulerCfg)
    stages: list[StageCfg] = Field(default_factory=list)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    mining: MiningCfg = Field(default_factory=MiningCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    ablation: str | None = None  # the ablation this run belongs to (an MLflow tag), e.g. "plain-grpo"

    @model_validator(mode="after")
    def _check(self) -> "RunCfg":
        if self.world.base_model and self.sft.enabled and not self.sft.data:
            raise ValueError("world.base_model is set and sft.enabled is true: sft.data must name the chat transcripts "
                             "to SFT on (JSON lines, README: Your own model and data), or set sft.enabled: false")
        lag = self.rollout.max_staleness
        if lag and self.trainer.tis_cap is None:
            raise ValueError(f"rollout.max_staleness {lag} needs trainer.tis_cap: the update corrects for the lag with "
                             "truncated importance weights against the engines' log-probs (e.g. trainer.tis_cap=2)")
        if lag and self.placement.colocate:
            raise ValueError(f"rollout.max_staleness {lag} overlaps the rollout with the update, and "
                             "placement.colocate puts the engines to sleep during it: set one of them off")
        if self.rollout.partial and self.trainer.tis_cap is None:
            raise ValueError("rollout.partial needs trainer.tis_cap: a carried trajectory's earlier turns were sampled "
                             "by older weights, which the update corrects for with truncated importance weights "
                             "against the engines' log-probs (e.g. trainer.tis_cap=2)")
        if lag and self.checkpoint.keep_last is not None and self.checkpoint.keep_last <= lag:
            raise ValueError(f"rollout.max_staleness {lag} needs checkpoint.keep_last > {lag} (or none): a resumed run "
                             f"regenerates its next rollout from the checkpoint {lag} step(s) back")
        return self

    def rollout_for(self, stage: StageCfg) -> RolloutCfg:
        return self.rollout.model_copy(update={k: v for k, v in (
            ("max_response_tokens", stage.max_response_tokens), ("max_turns", stage.max_turns)) if v is not None})


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _set(tree: dict, dotted: str, value) -> None:
    """Set `a.b.0.c` in a nested dict/list tree (list items addressed by index)."""
    *path, leaf = dotted.split(".")
    node = tree
    for key in path:
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ValueError(f"cannot set {dotted}: no item {key} in a list of {len(node)}")
            node = node[int(key)]
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            raise ValueError(f"cannot set {dotted}: {key} is not a section")
    if isinstance(node, list):
        if not leaf.isdigit() or int(leaf) >= len(node):
            raise ValueError(f"cannot set {dotted}: no item {leaf} in a list of {len(node)}")
        node[int(leaf)] = value
    elif isinstance(node, dict):
        node[leaf] = value
    else:
        raise ValueError(f"cannot set {dotted}: its parent is not a section")


def _merge(base: dict, over: dict) -> dict:
    return {**base, **{k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


def _layers(path: Path, seen: tuple = ()) -> list[dict]:
    """A preset's trees, its bases' first: `base: other` starts from another preset and overrides it."""
    if path in seen:
        raise ValueError(f"preset {path.name} inherits from itself via {' -> '.join(p.name for p in seen)}")
    tree = yaml.safe_load(path.read_text()) or {}
    base = tree.pop("base", None)
    if base is None:
        return [tree]
    base_path = PRESETS / f"{base}.yaml"
    if not base_path.is_file():
        raise ValueError(f"preset {path.name} has base {base!r}, which is not a preset ({', '.join(list_presets())})")
    return _layers(base_path, seen + (path,)) + [tree]


def _read(path: Path) -> dict:
    """A preset's tree, its bases merged under it (sections merge, lists replace)."""
    layers = _layers(path)
    tree = layers[0]
    for layer in layers[1:]:
        tree = _merge(tree, layer)
    return tree


def _context_is_other_models(layers: list[dict]) -> bool:
    """Whether world.max_positions was set only before (below) the layer that names world.base_model: then it was
    another model's (the tiny preset's 1,024 for its own model), and the named model's own context applies."""
    world = [layer.get("world") if isinstance(layer.get("world"), dict) else {} for layer in layers]
    named = [i for i, w in enumerate(world) if "base_model" in w]
    return bool(named) and not any("max_positions" in w for w in world[named[-1]:])


def load(preset: str, overrides: list[str] | None = None) -> RunCfg:
    """Load a preset by name (or a YAML path, or a run's resolved config.json) and apply `key.path=value` overrides
    (values parsed as YAML)."""
    path = Path(preset) if preset.endswith((".yaml", ".yml", ".json")) else PRESETS / f"{preset}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(list_presets())} (or a path to a .yaml)")
    layers = _layers(path)
    tree = _read(path)
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set(tree, key.strip(), yaml.safe_load(raw))
        layers.append({})
        _set(layers[-1], key.strip(), yaml.safe_load(raw))
    if _context_is_other_models(layers) and isinstance(tree.get("world"), dict):
        tree["world"].pop("max_positions", None)  # WorldCfg then takes the model's own
    return RunCfg.model_validate(tree)
