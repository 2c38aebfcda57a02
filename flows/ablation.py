"""Ablations (paper Fig. 4/8): the same preset, world and SFT model, one RL campaign per variant (GRPO-RoC, plain GRPO,
overlong filtering, no tool); then one comparison report in MLflow: reward, pass@1, tool-error rate among positive
trajectories and response length vs step, one line per variant (matplotlib PNGs), and a table of the figures.

With `seeds` N > 1 every variant runs N RL seeds from the shared SFT model; the report gives each variant's mean,
min, max and 95 % interval over its seeds (held-out pass@1, and the training figures at the end of RL: tool-error
rate among positives, response length, ... averaged over the last `last_steps` steps), and each variant against the
first (the baseline): the difference with its Welch interval and whether it is beyond the seeds' noise
(rstar2.evaluation.report.ablation_summary, last_steps_summary). Curves: the seeds' mean with a min-max band.

With `world_seeds` K > 1 all of it runs once per world (cfg.seed, cfg.seed+1, ...: each its own problems and so its own
SFT model, which that world's variants share), and the report pools the K x N runs of each variant (run i of every
variant: one world's SFT model, one rl_seed; rstar2.evaluation.report.pool_worlds). The SFT model is a draw, as
floats differ between hosts: a conclusion that holds over two SFT models is one that another host should reach."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, Field, model_validator

from rstar2.core import config
from rstar2.core.layout import RunLayout
from rstar2.evaluation import report
from rstar2.flows.campaign import CampaignParams, campaign
from rstar2.run import ablations, runstate
from rstar2.tasks import track
from rstar2.tasks.reports import ablation_report


class AblationParams(BaseModel):
    """The run form: the variants to compare (see rstar2/run/ablations.py) on a preset."""
    preset: str = "tiny-recovery"  # the tiny world where the policy recovers from tool errors: RoC has them to act on
    variants: list[str] = ["roc", "plain-grpo"]
    overrides: list[str] = []
    name: str = "ablation"  # run directories are <name>-<variant>
    sft_checkpoint: str | None = None  # share this committed SFT model (default: the first variant trains one)
    seeds: int = Field(3, ge=1)  # RL seeds per variant (3: the paired tool-error ratio has an interval)
    # worlds, each with its own SFT model (the conclusion must hold over draws); default 2, or 1 with sft_checkpoint
    world_seeds: int | None = Field(None, ge=1)
    last_steps: int = Field(3, ge=1)  # the training figures "at the end of RL": each seed's mean over its last steps

    @model_validator(mode="after")
    def _worlds(self) -> "AblationParams":
        if self.world_seeds is None:
            self.world_seeds = 1 if self.sft_checkpoint else 2
        elif self.world_seeds > 1 and self.sft_checkpoint:
            raise ValueError("world seeds each train their own SFT model: sft_checkpoint cannot be given with them")
        return self


@flow(name="ablation", flow_run_name="{params.name}")
def ablation(params: AblationParams = AblationParams()) -> dict:
    for v in params.variants:
        ablations.overrides(v)  # an unknown variant fails before anything runs
    base_cfg = config.load(params.preset, params.overrides)
    worlds = range(base_cfg.seed, base_cfg.seed + params.world_seeds)
    by_world = {w: _variants(params, base_cfg, w) for w in worlds}
    results = by_world[base_cfg.seed] if params.world_seeds == 1 else {
        v: report.pool_worlds({w: by_world[w][v] for w in worlds}) for v in params.variants}
    out = runstate.layout(base_cfg, params.name)
    exp_id, run_id = track.open_run(track.RunSpec(
        experiment=base_cfg.experiment, out_dir=base_cfg.out_dir, name=params.name, key=str(out.top),
        tags={"kind": "ablation-report"},
        set_tags={"seeds": params.seeds, "world_seeds": params.world_seeds},  # tags: a re-run may add seeds
        params={"variants": ",".join(params.variants), "preset": params.preset}))
    runs = (f"{params.seeds} seeds" if params.seeds > 1 else "") + (
        f" x {params.world_seeds} worlds" if params.world_seeds > 1 else "")
    title = f"{params.preset}: {', '.join(params.variants)}" + (f" ({runs.strip(' x')})" if runs else "")
    res = ablation_report((exp_id, run_id), str(out.plots), results, title, params.last_steps)
    figures, per_step = {k: v for k, v in res.items() if k != "per_step"}, res["per_step"]
    cells = lambda rows: [{k: ", ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()}  # noqa: E731
                          for r in rows]  # an interval as one cell
    create_table_artifact(cells(figures["variants"]), key=f"{params.name}-summary".lower(),
                          description="held-out pass@1 per variant (mean, min, max, 95 % interval over seeds)")
    if figures["comparisons"]:
        create_table_artifact(cells(figures["comparisons"]), key=f"{params.name}-vs-baseline".lower(),
                              description="each variant minus the first: Welch 95 % interval over seeds")
    create_table_artifact(report.last_steps_rows(figures["last_steps"]), key=f"{params.name}-last-steps".lower(),
                          description=f"training figures over the last {params.last_steps} steps: mean, min, max, "
                                      "95 % interval over seeds")
    create_markdown_artifact(report.per_step_markdown(per_step), key=f"{params.name}-per-step".lower())
    track.end_run(run_id)
    return {**figures, "seeds": params.seeds, "world_seeds": list(worlds), "per_step": per_step,
            "mlflow_run_id": run_id, "plots": str(out.plots)}


def _variants(params: AblationParams, base_cfg, world: int) -> dict[str, dict]:
    """Every variant's campaign in one world (run directories <name>-<variant>, or <name>-world-<w>-<variant> with
    several worlds), all from the first variant's SFT model."""
    several = params.world_seeds > 1
    results, sft = {}, params.sft_checkpoint
    for v in params.variants:
        summary = campaign(CampaignParams(
            preset=params.preset, overrides=params.overrides + ablations.overrides(v) + ([f"seed={world}"] * several),
            run_name=f"{params.name}-world-{world}-{v}" if several else f"{params.name}-{v}", sft_checkpoint=sft,
            seeds=params.seeds))
        # later variants start from the first one's SFT model; with SFT off there is none to share: each starts
        # from its own world's initial model (the same seed: the same weights)
        if base_cfg.sft.enabled:
            sft = sft or runstate.sft_model(RunLayout.at(summary["run_dir"]), base_cfg)
        results[v] = summary
    return results
