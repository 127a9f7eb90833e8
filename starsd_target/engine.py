"""The target's generation loop: prefill, then rounds of {get drafts, one forward, verify, crop}.

The target's cache always holds every verified token but the last; a round feeds
[last verified token, x_1..x_k] in one forward, which yields the k+1 distributions p_0..p_k
that verification needs. Without drafts (k = 0) the same round is plain decoding.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import NamedTuple, Protocol

import numpy as np
import torch

from common.features import fused_features
from common.models import LoadedModel, context_length, crop_cache
from common.prefix_cache import PrefixCache
from common.runner import ModelRunner
from common.slot_cache import PoolBatch, PoolRowCache, SlotPool
from common.tensors import as_torch, to_wire
from common.tree import TreeError, check_parents, mask_refusal, tree_attention
from common.verify import (SamplingParams, dense_q, logits_to_probs, make_generator, verify_greedy_host,
                           verify_greedy_tensor, verify_sampling_tensor, verify_tree_greedy, verify_tree_sampling)
from starsd_target import warmup
from starsd_target.config import TargetConfig, prefill_chunk_for
from starsd_target.detokenizer import IncrementalText
from starsd_target.results import GenerationResult, GenerationStats, TokenLogprob

log = logging.getLogger("starsd.target.engine")

# Bounds on one request, the same on every front end (HTTP and the job socket): each stop string
# is searched in the new text of every round (and as many characters before it as it is long),
# so their number and length bound that work.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_NEW_TOKENS = 1 << 16  # for models that declare no context length (those that do are bounded by it)
PREALLOCATE_TOKENS = 512  # generated positions a generation's KV cache holds before it first grows
# Architectures whose batched verification is tested (custom 4-D masks with per-row positions);
# others verify one generation per forward.
BATCH_ARCHITECTURES = ("llama", "qwen2")
# A generation whose prompt (with room for its first PREALLOCATE_TOKENS) needs more positions takes
# a cache of its own rather than a pool row, so that one long prompt does not size every row.
POOL_ROW_LIMIT = 4096
MAX_LOGPROBS = 20  # the most alternatives per generated token a request may ask the log-probabilities of


class GenerationFailed(RuntimeError):
    """The model gave what no generation can go on from (NaN logits): a server fault, not the request's."""


class BatchFailed(RuntimeError):
    """A batched verification failed before any of its generations took an outcome; their caches
    and random generators are as they were (``TargetEngine.verify_batch``)."""


class InvalidRequest(ValueError):
    """A request outside the target's bounds; ``param`` names the field at fault (for HTTP's error)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Proposal(Protocol):
    tokens: list[int]
    q_ids: np.ndarray | torch.Tensor | None  # as they arrived from the wire, or tensors
    q_probs: np.ndarray | torch.Tensor | None
    parents: list[int] | None  # a tree's parent indices (common.tree); None (or absent): a chain


class DraftSource(Protocol):
    """Where one generation's drafts come from (a remote session, or a fake in tests)."""

    feature_size: int  # >0: propose() needs the target's features
    # (optional attribute ``feature_layers``: which hidden states they fuse; absent or None: the final one)

    def propose(self, tokens: list[int], depth: int, features: np.ndarray | None = None,
                tree_tokens: int = 0) -> Proposal | None:
        """Up to ``depth`` drafts following ``tokens`` (all verified tokens), or None; with
        ``tree_tokens`` > ``depth``, a tree of up to that many may come instead.
        ``features`` holds the target's final hidden state (or the fused states of the source's
        ``feature_layers``) for every token but the last, as the wire array that goes out
        (``FeatureBuffer.view``)."""

    def kept(self, n: int) -> None:
        """How many tokens of the last proposal verification kept."""

    def close(self) -> None: ...


class FeatureBuffer:
    """The target's final hidden states of all cached positions, grown in place (amortised),
    held in the dtype they travel in and handed out as a numpy view of the same memory: what
    goes to the draft daemon is sliced and sent with no call into torch."""

    def __init__(self, width: int, dtype: torch.dtype):
        self.buf = torch.empty(64, width, dtype=dtype)
        self.wire = to_wire(self.buf)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self.buf.shape[0]:
            grown = torch.empty(max(need, 2 * self.buf.shape[0]), self.buf.shape[1], dtype=self.buf.dtype)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
            self.wire = to_wire(self.buf)
        self.buf[self.n: need] = rows
        self.n = need

    def view(self) -> np.ndarray:
        """Rows 0..n-1 as a wire array (``common.tensors.as_torch`` views it as a tensor)."""
        return self.wire[: self.n]


def feature_wire_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Features cross the network in 16 bits: the model's own half type, float16 for float32 models."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


