"""Lookahead: the draft daemon drafts a session's next round while nothing is queued, and a
request for exactly the sequence it guessed is answered from that work without a backend call."""

import time

import pytest

from common.models import load_causal_lm
from common.protocol import Message, MsgType
from common.verify import SamplingParams
from fakes import RawPeer, running_server, speculate
from starsd_draftd.backends.base import ChainDrafter, Draft, DraftBackend, Lookahead, position_seed
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.ingress import Ingress
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine

VOCAB = 259


class ScriptedBackend(DraftBackend):
    """Drafts last+1, last+2, ... and guesses the target's next token as last+1; its lookahead
    runs one step per drafted token (plus one for the guess), each logged, so the tests can see
    what ran when."""

    name = "scripted"
    drafts_ahead = True
    vocab_size = VOCAB
    fingerprint = "fake-tok"

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.events: list[tuple] = []  # ("draft", first token after) / ("step", session) / ("queued", session)
        self.draft_calls = 0

    def new_state(self, params):
        return {"sid": None}

    @staticmethod
    def chain(last: int, depth: int) -> list[int]:
        return [(last + i + 1) % VOCAB for i in range(depth)]

    def draft(self, state, verified, depth, new_features=None):
        self.draft_calls += 1
        self.events.append(("draft", verified[-1]))
        return Draft(self.chain(verified[-1], depth))

    def lookahead(self, state, verified, draft, depth):
        sequence = verified + draft.tokens

        def steps(task):
            time.sleep(self.step_s)
            self.events.append(("step", sequence[-1]))
            yield
            task.guesses[0] = sequence + [(sequence[-1] + 1) % VOCAB]
            for _ in range(depth):
                time.sleep(self.step_s)
                self.events.append(("step", sequence[-1]))
                yield
            return [Draft(self.chain(task.guesses[0][-1], depth))]

        return Lookahead(steps, [None])


def _peer(server, ctx, sid, prompt):
    """A connection that completed the handshake, with session ``sid`` open on ``prompt``."""
    peer = RawPeer(ctx, server.endpoint)
    assert peer.hello(VOCAB).type is MsgType.WELCOME
    peer.open(sid, prompt)
    return peer


def _draft(peer, sid, seq, accepted, new, pos, depth=3):
    reply = peer.draft(sid, seq, accepted, new, pos, depth)
    assert reply is not None and reply.type is MsgType.DRAFTED, reply
    return reply.header["tokens"]


