"""Draft backend "model": any Hugging Face causal LM drafts a chain of tokens, or a draft tree
(``trees``), with a KV cache."""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from common.draft_vocab import SubsetHead
from common.models import LoadedModel, common_prefix_len, crop_cache, kv_bytes_per_token
from common.prefix_cache import PrefixCache
from common.runner import ModelRunner
from common.tree import ROOT, additive_mask, mask_refusal
from common.verify import SamplingParams, make_generator
from starsd_draftd.backends.base import (Calibration, ChainDrafter, Draft, DraftBackend, DraftRequest, Lookahead,
                                        Stopping, clip_draft, frontier_width, request_stopping, session_seed,
                                        stopped_sent, top_probs)
from starsd_draftd.backends.batching import BatchedCaches, CacheView
from starsd_draftd.backends.trees import GreedyTree, chain_drafter
from starsd_draftd.suffix import SuffixIndex

log = logging.getLogger("starsd.draftd.model")


@dataclass
class ModelSession:
    params: SamplingParams
    generator: torch.Generator
    cache: object
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values the cache holds
    seed: int = 0  # the base of its draws' position seeds (base.position_seed)
    calibration: Calibration = field(default_factory=Calibration)  # greedy stopping's chances (base.Stopping)
    min_survival: float = 0.0  # its last request's stopping threshold (its work ahead stops by it too)
    text: object | None = None  # its text in the daemon's suffix index (a suffix.SuffixText; None: own tokens only)
    share: object = None  # its partition of the kept prompts (ModelBackend.keep_prompts)
    reuses: bool = False  # it takes and leaves kept prompts (bound to a share)


