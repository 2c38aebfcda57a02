"""The preflight (`rstar2 check`, and the first thing a campaign does): everything a run needs, seen before anything
starts, so that nothing is found fatal hours later.

One row per check, each ok, warn (the run goes on; something was dropped or looks odd) or fail (it cannot run): the
world (made once in the run directory, as the campaign makes it), the model (config, weights present, tokenizer and chat
template through rstar2.rollout.chat), the context (world.max_positions against the model's own), the prompts of the
training split, of the world's evaluation splits and of each of eval.suites (rendered and tokenised as the rollout does,
rstar2.rollout.trajectory.prompt_ids), the SFT transcripts, the plan's verdict (rstar2.run.plan) and the sandbox (a
trivial execution, then closed).

A prompt fits when the prompt and its whole response budget fit the context (rstar2.rollout.trajectory.fits, the
rollout's own rule): the training split against the largest response budget of any stage, evaluation against
eval.max_response_tokens. Prompts that do not fit are dropped and counted with their ids (verl's
filter_overlong_prompts), recorded in the world directory (fit.json): a world split's kept rows go to
`fit-<split>.parquet`, which the world's URIs then name (rstar2.world.build.uris), and a suite's dropped ids are left
out when the suite is prepared for evaluation (`exclude`). Only what cannot run at all fails: no problem left to train
or evaluate on, a model or template that cannot load, a context beyond the model's, a plan that does not fit, a sandbox
that does not run code."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from rstar2.core import checkpoint
from rstar2.core.config import RunCfg, model_positions
from rstar2.core.layout import RunLayout, WorldLayout
from rstar2.rollout import trajectory
from rstar2.world import build

OK, WARN, FAIL = "ok", "warn", "fail"
SHOWN_IDS = 8  # dropped ids a row's detail names (every one is in the figures and the record)


class PreflightError(ValueError):
    """A run that cannot start: the failed checks, one line each."""


@dataclass
class Row:
    check: str
    status: str  # ok, warn or fail
    detail: str
    figures: dict = field(default_factory=dict)


@dataclass
class Fit:
    """A problem table's prompts against the context: the rows kept and the ids dropped."""
    problems: int
    kept: pl.DataFrame
    dropped_ids: list[str]
    max_prompt_tokens: int


def fit(df: pl.DataFrame, chat, limits: trajectory.RolloutLimits) -> Fit:
    """Render and tokenise every prompt of `df` as the rollout does; keep those that fit
    (rstar2.rollout.trajectory.fits)."""
    lengths = [len(ids) for ids in trajectory.prompt_ids(chat, df["prompt"].to_list())]
    keep = [trajectory.fits(n, limits) for n in lengths]
    dropped = df.filter(~pl.Series(keep, dtype=pl.Boolean))["problem_id"].to_list()
    return Fit(df.height, df.filter(pl.Series(keep, dtype=pl.Boolean)), dropped, max(lengths, default=0))


def fit_row(name: str, f: Fit, limits: trajectory.RolloutLimits, required: bool = True) -> Row:
    """A table's row: how many prompts were kept, the longest, and the dropped ids; fail when a table the run needs
    keeps none."""
    room = f"+ {limits.max_response_tokens} response tokens within {limits.max_model_len}"
    figures = {"problems": f.problems, "kept": f.kept.height, "dropped": len(f.dropped_ids),
               "dropped_ids": f.dropped_ids, "max_prompt_tokens": f.max_prompt_tokens,
               "response_budget": limits.max_response_tokens, "context": limits.max_model_len}
    detail = f"{f.kept.height} of {f.problems} kept (longest prompt {f.max_prompt_tokens} tokens; a prompt {room})"
    if not f.dropped_ids:
        return Row(name, OK, detail, figures)
    shown = ", ".join(f.dropped_ids[:SHOWN_IDS]) + (" ..." if len(f.dropped_ids) > SHOWN_IDS else "")
    status = FAIL if f.kept.height == 0 and required else WARN
    return Row(name, status, f"{detail}; dropped {len(f.dropped_ids)}: {shown}", figures)


