"""starsd-target: run a target model that verifies drafts from a remote draft daemon."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from common.cliutil import MS, ConfigOptions, Unit, env_options, fail_cleanly, logging_options, status_command
from common.logs import setup_logging
from common.memory import status_line as memory_status_line
from common.models import DTYPE_CHOICES, DTYPE_HELP, ModelLoadError
from common.runner import COMPILE_HELP, LEAN_HELP
from common.verify import SamplingParams
from starsd_target import app
from starsd_target.client import HandshakeRefused
from starsd_target.jobs import ServiceFailed
from starsd_target.pool import parse_endpoints
from starsd_target.profile import describe as describe_profile
from starsd_target.scheduler import ADMIT_WINDOWS_AT_MOST

option = env_options("STARSD_TARGET")
AUTO = Unit(lambda n: n, lambda n: "auto" if n is None else n)  # the option says auto where the field has None
# --draft may be given more than once, each time one or more endpoints; the field holds them all
ENDPOINTS = Unit(lambda values: ",".join(parse_endpoints(values)) or None,
                 lambda spec: tuple(parse_endpoints(spec)))
# the options that set TargetConfig's fields, each showing its field's default
CONFIG_OPTIONS = ConfigOptions(app.TargetConfig, {
    "draft_timeout": "draft_timeout_s", "ack_timeout": "ack_timeout_s", "connect_timeout": "connect_timeout_s",
    "heartbeat": "heartbeat_s", "compile_": "compile", "stall_timeout": "stall_timeout_s",
    "admit_window_ms": ("admit_window_s", MS),
    "draft_max_active": ("draft_max_active", AUTO), "draft": ("draft", ENDPOINTS),
    "draft_resolve_interval": "draft_resolve_interval_s"})
_d = CONFIG_OPTIONS.default


class _AutoOrCount(click.ParamType):
    """``auto`` (None) or a count >= 0."""

    name = "auto|N"

    def get_metavar(self, param, ctx=None):
        return "[auto|N]"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return None
        if text.isascii() and text.isdecimal():
            return int(text)
        self.fail(f"expected auto or a whole number >= 0, got {value!r}", param, ctx)


def model_options(f):
    decorators = [
        option("--model", default=_d("model"), help="Target checkpoint directory, or 'demo' for the built-in target."),
        option("--draft", multiple=True, default=_d("draft"),
               help="Endpoint of a draft daemon; give it more than once (or several in one value, separated by "
                    "commas or spaces) for a pool: each generation drafts on one daemon and moves to another when "
                    "that one fails or drains. A host name that resolves to several addresses (a Kubernetes "
                    "headless Service) is one daemon per address."),
        option("--draft-resolve-interval", type=click.FloatRange(1), default=_d("draft_resolve_interval"),
               help="Seconds between resolving --draft's host names again: new addresses join the pool, "
                    "vanished ones take no new sessions."),
        option("--device", default=_d("device"), help="cpu, cuda or cuda:N."),
        option("--dtype", type=click.Choice(DTYPE_CHOICES), default=_d("dtype"), help=DTYPE_HELP),
        option("--depth", type=click.IntRange(1, 64), default=_d("depth"),
               help="Most draft tokens asked for per round (capped by the draft daemon's maximum)."),
        option("--adaptive-depth/--no-adaptive-depth", default=_d("adaptive_depth"),
               help="Per generation, draft as many tokens (1..--depth) as pay, from its measured costs: greedy "
                    "chains are stopped by the draft daemon once the chance that all their drafts are kept falls "
                    "below the measured rate times one draft's cost (the model and EAGLE backends); "
                    "otherwise the target asks for the length that maximises expected tokens per "
                    "second from its measured acceptance. Off: --depth every round. Seeded sampled generations "
                    "keep --depth, so that a seed gives the same tokens at any speed."),
        option("--pause-unpaid-drafts/--no-pause-unpaid-drafts", default=_d("pause_unpaid_drafts"),
               help="With --adaptive-depth: once a generation's rounds with drafts run below 0.95 of the target "
                    "alone's rate (measured on its rounds: a draft rarely kept, a slow draft daemon, rows that cost "
                    "far more than one), it runs rounds without drafts, in runs of 4 doubling to 64, trying drafts "
                    "for two rounds after each run. Counted as plain_rounds. Seeded sampled generations always draft."),
        option("--fill-steps/--no-fill-steps", default=_d("fill_steps"),
               help="With --adaptive-depth: while a generation's drafts are on their way and the target has nothing "
                    "else to run, it takes a one-token step of its own where its measured costs say that pays (a "
                    "draft daemon that takes about as long as a target step); the drafts then count only if they "
                    "begin with that token, and the rest are verified. Hides drafting behind the target's work "
                    "where drafts come slowly or are rarely kept; off by default, as beside a draft daemon that "
                    "answers in a few milliseconds the steps cost a few percent. Counted as fill_steps. Chains "
                    "only; seeded sampled generations never take them."),
        option("--draft-tokens", type=click.IntRange(1, 256), default=_d("draft_tokens"),
               help="Most draft tokens verified in one forward (default: --depth, a chain). Above --depth, rounds "
                    "ask the draft daemon for a tree of up to this many tokens, --depth deep, verified in one "
                    "forward with a tree attention mask (Llama and Qwen2 targets); a daemon that drafts chains "
                    "only (--tree-topk 1) answers with a chain."),
        option("--draft-timeout", type=click.FloatRange(0.001), default=_d("draft_timeout"),
               help="Most seconds to wait for drafts before verifying a round with the target alone. "
                    "The wait is the daemon's own estimate, which it sends when it queues the request, plus "
                    "a margin; with no acknowledgement within a round trip the round does not wait. This "
                    "caps a bad estimate. A seeded sampled generation waits for its drafts up to this cap "
                    "while the daemon has been answering (a round without drafts would change the tokens its "
                    "seed gives)."),
        option("--draft-patience", type=click.FloatRange(1.0), default=_d("draft_patience"),
               help="How long a round waits for drafts the daemon has acknowledged, in multiples of the "
                    "daemon's estimate (plus a round trip; --draft-timeout caps it). Past it the round runs "
                    "with the target alone. Raise it where processes stall for tens of milliseconds (many "
                    "daemons sharing few cores); a hung daemon is still found in a round trip."),
        option("--ack-timeout", type=click.FloatRange(0.03), default=_d("ack_timeout"),
               help="Least seconds a draft request waits for the daemon's acknowledgement (longer when the "
                    "measured round trip says so). With none by then the round runs without drafts and the "
                    "link is suspect until the daemon is heard again: how fast a hung daemon is found. "
                    "Raise it where processes stall (many daemons sharing few cores)."),
        option("--connect-timeout", type=click.FloatRange(0), default=_d("connect_timeout"),
               help="Seconds to wait for the draft daemon's WELCOME at start-up (serving never waits for one)."),
        option("--threads", type=click.IntRange(0), default=_d("threads"),
               help="Torch CPU threads (0: one per core this process may run on; docs/bench.md, threads and "
                    "placement)."),
        option("--name", default=_d("name"), help="Name this target reports to the draft daemon."),
        option("--heartbeat", type=click.FloatRange(0.05), default=_d("heartbeat"),
               help="Seconds between liveness pings to the draft daemon while idle."),
        option("--curve-secret", type=click.Path(exists=True, dir_okay=False, path_type=Path),
               default=_d("curve_secret"), help="This target's CURVE secret key file; enables encryption."),
        option("--curve-server-key", type=click.Path(exists=True, dir_okay=False, path_type=Path),
               default=_d("curve_server_key"), help="The draft daemon's CURVE public key file."),
        option("--prefill-chunk", type=click.IntRange(0), default=_d("prefill_chunk"),
               help="Prompt tokens per prefill forward: a long prompt is prefilled in chunks between other "
                    "generations' rounds, so it delays them by one chunk at most; --prefix-cache-mib keeps "
                    "whole chunks. 0: 64 on a CPU whose prefill multiplies in float32, at about the same cost a "
                    "token in chunks of 64 as of 256; 256 on a GPU or a CPU that prefills in bfloat16 on AMX "
                    "or AVX-512 BF16; the log says which."),
        option("--prefix-cache-mib", type=click.IntRange(0), default=_d("prefix_cache_mib"),
               help="Memory for recent prompts' keys and values, in whole prefill chunks: a prompt that begins "
                    "as a recent one did (a conversation's next turn, an agent's next step, a shared system "
                    "prompt) skips the prefill of the chunks they share, with the same output as without "
                    "(prompts used longest ago are dropped first; 0: off)."),
        option("--compile/--no-compile", "compile_", default=_d("compile_"), help=COMPILE_HELP),
        option("--lean/--no-lean", default=_d("lean"), help=LEAN_HELP),
        logging_options(option),
    ]
    for dec in reversed(decorators):
        f = dec(f)
    return f


def _config(params: dict) -> app.TargetConfig:
    """The configuration from a command's parsed options (removed from ``params``): --no-draft
    means no draft daemon."""
    if params.pop("no_draft"):
        params["draft"] = None
    return app.TargetConfig(**CONFIG_OPTIONS.values(params))


def _host_port(ctx, param, value: str | None) -> str | None:
    host, _, port = (value or "").rpartition(":")
    if value is not None and (not host or not port.isdigit()):
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """StarSD target daemon: generates with a target model, verifying drafts from a draft daemon.

    Output is exactly what the target model alone would produce: greedy output equals the
    model's own greedy decoding, sampled output follows its distribution."""


