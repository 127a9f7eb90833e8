"""Draft backend "model": any Hugging Face causal LM drafts a chain of tokens with a KV cache."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from common.models import LoadedModel, common_prefix_len, crop_cache, kv_bytes_per_token
from common.runner import ModelRunner
from common.verify import SamplingParams, make_generator
from starsd_draftd.backends.base import (ChainDrafter, ContextLookup, Draft, DraftBackend, DraftRequest, Lookahead,
                                        session_seed)
from starsd_draftd.backends.batching import BatchedCaches


@dataclass
class ModelSession:
    params: SamplingParams
    generator: torch.Generator
    cache: object
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values the cache holds
    seed: int = 0  # the base of its draws' position seeds (base.position_seed)


class ModelBackend(DraftBackend):
    name = "model"

    def __init__(self, loaded: LoadedModel, q_topk: int = 32, lookup: ContextLookup | None = None,
                 runner: ModelRunner | None = None):
        """``lookup``: in greedy sessions, each draft token comes from the context where it holds
        the continuation of the last few tokens (``ContextLookup``), else from the model.
        ``runner``: how the model runs (compiled or eager); eager by default."""
        if q_topk < 1:
            raise ValueError("q_topk must be >= 1")
        self.lookup = lookup
        self.lookup_hits = 0  # draft tokens taken from the context
        self.model_picks = 0  # greedy draft tokens the model chose
        self.loaded = loaded
        self.runner = runner if runner is not None else ModelRunner(loaded)
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.fingerprint = loaded.fingerprint
        self.q_topk = min(q_topk, loaded.vocab_size)
        cfg = loaded.model.config
        self.max_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, loaded.dtype)

    def warm_up(self, batch_max: int = 1) -> float:
        """With a compiled runner, compile the kinds of forward drafting runs before serving: a
        session's first feed, one token or several after cached positions (a request's new
        tokens, tokens copied by lookup), one-token steps; batched alike when ``batch_max`` > 1.
        0 s when eager."""
        def exercise():
            params = SamplingParams(temperature=1.0, seed=0)  # sampled: every step runs the model
            st = self.new_state(params)
            for verified in ([1] * 6, [1] * 7, [1] * 9):  # first feed; 1 new token; 2 new tokens
                self.draft(st, verified, 3)
            if batch_max > 1:
                a, b = self.new_state(params), self.new_state(params)
                for extra in (0, 1, 3):  # first feeds; 1 new token each; 2 new tokens each
                    self.draft_many([DraftRequest(a, [1] * (5 + extra), 3), DraftRequest(b, [1] * (6 + extra), 3)])

        return self.runner.warm_up(exercise, "draft model")

    @property
    def model(self):
        return self.runner.model

    def counters(self) -> dict:
        return {"lookup": self.lookup is not None, "lookup_hits": self.lookup_hits, "model_picks": self.model_picks}

    def new_state(self, params: SamplingParams) -> ModelSession:
        return ModelSession(params, make_generator(params.seed), self.runner.new_cache(), seed=session_seed(params))

    def _forward(self, st: ModelSession, tokens: list[int]) -> torch.Tensor:
        """Feed tokens after the cached ones; return the last position's logits over the vocabulary."""
        logits, _ = self.runner.forward(st.cache, tokens, "last")
        st.cached.extend(tokens)
        return logits[: self.vocab_size]

    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None) -> Draft:
        steps = self._draft_steps(state, verified, depth)  # type: ignore[arg-type]
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def _draft_steps(self, st: ModelSession, verified: list[int], depth: int,
                     guess: bool = False) -> Generator[None, None, Draft]:
        """Draft ``depth`` tokens after ``verified``, pausing (a ``yield``) after each model
        forward; the session's cache and ``cached`` agree at every pause. ``guess``: pick the
        draft's most likely token even in a sampled session (lookahead's guess of the target's
        next token, which is not sent as a draft and draws nothing)."""
        if not verified:
            raise ValueError("cannot draft after an empty sequence")
        # Keep the cached prefix that still matches; always re-feed at least one token so the
        # forward yields the logits of the next position.
        keep = min(common_prefix_len(st.cached, verified), len(verified) - 1)
        crop_cache(st.cache, keep)
        del st.cached[keep:]
        params = SamplingParams() if guess else st.params
        chain = ChainDrafter(params, st.generator, self.q_topk, st.seed, len(verified))
        seq = self._context(params, verified, depth)
        # Tokens reach the model only when it must pick: a run of tokens copied from the context
        # costs no forward, and is fed with the next one the model picks after it (or next time).
        pending, logits = list(verified[keep:]), None
        for j in range(depth):
            found = self._look(seq, len(verified) + j)
            if found is None:
                if pending:
                    logits, pending = self._forward(st, pending), []
                    yield
                tok = chain.pick(logits)
            else:
                tok = chain.take(found)
            if seq is not None:
                seq[len(verified) + j] = tok
            pending.append(tok)
        return chain.result()

    def lookahead(self, state: object, sequence: list[int], depth: int) -> Lookahead:
        """Draft the next round ahead: guess the target's next token after ``sequence`` (the
        verified tokens and the drafts just sent, all assumed kept), then draft ``depth``
        tokens after that guess, one forward per step."""
        return Lookahead(lambda task: self._lookahead_steps(state, list(sequence), depth, task))  # type: ignore[arg-type]

    def _lookahead_steps(self, st: ModelSession, sequence: list[int], depth: int,
                         task: Lookahead) -> Generator[None, None, Draft]:
        nxt = yield from self._draft_steps(st, sequence, 1, guess=True)
        task.guess = sequence + nxt.tokens
        return (yield from self._draft_steps(st, task.guess, depth))

    def _context(self, params: SamplingParams, verified: list[int], depth: int) -> np.ndarray | None:
        """The session's tokens with room for its drafts, when lookup applies (greedy sessions)."""
        if self.lookup is None or not params.greedy:
            return None
        seq = np.empty(len(verified) + depth, dtype=np.int64)
        seq[: len(verified)] = verified
        return seq

    def _look(self, seq: np.ndarray | None, n: int) -> int | None:
        """The lookup's draft for position ``n`` (None: let the model pick)."""
        if seq is None:
            return None
        found = self.lookup(seq[:n])
        if found is None:
            self.model_picks += 1
        else:
            self.lookup_hits += 1
        return found

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """Draft for several sessions with one batched forward per step (ragged prefixes)."""
        if len(requests) == 1:
            r = requests[0]
            return [self.draft(r.state, r.verified, r.depth)]
        sessions: list[ModelSession] = [r.state for r in requests]  # type: ignore[misc]
        feeds = []
        for st, r in zip(sessions, requests):
            if not r.verified:
                raise ValueError("cannot draft after an empty sequence")
            keep = min(common_prefix_len(st.cached, r.verified), len(r.verified) - 1)
            crop_cache(st.cache, keep)
            del st.cached[keep:]
            feeds.append(r.verified[keep:])
        batch = BatchedCaches(self.runner, [st.cache for st in sessions], feeds, self.device,
                              steps=max(r.depth for r in requests))
        logits = batch.first()[:, : self.vocab_size].float()
        chains = [ChainDrafter(st.params, st.generator, self.q_topk, st.seed, len(r.verified))
                  for st, r in zip(sessions, requests)]
        greedy = [st.params.greedy for st in sessions]
        seqs = [self._context(st.params, r.verified, r.depth) for st, r in zip(sessions, requests)]
        depth = max(r.depth for r in requests)
        for j in range(depth):
            best = logits.argmax(-1).tolist() if any(greedy) else None  # every greedy row in one op
            picks = []
            for b, (chain, r) in enumerate(zip(chains, requests)):
                if j >= r.depth:
                    picks.append(0)
                elif greedy[b]:
                    found = self._look(seqs[b], len(r.verified) + j)
                    picks.append(chain.take(best[b] if found is None else found))
                    if seqs[b] is not None:
                        seqs[b][len(r.verified) + j] = picks[-1]
                else:
                    picks.append(chain.pick(logits[b]))
            if j + 1 < depth:
                live = [j + 1 < r.depth for r in requests]
                logits = batch.step(picks, live)[:, : self.vocab_size].float()
        for b, (st, r, feed) in enumerate(zip(sessions, requests, feeds)):
            batch.split(b, st.cache)
            st.cached.extend(feed)
            st.cached.extend(chains[b].tokens[: r.depth - 1])
        return [c.result() for c in chains]