def budgets(cfg: RunCfg) -> tuple[int, int]:
    """The response budgets prompts must leave room for: training (the largest of any stage, mining included) and
    evaluation."""
    train = max([cfg.rollout_for(s).max_response_tokens for s in cfg.stages] or [cfg.rollout.max_response_tokens])
    return train, cfg.eval.max_response_tokens


def run(cfg: RunCfg, layout: RunLayout, sft_checkpoint: str | None = None) -> dict:
    """Every check for the run at `layout` (its world is made there if it is not yet); the record of what was
    dropped goes to the world directory. With `sft_checkpoint` (a given SFT model RL starts from) that model is the
    one checked (committed, its template, its context) and the SFT transcripts are not.
    Returns the rows, what was dropped, and `ok` (no check failed)."""
    rows: list[Row] = []
    world_dir = layout.world
    train_budget, eval_budget = budgets(cfg)
    out = {"run_dir": str(layout.top), "context": cfg.world.max_positions, "train_budget": train_budget,
           "eval_budget": eval_budget, "dropped": {}}
    uris = _world(cfg, world_dir, rows)
    # the model the engines serve: the given SFT model, else the base model, else the tiny world's (once it is made)
    model_dir = sft_checkpoint or cfg.world.base_model or (uris or {}).get("init_model")
    chat = None
    if sft_checkpoint and not checkpoint.is_committed(Path(sft_checkpoint)):
        rows.append(Row("model and template", FAIL, f"sft_checkpoint {sft_checkpoint} is not a committed checkpoint "
                        f"(no {checkpoint.MARKER})"))
    elif model_dir:
        chat = _model(model_dir, rows)
    out["model"] = model_dir
    if chat is not None:
        _context(cfg, model_dir, rows)
    if chat is not None and uris:
        tables = _prompts(cfg, chat, uris, rows)
        out["dropped"] = {k: f.dropped_ids for k, f in tables.items()}
        _record(world_dir, uris, tables, out)
        if not sft_checkpoint:
            rows.append(_sft(cfg, chat, uris["sft_data"], layout.sft))
    rows += [_plan(cfg), _sandbox(cfg)]
    return {**out, "ok": all(r.status != FAIL for r in rows), "checks": [asdict(r) for r in rows]}


def require(res: dict) -> dict:
    """`res` (from `run`) when nothing failed; else PreflightError naming each failed check."""
    bad = [c for c in res["checks"] if c["status"] == FAIL]
    if bad:
        raise PreflightError("preflight failed (`rstar2 check` shows every check): " + "; ".join(
            f"{c['check']}: {c['detail']}" for c in bad))
    return res


def exclude(df: pl.DataFrame, fit_uri: str | None, key: str) -> pl.DataFrame:
    """`df` without the problems the preflight's record (`fit_uri`, none: nothing) dropped from table `key` (a
    world split, or `suite:<name>`)."""
    if not fit_uri or not Path(fit_uri).is_file():
        return df
    dropped = json.loads(Path(fit_uri).read_text())["dropped"].get(key, [])
    return df.filter(~pl.col("problem_id").is_in(dropped)) if dropped else df


# ---- the checks -------------------------------------------------------------------------------------------------

def _world(cfg: RunCfg, world_dir: Path, rows: list[Row]) -> dict[str, str] | None:
    """The world, made once (as the campaign makes it); its tables as they are, before any fit."""
    try:
        build.ensure(cfg, world_dir)
    except Exception as e:  # noqa: BLE001 - any failure to make the world is this check's verdict
        rows.append(Row("world", FAIL, f"{type(e).__name__}: {e}"))
        return None
    uris = build.uris(cfg, world_dir, fitted=False)
    splits = [s for s in build.SPLITS if s in uris]
    rows.append(Row("world", OK, f"{world_dir}: splits {', '.join(splits)}", {"world_dir": str(world_dir)}))
    return uris


