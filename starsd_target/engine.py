"""The target's generation loop: prefill, then rounds of {get drafts, one forward, verify, crop}.

The target's cache always holds every verified token but the last; a round feeds
[last verified token, x_1..x_k] in one forward, which yields the k+1 distributions p_0..p_k
that verification needs. Without drafts (k = 0) the same round is plain decoding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import torch

from common.models import LoadedModel, context_length, crop_cache
from common.runner import ModelRunner
from common.tensors import as_torch, to_wire
from common.verify import SamplingParams, dense_q, logits_to_probs, make_generator, verify_greedy, verify_sampling
from starsd_target.detokenizer import IncrementalText
from starsd_target.profile import RoundProfile

log = logging.getLogger("starsd.target.engine")

# Bounds on one request, the same on every front end (HTTP and the job socket): each stop string
# is searched in the new text of every round (and as many characters before it as it is long),
# so their number and length bound that work.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_NEW_TOKENS = 1 << 16  # for models that declare no context length (those that do are bounded by it)
# Prompt tokens per prefill forward: what one long prompt delays each round of the others by.
# Measured on 2 CPU cores with the 135M demo target beside an 8,000-token prompt: at 512 a chunk
# took 2-6 s and an 8-token request 24 s (0.7 s alone); at 128, 1.6 s and 4.8 s, for a whole
# prefill 14% longer. On a GPU any of these is milliseconds.
DEFAULT_PREFILL_CHUNK = 256
PREALLOCATE_TOKENS = 512  # generated positions a generation's KV cache holds before it first grows


class InvalidRequest(ValueError):
    """A request outside the target's bounds; ``param`` names the field at fault (for HTTP's error)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Proposal(Protocol):
    tokens: list[int]
    q_ids: np.ndarray | torch.Tensor | None  # as they arrived from the wire, or tensors
    q_probs: np.ndarray | torch.Tensor | None


class DraftSource(Protocol):
    """Where one generation's drafts come from (a remote session, or a fake in tests)."""

    feature_size: int  # >0: propose() needs the target's features

    def propose(self, tokens: list[int], depth: int, features: np.ndarray | None = None) -> Proposal | None:
        """Up to ``depth`` drafts following ``tokens`` (all verified tokens), or None.
        ``features`` holds the target's final hidden state for every token but the last, as the
        wire array that goes out (``FeatureBuffer.view``)."""

    def kept(self, n: int) -> None:
        """How many tokens of the last proposal verification kept."""

    def close(self) -> None: ...


