"""The tables and views the `rstar2` commands print (rich), one function per command's output; the commands
(cli/runs.py, cli/evaluation.py, cli/models_data.py) only gather figures and write them (--json). The benchmarks'
tables: cli/bench_tables.py."""

from __future__ import annotations

from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from rstar2.sandbox import OK


def campaign_table(summary: dict, preset: str) -> Table:
    """The imported model as it came (where there is one), SFT, one row per RL seed, and with several seeds their
    mean with min, max and 95 % interval over seeds;
    pass@1 ± its standard error over problems, pass@k."""
    ks = sorted(int(k.removeprefix("pass_at_").removesuffix("_sft")) for k in summary
                if k.startswith("pass_at_") and k.endswith("_sft"))[1:]
    n = summary["seeds"]
    table = Table(title=f"rstar2 campaign '{preset}': held-out pass@1 ({summary['eval_samples']} samples x "
                        f"{summary['eval_problems']} problems{f', {n} RL seeds' if n > 1 else ''}; ± standard error "
                        f"over problems)")
    for col in ("checkpoint", "pass@1 ± se", *(f"pass@{k}" for k in ks), "gain"):
        table.add_column(col, justify="left" if col == "checkpoint" else "right")
    if "pass1_instruct" in summary:  # an imported model, evaluated as it came (its tool template only)
        table.add_row("imported model as it came", _pm(summary, "pass1_instruct", "pass1_instruct_se"),
                      *("" for _ in ks), "")
    table.add_row("SFT", _pm(summary, "pass1_sft", "pass1_sft_se"),
                  *(f"{summary[f'pass_at_{k}_sft']:.3f}" for k in ks), "")
    for s in summary["by_seed"]:
        table.add_row(f"after RL, rl_seed {s['rl_seed']} ({s['steps']} steps)", _pm(s),
                      *(f"{s.get(f'pass_at_{k}', float('nan')):.3f}" for k in ks), f"{s['pass1_gain']:+.3f}")
    if n > 1:
        lo, hi = summary["pass1_gain_ci95"]
        table.add_row(escape(f"mean of {n} seeds [min, max] (gain's 95 % interval)"),
                      f"{summary['pass1_rl']:.3f} [{summary['pass1_rl_min']:.3f}, {summary['pass1_rl_max']:.3f}]",
                      *(f"{summary.get(f'pass_at_{k}_rl', float('nan')):.3f}" for k in ks),
                      f"{summary['pass1_gain']:+.3f} [{summary['pass1_gain_min']:+.3f}, "
                      f"{summary['pass1_gain_max']:+.3f}] ({lo:+.3f}, {hi:+.3f})", style="bold")
    return table

def speed_line(speed: dict) -> str:
    """The campaign's SFT and its first seed's mean RL step, in one line."""
    parts = []
    if "sft_tokens_per_s" in speed:
        parts.append(f"SFT {speed['sft_tokens_per_s']:.0f} tokens/s ({speed['sft_s']:.0f} s)")
    if "rl_steps" in speed:
        parts.append(f"RL step (mean of {speed['rl_steps']}): rollout {speed['rollout_s']:.0f} s "
                     f"({speed['rollout_tokens_per_s']:.0f} generated tokens/s), update {speed['update_s']:.0f} s "
                     f"({speed['update_tokens_per_s']:.0f} tokens/s)")
    numerics = f" ({speed['trainer_dtype']} trainer)" if "trainer_dtype" in speed else ""
    return ("speed" + numerics + ": " + "; ".join(parts)) if parts else "speed: nothing measured"


