"""The suffix index (starsd_draftd.suffix): what it drafts from a session's own text and from other
sessions' outputs, whose outputs it may use, its bounds and its costs."""

import tracemalloc

import numpy as np
import pytest

from common.tree import ROOT, check_parents
from starsd_draftd.suffix import KEY_SIZES, MAX_MATCH, STAGE, SuffixIndex, _agree_before, _match_lengths

A, B = b"key-a", b"key-b"
# an output no session could guess: none of it is consecutive (the fake backend drafts last+1, +2...)
SECRET = [100, 57, 23, 180, 3, 99, 140, 77, 12, 250, 31, 66, 201, 8, 145, 90]


def _served(index: SuffixIndex, principal: bytes, prompt: list[int], output: list[int], step: int = 3):
    """A session that verified ``output`` after ``prompt``, a few tokens a round."""
    text = index.open(principal, prompt)
    for i in range(0, len(output), step):
        index.extend(text, output[i: i + step])
    return text


def test_a_later_session_drafts_what_an_earlier_one_produced_after_the_same_tokens():
    index = SuffixIndex()
    _served(index, A, [1, 2, 3], SECRET)
    text = index.open(A, [7, 7, *SECRET[:6]])  # quotes the start of that output
    d = index.propose(text, depth=16)
    assert d.parents is None and d.match == 6 and d.tokens == SECRET[6:12]  # capped at its match's length
    assert d.chances == [0.5] * 6 and d.score == pytest.approx(3.0)  # one occurrence: 1 / (1 + 1) each
    assert index.propose(text, depth=4).tokens == SECRET[6:10]  # and at the depth asked
    assert index.next_token(text, text.tokens) == SECRET[6]


def test_prompts_are_not_shared_only_outputs():
    index = SuffixIndex()
    _served(index, A, SECRET, [5, 5])
    assert index.propose(index.open(A, [9, *SECRET[:6]]), depth=8) is None


def test_a_session_drafts_from_its_own_prompt_and_output():
    index = SuffixIndex(share="off")
    text = index.open(A, [4, 8, 15, 16, 23, 42, 9, 4, 8, 15])
    assert index.propose(text, depth=8).tokens == [16, 23, 42]  # match of 3: three drafts
    index.extend(text, [16, 23, 42])
    assert index.propose(text, depth=8).tokens == [9, 4, 8, 15, 16, 23]  # longer match, longer draft


def test_the_most_frequent_continuation_wins_and_a_tree_holds_the_others():
    index = SuffixIndex()
    for tail in ([30, 31, 32, 33], [30, 31, 32, 33], [30, 40, 41, 42]):
        _served(index, A, [1], [11, 12, 13, 14, *tail])
    text = index.open(A, [9, 11, 12, 13, 14])
    chain = index.propose(text, depth=4)
    assert chain.tokens == [30, 31, 32, 33] and chain.chances[0] == pytest.approx(3 / 4)
    tree = index.propose(text, depth=4, budget=8)
    check_parents(tree.parents, len(tree.tokens), 4)
    assert tree.tokens[:4] == [30, 31, 32, 33] and tree.parents[:4] == [ROOT, 0, 1, 2]
    assert tree.tokens[4:] == [40, 41, 42] and tree.parents[4] == 0  # the other branch, after 30
    assert tree.score > chain.score
    # a threshold (the target's min_survival) cuts what is less likely
    assert index.propose(text, depth=4, budget=8, min_chance=0.4).tokens == [30, 31, 32, 33]