@dataclass
class GenerationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0  # rounds that wanted drafts but verified without them
    invalid_drafts: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    accepted_by_position: list[int] = field(default_factory=list)
    profile: RoundProfile = field(default_factory=RoundProfile)  # where its rounds' time went (the scheduler's)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per target forward (kept drafts plus the target's own token)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_length"] = self.mean_accepted_length
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats


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
    def __init__(self, loaded: LoadedModel, depth: int = 5, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 runner: ModelRunner | None = None):
        """``runner``: how the model runs (compiled or eager); eager by default."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.loaded = loaded
        self.runner = runner if runner is not None else ModelRunner(loaded)
        self.depth = depth
        self.prefill_chunk = prefill_chunk
        self.context = context_length(loaded.model)  # None: the model declares none

    def warm_up(self, features: bool = False) -> float:
        """With a compiled runner, compile the kinds of forward serving runs before the daemon
        takes jobs: prefill chunks (a first one, one after cached positions, a one-token rest),
        a round with drafts and a round without; with ``features`` (a draft daemon with a
        feature-based head) both with and without hidden states. 0 s when eager."""
        tok = next(t for t in range(1, self.loaded.logits_size) if t not in self.loaded.eos_token_ids)

        def exercise():
            chunk = self.prefill_chunk
            self.prefill_chunk = 4  # 9 prompt positions to prefill: chunks of 4, 4 and 1
            try:
                for feats in ((False, True) if features else (False,)):
                    g = self.start([tok] * 10, self.depth + 3, SamplingParams(), features=feats)
                    while g.prefilling:
                        g.prefill()
                    g.verify(_WarmUpDrafts([tok] * min(self.depth, g.draft_depth())))
                    if not g.done:
                        g.verify(None, wanted=False)
            finally:
                self.prefill_chunk = chunk

        return self.runner.warm_up(exercise, "target model")

    def check(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop=()) -> None:
        """InvalidRequest unless the request fits the target's bounds: prompt ids in the
        vocabulary, prompt plus max_tokens within the model's context, top_k at most the
        vocabulary, stop strings bounded in number and length. One check for every front end."""
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

    def _forward(self, cache, ids: list[int], features: bool = False,
                 logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [len(ids), V] (float32, CPU; None with ``logits=False``, as a prefill needs none)
        and, if asked, the final hidden states [len(ids), H]."""
        rows, hidden = self.runner.forward(cache, ids, "all" if logits else "none", features)
        return (rows.cpu() if rows is not None else None), hidden

    def _valid(self, prop: Proposal, depth: int, greedy: bool) -> bool:
        k = len(prop.tokens)
        if k > depth or any(not 0 <= t < self.loaded.logits_size for t in prop.tokens):
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
              features: bool = False) -> "Generation":
        """A generation, not yet prefilled: ``prefill()`` it until ``prefilling`` is false, then
        run its rounds (see Generation). A scheduler interleaves the chunks with other rounds."""
        return Generation(self, prompt, max_tokens, params, stop, features)

    def generate(self, prompt: list[int], max_tokens: int, params: SamplingParams,
                 drafts: DraftSource | None = None, stop: list[str] | tuple[str, ...] = ()) -> GenerationResult:
        """Run one generation to the end, asking ``drafts`` for proposals each round: a local
        convenience for tests and fakes. The daemons drive generations through
        ``starsd_target.scheduler.Scheduler`` (one job or many), never through this loop."""
        g = self.start(prompt, max_tokens, params, stop, features=drafts is not None and drafts.feature_size > 0)
        try:
            while g.prefilling:
                g.prefill()
            while not g.done:
                depth = g.draft_depth()
                prop = None
                if drafts is not None and depth > 0:
                    prop = drafts.propose(g.tokens, depth, g.features())
                n = g.verify(prop, wanted=drafts is not None and depth > 0)
                if prop is not None and n is not None:
                    drafts.kept(n)
        finally:
            if drafts is not None:
                drafts.close()
        return g.result()


@dataclass
class _WarmUpDrafts:
    tokens: list[int]
    q_ids: None = None
    q_probs: None = None