def _model(model_dir: str, rows: list[Row]):
    """The model's config, its weights' presence, its tokenizer and chat template (the weights are not read)."""
    from transformers import AutoConfig

    from rstar2.models import tools
    from rstar2.rollout.chat import ChatFormat

    try:
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory on this machine (no config.json)")
        mc = AutoConfig.from_pretrained(model_dir)
        if not any(Path(model_dir).glob(p) for p in ("*.safetensors", "*.bin", "*.safetensors.index.json")):
            raise FileNotFoundError(f"{model_dir} has no weights (*.safetensors or *.bin)")
        chat = ChatFormat.load(model_dir)
    except Exception as e:  # noqa: BLE001 - a model that cannot load is this check's verdict
        rows.append(Row("model and template", FAIL, f"{type(e).__name__}: {e}"))
        return None
    overhead = len(trajectory.prompt_ids(chat, [""])[0])
    added = tools.record(model_dir)  # a template and tokens rstar2 gave the model (rstar2 model add-tools)
    given = (f"; its tool template ({added['tool_template']}) and tokens {', '.join(added['added_tokens'])} were "
             f"added by rstar2 (rstar2_model.json)" if added.get("tool_template") else "")
    rows.append(Row("model and template", OK, f"{model_dir}: {mc.model_type}, vocabulary {len(chat.tokenizer)}; the "
                    f"template renders system prompt and tools in {overhead} tokens, ends a turn with "
                    f"{chat.end_of_turn}{given}", {"model_type": mc.model_type, "prompt_overhead_tokens": overhead,
                                                    **({"added": added} if given else {})}))
    return chat


def _context(cfg: RunCfg, model_dir: str, rows: list[Row]) -> None:
    """world.max_positions against the model's own context (vLLM refuses a longer one)."""
    ctx, own = cfg.world.max_positions, model_positions(model_dir)
    train, evals = budgets(cfg)
    figures = {"context": ctx, "model_max_positions": own, "train_budget": train, "eval_budget": evals}
    budget = f"response budgets: training {train}, evaluation {evals}"
    if own is not None and ctx > own:
        rows.append(Row("context", FAIL, f"world.max_positions {ctx} exceeds the model's max_position_embeddings "
                        f"{own}", figures))
    elif own is None or ctx == own:
        rows.append(Row("context", OK, f"{ctx} tokens, the model's own; {budget}", figures))
    else:
        rows.append(Row("context", OK, f"{ctx} tokens as set (the model's: {own}); {budget}", figures))


def _prompts(cfg: RunCfg, chat, uris: dict[str, str], rows: list[Row]) -> dict[str, Fit]:
    """The training split, the world's evaluation splits and each suite against the context."""
    from rstar2.data import suites
    from rstar2.data.schema import validate

    ctx = cfg.world.max_positions
    train = trajectory.RolloutLimits(max_response_tokens=budgets(cfg)[0], max_model_len=ctx)
    evals = trajectory.RolloutLimits(max_response_tokens=cfg.eval.max_response_tokens, max_model_len=ctx)
    tables: dict[str, Fit] = {}
    for split in [s for s in build.SPLITS if s in uris]:
        limits = train if split == "train" else evals
        needed = split == "train" or (split == cfg.eval.split and not cfg.eval.suites)
        try:
            tables[split] = fit(validate(pl.read_parquet(uris[split]), uris[split]), chat, limits)
        except Exception as e:  # noqa: BLE001 - a table that cannot be read or rendered is this check's verdict
            rows.append(Row(f"{split} prompts", FAIL if needed else WARN, f"{uris[split]}: {e}"))
            continue
        rows.append(fit_row(f"{split} prompts", tables[split], limits, needed))
    for s in cfg.eval.suites:
        try:
            tables[f"suite:{s.name}"] = fit(suites.load(s, cfg.eval.seed), chat, evals)
        except Exception as e:  # noqa: BLE001 - a suite that cannot load is this check's verdict
            rows.append(Row(f"suite {s.name} prompts", FAIL, f"{s.path}: {e}"))
            continue
        rows.append(fit_row(f"suite {s.name} prompts", tables[f"suite:{s.name}"], evals))
    return tables


