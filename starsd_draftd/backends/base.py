"""The interface every draft backend implements; the server loop knows nothing else about drafting."""

from __future__ import annotations

import abc
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from common.verify import SamplingParams, logits_to_probs


@dataclass
class DraftRequest:
    """One session's request as the server hands it to a backend. ``new_features`` is a wire
    array (a read-only numpy view of the request's frame; ``common.tensors.as_torch`` views it
    as a tensor). ``tree_tokens``: the most draft tokens (tree nodes) the target verifies this
    round; a backend drafts a tree when it exceeds ``depth`` and the backend's ``tree_topk`` is
    above 1, else a chain of ``depth``."""

    state: object
    verified: list[int]
    depth: int
    new_features: np.ndarray | torch.Tensor | None = None
    tree_tokens: int = 0
    min_survival: float = 0.0  # a greedy chain stops early below this chance of being kept whole (``Stopping``)
    # a greedy tree's nodes are neither fed nor sent below this chance of lying on the target's
    # path (0: min_survival's): the target's min_chance, what one more verified row costs
    min_chance: float = 0.0


@dataclass
class Draft:
    """k proposed tokens; in sampling mode also the sparse proposal distribution each was drawn
    from: ``q_ids`` [k, K] int32 and ``q_probs`` [k, K] float32 (rows sum to 1), as torch
    tensors or numpy arrays. ``parents``: None for a chain; for a tree (``common.tree``), each
    node's parent (ROOT or an earlier node), and row i of q is the distribution node i was
    drawn from, its parent's (siblings share a row; they were drawn from it in node order
    without replacement)."""

    tokens: list[int]
    q_ids: torch.Tensor | np.ndarray | None = None
    q_probs: torch.Tensor | np.ndarray | None = None
    # per token, the draft's most likely other token there (None: not known, e.g. copied from
    # the context): lookahead's guess of what the target puts there when it rejects the draft
    # (kept on this side; never sent)
    alternatives: list[int | None] | None = None
    parents: list[int] | None = None
    # per token of a greedy chain, the draft model's probability of its pick (None: copied from
    # the context, or not measured): what ``Calibration`` turns into the chance it is kept
    # (kept on this side; never sent)
    top_probs: list[float | None] | None = None
    # a chain that stopped at a model pick: the model's likeliest tokens after its last draft, with
    # their probabilities (lookahead's guesses of the target's next token after an all-kept round)
    next_top: list[tuple[int, float]] | None = None


_MASK64 = (1 << 64) - 1


