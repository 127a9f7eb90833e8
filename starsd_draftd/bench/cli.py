"""`starsd-draftd bench` and `starsd-draftd plan`: thin click commands over the bench package and
the analytic model (registered lazily on the draft daemon's command group)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from common.cliutil import env_options, fail_cleanly, logging_options
from common.logs import setup_logging
from common.models import DTYPE_CHOICES, ModelLoadError
from starsd_draftd.bench.config import NOT_QUICK, SECTIONS, BenchConfig
from starsd_draftd.bench.report import format_report
from starsd_draftd.bench.run import run_bench
from starsd_draftd.bench.plan import Plan, format_plan

option = env_options("STARSD_DRAFTD")
_b = BenchConfig()


@click.command()
@option("--quick", is_flag=True, help="A few seconds of measurement, N up to 3, tiny random models (CI).")
@option("--out", type=click.Path(file_okay=False, path_type=Path), default=_b.out,
        help="Results folder: bench.json, bench.png, bench.md.")
@option("--sections", default="", help="Comma-separated subset of: " + ", ".join(SECTIONS) + " [default: all; with "
        "--quick all but " + ", ".join(NOT_QUICK) + "].")
@option("--n-max", type=click.IntRange(1, 64), default=None,
        help=f"Most targets in the emulation sweep [default: {_b.n_max}; quick: 3].")
@option("--real-n-max", type=click.IntRange(1, 32), default=None,
        help=f"Most real target daemons [default: {_b.real_n_max}; quick: 2].")
@option("--depth", type=click.IntRange(1, 16), default=_b.depth, help="Draft tokens per round.")
@option("--draft-base-ms", type=click.FloatRange(0), default=_b.draft_base_ms,
        help="Emulation: S(d) = base + per-token * d, the fixed part.")
@option("--draft-per-token-ms", type=click.FloatRange(0), default=_b.draft_per_token_ms,
        help="Emulation: S(d), the part per drafted token.")
@option("--verify-ms", type=click.FloatRange(0), default=_b.verify_ms, help="Emulation: target verification V.")
@option("--rtt-ms", type=click.FloatRange(0), default=_b.rtt_ms,
        help="Emulation: network round trip R added per round (on top of the real loopback).")
@option("--single-ms", type=click.FloatRange(0, min_open=True), default=None,
        help="Emulation: the target's single-token forward V1 (standalone baseline) [default: V].")
@option("--acceptance", type=click.FloatRange(0, 1), default=_b.acceptance,
        help="Emulation: i.i.d. acceptance probability of each draft token.")
@option("--guess-rate", type=click.FloatRange(0, 1), default=_b.guess_rate,
        help="Emulation with lookahead: the chance that the emulated drafter's guess of a target's next token "
             "after a round that kept every draft is right (hit rate acceptance^depth x this).")
@option("--models", type=click.Choice(["demo", "demo-third", "tiny"]), default=None,
        help="Sections with real models: the demo checkpoints (SmolLM2 and its distilled two-layer draft); "
             "demo-third: the demo target with a draft of its first third of layers, distilled the same way "
             "(built once, about 4.5 minutes): a draft step costs a real share of a round, as a 0.5B draft's "
             "does beside a 1.5B target; or tiny random checkpoints [default: demo; quick: tiny].")
@option("--dtype", type=click.Choice(DTYPE_CHOICES), default=_b.dtype,
        help="The daemons' --dtype in the sections with real models [default: auto: the demo's format for the "
             "demo models (fp16-weights on x86), float32 for the tiny ones]. The target alone it is compared "
             "with runs the same format.")
@option("--max-tokens", type=click.IntRange(1), default=None,
        help=f"Real section: tokens per job [default: {_b.max_tokens}; quick: 24].")
@option("--jobs", type=click.IntRange(1), default=None,
        help=f"Real section: jobs per target [default: {_b.jobs_per_target}; quick: 1].")
@option("--repeats", type=click.IntRange(1), default=None,
        help=f"Lookahead section: runs of each configuration, in alternating order, each beside the target "
             f"alone (more runs: less of a shared machine's noise) [default: {_b.repeats}; quick: 1].")
@option("--batch-max", type=click.IntRange(2, 64), default=_b.batch_max,
        help="Batched section: batch_max compared with one session at a time.")
@option("--rows-model", default=_b.rows_model,
        help="rows section: 'target' (the bench's target), a real configuration with random weights built once "
             "in the cache ('qwen2.5-1.5b', 'qwen2.5-0.5b'; a forward costs what the real model's does), or a "
             "checkpoint directory.")
@option("--seed", type=int, default=_b.seed, help="Seed of the emulated acceptance chains.")
@option("--no-plot", is_flag=True, help="Skip the PNG (and the matplotlib requirement).")
@option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the tables.")
@logging_options(option, default_level="warning")  # the progress bar is the bench's running report
@fail_cleanly(ModelLoadError, RuntimeError, TimeoutError, ValueError, ImportError)
def bench(quick, out, sections, n_max, real_n_max, depth, draft_base_ms, draft_per_token_ms, verify_ms, rtt_ms,
          single_ms, acceptance, guess_rate, models, dtype, max_tokens, jobs, repeats, batch_max, rows_model, seed, no_plot,
          no_progress,
          as_json, log_level, log_format) -> None:
    """Measure the star on this machine: wire cost, accelerator emulation beside the analytic model,
    real models beside the target alone and co-located speculative decoding, batched drafting."""
    setup_logging(log_level, log_format)
    given = {"n_max": n_max, "real_n_max": real_n_max, "models": models, "max_tokens": max_tokens,
             "jobs_per_target": jobs, "repeats": repeats}
    kw = dict({k: v for k, v in given.items() if v is not None}, out=out, depth=depth, draft_base_ms=draft_base_ms,
              draft_per_token_ms=draft_per_token_ms, verify_ms=verify_ms, rtt_ms=rtt_ms, single_ms=single_ms,
              acceptance=acceptance, guess_rate=guess_rate, dtype=dtype, batch_max=batch_max, rows_model=rows_model, seed=seed,
              plot=not no_plot,
              progress=not no_progress,
              sections=tuple(s.strip() for s in sections.split(",") if s.strip()))
    if not kw["sections"]:
        del kw["sections"]  # each kind of run's default
    cfg = BenchConfig.quick_config(**kw) if quick else BenchConfig(**kw)
    report = run_bench(cfg)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))
        click.echo(f"(results in {cfg.out}; daemon logs in {report['logs']})")


@click.command()
@option("--draft-ms", type=click.FloatRange(0, min_open=True), default=None,
        help="S(d): service time of one depth-d draft request. Without it, S(d) = --draft-base-ms + "
             "--draft-per-token-ms * d.")
@option("--draft-base-ms", type=click.FloatRange(0), default=0.0, help="S(d) = base + per-token * d: the fixed part.")
@option("--draft-per-token-ms", type=click.FloatRange(0), default=0.0, help="S(d): the part per drafted token.")
@option("--verify-ms", type=click.FloatRange(0), required=True, help="V: one verification forward on a target.")
@option("--rtt-ms", type=click.FloatRange(0), default=0.0, help="R: network round trip and serialization per round.")
@option("--depth", type=click.IntRange(1, 64), default=4,
        help="d: draft tokens per round (with --adaptive-depth, the largest depth allowed).")
@option("--acceptance", type=click.FloatRange(0, 1), default=None,
        help="a: acceptance probability of each draft token (i.i.d. assumed). Give it or --tokens-per-round.")
@option("--tokens-per-round", type=click.FloatRange(1), default=None,
        help="E: measured tokens kept per round (kept drafts and the target's own), for example a draft tree's from "
             "`starsd-draftd bench --sections trees`; the model then uses the acceptance a with E(a, --depth) = E. "
             "A tree's drafting time goes in --draft-ms.")
@option("--single-ms", type=click.FloatRange(0, min_open=True), default=None,
        help="V1: the target's single-token forward, for the standalone baseline [default: V].")
@option("--hit-rate", type=click.FloatRange(0, 1), default=0.0,
        help="h: lookahead drafting. Probability that a target's next request matches one of the rounds the "
             "draft server pre-drafted in its idle time (the daemon guesses several outcomes: all d drafts kept "
             "and the next token guessed, or a rejection at an early position and the draft's second choice "
             "there; `starsd-draftd status` reports the measured rate). 0: no lookahead, today's design.")
@option("--adaptive-depth/--no-adaptive-depth", default=False,
        help="Also show, per N, the depth in 1..--depth that maximises a target's tokens per second, and its "
             "throughput (needs --draft-base-ms/--draft-per-token-ms, not --draft-ms).")
@option("--n-max", type=click.IntRange(1, 1024), default=16, help="Largest N in the table.")
@option("--json", "as_json", is_flag=True, help="Print the model as JSON.")
@fail_cleanly(ValueError)
def plan(draft_ms, draft_base_ms, draft_per_token_ms, verify_ms, rtt_ms, depth, acceptance, tokens_per_round,
         single_ms, hit_rate, adaptive_depth, n_max, as_json) -> None:
    """The analytic model: round time T = N * S(d) + T_idle, N_full, and per-target and system
    throughput versus N, beside the target alone; with --hit-rate and --adaptive-depth, lookahead
    drafting and the best depth per N beside the fixed-depth design."""
    if (acceptance is None) == (tokens_per_round is None):
        raise click.UsageError("give one of --acceptance and --tokens-per-round")
    if tokens_per_round is not None:
        from starsd_draftd.bench.plan import acceptance_for_tokens_per_round

        if tokens_per_round > depth + 1:
            raise click.UsageError(f"--tokens-per-round {tokens_per_round} exceeds depth + 1 = {depth + 1}: a round "
                                   f"keeps at most --depth drafts and the target's own token")
        acceptance = acceptance_for_tokens_per_round(tokens_per_round, depth)
    p = Plan(verify_ms=verify_ms, rtt_ms=rtt_ms, depth=depth, acceptance=acceptance, draft_ms=draft_ms,
             draft_base_ms=draft_base_ms, draft_per_token_ms=draft_per_token_ms, single_ms=single_ms,
             hit_rate=hit_rate)
    if as_json:
        click.echo(json.dumps(dict(p.summary(), table=p.table(n_max, adaptive_depth)), indent=2))
    else:
        click.echo(format_plan(p, n_max, adaptive_depth))
