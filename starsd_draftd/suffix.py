"""Drafting from text already seen: one suffix index over every target's sessions.

Agentic and chat traffic repeats itself: an edit copies the file it was given, tool calls share
a schema, later turns quote earlier answers. The draft daemon sees every target's text, so it
keeps an index of it and drafts the continuations that followed the longest earlier match of a
session's last tokens, at the cost of a few dictionary look-ups instead of a forward.

Two sources, one query:

* **the session's own text** (its prompt and verified output, and, during a draft, the drafts
  so far): scanned vectorised on each query, nothing stored beyond the tokens;
* **the shared index**: recent sessions' *outputs* from all targets, keyed by the hash of the
  KEY_SIZES tokens before each output token, with each key's MAX_OCCURRENCES most recent
  occurrences. It is bounded in bytes (``max_bytes``) and evicts whole requests, oldest first.
  It is partitioned: with ``share="key"`` each principal (a target's CURVE key) sees only what
  its own sessions produced, so one tenant's text never drafts for another (its drafts and
  their timing would leak it); ``"all"`` shares one partition; ``"off"`` keeps none.

A query finds the occurrences of the context's last tokens (at least MIN_MATCH), measures each
one's match length exactly (up to MAX_MATCH), and builds a trie of what followed them. A node's
chance of being kept is its share of the occurrences (``count / (n + 1)``, so one occurrence is
never a certainty).
A chain follows the most frequent child while its chance, raised where the session's copies were
kept more than promised (``SuffixText.ratio``), stays at or above a floor (the target's
``min_chance`` or ``min_survival``, or MIN_CHANCE); a tree takes nodes best first within a
budget. An occurrence
drafts at most SPEC_FACTOR times its match length. A draft's score, the drafts it is expected to
keep (its chances' sum scaled by ``SuffixText.ratio``, how the session's suffix drafts have fared),
is what the server weighs against the backend's measured drafts kept (``SuffixText.choose``).

Drafts chosen this way are deterministic: speculative sampling verifies them with q one-hot at
the drafted token, which keeps sampling exact. A seeded sampled session drafts from its own text
only (``SuffixText.shared`` False): the shared index changes with other sessions' timing, and a
seeded generation's tokens must follow its requests alone.
"""

from __future__ import annotations

import collections
import heapq
import secrets
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from common.tree import ROOT

KEY_SIZES = (16, 8, 4, 2, 1)  # the shared index's key lengths, longest first
MIN_MATCH = 1  # the shortest match a suffix draft comes from (at most SPEC_FACTOR tokens long)
MIN_STEP_MATCH = 2  # the shortest a draft model's step takes the index's token for (``next_token``)
MAX_MATCH = 64  # match lengths are measured up to this
MAX_OCCURRENCES = 32  # per key of the shared index, and per query from the session's own text
READ = 64  # continuation tokens read per occurrence at most
SPEC_FACTOR = 1.0  # a draft is at most this many times its match length (at least MIN_MATCH)
MIN_CHANCE = 0.1  # a node whose chance is below this is not drafted (when the target sets no threshold)
MAX_CHANCE = 0.99
COUNT_PRIOR = 1.0  # a node's chance is count / (occurrences + COUNT_PRIOR): one occurrence is no certainty
# Memory the index charges itself, measured with tracemalloc (tests/test_suffix.py checks it):
# per key inserted (a dict slot, the hash, the occurrence and its share of a list) and per token
# stored (array('i')), plus a request's fixed cost.
KEY_BYTES = 120
TOKEN_BYTES = 4
DOC_BYTES = 400
SHARES = ("key", "all", "off")
STAGE = 8  # match lengths are measured this many tokens at a time first (the longer ones further)
MAX_SCAN = 512  # a session's own text: the latest occurrences of its last token whose matches are measured
_OFFSET = 1 << 32  # an occurrence's code: serial * _OFFSET + position


@dataclass
class _Part:
    """One partition of the shared index (a principal's, or everyone's): its keys, by key length,
    and what the backend's drafts keep per round in its sessions (the prior of a session that has
    not measured them yet; per partition, so one tenant's figures never steer another's drafts)."""

    keys: dict[int, dict] = field(default_factory=lambda: {n: {} for n in KEY_SIZES})
    prior_model: float = 1.0


