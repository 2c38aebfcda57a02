import logging
from pathlib import Path

from prefect import task

from rstar2.core.config import RunCfg
from rstar2.tasks import costs
from rstar2.training import sft
from rstar2.world import build

log = logging.getLogger(__name__)


@task(name="build-world", cache_policy=None, retries=0)
@costs.work
def build_world(cfg: RunCfg, out_dir: str) -> dict[str, str]:
    """Make the world once per run directory (committed atomically); a retried or later flow reuses it. The user's
    problem tables (world.<split>_data) are brought in again whenever their content changed."""
    uris, synced = build.ensure(cfg, Path(out_dir))
    for split, r in synced.items():
        log.warning(f"world.{split}_data {r['source']}: {r['rows_out']} of {r['rows_in']} rows kept "
                    f"({r['dropped_malformed']} malformed, {r['dropped_non_integer']} with a "
                    f"non-integer answer dropped)")
    return uris


@task(name="sft", cache_policy=None)
@costs.work
def run_sft(cfg: RunCfg, init_model: str, sft_data: str, out_dir: str) -> str:
    """Non-reasoning SFT; returns the SFT model dir (committed only when training finished)."""
    from rstar2.core import checkpoint

    if checkpoint.is_committed(Path(out_dir)):
        return out_dir  # a retried campaign does not redo a finished SFT
    sft.train_and_commit(cfg, Path(init_model), Path(sft_data), Path(out_dir), {})
    return out_dir


@task(name="prepare-suites", cache_policy=None)
@costs.work
def prepare_suites(cfg: RunCfg, out_dir: str, fit: str | None = None) -> dict[str, str]:
    """Each of eval.suites read from its file (rstar2/data/suites.py) and written in the problem schema as
    `<out_dir>/<name>.parquet`, again each time (an edited suite file is picked up), less the problems the
    preflight's record `fit` dropped (the world's "fit"); suite name -> that table."""
    from rstar2.data import suites
    from rstar2.run import preflight

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for s in cfg.eval.suites:
        found[s.name] = str(out / f"{s.name}.parquet")
        preflight.exclude(suites.load(s, cfg.eval.seed), fit, f"suite:{s.name}").write_parquet(found[s.name])
    return found
