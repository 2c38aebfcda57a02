"""The campaign's first task: the preflight (rstar2/run/preflight.py), its rows logged and kept as a Prefect artifact; a
run that cannot start stops here, before SFT, Ray or any actor."""

from __future__ import annotations

import logging

from prefect import task
from prefect.artifacts import create_markdown_artifact

from rstar2.core.config import RunCfg
from rstar2.core.layout import RunLayout
from rstar2.run import preflight as checks
from rstar2.tasks import costs

log = logging.getLogger(__name__)


@task(name="preflight", cache_policy=None, retries=0)
@costs.work
def preflight(cfg: RunCfg, layout: RunLayout, sft_checkpoint: str | None = None) -> dict:
    """Every check of `rstar2 check` for the run at `layout`; PreflightError naming what failed, else the figures
    (what was dropped is recorded in the world, which RL and evaluation then read)."""
    res = checks.run(cfg, layout, sft_checkpoint)
    for c in res["checks"]:
        log.log(logging.INFO if c["status"] == checks.OK else logging.WARNING, "preflight %s: %s: %s", c["status"],
                c["check"], c["detail"])
    table = "| check | status | detail |\n|---|---|---|\n" + "".join(
        f"| {c['check']} | {c['status']} | {c['detail'].replace('|', '/')} |\n" for c in res["checks"])
    with costs.prefect():
        create_markdown_artifact(table, key="preflight", description="what the campaign checked before it started")
    return checks.require(res)
