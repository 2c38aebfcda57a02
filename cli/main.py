"""`rstar2`: the command line (typer), assembled here from the modules that hold its commands by topic; every command
that measures or summarises prints a table and takes --json PATH. `python -m rstar2.cli.main ...` runs it too."""

from __future__ import annotations

import typer

from rstar2.cli import bench, evaluation, models_data, runs, services

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rStar2-Agent: agentic RL for math with a Python tool")

app.command("campaign")(runs.campaign)
app.command("chaos")(runs.chaos)
app.command("plan")(runs.plan)
app.command("check")(runs.check)
app.command("ablation")(runs.ablation)
app.command("evaluate")(evaluation.evaluate)
app.command("solve")(evaluation.solve)
app.command("export")(evaluation.export)
app.command("sft")(models_data.sft)
app.command("serve")(services.serve)
app.command("presets")(runs.presets)
app.command("config")(runs.show_config)
app.add_typer(evaluation.analyze_app, name="analyze")
app.add_typer(models_data.data_app, name="data")
app.add_typer(services.sandbox_app, name="sandbox")
app.add_typer(models_data.models_app, name="model")
app.add_typer(bench.app, name="bench")

if __name__ == "__main__":
    app()
