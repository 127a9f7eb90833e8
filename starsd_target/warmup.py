"""What a target engine runs before its daemon takes jobs: the pool's KV buffers made, and with a
compiled runner the serving forwards compiled. Both drive an engine's own generations on a
made-up prompt and release them; nothing here is counted in the daemon's STATS."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.verify import SamplingParams

if TYPE_CHECKING:
    from starsd_target.engine import TargetEngine

log = logging.getLogger("starsd.target.warmup")


@dataclass
class WarmUpDrafts:
    """A proposal of ``tokens`` without the draft's probabilities (a greedy round's drafts)."""
    tokens: list[int]
    q_ids: None = None
    q_probs: None = None


def warm_up_token(engine: "TargetEngine") -> int:
    """A token to fill made-up prompts and drafts with: the first id after 0 that ends nothing."""
    return next(t for t in range(1, engine.loaded.logits_size) if t not in engine.loaded.eos_token_ids)


def compile_exercise(engine: "TargetEngine", features: bool = False,
                     feature_layers: tuple[int, ...] | None = None) -> None:
    """The kinds of forward serving runs, once each, for a compiled runner to compile: prefill
    chunks (a first one, one after cached positions, a one-token rest), a round with drafts and
    a round without; with ``features`` both with and without hidden states."""
    tok = warm_up_token(engine)
    chunk = engine.prefill_chunk
    engine.prefill_chunk = 4  # 9 prompt positions to prefill: chunks of 4, 4 and 1
    try:
        for feats in ((False, True) if features else (False,)):
            g = engine.start([tok] * 10, engine.depth + 3, SamplingParams(), features=feats,
                             feature_layers=feature_layers)
            while g.prefilling:
                g.prefill()
            g.verify(WarmUpDrafts([tok] * min(engine.depth, g.draft_depth())))
            if not g.done:
                g.verify(None, wanted=False)
            g.release()
    finally:
        engine.prefill_chunk = chunk


def prime_pool(engine: "TargetEngine") -> float:
    """Make the engine's pool KV buffers now and run its batched kinds of forward once (a prefill
    of two rows, then a round with drafts beside one without), so that the first requests pay
    for neither. The buffers are made at the first forward that writes them (their shapes come
    from it): made there, the demo target's 91 MiB took over 200 ms of the first burst's first
    forward (made at start-up, 0.04 s). Once; returns its seconds (0 when the engine has no pool or it is made)."""
    pool = engine.pool
    if pool is None or pool.allocated:
        return 0.0
    t0 = time.perf_counter()
    tok = warm_up_token(engine)
    gens = []
    try:
        for i in range(min(2, engine.max_batch)):
            gens.append(engine.start([tok] * (2 + i), 2, SamplingParams()))
        while any(g.prefilling for g in gens):  # more than one pass with a --prefill-chunk of 1
            for outcome in engine.prefill_batch([g for g in gens if g.prefilling]):
                if outcome is not None:
                    raise outcome
        rounds = [(g, WarmUpDrafts([tok] * min(engine.depth, g.draft_depth())) if i == 0 else None, i == 0)
                  for i, g in enumerate(gens)]
        for outcome in engine.verify_batch(rounds):
            if isinstance(outcome, Exception):
                raise outcome
    finally:
        for g in gens:
            g.release()
    seconds = time.perf_counter() - t0
    log.info("KV pool ready: %d rows x %d positions, %.0f MiB (%.2f s)", pool.rows, pool.slots,
             pool.nbytes / 2**20, seconds)
    return seconds