def _wait(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_hit_is_answered_without_a_backend_call_and_a_miss_drafts_as_before():
    backend = ScriptedBackend()
    with running_server(backend, max_depth=4) as (server, ctx):
        peer = _peer(server, ctx, 1, [10, 20])
        assert _draft(peer, 1, 1, 0, [], 2) == [21, 22, 23]
        _wait(lambda: server.stats.lookahead["steps"] >= 5 and not server.lookahead.pending)  # the guess, 4 drafts: done
        calls = backend.draft_calls
        # the target kept all three and added 24 (the guess): answered from the work done ahead
        got = _draft(peer, 1, 2, 3, [24], 6)
        assert got == [25, 26, 27] and backend.draft_calls == calls
        assert server.stats.lookahead["hits"] == 1
        _wait(lambda: server.stats.lookahead["steps"] >= 10)
        # kept one and added 99: not what was guessed, so drafted on arrival
        assert _draft(peer, 1, 3, 1, [99], 8) == [100, 101, 102]
        assert backend.draft_calls == calls + 1 and server.stats.lookahead["misses"] == 1
        _wait(lambda: server.snapshot()["lookahead"]["started"] == 3)  # counted once its reply went out
        peer.sock.close(0)


def test_lookahead_off_drafts_every_request():
    backend = ScriptedBackend()
    with running_server(backend, max_depth=4, lookahead=False) as (server, ctx):
        peer = _peer(server, ctx, 1, [10, 20])
        _draft(peer, 1, 1, 0, [], 2)
        assert _draft(peer, 1, 2, 3, [24], 6) == [25, 26, 27]
        assert backend.draft_calls == 2 and server.stats.lookahead["started"] == 0
        peer.sock.close(0)


def test_a_queued_request_waits_one_lookahead_step_at_most(monkeypatch):
    """Session 1's work ahead is long (each step sleeps); session 2's request, once queued, is
    served after at most one more of those steps: the loop looks at the socket between steps."""
    backend = ScriptedBackend(step_s=0.03)
    enqueue = Ingress.enqueue

    def logged(self, identity, principal, msg, cost, share, **kw):
        backend.events.append(("queued", msg.header["new"][-1] if msg.header["new"] else None))
        return enqueue(self, identity, principal, msg, cost, share, **kw)

    monkeypatch.setattr(Ingress, "enqueue", logged)
    with running_server(backend, max_depth=16) as (server, ctx):
        a, b = _peer(server, ctx, 1, [10, 20]), _peer(server, ctx, 2, [150, 160])
        _draft(a, 1, 1, 0, [], 2, depth=15)  # session 1's lookahead: 17 steps of 30 ms
        _wait(lambda: server.stats.lookahead["steps"] >= 2)
        assert _draft(b, 2, 1, 0, [170], 3) == [171, 172, 173]
        ev = backend.events
        queued = ev.index(("queued", 170))
        served = ev.index(("draft", 170))
        assert served > queued
        between = [e for e in ev[queued:served] if e[0] == "step"]
        assert len(between) <= 1, ev
        assert server.stats.lookahead["steps"] < 17  # it was still under way
        a.sock.close(0)
        b.sock.close(0)


def test_a_session_it_rarely_answers_is_drafted_ahead_less():
    backend = ScriptedBackend()
    with running_server(backend, max_depth=4) as (server, ctx):
        peer = _peer(server, ctx, 1, [10, 20])
        _draft(peer, 1, 1, 0, [], 2)
        pos = 2
        for seq in range(2, 22):  # every round: one draft kept, then a token no guess had
            pos += 2
            _draft(peer, 1, seq, 1, [200 + seq], pos)
        la = server.stats.lookahead
        _wait(lambda: la["started"] + la["skipped"] == 21)  # the last reply's bookkeeping follows its send
        assert la["misses"] >= 4 and la["hits"] == 0
        # three misses bring its score below the gate; then it skips 7 rounds and probes the 8th
        assert la["skipped"] >= 7
        assert la["started"] >= 4  # a probe: it would notice the text getting predictable
        peer.sock.close(0)


def test_closing_a_session_drops_its_work_ahead():
    backend = ScriptedBackend(step_s=0.02)
    with running_server(backend, max_depth=8) as (server, ctx):
        peer = _peer(server, ctx, 1, [10, 20])
        _draft(peer, 1, 1, 0, [], 2, depth=7)
        _wait(lambda: server.stats.lookahead["steps"] >= 1)
        peer.send(Message(MsgType.CLOSE, {"session": 1}))
        _wait(lambda: server.stats.lookahead["dropped"] == 1)
        assert not server.lookahead.pending and server.stats.lookahead["hits"] == 0
        peer.sock.close(0)


def test_position_seeds_make_a_draw_depend_on_its_position_only():
    params = SamplingParams(temperature=1.0, seed=3)
    logits = __import__("torch").randn(50)
    import torch

    def draws(start, n, burn=0):
        g = torch.Generator().manual_seed(123)
        for _ in range(burn):  # whatever the generator drew before
            torch.rand(5, generator=g)
        c = ChainDrafter(params, g, 50, seed=99, start=start)
        return [c.pick(logits) for _ in range(n)]

    assert draws(10, 4) == draws(10, 4, burn=7)  # the stream's state does not matter
    assert draws(10, 4)[1:] == draws(11, 3)  # token j of a chain from 10 is token j-1 of one from 11
    assert position_seed(1, 2) != position_seed(2, 1) and position_seed(5, 0) != position_seed(5, 1)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)],
                         ids=["greedy", "seeded"])