def suites_table(summary: dict) -> Table:
    """eval.suites beside a campaign's headline split (eval.also_split): each suite's pass@1 ± se per checkpoint."""
    rows = ([("imported model as it came", summary["suites_instruct"])] if "suites_instruct" in summary else []) + \
        [("SFT", summary["suites_sft"])] + [(f"after RL, rl_seed {s['rl_seed']}", s.get("suites", {}))
                                            for s in summary["by_seed"]]
    names = list(summary["suites_sft"])
    table = Table(title="evaluation suites: pass@1 ± standard error over problems (samples x problems)")
    for col in ("checkpoint", *names):
        table.add_column(col, justify="left" if col == "checkpoint" else "right")
    for label, suites in rows:
        table.add_row(label, *(f"{_pm(suites[n])} ({suites[n]['samples']} x {suites[n]['problems']})" if n in suites
                               else "-" for n in names))
    return table


def worlds_table(summary: dict, preset: str) -> Table:
    """One row per (world seed, RL seed): the world's SFT pass@1, after RL, the gain; then every gain's mean with
    min, max, the interval over runs and the interval over world means."""
    table = Table(title=f"rstar2 campaign '{preset}': held-out pass@1 ({summary['eval_samples']} samples x "
                        f"{summary['eval_problems']} problems) over {len(summary['world_seeds'])} worlds x "
                        f"{summary['seeds']} RL seeds")
    for col in ("world seed", "rl seed", "SFT", "after RL", "gain"):
        table.add_column(col, justify="right")
    for r in summary["runs"]:
        table.add_row(str(r["world_seed"]), str(r["rl_seed"]), f"{r['pass1_sft']:.3f}", f"{r['pass1']:.3f}",
                      f"{r['pass1_gain']:+.3f}")
    (lo, hi), (wlo, whi) = summary["pass1_gain_ci95"], summary["pass1_gain_worlds_ci95"]
    table.add_row(escape(f"all {len(summary['runs'])}: mean [min, max]"), "", "", "",
                  f"{summary['pass1_gain_mean']:+.3f} [{summary['pass1_gain_min']:+.3f}, "
                  f"{summary['pass1_gain_max']:+.3f}]", style="bold")
    table.add_row("95 % interval: runs / world means", "", "", "", f"({lo:+.3f}, {hi:+.3f}) / ({wlo:+.3f}, {whi:+.3f})")
    return table

def _ks(res: dict) -> list[int]:
    """The k of an evaluation's pass_at_{k} keys, ascending."""
    return sorted(int(k.removeprefix("pass_at_")) for k in res if k.startswith("pass_at_"))

def _pm(res: dict, key: str = "pass1", se: str = "pass1_se") -> str:
    """`0.512 ± 0.031` (the standard error is left out where it is not defined: one problem)."""
    v, e = res[key], res.get(se)
    return f"{v:.3f}" if e is None or e != e else f"{v:.3f} ± {e:.3f}"

def plan_tables(res: dict, preset: str) -> list[Table]:
    f = res["figures"]
    where = f"{res['gpus']} x {res['gpu_mem_gb']:g} GB" if res["gpus"] else "this machine (CPU)"
    sizes = Table(title=f"rstar2 plan '{preset}' on {where}: {f['params'] / 1e9:.3g} B parameters "
                        f"(largest layer {f['largest_layer_params'] / 1e6:.0f} M)")
    for col in ("per device", "GB"):
        sizes.add_column(col, justify="right" if col == "GB" else "left")
    lora = "lora_params" in f
    states = "frozen base + LoRA adapters" if lora else "DeepSpeed estimator"
    rows = [(f"trainer model states ({states})", "trainer_model_states_gb")]
    if lora:  # the states' two parts, and DeepSpeed's estimator for the same adapters beside the plan's 16 B a param
        rows += [(f"  frozen base ({f['lora_adapted_layers']} adapted layers' weights in compute dtype, rest fp32)",
                  "trainer_frozen_base_gb"),
                 (f"  LoRA adapter states (rank {f['lora_rank']}, {f['lora_params'] / 1e6:.1f} M params x 16 B)",
                  "trainer_adapter_states_gb"),
                 ("  same adapters, DeepSpeed ZeRO-2 estimator on 1 GPU (20 B a param)",
                  "trainer_adapter_states_deepspeed_gb")]
    rows += [("trainer reference policy" + (" (the base, adapter off)" if lora else ""), "trainer_reference_gb"),
             ("trainer activations (as configured)", "trainer_activations_gb"),
             ("trainer activations (checkpointing toggled)", "trainer_activations_other_gb"),
             ("trainer total", "trainer_gb"), ("engine weights per TP shard", "engine_weights_gb")]
    if lora:
        rows.append((f"engine LoRA buffers (1 slot, max_lora_rank {f['engine_lora_rank']})", "engine_lora_gb"))
    for label, key in rows:
        sizes.add_row(label, f"{f[key]:.2f}")
    verdict = Table(title="verdict per device kind")
    for col in ("device", "count", "needs GB", "has GB", "fits", "detail"):
        verdict.add_column(col, justify="right" if col in ("count", "needs GB", "has GB") else "left")
    for d in res["devices"]:
        verdict.add_row(d["kind"], str(d["count"]), f"{d['need_gb']:.1f}", f"{d['have_gb']:.1f}",
                        "yes" if d["fits"] else "[red]no[/red]", escape(d["detail"]))
    return [sizes, verdict]

