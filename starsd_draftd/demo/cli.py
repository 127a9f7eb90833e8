"""`starsd-draftd demo` and `starsd-draftd train-eagle`: thin click commands over the demo package
(registered lazily on the draft daemon's command group)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from common.cliutil import env_options, fail_cleanly, logging_options
from common.logs import setup_logging
from common.models import DTYPE_CHOICES, ModelLoadError
from starsd_draftd.demo.checkpoints import DRAFT_VOCAB
from starsd_draftd.demo.run import DemoConfig, format_table, format_texts, prepare as prepare_checkpoints, run_demo

option = env_options("STARSD_DRAFTD")
_demo = DemoConfig()


@click.command("train-eagle")
@option("--base-model", required=True, help="Target checkpoint directory (or 'demo') to train a head for.")
@option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Where to write the head.")
@option("--kind", type=click.Choice(["eagle1", "eagle3"]), default="eagle1", show_default=True,
        help="eagle1: a head reading the target's final hidden state, trained to regress the next one plus "
             "the target's next token (serve it with --backend eagle). eagle3: a head reading three of the "
             "target's hidden states fused (entering layers 2, L//2 and L-3; the target needs 7+ layers), "
             "predicting the target's next token over a draft vocabulary of its own, trained over a multi-step "
             "training-time-test rollout on its own outputs (see --ttt-steps); the target's forward over the "
             "training text is part of the budget (serve it with --backend eagle3).")
@option("--ttt-steps", type=click.IntRange(2), default=None,
        help="eagle3 only: draft steps of the training-time-test rollout (at least 2; default 3). Step k feeds "
             "the head its own step k-1 outputs, as drafting k+1 tokens ahead does; its loss weighs 0.8^k.")
# its own variable: STARSD_DRAFTD_DRAFT_VOCAB is serve's --draft-vocab (auto, off or a file)
@option("--draft-vocab", type=click.IntRange(1), default=None, envvar="STARSD_DRAFTD_EAGLE3_DRAFT_VOCAB",
        help="eagle3 only: the draft vocabulary's size, the target tokens most frequent in the training text "
             "(default: the target's vocabulary size or 8192, whichever is smaller).")
@option("--time-budget", type=click.FloatRange(10), default=180.0, help="Wall-clock seconds for the whole run.")
@option("--threads", type=click.IntRange(1), default=2, help="Torch CPU threads for training.")
@logging_options(option)
@fail_cleanly(ModelLoadError, ValueError, ImportError)
def train_eagle(base_model, out, kind, ttt_steps, draft_vocab, time_budget, threads, log_level, log_format) -> None:
    """Train an EAGLE head (EAGLE-1 by default, or EAGLE-3) for a target on its own continuations of
    standard-library prompts (CPU, minutes). The head is written in the published layout with a
    train_report.json (held-out agreement, tokens per round at depth 4 on greedy paths)."""
    if kind == "eagle1":
        given = [name for name, v in (("--ttt-steps", ttt_steps), ("--draft-vocab", draft_vocab)) if v is not None]
        if given:
            raise click.UsageError(f"{' and '.join(given)} apply to --kind eagle3 only")
    setup_logging(log_level, log_format)
    if kind == "eagle3":
        from starsd_draftd.demo.eagle3_train import DEFAULT_TTT_STEPS, train_eagle3_head

        report = train_eagle3_head(base_model, out, time_budget_s=time_budget, num_threads=threads,
                                   ttt_steps=ttt_steps or DEFAULT_TTT_STEPS, draft_vocab=draft_vocab)
    else:
        from starsd_draftd.demo.eagle_train import train_eagle_head

        report = train_eagle_head(base_model, out, time_budget_s=time_budget, num_threads=threads)
    click.echo(json.dumps(report, indent=2))


@click.command()
@option("--targets", type=click.IntRange(1, 32), default=_demo.targets, help="Target daemons to start.")
@option("--prompts", "prompts_per_target", type=click.IntRange(1), default=_demo.prompts_per_target,
        help="Generations per target.")
@option("--max-tokens", type=click.IntRange(1), default=_demo.max_tokens, help="Tokens per generation.")
@option("--depth", type=click.IntRange(1, 64), default=_demo.depth, help="Draft tokens per round.")
@option("--temperature", type=click.FloatRange(0), default=0.0, help="0 means greedy.")
@option("--backend", type=click.Choice(["model", "eagle", "eagle3"]), default="model",
        help="eagle: run the demo target's EAGLE head (trained once, cached) and compare it with the "
             "standalone draft model. eagle3: its EAGLE-3 head (trained once, with the EAGLE head's "
             "training time), then the EAGLE head, then the draft model.")
@option("--device", default="cpu", help="Device for every daemon.")
@option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto",
        help="Model dtype for every daemon (auto, on a CPU: fp16-weights where fbgemm is available (x86, PyPI's aarch64 "
             "builds), "
             "else float32, which is exact where bfloat16 is not; see `starsd-target serve --help`).")
@option("--no-pin", is_flag=True,
        help="Let every daemon use every core (by default, with 2+ cores, the draft daemon and the targets "
             "are pinned to disjoint cores, as separate machines would be).")
@option("--no-suffix", is_flag=True,
        help="The draft model alone: no drafts from text already seen (`starsd-draftd serve --no-suffix`).")
@option("--full-vocab", is_flag=True,
        help=f"The draft model's full output layer: not cut to the demo's {DRAFT_VOCAB} most frequent token ids "
             "(`starsd-draftd serve --draft-vocab off`; greedy outputs are the same, drafting is slower).")
@option("--prepare", is_flag=True,
        help="Only build the demo checkpoints into the cache (what `--model demo` and `demo-draft` name), then exit.")
@option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
@logging_options(option)
@fail_cleanly(ModelLoadError, RuntimeError, TimeoutError, OSError, ImportError)
def demo(targets, prompts_per_target, max_tokens, depth, temperature, backend, device, dtype, no_pin, no_suffix,
         full_vocab, prepare, as_json, log_level, log_format) -> None:
    """Run one draft daemon and N target daemons on loopback, then compare with the targets alone."""
    setup_logging(log_level, log_format)
    cfg = DemoConfig(targets=targets, prompts_per_target=prompts_per_target, max_tokens=max_tokens, depth=depth,
                     temperature=temperature, backend=backend, device=device, dtype=dtype, pin=not no_pin,
                     suffix=not no_suffix, draft_vocab=not full_vocab)
    if prepare:
        for name, path in prepare_checkpoints(cfg).items():
            click.echo(f"{name}: {path}")
        return
    report = run_demo(cfg)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        c = report["config"]
        click.echo(f"StarSD demo: 1 draft daemon, {targets} target daemon(s), {prompts_per_target} x "
                   f"{max_tokens} tokens each, depth {depth}, {device}, {c['dtype']}"
                   + ("" if c["suffix"] else ", no suffix drafts")
                   + ("" if c["draft_vocab"] else ", the draft's full output layer"))
        click.echo(f"topology: {c['topology']}")
        click.echo(format_table(report))
        click.echo(format_texts(report))
        click.echo(f"(daemon logs in {report['logs']})")