def position_seed(base: int, position: int) -> int:
    """The seed of a session's draft draw at sequence ``position`` (splitmix64 of the pair): a
    draw depends on the session's seed and where it lands, never on how many draws came before,
    so drafting ahead of a request (lookahead) and on request draw alike, and a seeded
    generation gives the same tokens whatever the timing. Each position's draw decides an
    output at most once (a position's draft is examined in one round only: kept, or replaced by
    the target's token), so reusing it across rounds keeps speculative sampling exact."""
    z = (base * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def session_seed(params: SamplingParams) -> int:
    """The base of a session's position seeds: its seed, or fresh entropy when it has none."""
    return int(params.seed) & _MASK64 if params.seed is not None else secrets.randbits(64)


class ChainDrafter:
    """Collects a chain of draft tokens: argmax when greedy; otherwise each token is drawn from
    the top-k truncation of q (after the request's temperature / top-k / top-p), and that
    truncated q is what the target verifies against, so speculative sampling stays exact.
    ``seed``: the session's ``session_seed``; with it, the draw for the token at sequence
    position ``start + j`` is the inverse CDF of q at the uniform ``position_seed(seed, start + j)``
    makes (its top 53 bits); without it, a draw from the generator's running stream."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, q_topk: int,
                 seed: int | None = None, start: int = 0):
        self.params = params
        self.generator = generator
        self.q_topk = q_topk
        self.seed, self.start = seed, start
        self.tokens: list[int] = []
        self.alternatives: list[int | None] = []
        self.top_probs: list[float | None] = []
        self.next_top: list[tuple[int, float]] | None = None  # set where a stopped chain knows it (Draft.next_top)
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor, top_prob: float | None = None) -> int:
        """Draw (or, greedy, take the best of) the next token from ``logits``; ``top_prob``: the
        model's probability of its best token there, when measured (greedy stopping)."""
        self.top_probs.append(top_prob)
        if self.params.greedy:
            best = torch.topk(logits, 2).indices.tolist() if logits.shape[-1] > 1 else [int(torch.argmax(logits))] * 2
            tok = best[0]
            self.alternatives.append(best[1])
        else:
            top = torch.topk(logits_to_probs(logits, self.params), min(self.q_topk, logits.shape[-1]))
            mass = (top.values / top.values.sum()).cpu()
            if self.seed is not None:  # inverse CDF at a uniform taken from all 64 bits of the position's seed
                u = (position_seed(self.seed, self.start + len(self.tokens)) >> 11) * 2.0 ** -53
                cdf = torch.cumsum(mass.double(), 0)
                at = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
                tok = int(top.indices[min(int(torch.searchsorted(cdf, at, right=True)), mass.shape[0] - 1)])
            else:
                tok = int(top.indices[int(torch.multinomial(mass, 1, generator=self.generator))])
            first = top.indices[:2].tolist()
            self.alternatives.append(first[0] if first[0] != tok or len(first) < 2 else first[1])
            self._ids.append(top.indices.to(torch.int32).cpu())
            self._probs.append(mass)
        self.tokens.append(tok)
        return tok

    def take(self, tok: int, alternative: int | None = None, top_prob: float | None = None) -> int:
        """Record a greedy pick made outside (one argmax over a whole batch, a token copied from
        the context), with the model's most likely other token there if known, and the model's
        probability of the token when it is the model's pick and was measured."""
        self.top_probs.append(top_prob)
        self.tokens.append(tok)
        self.alternatives.append(alternative)
        return tok

    def stops(self, stop: "Stopping", prob: float | None, logits: torch.Tensor | None = None) -> bool:
        """Whether ``stop`` ends the chain before its next token, whose model probability is
        ``prob`` (None: copied from the context). Where it ends at a model pick, the model's
        NEXT_GUESSES likeliest tokens there (from ``logits``) become the chain's ``next_top``."""
        if stop.go_on(len(self.tokens), prob):
            return False
        if prob is not None:
            self.next_top = likeliest(logits, NEXT_GUESSES)
        return True

    def result(self) -> Draft:
        if not self._ids:
            return Draft(self.tokens, alternatives=list(self.alternatives), top_probs=list(self.top_probs),
                         next_top=self.next_top)
        return Draft(self.tokens, torch.stack(self._ids), torch.stack(self._probs), list(self.alternatives),
                     top_probs=list(self.top_probs), next_top=self.next_top)


def top_probs(logits: torch.Tensor) -> torch.Tensor:
    """The probability softmax(logits) gives its most likely token, per row ([..., V] -> [...])."""
    return torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))


NEXT_GUESSES = 3  # a chain stopped at a model pick reports its likeliest next tokens (Draft.next_top)


