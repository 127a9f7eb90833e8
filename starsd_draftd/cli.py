"""starsd-draftd: the draft daemon's command line (serve, keygen, status, vocab; the tooling commands
bench, bench-peers, plan, demo and train-eagle are imported only when invoked)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from common.draft_vocab import DEFAULT_SIZE, DRAFT_VOCAB_HELP, MIN_IDS
from common.cliutil import MIB, MS, ConfigOptions, LazyGroup, env_options, fail_cleanly, logging_options, status_command
from common.logs import setup_logging
from common.memory import status_line as memory_status_line
from common.models import DTYPE_CHOICES, DTYPE_HELP, ModelLoadError
from common.runner import COMPILE_HELP, LEAN_HELP
from common.security import keygen as keygen_pair
from starsd_draftd import app
from starsd_draftd.server import ServerConfig

option = env_options("STARSD_DRAFTD")
# serve's options: each sets a field of ServeConfig or of its ServerConfig, whose default it shows
SERVE_OPTIONS = ConfigOptions(app.ServeConfig, {"compile_": "compile"})
SERVER_OPTIONS = ConfigOptions(ServerConfig, {
    "depth": "max_depth", "batch_window_ms": ("batch_window_s", MS), "max_queue_mib": ("max_queue_bytes", MIB),
    "max_peer_queue_mib": ("max_peer_queue_bytes", MIB), "max_kv_mib": ("max_kv_bytes", MIB),
    "max_peer_kv_mib": ("max_peer_kv_bytes", MIB), "max_session_kv_mib": ("max_session_kv_bytes", MIB),
    "session_ttl": "session_ttl_s", "peer_ttl": "peer_ttl_s", "evict_idle": "evict_idle_s",
    "drain_timeout": "drain_s", "suffix_cache_mib": ("suffix_cache_bytes", MIB),
    "prefix_cache_mib": ("prefix_cache_bytes", MIB)})
_serve, _server = SERVE_OPTIONS.default, SERVER_OPTIONS.default

TOOLING = {"bench": "starsd_draftd.bench.cli:bench", "plan": "starsd_draftd.bench.cli:plan",
           "demo": "starsd_draftd.demo.cli:demo", "train-eagle": "starsd_draftd.demo.cli:train_eagle",
           "bench-peers": "starsd_draftd.bench.peers.cli:main"}


@click.group(cls=LazyGroup, lazy=TOOLING,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """StarSD draft daemon: one draft model serving many target daemons over ZeroMQ.

    Start here: `starsd-draftd demo --targets 2` runs the whole star on this machine."""


@main.command()
@option("--backend", type=click.Choice(["model", "eagle", "eagle3"]), default=_serve("backend"),
        help="model: a standalone draft LM (--model). eagle: an EAGLE-1 head drafting from the target's "
             "final hidden states (--eagle-head, --base-model). eagle3: an EAGLE-3 head (published layout) "
             "drafting from three of the target's hidden states fused; the targets send them, as the "
             "handshake tells them.")
@option("--model", default=_serve("model"), help="Draft checkpoint directory, or 'demo-draft' for the built-in draft.")
@option("--eagle-head", default=_serve("eagle_head"),
        help="EAGLE head directory (config.json + model.safetensors or pytorch_model.bin), "
             "or 'demo-eagle' / 'demo-eagle3' (the demo target's heads).")
@option("--base-model", default=_serve("base_model"),
        help="The target's checkpoint directory: the EAGLE head reads its embedding (EAGLE-1: "
             "and LM head; EAGLE-3: and config, for its layer count) from it (nothing else is loaded).")
@option("--bind", default=_server("bind"), help="ZeroMQ endpoint the ROUTER socket binds.")
@option("--depth", type=click.IntRange(1, 64), default=_server("depth"),
        help="Most draft tokens served per request (targets ask for up to this many).")
@option("--device", default=_serve("device"), help="cpu, cuda or cuda:N.")
@option("--dtype", type=click.Choice(DTYPE_CHOICES), default=_serve("dtype"), help=DTYPE_HELP)
@option("--batch-max", type=click.IntRange(1), default=_server("batch_max"),
        help="Draft up to this many waiting sessions together, one batched forward per step (1: one at a time).")
@option("--batch-window-ms", type=click.FloatRange(0), default=_server("batch_window_ms"),
        help="With requests waiting and room in the batch, wait up to this long for sessions whose targets "
             "usually answer within it (learned per session); 0 never waits (strictly work-conserving). "
             "Millisecond granularity.")
@option("--batch-prefill-tokens", type=click.IntRange(0), default=_server("batch_prefill_tokens"),
        help="Prompt tokens one batch feeds at most (a new session's prompt, a round's newly verified tokens): a "
             "longer request waits for a later batch while its prompt is fed in chunks of this size between "
             "batches (--backend model; behind an EAGLE head it is drafted in a batch of its own), so a short "
             "request is never drafted behind several long prefills. 0: no budget.")
@option("--lookahead/--no-lookahead", default=_server("lookahead"),
        help="With no request waiting, draft each served session's next round ahead for the outcomes the draft "
             "can guess (its drafts all kept, then its next token; kept up to one of the first positions, then "
             "its second choice there), one batched forward at a time, so a request that comes waits one forward; "
             "a request that brings one of those sequences is answered at once. Sessions it rarely answers are "
             "drafted ahead every 8th round only; seeded sampled sessions are not. Lossless like every "
             "draft (--backend model; an EAGLE head drafts on request). Idle passes also feed the draft model "
             "the tokens it missed while suffix drafts answered a session, a step's worth at a time.")
@option("--q-topk", type=click.IntRange(1), default=_serve("q_topk"),
        help="Sampling mode: drafts are drawn from the top-k of q and that sparse q is sent along.")
@option("--tree-topk", type=click.IntRange(1), default=_serve("tree_topk"),
        help="Branching of draft trees: a target that asks for more draft tokens than its depth (its "
             "--draft-tokens) gets a tree whose nodes have up to K children (greedy: EAGLE-2 dynamic trees, a "
             "frontier of about draft-tokens / depth nodes per level; sampling: the chain with up to K-1 "
             "alternatives per position). Targets that ask for chains get chains. 1: chains only.")
@option("--max-tree-tokens", type=click.IntRange(1, 256), default=_server("max_tree_tokens"),
        help="The most draft tokens a target may ask one tree to hold (its --draft-tokens); a larger ask is "
             "refused as a bad request. With requests still queued behind a batch, its trees are drafted at half "
             "the size asked.")
@option("--max-sessions", type=click.IntRange(1), default=_server("max_sessions"),
        help="Sessions held at once, all peers.")
@option("--max-sessions-per-peer", type=click.IntRange(1), default=_server("max_sessions_per_peer"),
        help="Sessions one target may hold at once.")
@option("--max-peers", type=click.IntRange(1), default=_server("max_peers"),
        help="Target connections held at once (each completed HELLO); a full table gives way to its least "
             "recently seen connection idle for --evict-idle, else BUSY.")
@option("--max-peers-per-address", type=click.IntRange(1), default=_server("max_peers_per_address"),
        help="Without CURVE: connections one remote address may hold.")
@option("--max-sessions-per-address", type=click.IntRange(1), default=_server("max_sessions_per_address"),
        help="Without CURVE: sessions one remote address may hold, over all its connections.")
@option("--max-queue", type=click.IntRange(1), default=_server("max_queue"), help="Draft requests waiting at once.")
@option("--max-queue-mib", type=click.IntRange(1), default=_server("max_queue_mib"),
        help="Memory queued draft requests may hold, all targets (MiB, estimated from their sizes); BUSY beyond.")
@option("--max-peer-queue", type=click.IntRange(1), default=_server("max_peer_queue"),
        help="Draft requests one target may have waiting at once; BUSY beyond.")
@option("--max-peer-queue-mib", type=click.IntRange(1), default=_server("max_peer_queue_mib"),
        help="Memory one target's queued requests may hold (MiB); BUSY beyond, TOO_LARGE for one request "
             "larger than this.")
@option("--max-kv-mib", type=click.IntRange(1), default=_server("max_kv_mib"),
        help="Draft cache memory all sessions may hold (MiB, estimated per position from the draft model's "
             "config); beyond, idle sessions make room, else BUSY.")
@option("--max-peer-kv-mib", type=click.IntRange(1), default=_server("max_peer_kv_mib"),
        help="Draft cache memory one target's sessions may hold (MiB); BUSY beyond.")
@option("--max-session-kv-mib", type=click.IntRange(1), default=_server("max_session_kv_mib"),
        help="Draft cache memory one session may hold (MiB); TOO_LARGE beyond (that generation goes on "
             "without drafts).")
@option("--session-ttl", type=click.FloatRange(1), default=_server("session_ttl"),
        help="Seconds after which a silent session is dropped and its cache freed.")
@option("--peer-ttl", type=click.FloatRange(1), default=_server("peer_ttl"),
        help="Seconds after which a silent target connection is forgotten (with CURVE, its key's sessions too).")
@option("--evict-idle", type=click.FloatRange(0), default=_server("evict_idle"),
        help="When the sessions, the connections or the cache memory are at their limit, the least recently "
             "used session (or connection) idle this long makes room.")
@option("--drain-timeout", type=click.FloatRange(0), default=_server("drain_timeout"),
        help="On SIGTERM, the most seconds to keep serving the sessions it holds while their targets move them "
             "to other draft daemons; it exits as soon as it holds none.")
@option("--curve-secret", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=_server("curve_secret"),
        help="This daemon's CURVE secret key file (from `starsd-draftd keygen`); enables encryption.")
@option("--curve-allow", type=click.Path(exists=True, file_okay=False, path_type=Path), default=_server("curve_allow"),
        help="Directory of target public keys (*.key) allowed to connect; re-read on SIGHUP.")
@option("--insecure", is_flag=True, default=_server("insecure"),
        help="Allow binding a non-loopback address without encryption.")
@option("--metrics-port", type=click.IntRange(1, 65535), default=_server("metrics_port"),
        help="Expose Prometheus metrics on this port (/metrics).")
@option("--threads", type=click.IntRange(0), default=_serve("threads"), help="Torch CPU threads (0: one per core this process may run on; docs/bench.md, threads and placement).")
@option("--suffix/--no-suffix", default=_server("suffix"),
        help="Draft from text already seen: where a session's last tokens occurred before, in its own text or "
             "in recent sessions' outputs, draft what followed (a chain, or a tree when the target's budget "
             "allows) whenever its expected tokens kept beat the model's measured ones; with --backend model, "
             "greedy steps also take the index's next token where it has one. Lossless like every draft.")
@option("--suffix-cache-mib", type=click.IntRange(0), default=_server("suffix_cache_mib"),
        help="Memory for recent sessions' outputs in the suffix index (whole requests evicted oldest first; "
             "0: each session drafts from its own text only).")
@option("--suffix-share", type=click.Choice(["key", "all", "off"]), default=_server("suffix_share"),
        help="Whose outputs a session's suffix drafts may come from: key: those of sessions of the same CURVE "
             "key only, so one tenant's text never drafts for another (without CURVE all targets share one "
             "index); all: every target's; off: its own text only.")
@option("--prefix-cache-mib", type=click.IntRange(0), default=_server("prefix_cache_mib"),
        help="Memory for finished sessions' keys and values (--backend model): a session whose text begins as "
             "a recent one's did skips computing what they share, within --suffix-share's partitions (not "
             "seeded sampled sessions). Oldest used first out; 0: off.")
@option("--compile/--no-compile", "compile_", default=_serve("compile_"), help=COMPILE_HELP)
@option("--lean/--no-lean", default=_serve("lean"), help="--backend model: " + LEAN_HELP)
@option("--draft-vocab", default=_serve("draft_vocab"), metavar="auto|off|FILE", help=DRAFT_VOCAB_HELP)
@logging_options(option)
@fail_cleanly(ModelLoadError, ValueError)
def serve(log_level, log_format, **params) -> None:
    """Load the draft model and serve draft requests until SIGTERM.

    SIGTERM drains: targets are told the daemon is draining and move their sessions to other draft
    daemons at their next round while it serves them; it exits 0 once it holds no session, or
    after --drain-timeout seconds. SIGHUP re-reads --curve-allow."""
    setup_logging(log_level, log_format)
    server = ServerConfig(**SERVER_OPTIONS.values(params))
    app.run(app.ServeConfig(server=server, **SERVE_OPTIONS.values(params)))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option("--name", required=True, help="Key name: writes NAME.key (public) and NAME.key_secret.")
@fail_cleanly(FileExistsError, OSError)
def keygen(directory, name) -> None:
    """Write a CURVE key pair in zmq.auth's certificate format.

    Give the daemon its .key_secret with --curve-secret; copy targets' .key files into the
    daemon's --curve-allow directory, and the daemon's .key to targets (--curve-server-key)."""
    public, secret = keygen_pair(directory, name)
    click.echo(f"public key: {public}\nsecret key: {secret} (keep it private)")


@main.command()
@click.argument("texts", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@option("--model", default=_serve("model"),
        help="Draft checkpoint directory (its tokenizer counts the tokens; its output layer's width is checked). "
             "Its environment variable is serve's, so a draft host's environment file names it once.")
@click.option("--size", type=click.IntRange(MIN_IDS), default=DEFAULT_SIZE, show_default=True,
        help="Token ids to keep: the tokenizer's special tokens, then the most frequent in TEXTS.")
# no environment variables for the rest: the bench's --out and --no-progress read the same names
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="File to write [default: the model directory's starsd_draft_vocab.json, which serve reads "
             "with --draft-vocab auto].")
@click.option("--glob", "pattern", default="*", show_default=True, help="Files taken from a TEXTS directory (recursive).")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@fail_cleanly(ModelLoadError, ValueError, OSError)
def vocab(texts, model, size, out, pattern, no_progress) -> None:
    """Count the draft model's tokens in TEXTS (files or directories of text like what the targets
    generate) and write the token ids its output layer should keep (--draft-vocab).

    Example: `starsd-draftd vocab --model /srv/draft ./samples` then restart serve: the cut head
    drafts faster; greedy outputs stay the target's own, sampled ones its distribution."""
    from common.draft_vocab import build_vocab_file

    written = build_vocab_file(model, [Path(t) for t in texts], size, out, pattern, progress=not no_progress)
    cov = written["coverage"]
    click.echo(f"{written['path']}: {written['size']} of {written['logits_size']} token ids, covering "
               f"{'-' if cov is None else f'{100 * cov:.1f}%'} of the {written['tokens_counted']} tokens counted "
               f"in {written['files']} files")