class ModelBackend(DraftBackend):
    name = "model"
    stops_drafts = True

    def __init__(self, loaded: LoadedModel, q_topk: int = 32, lookup: SuffixIndex | None = None,
                 runner: ModelRunner | None = None, tree_topk: int = 1):
        """``lookup``: in greedy sessions, each draft token comes from the suffix index where the
        last tokens occurred before (the session's own text, and what the index shares with it:
        ``SuffixIndex.next_token``), else from the model; the draft daemon attaches its index
        (``attach_suffix``).
        ``runner``: how the model runs (compiled or eager); eager by default. ``tree_topk``: the
        most children a draft tree's node gets (1: chains only; see ``_greedy_tree`` and
        ``trees.CaterpillarDrafter``); greedy trees need a model that takes custom 4-D masks."""
        if q_topk < 1:
            raise ValueError("q_topk must be >= 1")
        if tree_topk < 1:
            raise ValueError("tree_topk must be >= 1")
        self.weights_bytes = loaded.weights_bytes
        self.lookup = lookup
        self.lookup_hits = 0  # draft tokens taken from the suffix index
        self.model_picks = 0  # greedy draft tokens the model chose
        self.loaded = loaded
        self.runner = runner if runner is not None else ModelRunner(loaded)
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.fingerprint = loaded.fingerprint
        self.q_topk = min(q_topk, loaded.vocab_size)
        self.tree_topk = min(tree_topk, loaded.vocab_size)
        if self.tree_topk > 1 and (why := mask_refusal(loaded.model.config)) is not None:
            log.warning("drafting chains only: draft trees need a tree attention mask, which this draft model "
                        "cannot take: %s", why)
            self.tree_topk = 1
        head = loaded.model.get_output_embeddings()  # a cut one (--draft-vocab) computes fewer ids
        self.output_ids = len(head.ids) if isinstance(head, SubsetHead) else loaded.logits_size
        cfg = loaded.model.config
        self.max_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, loaded.dtype)
        self.prompts = PrefixCache(0)  # finished sessions' keys and values (keep_prompts)

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
            if self.tree_topk > 1:  # a greedy tree's levels: forwards with a 4-D mask
                self.draft(self.new_state(SamplingParams()), [1] * 6, 3, tree_tokens=3 * self.tree_topk)

        return self.runner.warm_up(exercise, "draft model")

    @property
    def model(self):
        return self.runner.model

    def counters(self) -> dict:
        return {"lookup": self.lookup is not None, "lookup_hits": self.lookup_hits, "model_picks": self.model_picks,
                "output_ids": self.output_ids, "logits_size": self.loaded.logits_size,
                "forward": self.runner.forward_kind, "kept_prompts": self.prompts.snapshot()}

    def attach_suffix(self, index: SuffixIndex | None) -> None:
        self.lookup = index

    def keep_prompts(self, budget_bytes: int) -> None:
        # the draft's keys and values only shape drafts, which the target verifies: a run of any
        # length is reused, computed however it was
        self.prompts = PrefixCache(budget_bytes, chunk=1)

    def bind_share(self, state: object, share: object) -> None:
        state.share, state.reuses = share, True  # type: ignore[attr-defined]

    def release(self, state: object) -> None:
        st: ModelSession = state  # type: ignore[assignment]
        if st.reuses and st.cached:
            self.prompts.remember(st.cached, len(st.cached), st.cache, st.share)

    def bind_text(self, state: object, text: object) -> None:
        state.text = text  # type: ignore[attr-defined]

    def new_state(self, params: SamplingParams) -> ModelSession:
        return ModelSession(params, make_generator(params.seed), self.runner.new_cache(), seed=session_seed(params))

    prefills = True

    @torch.inference_mode()
    def prefill(self, state: object, verified: list[int], budget: int) -> tuple[int, int]:
        st: ModelSession = state  # type: ignore[assignment]
        keep = self._rewind(st, verified)
        upto = min(len(verified) - 1, keep + budget)
        if upto > keep:
            self.runner.forward(st.cache, verified[keep:upto], "last")
            st.cached.extend(verified[keep:upto])
        return upto - keep, len(verified) - upto

    def held(self, state: object, verified: list[int]) -> int | None:
        st: ModelSession = state  # type: ignore[assignment]
        return common_prefix_len(st.cached, verified)

    def _forward(self, st: ModelSession, tokens: list[int]) -> torch.Tensor:
        """Feed tokens after the cached ones; return the last position's logits over the vocabulary."""
        logits, _ = self.runner.forward(st.cache, tokens, "last")
        st.cached.extend(tokens)
        return logits[: self.vocab_size]

    def _rewind(self, st: ModelSession, verified: list[int]) -> int:
        """Keep the cached prefix that still matches ``verified``, always leaving at least one
        token to re-feed (its forward yields the logits of the next position); its length. A
        session's first feed starts from the longest run a kept session of its share had in common."""
        if not verified:
            raise ValueError("cannot draft after an empty sequence")
        if not st.cached and st.reuses and self.prompts.enabled:
            st.cached = list(verified[: self.prompts.fill(st.cache, verified, len(verified) - 1, st.share)])
        keep = min(common_prefix_len(st.cached, verified), len(verified) - 1)
        crop_cache(st.cache, keep)
        del st.cached[keep:]
        return keep

    @staticmethod
    def _stopping(st: ModelSession, verified: list[int], min_survival: float) -> Stopping:
        """The request's stopping rule (``request_stopping``); its threshold stays with the
        session, for the work done ahead of its next request."""
        stop = request_stopping(st.params, st.calibration, verified, min_survival)
        st.min_survival = stop.min_survival
        return stop

    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None, tree_tokens: int = 0,
              min_survival: float = 0.0, min_chance: float = 0.0) -> Draft:
        """``min_survival`` > 0 (greedy sessions): a chain stops before ``depth`` where
        ``Stopping`` says; a tree feeds and keeps only the nodes that pay their row (whose chance
        reaches ``min_chance``, or ``min_survival`` without it)."""
        st: ModelSession = state  # type: ignore[assignment]
        if st.params.greedy and self.drafts_tree(depth, tree_tokens):
            return self._greedy_tree(st, verified, depth, tree_tokens, min_survival, min_chance)
        stop = self._stopping(st, verified, min_survival)
        keep = self._rewind(st, verified)
        chain = chain_drafter(self, st, len(verified), depth, tree_tokens)
        seq = self._context(st.params, verified, depth)
        # Tokens reach the model only when it must pick: a run of tokens copied from the context
        # costs no forward, and is fed with the next one the model picks after it (or next time).
        pending, logits = list(verified[keep:]), None
        for j in range(depth):
            found = self._look(st, seq, len(verified) + j, count=False)
            if found is None:
                if pending:
                    logits, pending = self._forward(st, pending), []
                p = float(top_probs(logits)) if stop.active else None
                if chain.stops(stop, p, logits):
                    break
                tok = chain.pick(logits, p)
            else:
                if chain.stops(stop, None):
                    break
                tok = chain.take(found)
            if seq is not None:
                self._count(found)
                seq[len(verified) + j] = tok
            pending.append(tok)
        return stopped_sent(stop, st.calibration, len(verified), chain.result())

    def finish_ahead(self, state: object, request: DraftRequest, draft: Draft) -> Draft:
        """A greedy chain drafted ahead, cut where drafting it on request would have stopped."""
        st: ModelSession = state  # type: ignore[assignment]
        stop = self._stopping(st, request.verified, request.min_survival)
        return stopped_sent(stop, st.calibration, len(request.verified), clip_draft(draft, request.depth, stop))

    @torch.inference_mode()
    def _greedy_tree(self, st: ModelSession, verified: list[int], depth: int, tree_tokens: int,
                     min_survival: float = 0.0, min_chance: float = 0.0) -> Draft:
        """A greedy session's dynamic tree (``trees.GreedyTree``). Lookup stays: where the
        context gives the chain's next token, that copy is the chain node's first child, as it
        is the chain's token in ``draft``, so the tree's first-child path is the chain ``draft``
        gives; the model's best others are its siblings. Forwards: the verified tokens the cache
        lacks, then one per level below the first, feeding the level's chosen nodes after the
        cache with a 4-D mask (each sees the verified positions, its ancestors and itself) at its
        depth's position. The cache is then cropped back to the verified tokens, so that the next
        request goes on from them as after a chain nothing of which was kept. With
        ``min_survival`` a node must pay its row (``GreedyTree``'s floor: ``min_chance``, the
        target's cost of a verified row, where sent, since a level's forward feeds many nodes;
        the session's calibration): a level with no such node ends the tree, and the chain sent
        is what the calibration learns from, as a chain's would be."""
        stop = self._stopping(st, verified, min_survival)
        keep = self._rewind(st, verified)
        root = self._forward(st, verified[keep:])
        held = len(verified)
        seq = self._context(st.params, verified, depth)
        tree = GreedyTree(self.tree_topk, frontier_width(self.tree_topk, depth, tree_tokens),
                          *((st.calibration.chance, min_chance or stop.min_survival) if stop.active else ()))
        tree.grow(ROOT, root, self._look(st, seq, held))
        dtype = self.loaded.dtype
        try:
            for d in range(1, depth):
                level = tree.frontier(d)
                if not level:
                    break
                see = tree.feed(level)
                allowed = torch.cat([torch.ones(len(level), held, dtype=torch.bool), see], dim=1)
                mask = additive_mask(allowed, dtype)
                ids = torch.tensor([[tree.token(n) for n in level]], dtype=torch.long, device=self.device)
                pos = torch.full((1, len(level)), held + d - 1, dtype=torch.long, device=self.device)
                if hasattr(st.cache, "reserve"):
                    st.cache.reserve(allowed.shape[1])
                out = self.runner(input_ids=ids, attention_mask=mask[None, None].to(self.device), position_ids=pos,
                                  cache=st.cache, use_cache=True)
                logits = out.logits[0, :, : self.vocab_size].float()
                for r, n in enumerate(level):
                    first = None
                    if tree.on_chain(n) and seq is not None:
                        seq[held + d - 1] = tree.token(n)
                        first = self._look(st, seq, held + d)
                    tree.grow(n, logits[r], first)
        finally:
            crop_cache(st.cache, held)
        draft = tree.draft(tree_tokens)
        stopped_sent(stop, st.calibration, len(verified), tree.sent_chain)  # its chain, for the calibration
        return draft

    drafts_ahead = True
    MAX_ALTERNATIVE_ROWS = 3  # guesses of a rejection: at the first positions, where rejections are likeliest
    MAX_ROWS = MAX_ALTERNATIVE_ROWS + 1  # guesses drafted ahead at most (one batch)
    # the share of rejections where the target's token is the draft's second choice: 8 of 77 on
    # the demo pair (replayed offline); ranks the rejection guesses against the all-kept ones
    ALTERNATIVE_SHARE = 0.1

    def lookahead_rows(self, draft: Draft) -> int:
        rows = min(len(draft.tokens), self.MAX_ALTERNATIVE_ROWS)
        if draft.next_top and draft.top_probs is not None:  # ranked guesses (``_ranked``)
            return min(rows + len(draft.next_top), self.MAX_ROWS)
        return rows + 1

    def lookahead(self, state: object, verified: list[int], draft: Draft, depth: int) -> Lookahead | None:
        """Draft the next round ahead for every outcome the draft can guess, as one batch:
        the drafts just sent all kept, followed by the draft's own next token (known after the
        batch's first forward); and for each draft position with an alternative, the drafts
        kept up to it and the alternative in its place (what the target most likely puts there
        if it rejects the draft), at the first MAX_ALTERNATIVE_ROWS positions. A chain that
        stopped where the model was unsure of its next token (``Draft.next_top``) is guessed
        all kept followed by each of the model's likeliest next tokens, and its guesses are
        ranked by their chance (``Calibration``), the MAX_ROWS likeliest drafted. ``depth``
        tokens after the all-kept guess, ``depth`` + 1 after the others, ``depth`` + 1 batched
        forwards at most (a row stops where its request would: ``Stopping``), over copies of the
        session's cache, which stays as it is until a guess is taken. None when the session's
        cache lags its sequence by much (lookup-copied tokens not fed yet): the first step would
        feed them once per row."""
        st: ModelSession = state  # type: ignore[assignment]
        if draft.parents is not None:
            return None  # after a tree: its next request's sequence is any of the tree's paths
        seq = list(verified) + list(draft.tokens)
        if len(seq) - common_prefix_len(st.cached, seq) > 2 * depth + 2:
            return None
        alts = (draft.alternatives or [None] * len(draft.tokens))[: self.MAX_ALTERNATIVE_ROWS]
        branches = [(list(verified) + list(draft.tokens[:j]), alt) for j, alt in enumerate(alts)
                    if alt is not None and alt < self.vocab_size]
        if draft.next_top and draft.top_probs is not None:
            branches = self._ranked(st.calibration, verified, draft, seq, branches)
        else:
            branches.append((seq, None))  # all kept: its token is the first forward's pick
        guesses = [prefix + [tok] if tok is not None else None for prefix, tok in branches]
        box: dict = {}

        def adopt(i: int) -> None:
            batch, fed = box["batch"], box["fed"]
            with torch.inference_mode():
                batch.split(i, st.cache)
            st.cached = fed[i]

        return Lookahead(lambda task: self._branch_steps(st, seq, branches, depth, task, box), guesses, adopt,
                         steps=depth + 1)

    def _ranked(self, cal: Calibration, verified: list[int], draft: Draft, seq: list[int],
                rejections: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
        """The guesses after a chain that stopped at a model pick, likeliest first, MAX_ROWS at
        most: all kept and then each of ``draft.next_top`` (the chain's chance times the token's),
        or kept up to a position and the alternative there (the chance of that rejection times
        ALTERNATIVE_SHARE)."""
        kept = cal.survivals(draft.top_probs)  # kept[j]: the chance the first j drafts are all kept
        scored = [(kept[-1] * cal.chance(p), (seq, tok)) for tok, p in draft.next_top if tok < self.vocab_size]
        for prefix, alt in rejections:
            j = len(prefix) - len(verified)
            scored.append((kept[j] * (1.0 - cal.chance(draft.top_probs[j])) * self.ALTERNATIVE_SHARE, (prefix, alt)))
        scored.sort(key=lambda x: -x[0])
        return [branch for _, branch in scored[: self.MAX_ROWS]]

    def _branch_steps(self, st: ModelSession, seq: list[int], branches: list[tuple[list[int], int | None]],
                      depth: int, task: Lookahead, box: dict) -> Generator[None, None, list[Draft]]:
        views, feeds, fed = [], [], []
        common = common_prefix_len(st.cached, seq)  # every prefix is one of the all-kept one, ``seq``
        for prefix, tok in branches:
            hold = min(common, len(prefix) - (1 if tok is None else 0))
            views.append(CacheView(st.cache, hold))
            feeds.append(prefix[hold:] + ([] if tok is None else [tok]))
            fed.append(prefix[:hold] + feeds[-1])  # what each row's cache holds, growing per step
        with torch.inference_mode():
            batch = BatchedCaches(self.runner, views, feeds, self.device, steps=depth + 1)
            logits = batch.first()[:, : self.vocab_size].float()
        yield
        rows = len(branches)
        # the all-kept row whose token the first forward picks (-1: none), its pick the guess, not a draft
        last = next((b for b, (_, tok) in enumerate(branches) if tok is None), -1)
        picks = [0] * rows
        if last >= 0:
            picks[last] = int(torch.argmax(logits[last]))
            task.guesses[last] = branches[last][0] + [picks[last]]
        chains = [ChainDrafter(st.params, st.generator, self.q_topk, st.seed, len(task.guesses[b])) for b in range(rows)]
        greedy = st.params.greedy
        seqs = [self._context(st.params, task.guesses[b], depth + 1) for b in range(rows)]
        # each row stops where its request would stop it, at the session's last threshold (a
        # request with another cuts the row again, never lengthens it): done sooner, hit more often
        stops = [Stopping(st.calibration if greedy else None, st.min_survival) for _ in range(rows)]
        live = [True] * rows
        for j in range(depth + 1):
            if j > 0 or last != 0 or rows > 1:
                top = torch.topk(logits, 2, dim=-1).indices.tolist() if greedy else None
                probs = top_probs(logits).tolist() if stops[0].active else [None] * rows  # the stopping rule's
                for b in range(rows):
                    if (b == last and j == 0) or not live[b]:
                        continue
                    chain = chains[b]
                    if greedy:
                        n = len(task.guesses[b]) + len(chain.tokens)
                        tok = self._take_greedy(st, chain, seqs[b], n, top[b], probs[b], stops[b], logits[b])
                        live[b] = tok is not None
                        picks[b] = 0 if tok is None else tok
                    else:
                        picks[b] = chain.pick(logits[b])
            if j == depth or not any(live):
                break
            with torch.inference_mode():
                logits = batch.step(picks, live)[:, : self.vocab_size].float()
            for b in range(rows):
                if live[b]:
                    fed[b].append(picks[b])
            yield
        box["batch"], box["fed"] = batch, fed
        return [c.result() for c in chains]

    def _context(self, params: SamplingParams, verified: list[int], depth: int) -> np.ndarray | None:
        """The session's tokens with room for its drafts, when lookup applies (greedy sessions)."""
        if self.lookup is None or not params.greedy:
            return None
        seq = np.empty(len(verified) + depth, dtype=np.int64)
        seq[: len(verified)] = verified
        return seq

    def _look(self, st: ModelSession, seq: np.ndarray | None, n: int, count: bool = True) -> int | None:
        """The suffix index's draft for position ``n`` (None: let the model pick). ``count``:
        count the position as drafted now (else ``_count`` does, once the chain takes it)."""
        if seq is None:
            return None
        found = self.lookup.next_token(st.text, seq[:n])
        if count:
            self._count(found)
        return found

    def _count(self, found: int | None) -> None:
        if found is None:
            self.model_picks += 1
        else:
            self.lookup_hits += 1

    def _take_greedy(self, st: ModelSession, chain: ChainDrafter, seq: np.ndarray | None, n: int, top: list[int],
                     prob: float | None = None, stop: Stopping | None = None,
                     logits: torch.Tensor | None = None) -> int | None:
        """A greedy row's pick at position ``n`` in a batch: the context's token (lookup) or the
        model's best, with the model's most likely other token as its alternative; ``top`` is the
        row's best two, ``prob`` the model's probability of its best and ``logits`` the row's.
        None: ``stop`` ends the chain here (where the model picked, its likeliest tokens are the
        chain's ``next_top``)."""
        found = self._look(st, seq, n, count=False)
        measured = prob if found is None else None
        if stop is not None and chain.stops(stop, measured, logits):
            return None
        if seq is not None:
            self._count(found)
        best, second = top
        tok = chain.take(best if found is None else found, second if found in (None, best) else best, measured)
        if seq is not None:
            seq[n] = tok
        return tok

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """Draft for several sessions with one batched forward per step (ragged prefixes);
        sampled trees among them (their extra nodes are leaves). Greedy trees are drafted one
        session at a time, and so are seeded sampled sessions: a batched forward's q differs from
        a single one's in its last bits (about 1e-6 here), and which sessions share a batch
        depends on timing, which a seeded session's output must not."""
        out: list[Draft | None] = [None] * len(requests)
        batch = []
        for i, r in enumerate(requests):
            params = r.state.params  # type: ignore[attr-defined]
            if params.greedy and self.drafts_tree(r.depth, r.tree_tokens):
                out[i] = self.draft(r.state, r.verified, r.depth, tree_tokens=r.tree_tokens,
                                    min_survival=r.min_survival, min_chance=r.min_chance)
            elif params.seeded:
                out[i] = self.draft(r.state, r.verified, r.depth, tree_tokens=r.tree_tokens,
                                    min_survival=r.min_survival)
            else:
                batch.append(i)
        if len(batch) == 1:
            r = requests[batch[0]]
            out[batch[0]] = self.draft(r.state, r.verified, r.depth, tree_tokens=r.tree_tokens,
                                       min_survival=r.min_survival)
        elif batch:
            for i, d in zip(batch, self._batched([requests[i] for i in batch])):
                out[i] = d
        return out  # type: ignore[return-value]

    def _batched(self, requests: list[DraftRequest]) -> list[Draft]:
        sessions: list[ModelSession] = [r.state for r in requests]  # type: ignore[misc]
        stops = [self._stopping(st, r.verified, r.min_survival) for st, r in zip(sessions, requests)]
        feeds = []
        for st, r in zip(sessions, requests):
            keep = self._rewind(st, r.verified)
            feeds.append(r.verified[keep:])
        batch = BatchedCaches(self.runner, [st.cache for st in sessions], feeds, self.device,
                              steps=max(r.depth for r in requests))
        logits = batch.first()[:, : self.vocab_size].float()
        chains = [chain_drafter(self, st, len(r.verified), r.depth, r.tree_tokens) for st, r in zip(sessions, requests)]
        greedy = [st.params.greedy for st in sessions]
        seqs = [self._context(st.params, r.verified, r.depth) for st, r in zip(sessions, requests)]
        ends = [r.depth for r in requests]  # a row's chain ends at its depth, or where it stops
        depth = max(ends)
        for j in range(depth):
            # every greedy row's best two in one op (the second is lookahead's guess on a rejection)
            top = torch.topk(logits, 2, dim=-1).indices.tolist() if any(greedy) else None
            probs = top_probs(logits).tolist() if any(s.active for s in stops) else [None] * len(requests)
            picks = []
            for b, (chain, r) in enumerate(zip(chains, requests)):
                tok = 0
                if j >= ends[b]:
                    pass
                elif greedy[b]:
                    tok = self._take_greedy(sessions[b], chain, seqs[b], len(r.verified) + j, top[b], probs[b], stops[b],
                                            logits[b])
                    if tok is None:
                        ends[b], tok = j, 0  # stopped: its drafts so far are its chain
                else:
                    tok = chain.pick(logits[b])
                picks.append(tok)
            live = [j + 1 < end for end in ends]
            if not any(live):
                break
            logits = batch.step(picks, live)[:, : self.vocab_size].float()
        for b, (st, r, feed) in enumerate(zip(sessions, requests, feeds)):
            batch.split(b, st.cache)
            st.cached.extend(feed)
            st.cached.extend(chains[b].tokens[: batch.live_steps[b]])
        return [stopped_sent(stop, st.calibration, len(r.verified), c.result())
                for st, stop, r, c in zip(sessions, stops, requests, chains)]