def test_outputs_are_the_same_with_lookahead_on_and_off(params, tiny_target, near_draft, loaded_target):
    """Greedy equals the target alone, and is answered from work ahead; a seeded sampled
    session is not drafted ahead (a batched forward's q rounds apart from a single one's, which
    could move a draw at a boundary), so its tokens are those of lookahead off."""
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode("def parse(line):\n    ")
    outs, stats = [], []
    for lookahead in (False, True):
        backend = ModelBackend(load_causal_lm(str(near_draft)))
        with running_server(backend, lookahead=lookahead) as (server, ctx):
            client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
            client.handshake(10)
            # a pause after each round stands for a target slower than its drafter: the work ahead
            # is done when the next request comes (in-process, the two share one interpreter)
            r = speculate(engine, client, prompt, 40, params, 30, on_round=lambda *_: time.sleep(0.03))
            client.close()
            stats.append(dict(server.stats.lookahead))
        assert r.stats.fallback_rounds == 0 and r.stats.accepted > 0
        outs.append(r.token_ids)
    assert outs[0] == outs[1]
    if params.greedy:
        assert outs[0] == engine.generate(prompt, 40, params).token_ids
    assert stats[0]["started"] == 0
    on = stats[1]
    if params.greedy:
        assert on["started"] > 0 and on["hits"] + on["late_hits"] > 0, on  # requests answered from work ahead
    else:
        assert on["started"] == 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_model_lookahead_drafts_each_guess_as_a_request_would(params, near_draft):
    """Every guess (the drafts all kept plus the draft's next token; kept up to a position plus
    its alternative there) is drafted ahead exactly as a request for it would be drafted, and
    taking one leaves the session as if it had been: its next drafts are a fresh session's."""
    ahead, fresh = (ModelBackend(load_causal_lm(str(near_draft))) for _ in range(2))
    st, ref = ahead.new_state(params), fresh.new_state(params)
    verified = [1, 5, 9, 30, 2, 77, 8]
    sent = ahead.draft(st, verified, 4)
    assert len(sent.alternatives) == 4 and all(a is not None and a != t for a, t in zip(sent.alternatives, sent.tokens))
    task = ahead.lookahead(st, verified, sent, 4)
    assert task.guesses[-1] is None  # the all-kept guess needs the first forward
    steps = 0
    while not task.step():
        steps += 1
    assert steps == 5  # the first forward and one per token drafted after it (depth + 1 in all)
    guesses = task.guesses
    assert guesses[-1][:-1] == verified + sent.tokens
    rows = ahead.MAX_ALTERNATIVE_ROWS  # rejections guessed at the first positions only
    assert len(guesses) == rows + 1 == ahead.lookahead_rows(sent)
    assert [g[len(verified):] for g in guesses[:-1]] == [sent.tokens[:j] + [sent.alternatives[j]] for j in range(rows)]
    for g, d in zip(guesses, task.result):
        assert d.tokens == fresh.draft(ref, g, len(d.tokens)).tokens
    pick = 2
    got = task.take(pick)
    assert task.match(guesses[pick]) == pick and task.match(verified) is None
    nxt = guesses[pick] + got.tokens[:2] + [3]
    assert ahead.draft(st, nxt, 4).tokens == fresh.draft(ref, nxt, 4).tokens


class _Task:
    """What ``finishing_pays`` reads of a Lookahead: steps run, their seconds, steps left."""

    def __init__(self, steps: int, seconds: float, left: int | None):
        self.steps, self.seconds, self.steps_left = steps, seconds, left


def test_a_late_hit_is_finished_when_its_steps_left_cost_less_than_drafting_afresh():
    from starsd_draftd.lookahead import LookaheadServing
    from starsd_draftd.stats import Stats

    la = LookaheadServing(ScriptedBackend(), None, Stats())
    # nothing measured yet: at most half the depth left
    assert la.finishing_pays(_Task(3, 0.3, 2), depth=4) and not la.finishing_pays(_Task(2, 0.2, 3), depth=4)
    assert la.finishing_pays(_Task(0, 0.0, None), depth=4)  # a backend that gives no length: finished
    la.note_fresh(0.4, 4)  # a fresh draft of four tokens: 0.1 s a forward
    assert la.fresh_step_s == pytest.approx(0.1)
    # a real-size draft, whose batched step costs about one row's: three steps left of five beat
    # four fresh forwards (the rule of thumb would have drafted afresh)
    assert la.finishing_pays(_Task(2, 0.22, 3), depth=4)
    # a small model, whose steps over four rows cost 2.5 fresh ones: two left cost more than four fresh
    assert not la.finishing_pays(_Task(3, 0.75, 2), depth=4) and la.finishing_pays(_Task(4, 1.0, 1), depth=4)
    la.note_fresh(0.2, 4)  # measures are smoothed, not replaced
    assert 0.05 < la.fresh_step_s < 0.1
    la.note_fresh(0.0, 4)
    la.note_fresh(0.3, 0)  # nothing to learn from an empty or unmeasured draft
    assert 0.05 < la.fresh_step_s < 0.1