class Generation:
    """One request's state between rounds, so a scheduler can interleave many of them.

    Prefill: the prompt but its last token enters the cache in chunks of the engine's
    ``prefill_chunk``, one per ``prefill()`` call while ``prefilling``, so that a scheduler can
    verify other generations' rounds between the chunks of a long prompt.

    Round protocol: ``draft_depth()`` says how many drafts are worth asking for (0: none),
    ``features()`` gives what feature-based drafters need, ``verify(proposal)`` runs the
    target's forward over the proposal and appends the kept tokens. ``done`` turns true at
    EOS, a stop string or max_tokens; ``result()`` then gives the output."""

    def __init__(self, engine: TargetEngine, prompt: list[int], max_tokens: int, params: SamplingParams,
                 stop=(), features: bool = False):
        loaded = engine.loaded
        engine.check(prompt, max_tokens, params, tuple(stop or ()))
        self.engine = engine
        self.max_tokens = max_tokens
        self.params = params
        self.stop = tuple(stop or ())
        self.stats = GenerationStats(accepted_by_position=[0] * engine.depth)
        self.t_start = time.perf_counter()
        self.gen = make_generator(params.seed)
        self.tokens = list(prompt)  # the prompt and ``out``
        self.out: list[int] = []
        self.detok = IncrementalText(engine.decode, self.stop)  # the text of ``out``, grown each round
        self.finish = "length"
        self.done = False
        # room for the prompt and the first PREALLOCATE_TOKENS generated (with a round's drafts);
        # a longer generation grows the cache (amortised), so max_tokens never reserves memory
        self.cache = engine.runner.new_cache(len(prompt) + min(max_tokens, PREALLOCATE_TOKENS) + engine.depth + 1)
        self.feats = None
        if features:
            self.feats = FeatureBuffer(loaded.feature_size, feature_wire_dtype(loaded.dtype))
        self.to_prefill = len(prompt) - 1  # the prompt but its last token (a round feeds that one)
        self.prefilled = 0  # of those, in the cache so far
        self.last_forward_s = 0.0  # the last round's model forward (logits to host included),
        self.last_math_s = 0.0  # and the rest of its verify(): what starsd_target.profile calls verify_math

    @property
    def prefilling(self) -> bool:
        """Prompt positions are still to enter the cache: no round can run yet."""
        return self.prefilled < self.to_prefill

    def prefill(self) -> None:
        """Feed the next chunk of the prompt into the cache (and its features, if collected)."""
        t0 = time.perf_counter()
        end = min(self.prefilled + self.engine.prefill_chunk, self.to_prefill)
        _, hidden = self.engine._forward(self.cache, self.tokens[self.prefilled: end], self.feats is not None,
                                         logits=False)
        if self.feats is not None:
            self.feats.append(hidden.to("cpu", self.feats.buf.dtype))
        self.prefilled = end
        self.stats.prefill_s += time.perf_counter() - t0

    def draft_depth(self) -> int:
        return 0 if self.done else min(self.engine.depth, self.max_tokens - len(self.out) - 1)

    def features(self) -> np.ndarray | None:
        return self.feats.view() if self.feats is not None else None

    def verify(self, prop: Proposal | None, wanted: bool = True) -> int | None:
        """One round: verify ``prop`` (None: the target alone). Returns how many drafts were kept,
        or None when the proposal was unusable. ``wanted`` says drafts were asked for this round,
        so a round without them counts as a fallback."""
        if self.prefilling:
            raise RuntimeError("a round cannot run before the prompt is prefilled")
        t_start = time.perf_counter()
        engine, stats = self.engine, self.stats
        depth = self.draft_depth()
        if prop is not None and not engine._valid(prop, depth, self.params.greedy):
            stats.invalid_drafts += 1
            prop = None
        if prop is None and wanted and depth > 0:
            stats.fallback_rounds += 1
        x = list(prop.tokens) if prop is not None else []
        base = len(self.tokens) - 1  # cached positions before this round
        t_forward = time.perf_counter()
        logits, hidden = engine._forward(self.cache, [self.tokens[-1], *x], self.feats is not None)
        self.last_forward_s = time.perf_counter() - t_forward
        if self.params.greedy:
            n, nxt = verify_greedy(logits, torch.tensor(x, dtype=torch.long))
        else:
            p = logits_to_probs(logits, self.params)
            q = torch.zeros(0, p.shape[-1])
            if x:
                q = dense_q(as_torch(prop.q_ids), as_torch(prop.q_probs), p.shape[-1])
            n, nxt = verify_sampling(p, q, torch.tensor(x, dtype=torch.long), self.gen)
        crop_cache(self.cache, base + 1 + n)
        if self.feats is not None:
            self.feats.append(hidden[: 1 + n].to("cpu", self.feats.buf.dtype))
        stats.rounds += 1
        stats.drafted += len(x)
        stats.accepted += n
        for i in range(n):
            stats.accepted_by_position[i] += 1
        new = [*x[:n], nxt]
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
        self.last_math_s = time.perf_counter() - t_start - self.last_forward_s
        return n if prop is not None else None

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
        self.cache = None  # free the KV cache as soon as the output is known
        return GenerationResult(list(self.out), self.text(), self.finish, self.stats)