def check_table(res: dict, preset: str) -> Table:
    """One row per check: ok, warn or fail, and what was found."""
    table = Table(title=f"rstar2 check '{preset}': context {res['context']} tokens; response budgets: training "
                        f"{res['train_budget']}, evaluation {res['eval_budget']}")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in res["checks"]:
        table.add_row(escape(c["check"]), f"[{colour[c['status']]}]{c['status']}[/{colour[c['status']]}]",
                      escape(c["detail"]))
    return table

def ablation_conclusions(res: dict) -> list[str]:
    """One line per variant on the tool-error rate among positives against the first variant, from the paired
    ratio over seeds (rstar2.evaluation.stats.paired_log_ratio): higher, lower, or not beyond the seeds' noise."""
    lines = []
    for v, figs in res["last_steps"]["vs_baseline"].items():
        c = figs.get("tool_error_rate_pos", {})
        p = c.get("paired_ratio")
        if not p or not p["ci95"]:
            continue
        verdict = "higher" if p["higher"] else "lower" if p["lower"] else "not beyond the seeds' noise"
        lines.append(f"tool-error rate among positives, {v} / {c['baseline']} seed by seed: {p['ratio']:.2f}x "
                     f"(95 % interval {p['ci95'][0]:.2f}x-{p['ci95'][1]:.2f}x): {v}'s is {verdict}")
    return lines

def ablation_steps_table(res: dict) -> Table:
    """Per variant and RL step, on the train batch: reward, pass@1, tool-error rate among positives, response length."""
    table = Table(title="per step (train batch): reward, pass@1, tool-error rate among positives, response length")
    cols = ["variant", "step", "reward_mean", "pass1_train", "tool_error_rate_pos", "response_len_mean"]
    for col in cols:
        table.add_column(col)
    for r in res["per_step"]:
        table.add_row(*[str(r.get(c, "")) for c in cols])
    return table