@dataclass
class _Doc:
    """A request's text in the shared index: its tokens, of which those from ``prompt_len`` on
    are output (indexed)."""

    serial: int
    part: _Part
    tokens: array
    prompt_len: int
    keys: int = 0
    evicted: bool = False

    @property
    def bytes(self) -> int:
        return DOC_BYTES + TOKEN_BYTES * len(self.tokens) + KEY_BYTES * self.keys


@dataclass
class SuffixText:
    """One session's text, its link to the shared index, and what its suffix drafts have done."""

    doc: _Doc | None  # its output's entry in the shared index (None: not shared)
    shared: bool  # queries read the shared index too (False: seeded sampled sessions, share off)
    buf: np.ndarray = field(default_factory=lambda: np.empty(64, dtype=np.int64))
    n: int = 0
    # suffix drafts' calibration: kept against promised (their scores), discounted
    kept: float = 2.0
    promised: float = 2.0
    model_kept: float | None = None  # the backend's drafts: kept per round, smoothed (None: none measured)
    last_source: str | None = None  # what drafted its last round: "suffix", "model" or None
    last_score: float = 0.0  # its last suffix draft's chances summed, uncalibrated (what it promised)
    last_tree: tuple[list[int], list[int]] | None = None  # its last round's tree (tokens, parents), if one

    @property
    def prior_model(self) -> float:
        """What the backend's drafts keep before this session measured them: its partition's
        figure, or a fixed one for a session that reads no shared text (its drafts must not
        depend on other sessions)."""
        return self.doc.part.prior_model if self.shared else 1.0

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    @property
    def ratio(self) -> float:
        return self.kept / self.promised

    def append(self, tokens: list[int]) -> None:
        need = self.n + len(tokens)
        if need > self.buf.shape[0]:
            grown = np.empty(max(need, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n: need] = tokens
        self.n = need

    def kept_of(self, accepted: int, new: list[int]) -> int:
        """Drafts its last round kept: ``accepted`` for a chain; for a tree (whose kept path the
        target reports as new tokens, then its own), the tree path ``new`` follows."""
        if self.last_tree is None:
            return accepted
        tokens, parents = self.last_tree
        node, kept = ROOT, 0
        for tok in new[:-1]:
            node = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == tok), None)
            if node is None:
                break
            kept += 1
        return kept

    def drafted(self, draft: "SuffixDraft") -> None:
        """Its next round is drafted from the index: ``draft``, whose uncalibrated chances are
        what ``learn`` weighs the outcome against (the calibrated score would count the ratio
        in its own measure, which then settles at the square root of the true factor)."""
        self.last_source, self.last_score = "suffix", float(sum(draft.chances))

    def learn(self, accepted: int) -> None:
        """The outcome of its last round (``accepted`` drafts kept), for what drafted it."""
        prior_model = self.prior_model
        if self.shared and self.last_source == "model":
            part = self.doc.part
            part.prior_model += 0.05 * (accepted - part.prior_model)
        if self.last_source == "suffix":
            d = 0.8
            self.kept = d * self.kept + accepted
            self.promised = d * self.promised + max(self.last_score, 0.1)
        elif self.last_source == "model":
            m = self.model_kept if self.model_kept is not None else prior_model
            self.model_kept = m + 0.3 * (accepted - m)
        self.last_source = None

    def choose(self, score: float) -> bool:
        """Whether a suffix draft scored ``score`` (drafts expected kept) beats the backend's:
        its measured drafts kept per round (``prior_model`` until measured). A suffix draft
        costs no forward, so a tie goes to it."""
        model = self.model_kept if self.model_kept is not None else self.prior_model
        return score > 0.0 and score >= model


@dataclass
class SuffixDraft:
    tokens: list[int]
    parents: list[int] | None  # None: a chain
    chances: list[float]  # each node's chance of being kept (with its ancestors), from the counts
    match: int  # the match length it was drafted from
    ratio: float = 1.0  # the session's calibration of those chances (SuffixText.ratio)

    @property
    def score(self) -> float:
        """Drafts expected kept: the chances' sum, calibrated by the session's outcomes."""
        return float(sum(self.chances)) * self.ratio


def partition(share: str, principal: bytes) -> bytes | None:
    """Whose text a session of ``principal`` shares under ``share`` (``--suffix-share``): its
    key's (``key``), everyone's (``all``: b""), or none (``off``: None)."""
    if share == "off":
        return None
    return principal if share == "key" else b""