def _describe(connect: str, s: dict) -> list[str]:
    up = max(s["uptime_s"], 1e-9)
    return [f"draft daemon at {connect}: up {s['uptime_s']:.0f}s, busy {100 * s['busy_s'] / up:.1f}% since start",
            f"  peers {s['peers']}, live sessions {s['live_sessions']}, queue {s['queue_depth']}",
            f"  requests {s['requests']} ({s['requests'] / up:.1f}/s), drafted tokens {s['drafted_tokens']}, "
            f"batches {s['batches']}",
            f"  errors {s['errors'] or 'none'}, dropped replies {s['dropped_replies']}"] + _profile_line(s) + \
        _lookahead_line(s) + _catch_up_line(s) + _trees_line(s) + _suffix_line(s) + _vocab_line(s) + \
        memory_status_line(s)


def _suffix_line(s: dict) -> list[str]:
    """Suffix drafts and the shared index (none with --no-suffix, or from an older daemon)."""
    x = s.get("suffix")
    if not x or "bytes" not in x:
        return []
    return [f"  suffix drafts: {x['requests']} requests, {x['tokens']} tokens drafted, {x['kept']} kept; index "
            f"{x['bytes'] / 2**20:.1f} of {x['max_bytes'] / 2**20:.0f} MiB ({x['requests_held']} outputs, "
            f"share {x['share']}), query {x['query_us']:.0f} us"]