def ablation_tables(res: dict, name: str, preset: str) -> list[Table]:
    """Per variant: held-out pass@1 after RL and the gain, mean [min, max] (95 % interval) over its seeds; then each
    variant minus the first with its Welch interval and whether it is beyond the seeds' noise."""
    from rstar2.evaluation.report import last_steps_rows

    iv = lambda ci, f="+.3f": "-" if ci is None else f"({ci[0]:{f}}, {ci[1]:{f}})"  # noqa: E731
    worlds = len(res.get("world_seeds", [])) or 1
    runs = f"{res['seeds']} RL seed(s)" + (f" x {worlds} worlds (SFT models)" if worlds > 1 else "")
    table = Table(title=escape(f"rstar2 ablation '{name}' on '{preset}': held-out pass@1, {runs} per variant: mean "
                               f"[min, max] (95 % interval over runs)"))
    for col in ("variant", "SFT", "after RL", "gain", "± se (eval)", "steps", "wall s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in res["variants"]:
        one = r["seeds"] == 1
        table.add_row(r["variant"], f"{r['pass1_sft']:.3f}",
                      f"{r['pass1_rl']:.3f}" + ("" if one else f" [{r['pass1_rl_min']:.3f}, {r['pass1_rl_max']:.3f}] "
                                                              f"{iv(r['pass1_rl_ci95'], '.3f')}"),
                      f"{r['gain']:+.3f}" + ("" if one else f" [{r['gain_min']:+.3f}, {r['gain_max']:+.3f}] "
                                                            f"{iv(r['gain_ci95'])}"),
                      f"{r['pass1_se']:.3f}", str(r["steps"]), str(r["wall_s"]))
    tables = [table]
    end = Table(title=escape(f"at the end of RL (each seed's mean over its last {res['last_steps']['steps']} steps): "
                             f"mean [min, max] (95 % interval over seeds); vs the first variant"))
    cols = ("variant", "figure", "mean", "min", "max", "ci95", "seeds", "vs_baseline")
    for col in cols:
        end.add_column(col, justify="left" if col in ("variant", "figure") else "right")
    for r in last_steps_rows(res["last_steps"]):
        end.add_row(*[str(r[c]) for c in cols])
    tables.append(end)
    if res["comparisons"]:
        vs = Table(title="each variant minus the first (Welch 95 % interval over seeds; beyond noise: it excludes 0)")
        for col in ("variant", "baseline", "difference", "95 % interval", "beyond noise"):
            vs.add_column(col, justify="left" if col in ("variant", "baseline") else "right")
        for c in res["comparisons"]:
            vs.add_row(c["variant"], c["baseline"], f"{c['diff']:+.3f}", iv(c["ci95"]) if c["ci95"] else
                       "- (needs 2+ seeds)", "yes" if c["beyond_noise"] else "no")
        tables.append(vs)
    return tables

def trajectory_view(rec: dict) -> list:
    """The problem, then per turn its reasoning, the code it ran and the tool's output (status in the title), then
    the final answer and the reward (rich renderables, in order)."""
    from rich.syntax import Syntax  # pygments: loaded when a trajectory is shown

    out = [Panel(escape(rec["problem"]), title="problem", title_align="left")]
    for i, t in enumerate(rec["turns"], 1):
        out.append(Panel(escape(t["reasoning"].strip()) or "-", title=f"turn {i}: reasoning", title_align="left"))
        tool = t["tool"]
        if tool is None:
            continue
        if tool["code"] is not None:
            stdin = f" (input {tool['input']!r})" if tool["input"] else ""
            out.append(Panel(Syntax(tool["code"], "python"), title=escape(f"turn {i}: code{stdin}"),
                             title_align="left"))
        out.append(Panel(escape(tool["output"]), title=escape(f"turn {i}: tool output [{tool['status']}]"),
                         title_align="left", border_style="green" if tool["status"] == OK else "red"))
    end = f"final answer: {escape(str(rec['final_answer']))}" + (" (truncated)" if rec["truncated"] else "")
    if rec["reward"] is not None:
        end += f"   reward: {rec['reward']:g} (gold {escape(rec['gold'])})"
    out.append(end)
    return out

def import_table(rep, out: str, n_suites: int) -> Table:
    """Rows in, dropped by reason with examples (the first two; --json's report names every contaminated row and the
    suite problem it matched), instruction phrasings stripped and how often, rows out."""
    from rstar2.data.importer import EXAMPLES

    table = Table(title=escape(f"rstar2 data import {rep.path} ({rep.format}) -> {out}"
                               f"{f'; decontaminated against {n_suites} suite(s)' if n_suites else ''}"))
    for col in ("", "rows", "examples"):
        table.add_column(col, justify="right" if col == "rows" else "left")
    table.add_row("rows in", str(rep.rows_in), "")
    for reason, n in rep.dropped.items():
        shown, more = rep.examples[reason][:EXAMPLES], len(rep.examples[reason]) - EXAMPLES
        table.add_row(f"dropped: {reason.replace('_', ' ')}", str(n),
                      escape("; ".join(shown) + (f"; and {more} more in --json's report" if more > 0 else "")))
    for phrase, n in rep.stripped.items():
        table.add_row("instruction stripped", str(n), escape(phrase))
    table.add_row("rows out", str(rep.rows_out), "", style="bold")
    return table

def evaluate_table(res: dict) -> Table:
    """`rstar2 evaluate` on the world's split: pass@1 with its standard error, pass@k, sizes."""
    ks = _ks(res)
    table = Table(title="rstar2 evaluate (± standard error over problems; pass@k unbiased, Chen et al. 2021)")
    for col in ("pass@1 ± se", *(f"pass@{k}" for k in ks[1:]), "samples", "problems", "mean response length"):
        table.add_column(col)
    table.add_row(_pm(res), *(f"{res[f'pass_at_{k}']:.3f}" for k in ks[1:]), str(res["samples"]),
                  str(res["problems"]), f"{res['response_len_mean']:.0f}")
    return table


def chaos_table(report: dict) -> Table:
    """One row per faulted run: where each fault struck, how the run ended, and what differs from the reference."""
    ref = report["reference"]
    table = Table(title=f"rstar2 chaos '{report['preset']}': each run against the same run without faults "
                        f"({ref['steps']} RL steps, held-out pass@1 {ref['pass1']})")
    for col in ("faults", "struck at", "verdict", "runs", "wall s", "differences"):
        table.add_column(col, justify="right" if col in ("runs", "wall s") else "left")
    for r in report["rows"]:
        struck = "\n".join(f"{f}: {r['struck'].get(f, 'not injected')}" for f in r["faults"])
        table.add_row("+".join(r["faults"]), escape(struck), r["verdict"], str(r["attempts"]),
                      "" if r["wall_s"] is None else f"{r['wall_s']:.0f}",
                      escape("\n".join(r["differences"])) or "none")
    return table


_ENTROPY_CLASSES = (("reasoning", "forking"), ("reflection", "reflection"))  # the analysis's class -> its name here


def entropy_table(res: dict, run: str, top_frac: float, window: int, samples: int) -> Table:
    """`rstar2 analyze entropy`: per checkpoint and token class, its tokens, mean entropy and share of the top set."""
    table = Table(title=escape(f"rstar2 analyze entropy '{run}': the top {top_frac:.0%} entropy tokens; forking = in "
                               f"reasoning, reflection = first {window} tokens after a tool response ({samples} "
                               f"trajectories of {res['trajectories']})"))
    for col in ("checkpoint", "tokens", "class", "class tokens", "mean entropy", "share of top", "class rate in top"):
        table.add_column(col, justify="left" if col in ("checkpoint", "class") else "right")
    for lbl, f in res["by_checkpoint"].items():
        for c, kind in _ENTROPY_CLASSES:
            table.add_row(lbl, str(f["tokens"]), kind, str(f[c]["tokens"]), f"{f[c]['entropy_mean']:.4f}",
                          f"{f[c]['share_of_high']:.3f}", f"{f[c]['high_rate']:.3f}")
    return table


def entropy_top_strings(res: dict) -> list[str]:
    """One line per checkpoint and token class: its most frequent high-entropy strings with their counts."""
    return [f"{lbl} {kind}: " + escape(", ".join(f"{s!r} {n}" for s, n in f[c]["top_strings"]))
            for lbl, f in res["by_checkpoint"].items() for c, kind in _ENTROPY_CLASSES]


def sft_table(res: dict, out) -> Table:
    """`rstar2 sft`: steps, each cycle's final loss, throughput and wall time."""
    table = Table(title=f"rstar2 sft -> {out}")
    for col in ("steps", "cycles: final loss", "tokens/s", "wall s"):
        table.add_column(col)
    table.add_row(str(res["steps"]), ", ".join(f"{x:.3f}" for x in res["cycle_losses"]), f"{res['tokens_per_s']:.0f}",
                  f"{res['wall_s']:.1f}")
    return table
