"""Between stages (paper §4.4): record why the previous stage ended, mine the hard problems if the next stage trains
on them (its own flow), reset the optimizer where the recipe says so, and hand the next stage its start."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from rstar2.core.config import RunCfg
from rstar2.core.layout import RunRef
from rstar2.flows.mine_hard import mine_hard_set
from rstar2.run import runstate
from rstar2.tasks import rl, track


class StageStart(BaseModel):
    """Where a stage starts: the problems it trains on, the checkpoint it starts from and its first global step."""
    problems_uri: str
    start_model: str
    global_step0: int


@flow(name="stage-transition", flow_run_name="to-{stage_name}")
def stage_transition(cfg: RunCfg, run: RunRef, stage_name: str, sft_model: str) -> StageStart:
    """Returns the next stage's start; the transition's record goes to the run's MLflow run."""
    layout = run.layout
    index = [s.name for s in cfg.stages].index(stage_name)
    stage = cfg.stages[index]
    start_model, global_step0 = runstate.stage_start(layout, cfg, index, sft_model)
    fresh = runstate.latest_step(layout, stage) is None  # not a retry of a started stage
    previous = runstate.finished(layout, cfg.stages[index - 1]) if index else None
    actions, problems_uri = [], run.needs_world().train
    if stage.data == "hard":
        lineage = mine_hard_set(cfg, run, stage_name, start_model)
        problems_uri = lineage["hard_uri"]
        actions.append(f"mined {lineage['problems_after']} hard of {lineage['problems_before']} problems")
    if fresh and stage.reset_optimizer:
        rl.reset_optimizer(run)
        actions.append("reset optimizer")
    record = {"to": stage.name, "from": previous["stage"] if previous else "sft",
              "previous_end": previous["decision"] if previous else None, "start_checkpoint": start_model,
              "global_step": global_step0, "data": problems_uri, "actions": actions,
              "settings": {"max_response_tokens": cfg.rollout_for(stage).max_response_tokens,
                           "max_turns": cfg.rollout_for(stage).max_turns, "prompts_per_step": stage.prompts_per_step}}
    why = (previous or {}).get("decision", {}).get("reason", "start")
    summary = f"from {record['from']} ({why}); {', '.join(actions) or 'no action'}"
    track.log_record(run.mlflow_run_id, record, f"transitions/{stage.name}.json",
                     {f"transition.{stage.name}": summary})
    return StageStart(problems_uri=problems_uri, start_model=start_model, global_step0=global_step0)