@main.command()
@model_options
@option("--prompt", required=True, help="Text to continue.")
@option("--max-tokens", type=click.IntRange(1), default=64, help="Most tokens to generate.")
@option("--temperature", type=click.FloatRange(0), default=0.0, help="0 means greedy decoding.")
@option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, help="Nucleus sampling mass.")
@option("--top-k", type=click.IntRange(0), default=0, help="Keep only the k most likely tokens (0: off).")
@option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@option("--no-draft", is_flag=True, help="Generate with the target alone (the baseline).")
@option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token_ids, stats.")
@fail_cleanly(ModelLoadError, HandshakeRefused, ValueError)
def generate(prompt, max_tokens, temperature, top_p, top_k, seed, stop, no_draft, as_json, log_level, log_format,
             **params) -> None:
    """Generate one completion and print it."""
    setup_logging(log_level, log_format)
    daemon = app.build_daemon(_config({**params, "no_draft": no_draft}))
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    result = daemon.generate(prompt, max_tokens, sampling, list(stop), no_draft)
    if as_json:
        stats = result.stats
        click.echo(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "stats": {"rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
                      "mean_accepted_length": stats.mean_accepted_length, "tokens_per_s": stats.tokens_per_s,
                      "fallback_rounds": stats.fallback_rounds, "plain_rounds": stats.plain_rounds,
                      "fill_steps": stats.fill_steps},
        }))
    else:
        click.echo(prompt + result.text)
        s = result.stats
        click.echo(f"[{s.generated} tokens in {s.wall_s:.2f}s, {s.tokens_per_s:.1f} tok/s, {s.rounds} rounds, "
                   f"mean accepted length {s.mean_accepted_length:.2f}, {s.fallback_rounds} fallback rounds, "
                   f"{s.plain_rounds} rounds on the target alone by choice, {s.fill_steps} fill steps]",
                   err=True)


