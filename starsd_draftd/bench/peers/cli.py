"""`python -m starsd_draftd.bench.peers`: a thin click command over ``run.run_peers`` (StarSD's
daemons and vLLM's CPU build on the same workload, same cores, one after another)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from common.cliutil import env_options, fail_cleanly, logging_options
from common.logs import setup_logging
from common.models import ModelLoadError
from starsd_draftd.bench.peers.run import MODEL_SETS, PeersConfig, plan, run_peers

option = env_options("STARSD_PEERS")
_c = PeersConfig()


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None


def _words(text: str | None) -> tuple[str, ...]:
    return tuple(shlex.split(text or ""))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@option("--out", type=click.Path(file_okay=False, path_type=Path), default=_c.out,
        help="Results folder: peers.json and peers.md.")
@option("--models", type=click.Choice(sorted(MODEL_SETS)), default="demo", show_default=True,
        help="The target and draft: the demo pair, or random-init checkpoints of Qwen2.5-1.5B and its 0.5B "
             "sibling (built once in the cache, 3.1 GB and 1.0 GB; their forwards cost what the real ones' do, "
             "their drafts keep nothing, and their prompts are random token ids).")
@option("--prompts", type=click.IntRange(1), default=_c.prompts, help="The first N demo prompts.")
@option("--max-tokens", type=click.IntRange(1), default=_c.max_tokens, help="Greedy tokens per prompt (at most).")
@option("--depth", type=click.IntRange(1, 16), default=_c.depth,
        help="Draft tokens per round (StarSD --depth, vLLM num_speculative_tokens).")
@option("--streams", default=",".join(map(str, _c.streams)), help="Comma-separated: prompts sent at once per case.")
@option("--vllm-python", type=click.Path(dir_okay=False, path_type=Path), default=_c.vllm_python,
        help="The python of the venv holding vLLM's CPU build (make bench-peers builds .venv-peers).")
@option("--no-vllm", is_flag=True, help="StarSD's cases only.")
@option("--no-starsd", is_flag=True, help="vLLM's cases only.")
@option("--vllm-dtypes", default=",".join(_c.vllm_dtypes), show_default=True,
        help="Comma-separated dtypes vLLM runs each case in; auto: bfloat16 where the CPU computes it natively "
             "(AMX or AVX512-BF16), else float32 (vLLM's faster choice on each machine measured).")
@option("--vllm-eager/--vllm-compile", default=_c.vllm_eager,
        help="vLLM's enforce_eager, or its torch.compile warm-up, vLLM's own CPU default (the default here; "
             "60-90 s per engine start on 2 cores).")
@option("--vllm-kvcache-gib", type=click.IntRange(1), default=_c.vllm_kvcache_gib, help="VLLM_CPU_KVCACHE_SPACE.")
@option("--preload", default=None,
        help="Colon-separated LD_PRELOAD for vLLM [default: Debian's libtcmalloc_minimal and the venv's libiomp5].")
@option("--starsd-dtypes", default=None,
        help="Comma-separated --dtype values StarSD's daemons run each case in, fresh daemons per dtype, each "
             "compared with its own target alone [default: the demo's choice on this machine].")
@option("--starsd-args", envvar="STARSD_ARGS", default="",
        help="Extra arguments for both daemons' serve, one shell-quoted string (e.g. --starsd-args=--compile).")
@option("--draftd-args", default="", help="Extra arguments for the draft daemon only.")
@option("--target-args", default="", help="Extra arguments for the target daemon only.")
@option("--cpus", default=None, help="Comma-separated: the two cores (draft, target) [default: the first two usable].")
@option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Where logs and vLLM's JSON go [default: a fresh temporary folder].")
@option("--alternate", type=click.IntRange(0), default=_c.alternate, show_default=True,
        help="Rounds of the alternated target-alone comparison: StarSD's target daemon (the first StarSD dtype) and "
             "a vLLM engine (the first vLLM dtype) both kept up on the target's core, passes in turns (the closest "
             "comparison on a noisy host); 0: none.")
@option("--alternate-pause", type=click.FloatRange(0), default=_c.alternate_pause_s, show_default=True,
        help="Seconds of pause before each alternated pass.")
@option("--alternate-streams", type=click.IntRange(1), default=_c.alternate_streams, show_default=True,
        help="Prompts sent at once in each alternated pass (1: one at a time; 4: both targets batch the four).")
@option("--alternated-only", is_flag=True, help="Run the alternated comparison only, not the table.")
@option("--plan", "show_plan", is_flag=True, help="Print what would run (commands, cores, environment) and exit.")
@option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the table.")
@logging_options(option, default_level="warning")
@fail_cleanly(ModelLoadError, RuntimeError, TimeoutError, ValueError)
def main(out, models, prompts, max_tokens, depth, streams, vllm_python, no_vllm, no_starsd, vllm_dtypes, vllm_eager,
         vllm_kvcache_gib, preload, starsd_dtypes, starsd_args, draftd_args, target_args, cpus, workdir, alternate,
         alternate_pause, alternate_streams, alternated_only, show_plan, as_json, log_level, log_format) -> None:
    """StarSD beside vLLM's CPU build: the demo's models and prompts, greedy, the target alone and
    speculative, 1 and 4 streams, the same cores; a table of both in OUT/peers.md, then the target
    alone of both alternated on one core, round by round (--alternate)."""
    setup_logging(log_level, log_format)
    target_model, draft_model = MODEL_SETS[models]
    cfg = PeersConfig(out=out, target_model=target_model, draft_model=draft_model, prompts=prompts, max_tokens=max_tokens, depth=depth, streams=_ints(streams),
                      vllm_python=None if no_vllm else vllm_python, starsd=not no_starsd,
                      vllm_dtypes=tuple(d.strip() for d in vllm_dtypes.split(",") if d.strip()),
                      vllm_eager=vllm_eager, vllm_kvcache_gib=vllm_kvcache_gib,
                      preload=None if preload is None else tuple(p for p in preload.split(":") if p),
                      starsd_dtypes=tuple(d.strip() for d in (starsd_dtypes or "").split(",") if d.strip()),
                      starsd_args=_words(starsd_args), draftd_args=_words(draftd_args),
                      target_args=_words(target_args), cpus=None if cpus is None else _ints(cpus), workdir=workdir,
                      alternate=alternate, alternate_pause_s=alternate_pause, alternate_streams=alternate_streams,
                      table=not alternated_only)
    if show_plan:
        click.echo(json.dumps(plan(cfg), indent=2))
        return
    report = run_peers(cfg, progress=lambda msg: click.echo(msg, err=True))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from starsd_draftd.bench.peers.report import format_markdown

        click.echo(format_markdown(report))
        click.echo(f"(results in {cfg.out}; logs in {report['logs']})")