def likeliest(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of softmax(logits) [V], with their probabilities."""
    top = torch.topk(torch.softmax(logits.float(), -1), min(k, logits.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist()))


# Calibration's priors, each worth PRIOR_WEIGHT outcomes: a token copied from the context was kept
# 80-93% of the time on the demo pair (teacher-forced over its prompts: 93% where the model's own
# pick agrees, 80% where not), and the model's probability of its pick is taken at its word.
PRIOR_COPIED = 0.85
PRIOR_WEIGHT = 8.0
CALIBRATION_DISCOUNT = 0.98  # weight of older outcomes per outcome learned (a session's text changes)
MAX_CHANCE = 0.99  # no draft is sure: a chain's chance keeps falling with its length


class Calibration:
    """One greedy session's estimate of the chance that a draft token is kept, given that the
    drafts before it were: for the model's pick, its probability ``top_prob`` scaled by how often
    such picks were kept against what their probabilities promised; for a token copied from the
    context (``top_prob`` None), the share of copies kept. Learned from the session's own
    outcomes: ``sent`` records a draft as it leaves, ``learn`` reads the next verified sequence
    (tokens up to the first rejection were kept, the first rejected one was not, the rest teach
    nothing)."""

    def __init__(self):
        self.copied_kept, self.copied_tried = PRIOR_COPIED * PRIOR_WEIGHT, PRIOR_WEIGHT
        self.model_kept, self.model_promised = PRIOR_WEIGHT, PRIOR_WEIGHT
        self._last: tuple[int, list[int], list[float | None]] | None = None

    def chance(self, top_prob: float | None) -> float:
        if top_prob is None:
            return min(self.copied_kept / self.copied_tried, MAX_CHANCE)
        return min(top_prob * self.model_kept / self.model_promised, MAX_CHANCE)

    def survivals(self, top_probs: list[float | None]) -> list[float]:
        """For a chain with these model probabilities (None: copied), the chance that its first
        j drafts are all kept, for j = 0..len."""
        out = [1.0]
        for p in top_probs:
            out.append(out[-1] * self.chance(p))
        return out

    def sent(self, start: int, draft: Draft) -> None:
        """``draft`` (a chain measured for stopping) went out for the sequence position ``start``."""
        probs = draft.top_probs
        self._last = (start, list(draft.tokens), list(probs)) if probs and draft.parents is None else None

    def learn(self, verified: list[int]) -> None:
        """The session's verified sequence now: its outcome for the draft last sent, once."""
        if self._last is None:
            return
        start, tokens, probs = self._last
        self._last = None
        if len(verified) <= start:
            return  # nothing verified past the drafts' start yet
        for tok, p, actual in zip(tokens, probs, verified[start:]):
            kept = float(tok == actual)
            d = CALIBRATION_DISCOUNT
            if p is None:
                self.copied_kept, self.copied_tried = d * self.copied_kept + kept, d * self.copied_tried + 1.0
            else:
                self.model_kept, self.model_promised = d * self.model_kept + kept, d * self.model_promised + p
            if not kept:
                break


class Stopping:
    """Where a greedy chain stops (adaptive draft length on the draft's side, after SpecDec++ and
    AdaEDL): the chain takes its next token only while the chance that every draft so far is kept
    stays at or above ``min_survival``, each draft's chance from ``Calibration``. The first draft
    too: a round's trip is paid anyway, but a draft forward and a verified row are not, so a chain
    may be empty and the round verify the target's own token alone. The target sets ``min_survival`` from its
    measured costs (``starsd_target.depth``): one more draft pays when the chance it is kept
    exceeds the round's rate times what the draft costs; 0 turns stopping off."""

    def __init__(self, calibration: Calibration | None, min_survival: float):
        self.calibration = calibration
        self.min_survival = min_survival if calibration is not None else 0.0
        self.survival = 1.0

    @property
    def active(self) -> bool:
        return self.min_survival > 0.0

    def go_on(self, drafted: int, top_prob: float | None) -> bool:
        """Whether the chain, ``drafted`` tokens long, takes a next token whose model probability
        is ``top_prob`` (None: copied from the context)."""
        if not self.active:
            return True
        survival = self.survival * self.calibration.chance(top_prob)
        if survival < self.min_survival:
            return False
        self.survival = survival
        return True


def request_stopping(params: SamplingParams, calibration: Calibration, verified: list[int],
                     min_survival: float) -> Stopping:
    """A session's stopping rule for one request: inactive for sampled sessions and at
    ``min_survival`` 0; else its calibration first learns the outcome the request's ``verified``
    sequence brings."""
    if not params.greedy or min_survival <= 0.0:
        return Stopping(None, 0.0)
    calibration.learn(verified)
    return Stopping(calibration, min_survival)


def stopped_sent(stop: Stopping, calibration: Calibration, start: int, draft: Draft) -> Draft:
    """``draft``, recorded as sent (from sequence position ``start``) where ``stop`` measured it."""
    if stop.active:
        calibration.sent(start, draft)
    return draft


def clip_draft(draft: Draft, depth: int, stopping: Stopping | None = None) -> Draft:
    """A chain's first ``depth`` drafts, cut where ``stopping`` would have stopped it (drafts
    made ahead of the request, before its ``min_survival`` was known)."""
    n = min(depth, len(draft.tokens))
    if stopping is not None and stopping.active and draft.top_probs is not None:
        n = next((j for j in range(n) if not stopping.go_on(j, draft.top_probs[j])), n)

    def cut(x):
        return None if x is None else x[:n]

    whole = n == len(draft.tokens)  # a cut chain's next token is its own next draft, not next_top's
    return Draft(draft.tokens[:n], cut(draft.q_ids), cut(draft.q_probs), cut(draft.alternatives), draft.parents,
                 cut(draft.top_probs), draft.next_top if whole else None)


class Lookahead:
    """A session's next round drafted ahead of its request, in small steps (one model forward
    each) while the draft daemon has nothing queued, for one or more guesses of the sequence
    its next request brings (the drafts just sent all kept and the draft's guess, or after a
    chain that stopped unsure its likeliest guesses, of the target's next token; or kept up to
    a position and the draft's second choice there).

    ``guesses`` holds each guessed sequence once known (None until then: the all-kept guess
    needs the first forward); ``result`` the drafts for each once done. ``step()`` runs one
    step; ``take(i)`` finishes the work (a request for exactly ``guesses[i]`` came) and returns
    guess i's drafts, leaving the session's state as if drafted for it on request; ``close()``
    drops the work (the session's state is untouched, or consistent, after every step)."""

    def __init__(self, start: Callable[["Lookahead"], Generator[None, None, list[Draft]]],
                 guesses: list[list[int] | None], adopt: Callable[[int], None] | None = None,
                 steps: int | None = None):
        """``start(task)``: the steps, a generator that yields after each forward, fills in
        ``task.guesses`` as they become known and returns one Draft per guess. ``adopt(i)``:
        make the session's state that of guess i's drafting (None: nothing to do). ``steps``:
        how many forwards the work takes in all, if known."""
        self.guesses = guesses
        self.result: list[Draft] | None = None
        self.total_steps = steps
        self.steps = 0
        self.seconds = 0.0  # the time its steps took
        self._adopt = adopt
        self._steps = start(self)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def steps_left(self) -> int | None:
        return None if self.total_steps is None else max(self.total_steps - self.steps, 0)

    def match(self, sequence: list[int]) -> int | None:
        """Which guess ``sequence`` is, if any."""
        for i, g in enumerate(self.guesses):
            if g is not None and len(g) == len(sequence) and g == sequence:
                return i
        return None

    def step(self) -> bool:
        """Run one step; whether the work is done."""
        if self.result is None:
            t0 = time.perf_counter()
            try:
                next(self._steps)
                self.steps += 1
            except StopIteration as stop:
                if stop.value is None:
                    raise RuntimeError("drafting ahead ended without drafts") from None
                self.result = stop.value
            finally:
                self.seconds += time.perf_counter() - t0
        return self.result is not None

    def take(self, i: int) -> Draft:
        while not self.step():
            pass
        if self._adopt is not None:
            self._adopt(i)
        return self.result[i]

    def close(self) -> None:
        self._steps.close()


def frontier_width(topk: int, depth: int, budget: int) -> int:
    """Nodes a greedy tree feeds per level: about the budget's nodes per level (ceil(budget /
    depth)), at most ``topk``. EAGLE-2's 60 tokens over depth 6 feed its top-k of 10."""
    return max(1, min(topk, -(-budget // max(depth, 1))))


class DraftBackend(abc.ABC):
    """Per-session state is opaque to the server; the backend creates, uses and frees it."""

    name: str = "base"
    vocab_size: int
    fingerprint: str
    feature_size: int = 0  # >0: each request must bring target features of this width
    feature_layers: tuple[int, ...] | None = None  # the target hidden states fused per feature (None: the final one)
    max_len: int | None = None  # longest sequence (verified + drafts) the drafter can attend over
    kv_bytes_per_token: int = 0  # cache memory a session holds per position (0: none worth bounding)
    tree_topk: int = 1  # most children a draft tree's node gets (1: chains only)
    weights_bytes: int = 0  # the checkpoint's weight files, which STATS sets resident memory against (0: unknown)

    def drafts_tree(self, depth: int, tree_tokens: int) -> bool:
        """Whether a request for ``depth`` tokens and up to ``tree_tokens`` nodes gets a tree."""
        return self.tree_topk > 1 and depth >= 1 and tree_tokens > depth

    def tree_room(self, depth: int, tree_tokens: int, greedy: bool) -> int:
        """Cache positions beyond the verified ones that drafting a request takes: a chain's
        depth; a greedy tree feeds its frontier (``frontier_width``) at every level below the
        first; a sampled tree (the chain with leaves beside it) its chain only."""
        if not greedy or not self.drafts_tree(depth, tree_tokens):
            return depth
        return max(depth, frontier_width(self.tree_topk, depth, tree_tokens) * (depth - 1))

    @abc.abstractmethod
    def new_state(self, params: SamplingParams) -> object:
        """Fresh state for one session (caches, a seeded generator...)."""

    @abc.abstractmethod
    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None, tree_tokens: int = 0) -> Draft:
        """Propose ``depth`` tokens following ``verified`` (the whole verified sequence), or a
        tree of up to ``tree_tokens`` nodes at most ``depth`` deep (``drafts_tree``).

        The backend reuses whatever of its cached work still matches ``verified`` and
        rolls back the rest. ``new_features`` ([m, feature_size], only for backends with
        feature_size > 0) are the target's features for the positions after those this
        session already holds; with them it holds one per verified token but the last.
        Backends that draft no trees (``tree_topk`` 1) may leave ``tree_tokens`` out."""

    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """Serve several sessions' requests at once. The default serves them one after another;
        backends that can batch the sessions' forwards override it."""
        if self.tree_topk <= 1:  # a chains-only backend need not take tree_tokens
            return [self.draft(r.state, r.verified, r.depth, r.new_features) for r in requests]
        return [self.draft(r.state, r.verified, r.depth, r.new_features, tree_tokens=r.tree_tokens) for r in requests]

    drafts_ahead: bool = False  # lookahead() returns work (the server reserves memory for it first)
    prefills: bool = False  # prefill() feeds part of a long prompt ahead of its request's drafting

    def prefill(self, state: object, verified: list[int], budget: int) -> tuple[int, int]:
        """Feed up to ``budget`` more of ``verified`` into the session's cache (one forward), so a
        long prompt is fed over several batches (``--batch-prefill-tokens``) and a short request
        never waits behind all of it; the next ``draft`` reuses what was fed. Returns the tokens
        fed now and those of ``verified`` still to feed (at least one: drafting feeds the last)."""
        raise NotImplementedError

    def held(self, state: object, verified: list[int]) -> int | None:
        """How many of ``verified``'s first tokens the session's cache holds (with ``prefills``),
        the drafts of its last chain the target kept included; None where the backend does not say."""
        return None
    stops_drafts: bool = False  # greedy chains stop early by confidence (DraftRequest.min_survival; ``Stopping``)

    def lookahead_rows(self, draft: Draft) -> int:
        """How many copies of a session's cache its work ahead holds after ``draft`` was sent."""
        return 1

    def lookahead(self, state: object, verified: list[int], draft: Draft, depth: int) -> Lookahead | None:
        """Start drafting a session's next round (``depth`` tokens) ahead of its request:
        ``verified`` is its verified sequence and ``draft`` the drafts just sent for it. None:
        this backend does not draft ahead (the default)."""
        return None

    def finish_ahead(self, state: object, request: DraftRequest, draft: Draft) -> Draft:
        """What a request answered from work done ahead gets of its drafts: by default the first
        ``request.depth`` (a backend that stops chains early cuts them as it would have)."""
        return clip_draft(draft, request.depth)

    def attach_suffix(self, index: object) -> None:
        """The draft daemon's suffix index (``starsd_draftd.suffix.SuffixIndex``, or None), for
        backends that take draft tokens from it step by step (default: they do not)."""

    def bind_text(self, state: object, text: object) -> None:
        """A session's text in that index (``SuffixText``), for such backends (default: unused)."""

    def keep_prompts(self, budget_bytes: int) -> None:
        """Keep finished sessions' keys and values within ``budget_bytes``, for later sessions of
        the same share whose text begins alike (``common.prefix_cache``; default: unsupported)."""

    def bind_share(self, state: object, share: object) -> None:
        """The partition a session's kept keys and values go to and come from (see
        ``keep_prompts``; default: unused). Unbound sessions neither keep nor reuse."""

    def release(self, state: object) -> None:
        """Free a session's state (default: let garbage collection do it)."""

    def counters(self) -> dict:
        """The backend's own counts for STATS (default: none)."""
        return {}
