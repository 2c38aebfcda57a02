"""Ablations (paper Fig. 4/8): the same preset, world and SFT model, one RL campaign per variant (GRPO-RoC, plain GRPO,
overlong filtering, no tool); then one comparison report in MLflow: reward, pass@1, tool-error rate among positive
trajectories and response length vs step, one line per variant (matplotlib PNGs), and a table of the figures."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from rstar2 import ablations, config, report, runstate, tracking
from flows.campaign import CampaignParams, campaign


class AblationParams(BaseModel):
    """The run form: the variants to compare (see rstar2/ablations.py) on a preset."""
    preset: str = "tiny"
    variants: list[str] = ["roc", "plain-grpo"]
    overrides: list[str] = []
    name: str = "ablation"  # run directories are <name>-<variant>
    sft_checkpoint: str | None = None  # share this committed SFT model (default: the first variant trains one)


@flow(name="ablation", flow_run_name="{params.name}")
def ablation(params: AblationParams = AblationParams()) -> dict:
    for v in params.variants:
        ablations.overrides(v)  # an unknown variant fails before anything runs
    base_cfg = config.load(params.preset, params.overrides)
    results, sft = {}, params.sft_checkpoint
    for v in params.variants:
        summary = campaign(CampaignParams(preset=params.preset, overrides=params.overrides + ablations.overrides(v),
                                          run_name=f"{params.name}-{v}", sft_checkpoint=sft))
        sft = sft or str(Path(summary["run_dir"]) / "sft")  # later variants start from the first one's SFT model
        results[v] = summary
    exp_id = tracking.setup(base_cfg.experiment, base_cfg.out_dir)
    out = runstate.run_dir(base_cfg, params.name)
    run_id = tracking.find_or_create_run(exp_id, params.name, str(out), tags={"kind": "ablation-report"})
    curves = {v: tracking.stage_histories(exp_id, s["mlflow_run_id"], list(report.CURVES)) for v, s in results.items()}
    for png in report.comparison_plots(curves, str(out / "plots"), f"{params.preset}: {', '.join(params.variants)}"):
        tracking.client().log_artifact(run_id, png, "plots")
    rows = [{"variant": v, "pass1_sft": round(s["pass1_sft"], 4), "pass1_rl": round(s["pass1_rl"], 4),
             "gain": round(s["pass1_gain"], 4), "steps": s["steps"], "wall_s": round(s["wall_s"])}
            for v, s in results.items()]
    per_step = report.per_step_rows(curves)
    tracking.client().log_dict(run_id, {"summary": rows, "per_step": per_step}, "ablation.json")
    tracking.log_params(run_id, {"variants": ",".join(params.variants), "preset": params.preset})
    create_table_artifact(rows, key=f"{params.name}-summary".lower(), description="held-out pass@1 per variant")
    create_markdown_artifact(report.per_step_markdown(per_step), key=f"{params.name}-per-step".lower())
    tracking.end(run_id)
    return {"variants": rows, "per_step": per_step, "mlflow_run_id": run_id, "plots": str(out / "plots")}