def _record(world_dir: Path, uris: dict[str, str], tables: dict[str, Fit], out: dict) -> None:
    """Each world split that lost prompts: its kept rows as `fit-<split>.parquet` (an earlier one removed where
    nothing is dropped now); the record of every dropped id as fit.json, with the content hash of each split whose
    kept rows stand in for it (a split changed since is read whole: build.uris)."""
    sources = {}
    files = WorldLayout(dir=world_dir)
    for split in [s for s in build.SPLITS if s in tables]:
        kept = files.fitted(split)
        if tables[split].dropped_ids:
            checkpoint.write_atomic(kept, tables[split].kept.write_parquet)
            sources[split] = build.file_sha256(uris[split])
        else:
            kept.unlink(missing_ok=True)
    record = {k: out[k] for k in ("context", "train_budget", "eval_budget")}
    checkpoint.write_atomic(files.fit, json.dumps({**record, "model": out["model"], "dropped": out["dropped"],
                                                   "sources": sources}, indent=1))


def _sft(cfg: RunCfg, chat, data: str, sft_dir: Path) -> Row:
    """The SFT transcripts rendered as SFT renders them (rstar2.training.sft.tokenize). SFT does not truncate: a
    transcript longer than the context trains positions the engine never reaches (a warning, not a failure)."""
    if not cfg.sft.enabled or checkpoint.is_committed(sft_dir):
        return Row("SFT transcripts", OK, "not needed: " + ("sft.enabled is off" if not cfg.sft.enabled else
                                                            f"{sft_dir} is already trained"))
    from rstar2.training import sft, transcripts
    try:
        ids, _ = sft.tokenize(chat, transcripts.read(data))
    except Exception as e:  # noqa: BLE001 - transcripts SFT cannot read or render are this check's verdict
        return Row("SFT transcripts", FAIL, f"{data}: {e}")
    lengths, ctx = [len(x) for x in ids], cfg.world.max_positions
    over = sum(n > ctx for n in lengths)
    figures = {"transcripts": len(lengths), "max_tokens": max(lengths), "longer_than_context": over}
    detail = f"{len(lengths)} transcripts, longest {max(lengths)} tokens"
    if over:
        return Row("SFT transcripts", WARN, f"{detail}; {over} longer than the context {ctx}: SFT does not truncate "
                   "them, so it trains positions the rollout never reaches", figures)
    return Row("SFT transcripts", OK, f"{detail}, all within the context {ctx}", figures)


def _plan(cfg: RunCfg) -> Row:
    """The plan's verdict for the run's own placement (rstar2.run.plan)."""
    from rstar2.run import plan
    try:
        res = plan.plan(cfg)
    except Exception as e:  # noqa: BLE001 - a shape the plan cannot size is this check's verdict
        return Row("plan", FAIL, f"{type(e).__name__}: {e}")
    where = f"{res['gpus']} x {res['gpu_mem_gb']:g} GB" if res["gpus"] else "this machine (CPU)"
    detail = "; ".join(f"{d['kind']} {d['need_gb']:.1f} of {d['have_gb']:.1f} GB{'' if d['fits'] else ' (no)'}"
                       for d in res["devices"])
    return Row("plan", OK if res["fits"] else FAIL, f"{'fits' if res['fits'] else 'does not fit'} {where}: {detail}",
               {"fits": res["fits"], "devices": res["devices"]})


def _sandbox(cfg: RunCfg) -> Row:
    """Start the configured sandbox, run one trivial program, close it."""
    from rstar2.sandbox import ExecRequest
    from rstar2.sandbox.backends import connect

    try:
        if cfg.sandbox.backend == "ray":
            from rstar2.rollout import cluster
            cluster.init()
        sb = connect(cfg.sandbox)
        try:
            res = sb.run_batch([ExecRequest("print(6 * 7)")])[0]
        finally:
            sb.close()
    except Exception as e:  # noqa: BLE001 - a sandbox that cannot start is this check's verdict
        return Row("sandbox", FAIL, f"{cfg.sandbox.backend}: {type(e).__name__}: {e}")
    if res.status != "ok" or res.stdout.strip() != "42":
        return Row("sandbox", FAIL, f"{cfg.sandbox.backend}: print(6 * 7) gave {res.status} {res.stdout!r} "
                   f"{res.stderr[-200:]!r}")
    return Row("sandbox", OK, f"{cfg.sandbox.backend}: ran print(6 * 7) in {res.wall_s * 1000:.0f} ms, closed",
               {"wall_s": res.wall_s})