@main.command()
@model_options
@option("--listen", default=_d("listen"),
        help="ZeroMQ endpoint of the job socket (GENERATE, and STATS for `status`): loopback or ipc, unless CURVE is "
             "configured (--listen-curve-secret, --listen-curve-allow) or --insecure-listen is given. It takes "
             "GENERATE over CURVE, or over an ipc:// endpoint (e.g. ipc:///run/starsd/target.sock), whose file it "
             "makes this user's alone; a plaintext TCP endpoint answers STATS only, unless --insecure-listen.")
@option("--listen-curve-secret", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=_d("listen_curve_secret"),
        help="The job socket's CURVE secret key file (from `starsd-draftd keygen`); needs --listen-curve-allow.")
@option("--listen-curve-allow", type=click.Path(exists=True, file_okay=False, path_type=Path),
        default=_d("listen_curve_allow"),
        help="Directory of client public keys (*.key) the job socket admits; re-read on SIGHUP.")
@option("--insecure-listen", is_flag=True, default=_d("insecure_listen"),
        help="Take jobs in plaintext over TCP from anyone who can reach --listen (any user of this machine, on "
             "loopback), and allow a non-loopback --listen without encryption.")
@option("--max-active", type=click.IntRange(1), default=_d("max_active"),
        help="Generations interleaved on the model at once (one verifies while others wait for drafts).")
@option("--max-batch", type=click.IntRange(1), default=_d("max_batch"),
        help="Of the active generations, the most verified together in one forward when their rounds are "
             "ready at once (capped by --max-active; 1: one per forward). Outputs are those of one at a time. "
             "Llama and Qwen2 models, eager forwards (off with --compile).")
