"""The closing reports of a campaign and of an ablation in MLflow: figures as metrics, the summary as JSON, the
curves as PNGs (rstar2/evaluation/report.py draws them from the runs' metric histories)."""

from __future__ import annotations

from prefect import task

from rstar2.core import tracking
from rstar2.core.layout import RunRef
from rstar2.evaluation import report
from rstar2.tasks import costs


@task(name="campaign-report", cache_policy=None)
@costs.work
def campaign_report(run: RunRef, summary: dict) -> list[str]:
    """The campaign's headline figures (pass@1, pass@k, gain with its interval, wall time) at its last step, the
    summary, and the curves: one line per stage, or with several seeds their mean with a min-max band. Returns the
    plots' paths."""
    experiment_id, run_id, name = run.experiment_id, run.mlflow_run_id, run.layout.name
    by_seed = summary["by_seed"]
    figures = {k: v for k, v in summary.items() if k.startswith(("pass1", "pass_at", "wall"))}
    figures.update(pass1_gain_ci95_lo=summary["pass1_gain_ci95"][0], pass1_gain_ci95_hi=summary["pass1_gain_ci95"][1])
    with costs.mlflow():
        tracking.log_metrics(run_id, figures, max(s["steps"] for s in by_seed))
        tracking.client().log_dict(run_id, summary, "summary.json")
        if len(by_seed) == 1:
            curves = tracking.histories_by_stage(experiment_id, run_id, list(report.CURVES))
            title = f"{name}: stages"
        else:
            curves = {name: [tracking.stage_histories(experiment_id, s["mlflow_run_id"], list(report.CURVES))
                                 for s in by_seed]}
            title = f"{name}: {len(by_seed)} RL seeds"
    pngs = report.comparison_plots(curves, str(run.layout.plots), title)
    with costs.mlflow():
        for png in pngs:
            tracking.client().log_artifact(run_id, png, "plots")
    return pngs


@task(name="ablation-report", cache_policy=None)
@costs.work
def ablation_report(tracked: tuple[str, str], plots_dir: str, results: dict[str, dict], title: str,
                    last_steps: int = 3) -> dict:
    """`tracked`: the report's MLflow (experiment id, run id). Each variant's curves over its seeds (their mean with a
    min-max band) as PNGs in `plots_dir`, the figures of
    rstar2.evaluation.report.ablation_summary and of report.last_steps_summary (the training figures over the last
    `last_steps` steps) as metrics and, with the per-step means, as ablation.json. Returns
    {**figures, "last_steps": ..., "per_step": rows}."""
    experiment_id, run_id = tracked
    with costs.mlflow():
        curves = {v: [tracking.stage_histories(experiment_id, seed["mlflow_run_id"], list(report.CURVES))
                      for seed in s["by_seed"]] for v, s in results.items()}  # per variant, one set per seed
    pngs = report.comparison_plots(curves, plots_dir, title)
    figures = {**report.ablation_summary(results), "last_steps": report.last_steps_summary(curves, last_steps)}
    per_step = report.per_step_rows({v: report.mean_curves(runs) for v, runs in curves.items()})
    with costs.mlflow():
        for png in pngs:
            tracking.client().log_artifact(run_id, png, "plots")
        tracking.client().log_dict(run_id, {**figures, "per_step": per_step}, "ablation.json")
        tracking.log_metrics(run_id, {f"{r['variant']}_{k}": r[k] for r in figures["variants"]
                                      for k in ("pass1_rl", "pass1_rl_min", "pass1_rl_max", "gain")}, 0)
        tracking.log_metrics(run_id, {f"{c['variant']}_minus_{c['baseline']}": c["diff"]
                                      for c in figures["comparisons"]}, 0)
        tracking.log_metrics(run_id, {f"{v}_last_{m}_{k}": f[k] for v, figs in figures["last_steps"]["variants"].items()
                                      for m, f in figs.items() for k in ("mean", "min", "max")
                                      if f[k] is not None}, 0)
    return {**figures, "per_step": per_step}
