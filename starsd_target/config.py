"""The target daemon's configuration: every `serve` default, stated here once.

The command line reads its defaults from TargetConfig; the engine and the scheduler take theirs
from it too, which is why it stands alone, importing nothing of the target's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TargetConfig:
    model: str = "demo"
    # the draft daemons' endpoints, separated by commas or spaces (None: the target alone); a host
    # name that resolves to several addresses is one daemon per address, resolved again every
    # draft_resolve_interval_s
    draft: str | None = "tcp://127.0.0.1:5555"
    draft_resolve_interval_s: float = 30.0
    device: str = "cpu"
    dtype: str = "auto"
    depth: int = 5
    draft_timeout_s: float = 2.0
    # an acknowledged draft request is waited for this times the daemon's own estimate, plus an
    # acknowledgement's round trip (draft_timeout_s caps it); more on a host whose processes stall
    draft_patience: float = 1.5
    # the least time a draft request waits for the daemon's acknowledgement (the measured round
    # trip's deadline when that is longer): the daemon's socket thread answers at once, but a host
    # whose cores are all busy stalls it for a scheduler slice or two
    ack_timeout_s: float = 0.05
    connect_timeout_s: float = 10.0
    threads: int = 0  # torch CPU threads (0: one per core this process may run on)
    name: str = ""
    listen: str = "tcp://127.0.0.1:5600"
    heartbeat_s: float = 5.0
    stall_timeout_s: float = 30.0  # a scheduler pass this late: the daemon exits to be restarted
    max_active: int = 4  # generations interleaved on the model at once
    max_batch: int = 4  # of those, the most verified together in one forward (1: one at a time)
    max_queue: int = 64  # jobs waiting beyond those; more are refused as busy
    metrics_port: int | None = None
    curve_secret: Path | None = None  # this target's .key_secret file
    curve_server_key: Path | None = None  # the draft daemon's public .key file
    # Prompt tokens per prefill forward, between other generations' rounds: what one long prompt
    # delays each round of the others by. Measured on 2 CPU cores with the 135M demo target beside
    # an 8,000-token prompt: at 512 a chunk took 2-6 s and an 8-token request 24 s (0.7 s alone);
    # at 128, 1.6 s and 4.8 s, for a whole prefill 14% longer. On a GPU any of these is milliseconds.
    # 0: chosen at start-up (prefill_chunk_for, below): 64 or 256
    prefill_chunk: int = 0
    # memory for recent prompts' whole prefill chunks, reused by later prompts that begin alike
    # (common.prefix_cache; 0: none); a 1.5B target's float32 keys and values take 57 KiB
    # a position, so the default holds about 2,300 positions
    prefix_cache_mib: int = 128
    listen_curve_secret: Path | None = None  # the job socket's .key_secret file
    listen_curve_allow: Path | None = None  # directory of client public keys the job socket admits
    insecure_listen: bool = False  # take plaintext TCP jobs from anyone who reaches --listen (a routable one too), on purpose
    compile: bool = False  # compile the target's forward (common.runner), warmed up before serving
    lean: bool = True  # eager forwards through common.lean where the model allows
    adaptive_depth: bool = True  # each generation's draft length follows its measured rounds, up to depth
    # with adaptive_depth: a generation runs rounds without drafts while its rounds with drafts run below
    # the target alone's rate (starsd_target.depth). Off by default: it follows measured times, and on a
    # small target beside a fast draft daemon it often finds the target alone faster
    pause_unpaid_drafts: bool = False
    # with adaptive_depth: while a generation's drafts are on their way and the target has nothing else
    # to run, it takes a step of its own where its measured costs say that pays (starsd_target.depth).
    # Off by default: beside a draft daemon that answers in a few milliseconds (the demo's) the steps
    # it takes cost a few percent; it pays where drafts come slowly or are rarely kept
    fill_steps: bool = False
    draft_tokens: int | None = None  # the most draft tokens a round verifies (None: depth, a chain; more: trees)
    # rounds draft only while at most this many generations are active (0: always; None: auto,
    # CPU_DRAFT_MAX_ACTIVE on a CPU, where verifying a batch's drafts costs more than it adds, else 0)
    draft_max_active: int | None = None
    # From idle, how long the scheduler waits behind a job for the next one of a burst, so that a
    # burst's jobs start together (seconds). Four requests sent at once from four client threads on
    # the target's host (the bench's clients): a 0.5 ms window took all four together in 3 runs of 4,
    # 2 ms in 6 of 6. A lone request's first token comes this much later.
    admit_window_s: float = 0.002
    http: str | None = None  # HOST:PORT: also serve the OpenAI-compatible HTTP API there
    api_key: str | None = None  # the HTTP API takes only requests bearing this key (None: any)
    api_open_paths: str = ""  # paths the HTTP API serves without the key (commas or spaces), e.g. /health
    served_model_name: str | None = None  # the model's name in the HTTP API (None: its directory's name)


# prompt tokens per prefill forward where the CPU's prefill multiplies in float32 arithmetic: a
# chunk of 64 cost 4% more a token than one of 256 on one AVX2 core (demo target, 1,024 tokens:
# 3.45 s against 3.3; Qwen2.5-1.5B shape, 512 tokens: 16.5 s against 15.9), keeps prompt prefixes
# four times as finely (the agentic bench reused 3,072 of 5,403 prompt tokens against 1,792, its
# prefill 7.7 s against 11.2) and delays other generations' rounds a quarter as long
CPU_FLOAT32_PREFILL_CHUNK = 64
LONG_PREFILL_CHUNK = 256  # a GPU's, and a CPU's that prefills in bfloat16 on its matrix units (wide prefill)


def prefill_chunk_for(chunk: int, runner) -> int:
    """The prefill chunk a ``--prefill-chunk`` of ``chunk`` means for the model ``runner``
    (a ``common.runner.ModelRunner``, its wide prefill settled) runs: itself, or for 0 the
    default, logged with why (ValueError below 0)."""
    import torch

    from common.fp16_weights import bf16_matrix_units

    if chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 1, or 0 for the device's default; got {chunk}")
    if chunk:
        return chunk
    if runner.device.type != "cpu":
        chunk, why = LONG_PREFILL_CHUNK, runner.device.type
    elif runner.wide_prefill_rows or (runner.loaded.dtype == torch.bfloat16 and bf16_matrix_units()):
        chunk, why = LONG_PREFILL_CHUNK, "a CPU that prefills in bfloat16 on its matrix units"
    else:
        chunk, why = CPU_FLOAT32_PREFILL_CHUNK, "a CPU whose prefill multiplies in float32"
    logging.getLogger("starsd.target.engine").info("prefill chunks of %d prompt tokens (--prefill-chunk 0: %s)",
                                                   chunk, why)
    return chunk