@option("--draft-max-active", type=_AutoOrCount(), default=_d("draft_max_active"),
        help="Rounds draft only while at most this many generations are active; with more, their rounds run "
             "on the target alone, batched (up to --max-batch per forward), and drafting resumes as they finish. On a CPU, "
             "verifying the drafts of a whole batch costs more than they add (on the demo pair, one core each, "
             "two streams speculative ran 0.85x the target alone batched, four 0.60x-0.77x). auto: 1 on a CPU (a lone "
             "generation drafts), no limit on other devices; 0: no limit. Counted as plain_rounds (STATS: "
             "crowded_rounds). Seeded sampled generations always draft; with batching off (--max-batch 1, --compile) "
             "every round drafts.")
@option("--admit-window-ms", type=click.FloatRange(0, 1000), default=_d("admit_window_ms"),
        help="When idle, how long the target waits behind a new request for the next one of a burst, so that "
             "requests sent together prefill in one forward and verify together from their first round "
             f"(each next request must come within this many ms of the last; {ADMIT_WINDOWS_AT_MOST} windows in all "
             "at most). A lone "
             "request's first token comes this much later. 0: start each request at once.")
@option("--max-queue", type=click.IntRange(1), default=_d("max_queue"),
        help="Jobs waiting beyond those; more are refused as busy.")
@option("--http", default=_d("http"), metavar="HOST:PORT", callback=_host_port,
        help="Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
             "/health) on this address.")
@option("--api-key", default=_d("api_key"),
        help="The HTTP API takes only requests that bear this key (Authorization: Bearer KEY, as OpenAI's clients "
             "send it), compared in constant time; others get 401. Prefer the environment variable (a systemd "
             "EnvironmentFile, a Kubernetes Secret) to the command line, which other users can read.")
@option("--api-open-paths", default=_d("api_open_paths"), metavar="PATHS",
        help="With --api-key, the HTTP paths served without it, separated by commas (e.g. /health for a load "
             "balancer's or Kubernetes' probes). None by default.")
@option("--served-model-name", default=_d("served_model_name"),
        help="Model name in the HTTP API (default: the model directory's name).")
@option("--metrics-port", type=click.IntRange(1, 65535), default=_d("metrics_port"),
        help="Expose Prometheus metrics on this port (/metrics).")
@option("--stall-timeout", type=click.FloatRange(1), default=_d("stall_timeout"),
        help="Seconds without a scheduler pass (one forward, or one prefill chunk, taking longer) after which "
             "/health fails, the jobs held fail and the daemon exits with status 1 to be restarted. Keep it "
             "below systemd's WatchdogSec.")
@option("--no-draft", is_flag=True,
        help="Serve with the target alone: no draft daemon link (--draft is ignored), every job generates without "
             "drafts. A baseline, or a target kept serving while its draft daemon is away for good.")
@fail_cleanly(ModelLoadError, HandshakeRefused, ValueError, ServiceFailed)
def serve(log_level, log_format, **params) -> None:
    """Keep the target model loaded and take generation jobs on an endpoint.

    SIGTERM: queued jobs are refused (SHUTTING_DOWN), jobs in progress finish, then it exits.
    Should the scheduler fail or stall, it exits with status 1, for systemd to restart it."""
    setup_logging(log_level, log_format)
    app.run(_config(params))


def _describe(connect: str, s: dict) -> list[str]:
    lines = [f"target daemon at {connect}: model {s['model']}" + (f" ({s['dtype']})" if "dtype" in s else ""),
             f"  draft link {'up' if s['draft_connected'] else 'DOWN'}; active {s.get('active', 0)}, "
             f"queued {s.get('queued', 0)}, completed {s.get('completed', 0)}, failed {s.get('failed', 0)}"]
    link = s.get("draft_link") or {}
    for ep, e in (link.get("endpoints") or {}).items():
        state = e["state"] + (", draining" if e.get("draining") else "") + (", suspect" if e.get("suspect") else "")
        lines.append(f"  draft {ep}: {state}; sessions {e.get('sessions', 0)}, round trip {e.get('rtt_ms', 0):.1f} ms, "
                     f"wait {e.get('wait_ms', 0):.1f} ms, missed {e.get('missed', 0)}")
    if link.get("endpoints") is not None:
        lines.append(f"  placements {link.get('placements', 0)}, failovers {link.get('failovers', 0)}, "
                     f"moved off draining daemons {link.get('drained', 0)}")
    if "round_profile" in s:  # an older daemon has none
        lines.append(f"  {describe_profile(s['round_profile'])}")
    return lines + memory_status_line(s)


status_command(main, option, _d("listen"), "target daemon", _describe)


if __name__ == "__main__":
    sys.exit(main())