def test_the_session_calibrates_its_suffix_drafts_and_chooses_against_the_model():
    index = SuffixIndex()
    _served(index, A, [1], SECRET)
    text = index.open(A, [5, *SECRET[:8]])
    first = index.propose(text, depth=8)
    assert first.score == pytest.approx(4.0) and text.choose(first.score)  # against the prior, 1.0
    assert index.propose(text, depth=8, min_chance=0.6) is None  # text seen once: a coin toss a token
    for _ in range(12):  # all its copies kept, each round drafted at its calibrated score
        text.drafted(index.propose(text, depth=8))
        text.learn(8)
    # the ratio measures kept against the uncalibrated chances (8 against 4), not against itself
    assert text.ratio == pytest.approx(2.0, rel=0.1)
    assert index.propose(text, depth=8, min_chance=0.6).tokens == first.tokens  # clears a floor above 1/2
    text.kept = text.promised = 2.0  # back to no evidence
    text.model_kept = 5.0  # the backend's drafts keep more for this session: they go
    assert not text.choose(first.score)
    text.model_kept = None
    for _ in range(5):  # its suffix drafts keep nothing: their score falls
        text.drafted(first)
        text.learn(0)
    assert index.propose(text, depth=8).score < first.score / 3
    # but the floor never reads a chance lowered: a session the ratio kept out could never learn back
    assert index.propose(text, depth=8, min_chance=0.5).tokens == first.tokens
    text.last_source = "model"
    text.learn(3)  # the backend's rounds are measured too, and move its partition's prior
    assert text.model_kept == pytest.approx(1.0 + 0.3 * 2)
    assert index.open(A, [1]).prior_model == pytest.approx(1.1) and index.open(B, [1]).prior_model == 1.0
    assert index.open(A, [1], shared=False).prior_model == 1.0  # a seeded session's is fixed


def test_a_tree_rounds_kept_drafts_are_the_path_its_new_tokens_follow():
    index = SuffixIndex()
    text = index.open(A, [1, 2])
    assert text.kept_of(3, [9]) == 3  # a chain: what the target said it accepted
    # 30 -> 31 -> 32 and 30 -> 40: the target kept 30, 40 and added its own 7
    text.last_tree = ([30, 31, 32, 40], [ROOT, 0, 1, 0])
    assert text.kept_of(0, [30, 40, 7]) == 2
    assert text.kept_of(0, [30, 31, 32, 5]) == 3 and text.kept_of(0, [8]) == 0


def test_keys_are_partitions_unless_shared_by_all():
    for share, b_sees in (("key", False), ("all", True), ("off", False)):
        index = SuffixIndex(share=share)
        _served(index, A, [1, 2], SECRET)
        b = index.open(B, [6, *SECRET[:6]])
        d = index.propose(b, depth=8)
        assert (d is not None and d.tokens == SECRET[6:12]) is b_sees, share
        a = index.open(A, [6, *SECRET[:6]])
        assert (index.propose(a, depth=8) is not None) is (share != "off"), share


def test_unshared_sessions_read_only_their_own_text():
    index = SuffixIndex()
    _served(index, A, [1, 2], SECRET)
    seeded = index.open(A, [6, *SECRET[:6]], shared=False)  # a seeded sampled session
    assert index.propose(seeded, depth=8) is None
    index.extend(seeded, SECRET[6:9])
    later = index.open(A, [7, *SECRET[:6]])
    assert index.propose(later, depth=8).tokens == SECRET[6:12]  # its output is still shared