def _vocab_line(s: dict) -> list[str]:
    """The draft model's output layer, when cut to a vocabulary (--draft-vocab)."""
    b = s.get("backend") or {}
    if "output_ids" not in b or b["output_ids"] >= b["logits_size"]:
        return []
    return [f"  draft output layer: {b['output_ids']} of {b['logits_size']} token ids (--draft-vocab)"]


def _trees_line(s: dict) -> list[str]:
    """The draft trees served (none from an older daemon, or before any)."""
    t = s.get("trees")
    if not t or not t["requests"]:
        return []
    return [f"  trees: {t['requests']} requests answered with trees, {t['tokens'] / t['requests']:.1f} tokens each, "
            f"{t['shrunk']} drafted at half size behind a queue"]


def _lookahead_line(s: dict) -> list[str]:
    """What drafting ahead did (none from an older daemon, or before any)."""
    la = s.get("lookahead")
    if not la or not la["started"]:
        return []
    answered = la["hits"] + la["late_hits"]
    tried = answered + la["misses"]
    rate = f"{100 * answered / tried:.0f}% of {tried}" if tried else "none yet"
    return [f"  lookahead: {la['started']} rounds drafted ahead, requests answered from them {rate} "
            f"({la['late_hits']} finished on arrival), {la['idle_s']:.1f}s of idle time used"]


def _catch_up_line(s: dict) -> list[str]:
    """What idle passes fed the draft model (none from an older daemon, or before any)."""
    cu = s.get("catch_up")
    if not cu or not cu["feeds"]:
        return []
    return [f"  idle feeds: {cu['tokens']} verified tokens the suffix drafts' sessions missed, in {cu['feeds']} "
            f"forwards, {cu['seconds']:.1f}s"]


def _profile_line(s: dict) -> list[str]:
    """Milliseconds per draft request served, by part (none from an older daemon)."""
    p = s.get("request_profile")
    if not p or not p["requests"]:
        return []
    ms = {part: 1000.0 * v / p["requests"] for part, v in p["seconds"].items()}
    return [f"  {sum(ms.values()):.2f} ms per request over {p['requests']}: queue {ms['queue']:.2f}, "
            f"draft forwards {ms['draft_forward']:.2f}, rest {ms['rest']:.2f}"]


status_command(main, option, _server("bind"), "draft daemon", _describe)


if __name__ == "__main__":
    sys.exit(main())