class TargetEngine:
    def __init__(self, loaded: LoadedModel, depth: int = TargetConfig.depth,
                 prefill_chunk: int = TargetConfig.prefill_chunk,
                 runner: ModelRunner | None = None, max_batch: int = 1, rows: int | None = None,
                 draft_tokens: int | None = None, prefix_cache_bytes: int = 0):
        """``runner``: how the model runs (compiled or eager); eager by default. ``max_batch``:
        the most generations one verification forward takes (1: one at a time); their caches
        are ``rows`` rows of one pool (default ``max_batch``; a generation beyond them gets a
        cache of its own and is verified alone). ``draft_tokens``: the most draft tokens a
        round verifies (None: ``depth``, a chain); above ``depth``, rounds ask for draft trees
        of that many tokens at most, ``depth`` deep. ``prefix_cache_bytes``: memory for recent
        prompts' whole prefill chunks, which later prompts that begin alike reuse
        (``common.prefix_cache``; 0: none). ``prefill_chunk`` 0: ``config.prefill_chunk_for``."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        draft_tokens = depth if draft_tokens is None else draft_tokens
        if draft_tokens < depth:
            raise ValueError(f"draft_tokens ({draft_tokens}) must be at least the depth ({depth}): a chain of the "
                             f"full depth is the smallest tree")
        self.loaded = loaded
        self.runner = runner if runner is not None else ModelRunner(loaded)
        self.runner.enable_row_exact()  # bfloat16 verification rows as one-row steps compute them
        self.runner.enable_wide_prefill()  # fp16-weights prompts multiplied in bfloat16 where the CPU has its units
        self.depth = depth
        self.tree_tokens = draft_tokens
        if draft_tokens > depth and (why := self._mask_refusal()) is not None:
            raise ValueError(f"draft trees (draft_tokens {draft_tokens} > depth {depth}) need a forward with a "
                             f"tree attention mask, which this model cannot take: {why}")
        self.round_tokens = max(depth, draft_tokens)  # the most positions a round feeds after the root
        self.prefill_chunk = prefill_chunk = prefill_chunk_for(prefill_chunk, self.runner)
        self.prefix = PrefixCache(prefix_cache_bytes, prefill_chunk)
        self.context = context_length(loaded.model)  # None: the model declares none
        self.max_batch, self.batch_off = 1, self._batch_refusal(max_batch)
        self.pool: SlotPool | None = None
        if self.batch_off is None:
            self.max_batch = max_batch
            self.pool = SlotPool(loaded.model.config, max(rows or max_batch, max_batch),
                                 capacity=PREALLOCATE_TOKENS + self.round_tokens + 1)
        elif max_batch > 1:
            log.info("batched verification is off: %s; generations are verified one per forward", self.batch_off)

    def _batch_refusal(self, max_batch: int) -> str | None:
        """Why this model cannot verify several generations per forward (None: it can)."""
        if max_batch <= 1:
            return "max_batch is 1"
        if self.runner.compiled:
            return "the forward is compiled (compiled graphs take one sequence)"
        return self._mask_refusal()

    def _mask_refusal(self) -> str | None:
        """Why this model cannot run a forward with a custom 4-D attention mask and position ids
        (batched verification, draft trees), or None: it can."""
        return mask_refusal(self.loaded.model.config, BATCH_ARCHITECTURES)

    def new_cache(self, capacity: int):
        """A generation's cache: a row of the pool while one is free (such generations can be
        verified together), else a cache of its own. A generation that needs more than
        POOL_ROW_LIMIT positions from its start always gets its own (and is verified alone):
        every row of the pool is as long as the longest."""
        if self.pool is not None and capacity <= POOL_ROW_LIMIT:
            row = self.pool.acquire(capacity)
            if row is not None:
                return row
        return self.runner.new_cache(capacity)

    def warm_up(self, features: bool = False, feature_layers: tuple[int, ...] | None = None) -> float:
        """Before the daemon takes jobs: make the pool's KV buffers (``prime_pool``), and with a
        compiled runner compile the kinds of forward serving runs (``warmup.compile_exercise``;
        ``features``: a draft daemon with a feature-based head, ``feature_layers`` the states it
        fuses). Returns the compile seconds (0 when eager)."""
        warmup.prime_pool(self)
        return self.runner.warm_up(lambda: warmup.compile_exercise(self, features, feature_layers), "target model")

    def prime_pool(self) -> float:
        """See ``warmup.prime_pool``."""
        return warmup.prime_pool(self)

    def check(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop=(),
              max_draft: int | None = None, logprobs: int | None = None) -> None:
        """InvalidRequest unless the request fits the target's bounds: prompt ids in the
        vocabulary, prompt plus max_tokens within the model's context, top_k at most the
        vocabulary, stop strings bounded in number and length, a draft-token cap within what
        the target verifies per round, at most MAX_LOGPROBS alternatives per token. One check for every front end."""
        if not prompt:
            raise InvalidRequest("the prompt must hold at least one token", "prompt")
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1", "max_tokens")
        if max(prompt) >= self.loaded.logits_size or min(prompt) < 0:
            raise InvalidRequest(f"prompt token ids must lie in 0..{self.loaded.logits_size - 1}", "prompt")
        if self.context is not None and len(prompt) + max_tokens > self.context:
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                 f"model's context of {self.context} tokens", "max_tokens")
        if self.context is None and max_tokens > MAX_NEW_TOKENS:
            raise InvalidRequest(f"max_tokens must be at most {MAX_NEW_TOKENS}, got {max_tokens}", "max_tokens")
        if params.top_k > self.loaded.logits_size:
            raise InvalidRequest(f"top_k must be at most the vocabulary size {self.loaded.logits_size}, "
                                 f"got {params.top_k}", "top_k")
        if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS
                                               for s in stop):
            raise InvalidRequest(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most "
                                 f"{MAX_STOP_CHARS} characters", "stop")
        if max_draft is not None and not (_is_int(max_draft) and 0 <= max_draft <= self.round_tokens):
            raise InvalidRequest(f"max_draft_tokens must be an integer in 0..{self.round_tokens} (the draft tokens "
                                 f"the target verifies per round), got {max_draft!r}", "max_draft_tokens")
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {logprobs!r}", "logprobs")

    @property
    def model(self):
        return self.runner.model

    def encode(self, text: str) -> list[int]:
        tok = self.loaded.tokenizer
        if tok is None:
            raise ValueError(f"the model in {self.loaded.path} has no tokenizer; send token ids instead of text")
        return list(tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        tok = self.loaded.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def forward(self, cache, ids: list[int], features: bool = False, logits: bool = True,
                layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [len(ids), V] (float32, on the model's device: verification runs there; None
        with ``logits=False``, as a prefill needs none) and, if asked, the features: the final
        hidden states [len(ids), H], or those entering ``layers``, fused (``common.features``)."""
        return self.runner.forward(cache, ids, "all" if logits else "none", features, layers)

    def _prefill_groups(self, gens: list["Generation"], keys: list) -> list[Exception | None]:
        """``prefill_batch`` for the generations of each key apart (a group whose batch fails is
        prefilled one at a time), outcomes in ``gens``' order."""
        outcomes: list[Exception | None] = [None] * len(gens)
        for key in dict.fromkeys(keys):
            idx = [i for i, k in enumerate(keys) if k == key]
            group = [gens[i] for i in idx]
            try:
                done = self.prefill_batch(group)
            except BatchFailed:
                log.warning("prefilling them one at a time", exc_info=True)
                done = [self.prefill_batch([g])[0] for g in group]
            for i, outcome in zip(idx, done):
                outcomes[i] = outcome
        return outcomes

    @torch.inference_mode()
    def _forward_batch(self, caches: list[PoolRowCache], feeds: list[list[int]], features: list[bool],
                       trees: list[list[int] | None] | None = None,
                       layers: list[tuple[int, ...] | None] | None = None,
                       logits: bool = True) -> tuple[list[torch.Tensor] | None, list]:
        """One forward over several pool rows' feeds (``PoolBatch``; ``trees``: per feed, the
        parents of the draft tree it is, or None): each feed's logits rows [len(feed), V]
        (float32, on the model's device; None with ``logits=False``, as prefill chunks need
        none) and, where its ``features`` entry asks, its features (the final hidden states, or
        those entering its ``layers``, fused), else None. Eager even when single forwards are
        compiled (batching is off then)."""
        batch = PoolBatch(caches, [len(f) for f in feeds], trees)
        dev = self.runner.device
        ids = torch.tensor([f + [f[-1]] * (batch.M - len(f)) for f in feeds], dtype=torch.long, device=dev)
        out = self.runner.eager(input_ids=ids, cache=batch, use_cache=True, output_hidden_states=any(features),
                                attention_mask=batch.mask(self.loaded.dtype, dev), position_ids=batch.positions(dev),
                                logits_to_keep=0 if logits else 1)
        batch.commit()
        rows = None
        if logits:
            out_logits = out.logits.float()
            rows = [out_logits[b, : len(f)] for b, f in enumerate(feeds)]
        layers = layers or [None] * len(feeds)
        hidden = [fused_features([h[b, : len(f)] for h in out.hidden_states], ls) if want else None
                  for b, (f, want, ls) in enumerate(zip(feeds, features, layers))]
        return rows, hidden

    @torch.inference_mode()
    def forward_tree(self, cache, ids: list[int], parents: list[int], features: bool,
                     layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over (root, tree nodes) = ``ids`` after the cached positions, each row
        attending to the cache and its own ancestors at the position of its depth
        (``common.tree.tree_attention``): logits rows [len(ids), V] (float32, on the model's
        device) and, if asked, the hidden states. Eager, as batched forwards: compiled graphs
        take causal feeds."""
        dev = self.runner.device
        mask, pos = tree_attention(parents, cache.get_seq_length(), self.loaded.dtype, dev)
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        out = self.runner.eager(input_ids=x, cache=cache, use_cache=True, output_hidden_states=features,
                                attention_mask=mask, position_ids=pos)
        return out.logits[0].float(), fused_features(out.hidden_states, layers)[0] if features else None

    def prefill_batch(self, gens: list["Generation"]) -> list[Exception | None]:
        """The next prefill chunk of each of several generations, in one forward (their chunks
        right-padded to the longest), exactly as ``Generation.prefill`` one at a time; a chunk
        that goes wide (``ModelRunner.wide_prefill_rows``) runs in a forward of its own (the
        scheduler does not batch those). Returns,
        per generation, None or the exception that failed its own part (its features; that
        generation alone is then broken). One generation, or any not in the pool, goes through
        ``prefill``. ``BatchFailed`` when the batch fails before any generation took its chunk:
        every cache is then as it was, for the caller to prefill them one at a time."""
        if len(gens) == 1 or any(not g.batchable for g in gens):
            outcomes: list[Exception | None] = []
            for g in gens:
                try:
                    g.prefill()
                    outcomes.append(None)
                except Exception as exc:
                    outcomes.append(exc)
            return outcomes
        if len(gens) > self.max_batch:
            raise ValueError(f"a batch of {len(gens)} exceeds max_batch {self.max_batch}")
        ends = [g.next_chunk_end() for g in gens]
        wide = [g.chunk_goes_wide for g in gens]
        if any(wide):  # a wide chunk alone: its GEMMs' rounding follows its length, never its batch's
            return self._prefill_groups(gens, [i if w else -1 for i, w in enumerate(wide)])
        t0 = time.perf_counter()
        try:
            _, hidden = self._forward_batch([g.cache for g in gens],
                                            [g.tokens[g.prefilled: end] for g, end in zip(gens, ends)],
                                            [g.feats is not None for g in gens], logits=False,
                                            layers=[g.feature_layers for g in gens])
        except BaseException as exc:
            for g in gens:  # the rows' lengths moved if the forward went through and what followed failed
                crop_cache(g.cache, g.prefilled)
            if not isinstance(exc, Exception):
                raise  # an interrupt: the caches are restored, and it goes on up
            raise BatchFailed(f"a batched prefill of {len(gens)} generations failed: {exc}") from exc
        seconds = time.perf_counter() - t0  # each generation's prefill_s counts the whole shared forward
        outcomes = []
        for g, end, h in zip(gens, ends, hidden):
            try:
                g.record_prefill(end, h, seconds)
                outcomes.append(None)
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def verify_batch(self, rounds: list[tuple["Generation", "Proposal | None", bool]]) -> list:
        """Verify several generations' rounds (generation, proposal, wanted) in one forward,
        exactly as ``Generation.verify`` would one at a time. Returns, per generation, its kept
        count (or None, as ``verify``), or the exception that failed its own outcome (that
        generation alone is then broken). One generation, or any not in the pool, goes through
        ``verify``. ``BatchFailed`` when the batch fails before any generation took its outcome:
        every cache and random generator is then as it was, for the caller to verify them one at
        a time, so that the failure is pinned on one."""
        if len(rounds) == 1 or any(not g.batchable for g, _, _ in rounds):
            return [g.verify(p, w) for g, p, w in rounds]
        if len(rounds) > self.max_batch:
            raise ValueError(f"a batch of {len(rounds)} exceeds max_batch {self.max_batch}")
        t_start = time.perf_counter()
        gens = [g for g, _, _ in rounds]
        states = [None if g.params.greedy else g.gen.get_state() for g in gens]
        try:
            plans = [g.prepare_round(p, w) for g, p, w in rounds]
            feeds = [[g.tokens[-1], *plan.x] for g, plan in zip(gens, plans)]
            t_forward = time.perf_counter()
            rows, hidden = self._forward_batch([g.cache for g in gens], feeds, [g.feats is not None for g in gens],
                                               [plan.parents for plan in plans], [g.feature_layers for g in gens])
            decided = [g.decide(r, plan) for g, r, plan in zip(gens, rows, plans)]
            chains = [i for i, d in enumerate(decided) if isinstance(d, torch.Tensor)]
            if chains:  # the chains' decisions in one transfer; trees were decided on the host
                for i, d in zip(chains, torch.stack([decided[i] for i in chains]).tolist()):
                    decided[i] = d
        except BaseException as exc:
            for g, state in zip(gens, states):
                crop_cache(g.cache, len(g.tokens) - 1)
                if state is not None:
                    g.gen.set_state(state)
            if not isinstance(exc, Exception):
                raise  # an interrupt: the caches are restored, and it goes on up
            raise BatchFailed(f"a batched verification of {len(gens)} generations failed: {exc}") from exc
        forward_s = time.perf_counter() - t_forward
        outcomes: list = []
        for b, (g, plan) in enumerate(zip(gens, plans)):
            g.last_forward_s = forward_s
            try:
                outcomes.append(g.apply_outcome(plan, *decided[b], rows[b], hidden[b]))
            except Exception as exc:
                outcomes.append(exc)
        math_s = time.perf_counter() - t_start - forward_s
        for g in gens:
            g.last_math_s = math_s
        return outcomes

    def valid_proposal(self, prop: Proposal, depth: int, greedy: bool, budget: int = 0,
                       parents: list[int] | None = None) -> bool:
        """Whether a proposal can be verified: a chain of at most ``depth`` tokens, or a tree
        (``parents``, from ``_parents``) of at most ``budget`` tokens none deeper than ``depth``
        (``common.tree.check_parents``), its ids in the vocabulary; in sampling mode one q row
        per token, each a (sub-)distribution."""
        k = len(prop.tokens)
        if parents is not None:
            if k > max(budget, depth):
                return False
            try:
                check_parents(parents, k, depth)
            except (TreeError, TypeError, ValueError):
                return False
        elif k > depth:
            return False
        if any(not 0 <= t < self.loaded.logits_size for t in prop.tokens):
            return False
        if greedy or k == 0:
            return True
        if prop.q_ids is None or prop.q_probs is None:
            return False
        qi, qp = as_torch(prop.q_ids), as_torch(prop.q_probs)
        if qi.dim() != 2 or qi.shape != qp.shape or qi.shape[0] != k:
            return False
        if qi.numel() and (int(qi.min()) < 0 or int(qi.max()) >= self.loaded.logits_size):
            return False
        qp = qp.float()
        return bool(torch.isfinite(qp).all() and (qp >= 0).all() and (qp.sum(-1) <= 1.0 + 1e-3).all())

    def start(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop=(),
              features: bool = False, max_draft: int | None = None, logprobs: int | None = None,
              feature_layers: tuple[int, ...] | None = None) -> "Generation":
        """A generation, not yet prefilled: ``prefill()`` it until ``prefilling`` is false, then
        run its rounds (see Generation). A scheduler interleaves the chunks with other rounds.
        ``max_draft``: the most draft tokens a round verifies (0..``round_tokens``; None: all it may).
        ``logprobs``: record each generated token's log-probability and that many alternatives
        (0..MAX_LOGPROBS; None: record none)."""
        return Generation(self, prompt, max_tokens, params, stop, features, max_draft, logprobs, feature_layers)

    def generate(self, prompt: list[int], max_tokens: int, params: SamplingParams,
                 drafts: DraftSource | None = None, stop: list[str] | tuple[str, ...] = (),
                 max_draft: int | None = None, logprobs: int | None = None) -> GenerationResult:
        """Run one generation to the end, asking ``drafts`` for proposals each round: a local
        convenience for tests and fakes. The daemons drive generations through
        ``starsd_target.scheduler.Scheduler`` (one job or many), never through this loop."""
        g = self.start(prompt, max_tokens, params, stop, features=drafts is not None and drafts.feature_size > 0,
                       max_draft=0 if drafts is None else max_draft, logprobs=logprobs,
                       feature_layers=getattr(drafts, "feature_layers", None))
        try:
            while g.prefilling:
                g.prefill()
            while not g.done:
                depth = g.draft_depth()
                prop = None
                if drafts is not None and depth > 0:
                    budget = g.draft_budget()
                    prop = (drafts.propose(g.tokens, depth, g.features(), tree_tokens=budget) if budget
                            else drafts.propose(g.tokens, depth, g.features()))
                n = g.verify(prop, wanted=drafts is not None and depth > 0)
                if prop is not None and n is not None:
                    drafts.kept(n)
        except BaseException:
            g.release(scrub=True)
            raise
        finally:
            if drafts is not None:
                drafts.close()
        return g.result()


class _Plan(NamedTuple):
    """A round before its forward: what ``Generation.prepare_round`` decided, counted by ``apply_outcome``."""

    prop: "Proposal | None"  # the proposal to verify (None: the target alone)
    x: list[int]  # its draft tokens
    invalid: bool  # a proposal came and was unusable
    fallback: bool  # drafts were wanted and the round goes without
    parents: list[int] | None = None  # x is a tree with these parents (None: a chain)


def _parents(prop) -> list[int] | None:
    """A proposal's tree parents, or None for a chain (including a tree that is one)."""
    parents = getattr(prop, "parents", None) if prop is not None else None
    if parents is None:
        return None
    parents = [int(p) for p in parents]
    chain = len(parents) == len(prop.tokens) and all(p == i - 1 for i, p in enumerate(parents))
    return None if chain else parents


class Generation:
    """One request's state between rounds, so a scheduler can interleave many of them.

    Prefill: the prompt but its last token enters the cache in chunks of the engine's
    ``prefill_chunk``, one per ``prefill()`` call while ``prefilling``, so that a scheduler can
    verify other generations' rounds between the chunks of a long prompt.

    Round protocol: ``draft_depth()`` says how many drafts are worth asking for (0: none),
    ``features()`` gives what feature-based drafters need, ``verify(proposal)`` runs the
    target's forward over the proposal and appends the kept tokens. ``done`` turns true at
    EOS, a stop string or max_tokens; ``result()`` then gives the output.

    ``max_draft`` caps the draft tokens a round verifies (None: the engine's ``round_tokens``; 0:
    none, so no round counts as a fallback). With ``logprobs`` (a count of alternatives, 0..MAX_LOGPROBS)
    each generated token's log-probability under the target's raw logits is recorded
    (``token_logprobs()``); None records nothing and costs nothing."""

    def __init__(self, engine: TargetEngine, prompt: list[int], max_tokens: int, params: SamplingParams,
                 stop=(), features: bool = False, max_draft: int | None = None, logprobs: int | None = None,
                 feature_layers: tuple[int, ...] | None = None):
        loaded = engine.loaded
        engine.check(prompt, max_tokens, params, tuple(stop or ()), max_draft, logprobs)
        self.engine = engine
        self.max_tokens = max_tokens
        self.params = params
        self.stop = tuple(stop or ())
        self.max_draft = engine.round_tokens if max_draft is None else max_draft
        self.logprob_top = logprobs  # alternatives recorded per token; None: no log-probabilities
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.stats = GenerationStats(accepted_by_position=[0] * engine.depth, max_draft_tokens=self.max_draft,
                                     tree_tokens=self.draft_budget(initial=True))
        self.t_start = time.perf_counter()
        self.gen = make_generator(params.seed, loaded.device)  # verification draws on the model's device
        self.tokens = list(prompt)  # the prompt and ``out``
        self.out: list[int] = []
        self.detok = IncrementalText(engine.decode, self.stop)  # the text of ``out``, grown each round
        self.finish = "length"
        self.done = False
        # room for the prompt and the first PREALLOCATE_TOKENS generated (with a round's drafts);
        # a longer generation grows the cache (amortised), so max_tokens never reserves memory
        self.cache = engine.new_cache(len(prompt) + min(max_tokens, PREALLOCATE_TOKENS) + engine.round_tokens + 1)
        # a pool row goes back when the generation ends, fails or is dropped, whichever comes first
        self._release = weakref.finalize(self, self.cache.release) if isinstance(self.cache, PoolRowCache) else None
        self.feats = None
        self.feature_layers = tuple(feature_layers) if features and feature_layers is not None else None
        if features:
            width = loaded.feature_size * (len(self.feature_layers) if self.feature_layers is not None else 1)
            self.feats = FeatureBuffer(width, feature_wire_dtype(loaded.dtype))
        self.to_prefill = len(prompt) - 1  # the prompt but its last token (a round feeds that one)
        self.prefilled = 0  # of those, in the cache so far
        # whole prefill chunks kept from earlier prompts are exact only at the chunk length they
        # were computed with (not the warm-up's), and keep no features
        prefix = engine.prefix
        self._prefix = prefix if prefix.enabled and engine.prefill_chunk == prefix.chunk and not features else None
        if self._prefix is not None:  # the longest run of whole chunks an earlier prompt shares with this one
            self.prefilled = self.stats.cached_prompt_tokens = self._prefix.fill(self.cache, prompt, self.to_prefill)
        self.last_forward_s = 0.0  # the last round's model forward (logits to host included),
        self.last_math_s = 0.0  # and the rest of its verify(): what starsd_target.profile calls verify_math

    @property
    def prefilling(self) -> bool:
        """Prompt positions are still to enter the cache: no round can run yet."""
        return self.prefilled < self.to_prefill

    def next_chunk_end(self) -> int:
        """Where the next prefill chunk ends (a prompt position): at most the engine's
        ``prefill_chunk`` positions on."""
        return min(self.prefilled + self.engine.prefill_chunk, self.to_prefill)

    @property
    def chunk_goes_wide(self) -> bool:
        """Its next prefill chunk multiplies in bfloat16 (``ModelRunner.wide_prefill_rows``),
        in a forward of its own: a bfloat16 GEMM's rounding follows its row count."""
        wide = self.engine.runner.wide_prefill_rows
        return bool(wide) and self.next_chunk_end() - self.prefilled >= wide

    def prefill(self) -> None:
        """Feed the next chunk of the prompt into the cache (and its features, if collected)."""
        t0 = time.perf_counter()
        end = self.next_chunk_end()
        _, hidden = self.engine.forward(self.cache, self.tokens[self.prefilled: end], self.feats is not None,
                                        logits=False, layers=self.feature_layers)
        self.record_prefill(end, hidden, time.perf_counter() - t0)

    def record_prefill(self, end: int, hidden: torch.Tensor | None, seconds: float) -> None:
        """The prompt up to ``end`` went into the cache in a forward of ``seconds`` (its
        features, if collected, are ``hidden``)."""
        if self.feats is not None:
            self.feats.append(hidden.to("cpu", self.feats.buf.dtype))
        self.prefilled = end
        self.stats.prefill_s += seconds

    def draft_depth(self) -> int:
        """How deep this round's drafts may go (0: ask for none)."""
        return 0 if self.done else min(self.engine.depth, self.max_draft, self.max_tokens - len(self.out) - 1)

    def draft_budget(self, initial: bool = False) -> int:
        """The most draft tokens this round's tree may hold; 0 when the round asks for a chain
        (the engine's trees are off, or the request's ``max_draft`` leaves no room beyond the depth)."""
        if self.engine.tree_tokens <= self.engine.depth:
            return 0  # the engine verifies chains only
        budget = min(self.engine.tree_tokens, self.max_draft)
        if budget <= min(self.engine.depth, self.max_draft):
            return 0  # no room beyond a chain (a round near max_tokens is only shallower)
        return budget if initial or self.draft_depth() > 0 else 0

    def features(self) -> np.ndarray | None:
        return self.feats.view() if self.feats is not None else None

    def verify(self, prop: Proposal | None, wanted: bool = True) -> int | None:
        """One round: verify ``prop`` (None: the target alone). Returns how many drafts were kept,
        or None when the proposal was unusable. ``wanted`` says drafts were asked for this round,
        so a round without them counts as a fallback. Its steps (``prepare_round``, the forward,
        ``decide``, ``apply_outcome``) are what ``TargetEngine.verify_batch`` runs for several
        generations in one forward."""
        t_start = time.perf_counter()
        plan = self.prepare_round(prop, wanted)
        t_forward = time.perf_counter()
        ids = [self.tokens[-1], *plan.x]
        if plan.parents is not None:
            logits, hidden = self.engine.forward_tree(self.cache, ids, plan.parents, self.feats is not None,
                                                      self.feature_layers)
        else:
            logits, hidden = self.engine.forward(self.cache, ids, self.feats is not None, layers=self.feature_layers)
        n, nxt, valid = _host(self.decide(logits, plan))  # the one host sync of the round
        self.last_forward_s = time.perf_counter() - t_forward
        kept = self.apply_outcome(plan, n, nxt, valid, logits, hidden)
        self.last_math_s = time.perf_counter() - t_start - self.last_forward_s
        return kept

    def prepare_round(self, prop: Proposal | None, wanted: bool) -> _Plan:
        """What the round verifies. Counts nothing: ``apply_outcome`` does, once the round is done."""
        if self.prefilling:
            raise RuntimeError("a round cannot run before the prompt is prefilled")
        depth = self.draft_depth()
        parents = _parents(prop)
        invalid = prop is not None and not self.engine.valid_proposal(prop, depth, self.params.greedy,
                                                                      self.draft_budget(), parents)
        if invalid:
            prop, parents = None, None
        fallback = prop is None and wanted and depth > 0
        return _Plan(prop, list(prop.tokens) if prop is not None else [], invalid, fallback, parents)

    def decide(self, logits: torch.Tensor, plan: _Plan):
        """The round's verification on the logits' device: [kept count, next token, valid] as a
        tensor (``common.verify``'s tensor path); a greedy chain's on a CPU as that tuple, decided
        through numpy (``verify_greedy_host``). A tree's is decided on the host: (kept path,
        next token, valid), the path the kept node indices."""
        prop, x = plan.prop, plan.x
        if plan.parents is not None:
            return self._decide_tree(logits, plan)
        if self.params.greedy and logits.device.type == "cpu":
            return verify_greedy_host(logits, x)  # decided on the host already: no tensor ops
        xt = torch.tensor(x, dtype=torch.long, device=logits.device)
        if self.params.greedy:
            return verify_greedy_tensor(logits, xt)
        p = logits_to_probs(logits, self.params)
        q = p.new_zeros(0, p.shape[-1])
        if x:
            q = dense_q(as_torch(prop.q_ids), as_torch(prop.q_probs), p.shape[-1], p.device)
        return verify_sampling_tensor(p, q, xt, self.gen)

    def _decide_tree(self, logits: torch.Tensor, plan: _Plan) -> tuple[list[int], int, int]:
        x, parents = plan.x, plan.parents
        if bool(torch.isnan(logits).any()):
            return [], 0, 0
        if self.params.greedy:
            path, nxt = verify_tree_greedy(logits, x, parents)
            return path, nxt, 1
        p = logits_to_probs(logits, self.params)
        if not bool(torch.isfinite(p).all()):  # an infinite logit: no distribution to draw from
            return [], 0, 0
        q = dense_q(as_torch(plan.prop.q_ids), as_torch(plan.prop.q_probs), p.shape[-1], p.device)
        path, nxt = verify_tree_sampling(p, q, x, parents, self.gen)
        return path, nxt, 1

    def apply_outcome(self, plan: _Plan, n, nxt: int, valid: int, logits: torch.Tensor,
                      hidden: torch.Tensor | None) -> int | None:
        """Keep the round's outcome: roll the cache back to the kept tokens, append them, count.
        For a tree, ``n`` is the kept path (node indices): the cache keeps the root and the path's
        positions, moved up behind it (one index copy per layer, ``SlotCache.keep``). A round
        whose verification saw no valid distribution (``valid`` 0: NaN logits) fails the
        generation with GenerationFailed."""
        prop, x, invalid, fallback, parents = plan
        engine, stats = self.engine, self.stats
        if not valid:
            raise GenerationFailed("the target model's logits are not a distribution (NaN): the generation "
                                   "cannot go on")
        base = len(self.tokens) - 1  # cached positions before this round
        if parents is not None:
            path = n
            n = len(path)
            rows = [0] + [i + 1 for i in path]  # the rows of the root and the kept nodes
            self.cache.keep(base + 1, [base + r for r in rows[1:]])
            kept_x = [x[i] for i in path]
            stats.tree_rounds += 1
        else:
            rows = list(range(n + 1))
            crop_cache(self.cache, base + 1 + n)
            kept_x = x[:n]
        if self.feats is not None:
            self.feats.append(hidden[rows].to("cpu", self.feats.buf.dtype))
        stats.invalid_drafts += invalid
        stats.fallback_rounds += fallback
        stats.rounds += 1
        stats.drafted += len(x)
        stats.accepted += n
        for i in range(n):
            stats.accepted_by_position[i] += 1
        new = [*kept_x, nxt]
        start = len(self.out)
        for t in new:
            self.out.append(t)
            if t in engine.loaded.eos_token_ids:
                self.finish, self.done = "stop", True
                break
            if len(self.out) >= self.max_tokens:
                self.done = True
                break
        self._add_text(start)
        self._record_logprobs(logits[rows], new)  # after the text: entries past a stop string go
        return n if prop is not None else None

    @property
    def batchable(self) -> bool:
        """Its cache is a pool row: its rounds can share a forward with others'."""
        return isinstance(self.cache, PoolRowCache)

    def release(self, scrub: bool = False) -> None:
        """Free the KV cache (a pool row goes back to the pool); the generation runs no more rounds.
        ``scrub``: the generation failed, so its row may hold NaN keys: they are zeroed, since a
        batched forward reads (masked) slots past each row's length, where a NaN still spreads."""
        if self._prefix is not None and not scrub and self.cache is not None:
            # its prompt's whole chunks, for later prompts that begin alike
            self._prefix.remember(self.tokens[: self.to_prefill], self.prefilled, self.cache)
            self._prefix = None
        if self._release is not None:
            if scrub and isinstance(self.cache, PoolRowCache):
                self.cache.scrub()
            self._release()
        self.cache = None

    def _record_logprobs(self, logits_rows: torch.Tensor, new_tokens: list[int]) -> None:
        """Append the log-probabilities of ``new_tokens``, one per row of ``logits_rows`` [m, V]
        (the target's raw logits at the positions that produced them, on the model's device),
        with the ``logprob_top`` most likely tokens of each row. Computed where the rows are;
        two small transfers cross to the host. Entries past ``out`` (tokens cut at EOS,
        max_tokens or a stop string) are dropped. Nothing is done when none were asked for."""
        if self.logprobs is None or not new_tokens:
            return
        rows = torch.log_softmax(logits_rows[: len(new_tokens)].float(), dim=-1)
        ids = torch.tensor(new_tokens, dtype=torch.long, device=rows.device).unsqueeze(1)
        values = rows.gather(1, ids)
        top_ids = None
        if self.logprob_top:
            top = torch.topk(rows, min(self.logprob_top, rows.shape[-1]), dim=-1)
            values, top_ids = torch.cat([values, top.values], dim=1), top.indices.tolist()
        values = values.tolist()
        for i, t in enumerate(new_tokens):
            alts = tuple(zip(top_ids[i], values[i][1:])) if top_ids is not None else ()
            self.logprobs.append(TokenLogprob(t, values[i][0], alts))
        del self.logprobs[len(self.out):]

    def token_logprobs(self) -> list[TokenLogprob] | None:
        """One entry per token of ``out`` (None: the request asked for no log-probabilities)."""
        return None if self.logprobs is None else self.logprobs[: len(self.out)]

    def _add_text(self, start: int) -> None:
        """Take ``out[start:]`` (this round's tokens, none past an EOS) into ``tokens`` and the text;
        a stop string in the text ends the generation at the fewest tokens whose text holds it."""
        keep = self.detok.add(self.out[start:])
        if keep is not None:
            del self.out[start + keep:]
            self.finish, self.done = "stop", True
        self.tokens.extend(self.out[start:])

    def text_so_far(self) -> str:
        """The output's text as far as it is final: no incomplete character at its end, and
        nothing from a stop string on."""
        if self.detok.stop_at is not None:
            return self.text()
        return self.detok.text

    def text(self) -> str:
        """The output's text (``decode(out)``), ending before the stop string that ended it."""
        return self.detok.full()[: self.detok.stop_at]

    def result(self) -> GenerationResult:
        self.stats.generated = len(self.out)
        self.stats.wall_s = time.perf_counter() - self.t_start
        self.release()
        return GenerationResult(list(self.out), self.text(), self.finish, self.stats, self.token_logprobs())


def _host(decided) -> tuple:
    """A round's decision on the host: a chain's tensor [n, token, valid] in one transfer, or a
    tree's (path, token, valid) as it is."""
    return tuple(decided.tolist()) if isinstance(decided, torch.Tensor) else decided


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