def test_the_index_stays_within_its_bytes_evicting_whole_requests_oldest_first():
    index = SuffixIndex(max_bytes=60_000)
    rng = np.random.default_rng(1)
    outputs = [rng.integers(300, 50_000, 100).tolist() for _ in range(6)]
    for out in outputs:
        _served(index, A, [1, 2], out, step=5)
        assert index.bytes <= index.max_bytes
    snap = index.snapshot()
    assert snap["evicted"] >= 1 and snap["requests_held"] < 6
    first, last = index.open(A, [9, *outputs[0][:8]]), index.open(A, [9, *outputs[-1][:8]])
    assert index.propose(first, depth=4) is None  # the oldest went first
    assert index.propose(last, depth=4).tokens == outputs[-1][8:12]
    for n in KEY_SIZES:  # an evicted request leaves no key behind
        for entry in index._parts[A].keys[n].values():
            codes = entry if isinstance(entry, list) else [entry]
            assert all(c // (1 << 32) in index._docs for c in codes)


def test_what_the_index_charges_itself_bounds_what_it_holds():
    """tracemalloc's count of what the shared index allocates stays within what it charges
    itself (its byte budget is honest), for varied and for repetitive text."""
    rng = np.random.default_rng(2)
    for vocab in (50_000, 300):
        index = SuffixIndex(max_bytes=1 << 30)
        outputs = [rng.integers(0, vocab, 1_000).tolist() for _ in range(10)]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            texts = [_served(index, A, out[:20], out, step=4) for out in outputs]
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        per_session = sum(t.buf.nbytes for t in texts)  # the sessions' own text, not the index's
        assert held - per_session <= index.bytes, (vocab, held, index.bytes)
        assert index.bytes / 10_000 < 700  # bytes per output token indexed


def _match_lengths_one_at_a_time(seq: np.ndarray, ps: np.ndarray) -> list[int]:
    """For each continuation position p: how far the tokens before p equal those before the end,
    compared one position at a time, at most MAX_MATCH."""
    out = []
    for p in ps.tolist():
        m = 0
        while m < MAX_MATCH and p - 1 - m >= 0 and seq[p - 1 - m] == seq[len(seq) - 1 - m]:
            m += 1
        out.append(m)
    return out


@pytest.mark.parametrize("kind", ["copy", "random", "runs", "short"])
def test_match_lengths_measured_in_two_passes_equal_one_position_at_a_time(kind):
    """A session's own text is scanned for its last token's earlier occurrences and each one's
    match measured, STAGE tokens back for all and further for those that matched that far: the
    lengths are those of comparing one position at a time, at and around STAGE and MAX_MATCH,
    for occurrences near the start, and in a copy that matches far at many places."""
    rng = np.random.default_rng(["copy", "random", "runs", "short"].index(kind))
    for _ in range(200):
        if kind == "copy":  # a text and the start of its copy: long matches everywhere it repeats
            base = rng.integers(0, 6, int(rng.integers(20, 200)))
            seq = np.concatenate([base, base, base[: int(rng.integers(1, len(base)))]])
        elif kind == "random":
            seq = rng.integers(0, 4, int(rng.integers(2, 400)))
        elif kind == "runs":  # one token repeated: every occurrence matches as far as the start allows
            seq = np.full(int(rng.integers(2, 3 * MAX_MATCH)), 7)
        else:
            seq = rng.integers(0, 2, int(rng.integers(2, STAGE + 3)))
        seq = seq.astype(np.int32)
        ps = np.flatnonzero(seq[:-1] == seq[-1]) + 1
        if not ps.size:
            continue
        assert _match_lengths(seq, ps).tolist() == _match_lengths_one_at_a_time(seq, ps)


def test_a_shared_occurrences_match_extended_a_stage_at_a_time_equals_one_position_at_a_time():
    """An occurrence in another session's output, its key's tokens matched, is measured further
    back STAGE tokens at a time: the same length as one position at a time, up to MAX_MATCH, the
    occurrence's start and the query's."""
    from array import array

    rng = np.random.default_rng(5)
    for _ in range(500):
        toks = array("i", rng.integers(0, 3, int(rng.integers(2, 3 * MAX_MATCH))).tolist())
        p = int(rng.integers(1, len(toks) + 1))
        # the query's text ends as toks[:p] does for a random length, then anything before
        agree = int(rng.integers(1, p + 1))
        tail = rng.integers(0, 3, int(rng.integers(0, 2 * MAX_MATCH))).tolist() + toks[p - agree: p].tolist()
        n = min(agree, int(rng.integers(1, 17)))
        m = 0
        while m < MAX_MATCH and p - 1 - m >= 0 and m < len(tail) and toks[p - 1 - m] == tail[-1 - m]:
            m += 1
        assert _agree_before(toks, p, tail, min(n, m)) == m


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="share"):
        SuffixIndex(share="tenants")
    with pytest.raises(ValueError, match="max_bytes"):
        SuffixIndex(max_bytes=-1)
    text = SuffixIndex(max_bytes=0).open(A, [1, 2, 3, 1, 2])  # no shared room: own text only
    assert text.doc is None and not text.shared
