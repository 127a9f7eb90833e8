"""`python -m starsd_draftd.bench.emulation_serve serve`: a draft daemon with the emulated backend
(or a real one) behind the service tracer, writing the trace on exit."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import click
import zmq

from common.models import DTYPE_CHOICES, DTYPE_HELP
from starsd_draftd.backends.base import DraftBackend
from starsd_draftd.bench.emulation import EMU_SERVER_NAME, EmulatedBackend, ServiceModel
from starsd_draftd.bench.trace import TracingBackend

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- the daemon for emulation runs
def server_config(**kw):
    """A ServerConfig; ``batch_max`` is dropped when this server has no batched drafting."""
    from starsd_draftd.server import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in kw.items() if k in names})


def run_traced_server(backend: DraftBackend, bind: str, depth: int, batch_max: int, trace_path: Path | None,
                      name: str, batch_window_s: float = 0.0, suffix: bool = True) -> None:
    """Serve until SIGTERM, then write the trace. Without a trace path the backend is served as it
    is, as in production (the wire measurements want exactly that path)."""
    from starsd_draftd.server import DraftServer

    traced = TracingBackend(backend) if trace_path is not None else None
    ctx = zmq.Context()
    server = DraftServer(traced or backend, server_config(bind=bind, max_depth=depth, batch_max=batch_max, name=name,
                                               batch_window_s=batch_window_s, suffix=suffix), ctx)
    server.install_signal_handlers()
    server.serve_forever()
    if traced is not None:
        traced.trace.dump(trace_path)
    ctx.term()


def _option(*decls, **kw):
    from common.cliutil import env_options

    return env_options("STARSD_EMULATION")(*decls, **kw)


@click.group()
def main() -> None:
    """Helpers for `starsd-draftd bench`: a traced draft daemon for emulation and real-model runs."""


@main.command()
@_option("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint (loopback unless you add CURVE).")
@_option("--backend", type=click.Choice(["emulated", "model", "eagle"]), default="emulated",
         help="emulated: sleep S(d) per request (accelerator emulation). model: a real draft model (--model). "
              "eagle: an EAGLE head (--eagle-head) drafting for the target checkpoint --model.")
@_option("--draft-base-ms", type=click.FloatRange(0), default=1.0, help="Emulated S(d) = base + per-token * d: base.")
@_option("--draft-per-token-ms", type=click.FloatRange(0), default=1.0, help="Emulated S(d): cost per drafted token.")
@_option("--depth", type=click.IntRange(1, 64), default=8, help="Most draft tokens per request.")
@_option("--batch-max", type=click.IntRange(1), default=1,
         help="Sessions drafted together (1: one at a time, the paper's loop and the analytic model's).")
@_option("--batch-window-ms", type=click.FloatRange(0), default=0.0,
         help="Wait up to this long for sessions due back soon before drafting a batch (see starsd-draftd serve).")
@_option("--q-topk", type=click.IntRange(1), default=32, help="Entries of the sparse q sent in sampling mode.")
@_option("--feature-size", type=click.IntRange(0), default=0,
         help="Emulated backend only: take target features of this width with each request.")
@_option("--model", default="demo-draft", help="--backend model: the draft checkpoint; eagle: the target's.")
@_option("--eagle-head", default=None, help="--backend eagle: the head directory.")
@_option("--device", default="cpu", help="--backend model or eagle: device.")
@_option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", help="--backend model or eagle: " + DTYPE_HELP)
@_option("--threads", type=click.IntRange(0), default=1, help="Torch CPU threads.")
@_option("--suffix/--no-suffix", default=True,
         help="--backend model or eagle: drafts from text already seen (see starsd-draftd serve). The emulated "
              "backend's drafts are its service model's alone.")
@_option("--lookahead/--no-lookahead", default=False,
         help="--backend emulated: draft greedy sessions' next rounds ahead in idle time (see EmulatedBackend).")
@_option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="Write the service trace here on exit.")
@_option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", help="Logging.")
def serve(bind, backend, draft_base_ms, draft_per_token_ms, depth, batch_max, batch_window_ms, q_topk, feature_size,
          model, eagle_head, device, dtype, threads, suffix, lookahead, trace, log_level) -> None:
    """Run a draft daemon behind the service tracer until SIGTERM."""
    from common.logs import setup_logging
    from common.models import set_torch_threads

    setup_logging(log_level)
    set_torch_threads(threads)
    if backend == "emulated":
        inner = EmulatedBackend(ServiceModel(draft_base_ms, draft_per_token_ms), q_topk=q_topk,
                                feature_size=feature_size, lookahead=lookahead)
        name = EMU_SERVER_NAME
    else:
        from starsd_draftd.app import ServeConfig, build_backend

        inner = build_backend(ServeConfig(server=server_config(), model=model, backend=backend, eagle_head=eagle_head,
                                          base_model=model, device=device, dtype=dtype, q_topk=q_topk,
                                          threads=threads, tree_topk=1))  # chains, as traced so far
        name = "starsd-draftd-traced"
    run_traced_server(inner, bind, depth, batch_max, trace, name, batch_window_ms / 1000,
                      suffix and backend != "emulated")


if __name__ == "__main__":
    sys.exit(main())