class SuffixIndex:
    """The draft daemon's suffix index (module docstring). Changed and queried on the batcher's
    thread (changes under the server's lock); ``snapshot`` reads counters from any thread.

    Keys are hashes of a per-process random salt and the tokens, so a target cannot craft
    colliding contexts to push other text out of a key's occurrences (a collision costs only
    speed: every occurrence's tokens are checked on reading)."""

    def __init__(self, max_bytes: int = 64 << 20, share: str = "key"):
        if share not in SHARES:
            raise ValueError(f"share must be one of {', '.join(SHARES)}, not {share!r}")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.share = share
        self._parts: dict[bytes, _Part] = {}
        self._salt = secrets.randbits(62)
        self._docs: collections.OrderedDict[int, _Doc] = collections.OrderedDict()  # oldest first
        self._serial = 0
        self.bytes = 0
        self.counts = {"requests": 0, "evicted": 0, "tokens_indexed": 0, "queries": 0, "update_s": 0.0,
                       "query_s": 0.0}

    # --- sessions -------------------------------------------------------------------------
    def open(self, principal: bytes, prompt: list[int], shared: bool = True) -> SuffixText:
        """A session's text, starting from ``prompt`` (its verified tokens when first drafted).
        ``shared``: its queries read the shared index (False for seeded sampled sessions); its
        output enters the shared index unless sharing is off."""
        doc = None
        if self.share != "off" and self.max_bytes > 0:
            part = self._parts.setdefault(partition(self.share, principal), _Part())
            self._serial += 1
            doc = _Doc(self._serial, part, array("i", prompt), len(prompt))
            self._docs[doc.serial] = doc
            self.bytes += doc.bytes
            self.counts["requests"] += 1
        text = SuffixText(doc, shared and doc is not None)
        text.append(prompt)
        self._evict()
        return text

    def extend(self, text: SuffixText, tokens: list[int]) -> None:
        """Tokens the target verified for the session: its text grows, and its output enters
        the shared index."""
        if not tokens:
            return
        t0 = time.perf_counter()
        text.append(tokens)
        doc = text.doc
        if doc is not None and not doc.evicted:
            before = doc.bytes
            seq, part, base, salt = doc.tokens, doc.part.keys, doc.serial * _OFFSET, self._salt
            for tok in tokens:
                p = len(seq)  # the new token's position: the windows ending before it lead to it
                if p >= doc.prompt_len:
                    for n in KEY_SIZES:
                        if p >= n:
                            keys = part[n]
                            h = hash((salt, *seq[p - n: p]))
                            entry = keys.get(h)
                            if entry is None:
                                keys[h] = base + p
                            elif isinstance(entry, list):
                                entry.append(base + p)
                                if len(entry) > MAX_OCCURRENCES:
                                    del entry[0]
                            else:
                                keys[h] = [entry, base + p]
                            doc.keys += 1
                seq.append(tok)
            self.counts["tokens_indexed"] += len(tokens)
            self.bytes += doc.bytes - before
            self._evict()
        self.counts["update_s"] += time.perf_counter() - t0

    # --- eviction --------------------------------------------------------------------------
    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._docs:
            _, doc = self._docs.popitem(last=False)
            self._drop(doc)

    def _drop(self, doc: _Doc) -> None:
        self.bytes -= doc.bytes
        doc.evicted = True
        self.counts["evicted"] += 1
        seq, part, base = doc.tokens, doc.part.keys, doc.serial * _OFFSET
        for p in range(doc.prompt_len, len(seq)):
            code = base + p
            for n in KEY_SIZES:
                if p < n:
                    continue
                keys = part[n]
                h = hash((self._salt, *seq[p - n: p]))
                entry = keys.get(h)
                if entry == code:
                    del keys[h]
                elif isinstance(entry, list):
                    try:
                        entry.remove(code)
                    except ValueError:
                        continue  # pushed out by newer occurrences
                    if not entry:
                        del keys[h]
        doc.tokens = array("i")
        doc.keys = 0

    # --- queries ---------------------------------------------------------------------------
    def _occurrences(self, text: SuffixText | None, seq: np.ndarray, read: int = READ) -> list[tuple[int, list[int]]]:
        """(match length, what followed) for earlier occurrences of ``seq``'s last tokens: in
        ``seq`` itself (the session's text, with drafts so far) and, where the session reads
        it, in the shared index (never its own entry: its text is ``seq``)."""
        length = int(seq.shape[0])
        found: list[tuple[int, list[int]]] = []
        if length > 1:
            ps = np.flatnonzero(seq[: length - 1] == seq[length - 1])[-MAX_SCAN:] + 1  # continuations, before the end
            if ps.size:
                lens = _match_lengths(seq, ps)
                order = np.lexsort((ps, lens))[::-1][:MAX_OCCURRENCES]  # longest, then latest
                for i in order.tolist():
                    p = int(ps[i])
                    found.append((int(lens[i]), seq[p: p + read].tolist()))
        if text is not None and text.shared and text.doc is not None:
            found.extend(self._shared(text.doc, seq, read))
        return found

    def _shared(self, own: _Doc, seq: np.ndarray, read: int) -> list[tuple[int, list[int]]]:
        length = int(seq.shape[0])
        part = own.part.keys
        tail = seq[max(0, length - MAX_MATCH - 1):].tolist()  # tail[-j] is seq[length - j]
        for n in KEY_SIZES:
            if length < n:
                continue
            ctx = tail[len(tail) - n:]
            entry = part[n].get(hash((self._salt, *ctx)))
            if entry is None:
                continue
            out = []
            for code in (entry if isinstance(entry, list) else [entry])[::-1]:  # latest first
                doc = self._docs.get(code // _OFFSET)
                if doc is None or doc is own:
                    continue
                p = code % _OFFSET
                toks = doc.tokens
                if toks[p - n: p].tolist() != ctx:
                    continue  # a hash collision
                out.append((_agree_before(toks, p, tail, n), toks[p: p + read].tolist()))
            if out:
                return out
        return []

    def next_token(self, text: SuffixText | None, seq: np.ndarray) -> int | None:
        """What most often followed the longest earlier match of ``seq``'s last tokens (the
        latest on a tie); None when they never occurred. A greedy draft model's step takes it
        in place of its own pick."""
        t0 = time.perf_counter()
        try:
            found = self._occurrences(text, seq, read=1)
            if not found:
                return None
            best = max(m for m, _ in found)
            if best < MIN_STEP_MATCH:
                return None
            votes: collections.Counter = collections.Counter(c[0] for m, c in found if m == best and c)
            return votes.most_common(1)[0][0] if votes else None
        finally:
            self.counts["queries"] += 1
            self.counts["query_s"] += time.perf_counter() - t0

    def propose(self, text: SuffixText, depth: int, budget: int = 0, min_chance: float = 0.0,
                seq: np.ndarray | None = None) -> SuffixDraft | None:
        """The best draft for the session's next round: a chain of at most ``depth`` tokens,
        or, with ``budget`` > ``depth``, a tree of at most ``budget`` nodes ``depth`` deep; each
        node's chance at least ``min_chance`` (MIN_CHANCE when 0). Tried from the longest match
        and from shorter ones (more occurrences, more spread); the best score wins. None: no
        match, or nothing likely enough."""
        t0 = time.perf_counter()
        try:
            found = self._occurrences(text, text.tokens if seq is None else seq)
            if not found:
                return None
            floor = min_chance if min_chance > 0.0 else MIN_CHANCE
            lengths = sorted({m for m, _ in found}, reverse=True)
            tries = sorted({lengths[0], max(MIN_MATCH, lengths[0] // 2), lengths[-1]}, reverse=True)
            best: SuffixDraft | None = None
            for m in tries:
                # each occurrence drafts as deep as its own match allows (SPEC_FACTOR times its length)
                conts = [c[: max(MIN_MATCH, int(SPEC_FACTOR * ml))] for ml, c in found if ml >= m and c]
                draft = _draft(conts, depth, budget, floor, text.ratio, m)
                if draft is not None and (best is None or draft.score > best.score):
                    best = draft
            return best
        finally:
            self.counts["queries"] += 1
            self.counts["query_s"] += time.perf_counter() - t0

    def snapshot(self) -> dict:
        c = self.counts
        return {"share": self.share, "bytes": self.bytes, "max_bytes": self.max_bytes, "requests_held": len(self._docs),
                "sessions_indexed": c["requests"], "evicted": c["evicted"], "tokens_indexed": c["tokens_indexed"],
                "update_us_per_token": 1e6 * c["update_s"] / max(c["tokens_indexed"], 1),
                "queries": c["queries"], "query_us": 1e6 * c["query_s"] / max(c["queries"], 1),
                "partitions": len(self._parts)}


def _agree(seq: np.ndarray, ps: np.ndarray, cap: int) -> np.ndarray:
    """For each continuation position p in ``ps``: how many of the tokens before p equal the
    tokens before ``seq``'s end, counted back from both, at most ``cap``."""
    back = np.arange(cap)
    before = ps[:, None] - 1 - back  # [occurrences, cap]: the positions compared with the end's
    same = (before >= 0) & (seq[np.maximum(before, 0)] == seq[seq.shape[0] - 1 - back])
    same = np.concatenate([same, np.zeros((ps.shape[0], 1), dtype=bool)], axis=1)  # a stop at cap
    return same.argmin(axis=1)  # the first difference


def _agree_before(toks: array, p: int, tail: list[int], m: int) -> int:
    """How far the tokens before ``toks[p]`` equal the last ones of ``tail``, at most MAX_MATCH,
    given that the last ``m`` do: compared STAGE at a time (a quoted answer matches far)."""
    limit = min(MAX_MATCH, p, len(tail))
    end = len(tail)
    while m < limit:
        step = min(STAGE, limit - m)
        mine, theirs = toks[p - m - step: p - m].tolist(), tail[end - m - step: end - m]
        if mine == theirs:
            m += step
            continue
        i = step - 1
        while mine[i] == theirs[i]:
            m += 1
            i -= 1
        break
    return m


def _match_lengths(seq: np.ndarray, ps: np.ndarray) -> np.ndarray:
    """Match lengths (up to MAX_MATCH) of the occurrences whose continuations start at ``ps``, in
    two passes: STAGE tokens back for all of them, all the way for those that matched so far.
    (A copy matches long at many places; comparing one position at a time cost a copy's query
    up to 64 rounds of array operations.)"""
    cap = min(MAX_MATCH, int(seq.shape[0]))
    lens = _agree(seq, ps, min(STAGE, cap))
    if cap > STAGE:
        far = np.flatnonzero(lens == STAGE)
        if far.size:
            lens[far] = _agree(seq, ps[far], cap)
    return lens


def _draft(conts: list[list[int]], cap: int, budget: int, floor: float, ratio: float,
           match: int) -> SuffixDraft | None:
    """A chain (``budget`` <= ``cap``) or tree from continuations ``conts`` (most relevant
    first: ties go to the earlier), nodes at most ``cap`` deep."""
    total = len(conts) + COUNT_PRIOR
    root: dict[int, list] = {}  # token -> [count, children]
    for c in conts:
        level = root
        for tok in c[:cap]:
            node = level.get(tok)
            if node is None:
                node = level[tok] = [0, {}]
            node[0] += 1
            level = node[1]

    def chance(count: int) -> float:
        return min(count / total, MAX_CHANCE)

    def below(c: float) -> bool:
        """Whether a node of chance ``c`` is below the floor, raised by how the session's suffix
        drafts fared: a copy of a prompt seen once counts as a coin toss, but a session whose
        copies were all kept (an edit) keeps them going. Never lowered: the ratio learns only from
        rounds the index drafted, so a floor it kept a session under would never let it back."""
        return min(c * max(ratio, 1.0), MAX_CHANCE) < floor

    tokens: list[int] = []
    chances: list[float] = []
    if budget <= cap:  # a chain: the most frequent child at each level
        level = root
        while level and len(tokens) < cap:
            tok, node = max(level.items(), key=lambda kv: kv[1][0])
            c = chance(node[0])
            if below(c):
                break
            tokens.append(tok)
            chances.append(c)
            level = node[1]
        return SuffixDraft(tokens, None, chances, match, ratio) if tokens else None
    parents: list[int] = []
    heap: list = []
    order = 0
    for tok, node in root.items():
        heapq.heappush(heap, (-node[0], order, tok, node, ROOT, 1))
        order += 1
    while heap and len(tokens) < budget:
        negc, _, tok, node, parent, d = heapq.heappop(heap)
        c = chance(-negc)
        if below(c):
            break  # the heap gives chances in falling order
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        chances.append(c)
        if d < cap:
            for t2, n2 in node[1].items():
                heapq.heappush(heap, (-n2[0], order, t2, n2, idx, d + 1))
                order += 1
    if not tokens:
        return None
    return SuffixDraft(tokens, parents, chances, match, ratio)
