"""Between stages (paper §4.4): record why the previous stage ended, mine the hard problems if the next stage trains
on them (its own flow), reset the optimizer where the recipe says so, and hand the next stage its start."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from rstar2 import checkpoint, runstate
from rstar2.config import RunCfg
from rstar2.controller import Controller
from flows.mine_hard import mine_hard_set
from tasks import rl, track


@flow(name="stage-transition", flow_run_name="to-{stage_name}")
def stage_transition(cfg: RunCfg, stage_name: str, ctl: Controller, world: dict, run_dir: str, experiment_id: str,
                     campaign_run_id: str, sft_model: str) -> dict:
    """Returns the next stage's start: problems URI, start checkpoint and global step."""
    run = Path(run_dir)
    index = [s.name for s in cfg.stages].index(stage_name)
    stage = cfg.stages[index]
    start_model, global_step0 = runstate.stage_start(run, cfg, index, sft_model)
    fresh = checkpoint.latest(runstate.stage_ckpts(run, stage)) is None  # not a retry of a started stage
    previous = runstate.finished(run, cfg.stages[index - 1]) if index else None
    actions, problems_uri = [], world["train"]
    if stage.data == "hard":
        lineage = mine_hard_set(cfg, stage_name, ctl, world, run_dir, experiment_id, campaign_run_id, start_model)
        problems_uri = lineage["hard_uri"]
        actions.append(f"mined {lineage['problems_after']} hard of {lineage['problems_before']} problems")
    if fresh and stage.reset_optimizer:
        rl.reset_optimizer(ctl)
        actions.append("reset optimizer")
    record = {"to": stage.name, "from": previous["stage"] if previous else "sft",
              "previous_end": previous["decision"] if previous else None, "start_checkpoint": start_model,
              "global_step": global_step0, "data": problems_uri, "actions": actions,
              "settings": {"max_response_tokens": cfg.rollout_for(stage).max_response_tokens,
                           "max_turns": cfg.rollout_for(stage).max_turns, "prompts_per_step": stage.prompts_per_step}}
    why = (previous or {}).get("decision", {}).get("reason", "start")
    summary = f"from {record['from']} ({why}); {', '.join(actions) or 'no action'}"
    track.log_record(campaign_run_id, record, f"transitions/{stage.name}.json", {f"transition.{stage.name}": summary})
    return {"problems_uri": problems_uri, "start_model": start_model, "global_step0": global_step0}
