"""``--draft-max-active``: with more generations active on a target than the limit, their rounds
run on the target alone, batched; drafting resumes as they finish. Outputs stay the target's own,
and a seeded sampled generation drafts every round (its tokens must not depend on the load)."""

import numpy as np
import pytest

from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.base import Draft, DraftBackend
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from starsd_target.scheduler import Job, Scheduler

PROMPTS = ["def parse(line):\n    ", "class Point:\n", "import os\n"]


class TruthBackend(DraftBackend):
    """Drafts the continuation of whichever known sequence the verified prefix starts (always
    right for the target's greedy output), else zeros."""

    name = "truth"

    def __init__(self, vocab: int, fingerprint: str, fulls: list[list[int]]):
        self.vocab_size, self.fingerprint, self.fulls = vocab, fingerprint, fulls

    def new_state(self, params):
        return params

    def draft(self, state, verified, depth, new_features=None):
        verified = list(verified)
        tokens = [0] * depth
        for full in self.fulls:
            if full[: len(verified)] == verified and len(full) > len(verified):
                tail = full[len(verified): len(verified) + depth]
                tokens = tail + [0] * (depth - len(tail))
                break
        if state.greedy:
            return Draft(tokens)
        # sampling: each token drawn from a point mass on itself
        return Draft(tokens, np.array(tokens, dtype=np.int32)[:, None], np.ones((depth, 1), dtype=np.float32))


def _run(engine, loaded, jobs: list[Job], limit: int, fulls: list[list[int]], adaptive_depth: bool = True):
    """The jobs queued before the scheduler's thread starts (so all are active from its first
    pass), served through a draft daemon; their results and the scheduler."""
    backend = TruthBackend(loaded.vocab_size, loaded.fingerprint, fulls)
    with running_server(backend, max_depth=4) as (server, ctx):
        client = DraftClient(server.endpoint, loaded.vocab_size, loaded.fingerprint, ctx=ctx)
        client.handshake(10)
        sched = Scheduler(engine, lambda: client, 30.0, max_active=4, draft_max_active=limit,
                          adaptive_depth=adaptive_depth)
        futures = [sched.submit(j) for j in jobs]
        sched.start()
        try:
            results = [f.result(timeout=120) for f in futures]
        finally:
            sched.stop()
            client.close()
    return results, sched


@pytest.fixture(scope="module")
def greedy_case(loaded_target):
    engine = TargetEngine(loaded_target, depth=4, max_batch=4)  # as the daemon's default --max-batch
    prompts = [engine.encode(p) for p in PROMPTS]
    lengths = [6, 40, 40]  # the first ends early: the two left are within a limit of 2
    refs = [engine.generate(p, n, SamplingParams()).token_ids for p, n in zip(prompts, lengths)]
    return engine, prompts, lengths, refs


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive-depth", "fixed-depth"])
def test_a_crowded_target_runs_rounds_alone_then_drafts_again_as_generations_finish(loaded_target, greedy_case,
                                                                                    adaptive, monkeypatch):
    import starsd_target.scheduler
    from starsd_target.depth import AdaptiveDepth

    alone = []  # plain rounds taken as the target alone's rate: none of these, batched as they are

    class Recording(AdaptiveDepth):
        def observe_plain(self, times):
            alone.append(times)
            super().observe_plain(times)

    monkeypatch.setattr(starsd_target.scheduler, "AdaptiveDepth", Recording)
    engine, prompts, lengths, refs = greedy_case
    jobs = [Job(list(p), n, SamplingParams()) for p, n in zip(prompts, lengths)]
    results, sched = _run(engine, loaded_target, jobs, 2, [p + r for p, r in zip(prompts, refs)], adaptive)
    assert alone == []
    for res, ref in zip(results, refs):
        assert res.token_ids == ref
        assert res.stats.fallback_rounds == 0
    short, *long_ = (r.stats for r in results)
    # three active: no drafts at all while the short one lives (its last round, one token left, asks for none)
    assert short.drafted == 0 and short.plain_rounds >= short.rounds - 1 > 0
    for s in long_:
        assert s.plain_rounds > 0  # crowded at first...
        assert s.drafted > 0 and s.accepted > 0  # ...drafting once the short one finished
        assert s.rounds - s.plain_rounds < s.generated  # the drafted rounds kept more than one token each
    assert sched.crowded_rounds == sum(r.stats.plain_rounds for r in results)
    assert sched.load()["crowded_rounds"] == sched.crowded_rounds and sched.load()["draft_max_active"] == 2


def test_no_limit_drafts_every_round(loaded_target, greedy_case):
    engine, prompts, lengths, refs = greedy_case
    jobs = [Job(list(p), n, SamplingParams()) for p, n in zip(prompts, lengths)]
    results, sched = _run(engine, loaded_target, jobs, 0, [p + r for p, r in zip(prompts, refs)])
    for res, ref in zip(results, refs):
        assert res.token_ids == ref
        assert res.stats.plain_rounds == 0 and res.stats.drafted > 0 and res.stats.fallback_rounds == 0
    assert sched.crowded_rounds == 0


def test_a_target_that_verifies_one_generation_per_forward_keeps_drafting(loaded_target, greedy_case):
    """Rounds without drafts gain only by sharing a forward: with batching off (max_batch 1)
    crowding changes nothing."""
    _, prompts, lengths, refs = greedy_case
    engine = TargetEngine(loaded_target, depth=4, max_batch=1)
    jobs = [Job(list(p), n, SamplingParams()) for p, n in zip(prompts, lengths)]
    results, sched = _run(engine, loaded_target, jobs, 1, [p + r for p, r in zip(prompts, refs)])
    for res, ref in zip(results, refs):
        assert res.token_ids == ref
        assert res.stats.plain_rounds == 0 and res.stats.drafted > 0
    assert sched.crowded_rounds == 0


def test_a_seeded_sampled_generation_drafts_while_crowded_and_keeps_its_tokens(loaded_target, greedy_case):
    """Beside a greedy generation that goes without drafts (limit 1, two active), a seeded
    sampled one asks for drafts every round and gives the tokens it gives alone."""
    engine, prompts, lengths, refs = greedy_case
    seeded = SamplingParams(temperature=0.9, seed=1234)
    fulls = [p + r for p, r in zip(prompts, refs)]
    backend = TruthBackend(loaded_target.vocab_size, loaded_target.fingerprint, fulls)
    with running_server(backend, max_depth=4) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        alone = speculate(engine, client, prompts[1], 30, seeded)
        client.close()
    jobs = [Job(list(prompts[0]), 30, SamplingParams()), Job(list(prompts[1]), 30, seeded)]
    (greedy, sampled), sched = _run(engine, loaded_target, jobs, 1, fulls)
    assert greedy.token_ids == engine.generate(prompts[0], 30, SamplingParams()).token_ids
    assert greedy.stats.plain_rounds > 0 and sched.crowded_rounds == greedy.stats.plain_rounds
    assert sampled.stats.plain_rounds == 0 and sampled.stats.drafted > 0
    assert sampled.token_ids == alone.token_ids


@pytest.mark.slow
def test_the_target_daemon_takes_draft_max_active(star, tiny_target, tiny_draft, loaded_target):
    """As a user runs it: ``--draft-max-active 1`` and two jobs at once on one target daemon.
    Outputs are the target's own; rounds while both were active ran without drafts (plain
    rounds, none a fallback), and STATS count them as crowded rounds. The target is stopped
    (SIGSTOP) while both requests go out, so that both are queued when it goes on."""
    import os
    import signal
    import threading
    import time
    import urllib.request

    from common.control import ControlClient
    from common.protocol import Message, MsgType
    from common.sockets import free_tcp_port
    from fakes import run_concurrently
    from tiny_models import reference_greedy

    draft_ep, metrics = star.draftd(tiny_draft, ready=False), free_tcp_port()
    (target_ep,) = star.targets(tiny_target, draft_ep, 1, "--draft-max-active", "1", "--metrics-port", str(metrics),
                                "--connect-timeout", "120")
    engine = TargetEngine(loaded_target)
    prompts = [engine.encode(p) for p in PROMPTS[:2]]
    results = []
    pid = star.procs["t0"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        sender = threading.Thread(target=lambda: results.extend(run_concurrently(
            [target_ep, target_ep], [{"id": i + 1, "prompt_ids": p, "max_tokens": 96} for i, p in enumerate(prompts)])))
        sender.start()
        time.sleep(0.5)  # both clients connected and their requests queued on their side
    finally:
        os.kill(pid, signal.SIGCONT)
    sender.join(300)
    assert len(results) == 2
    plain = 0
    for p, res in zip(prompts, results):
        assert res["token_ids"] == reference_greedy(tiny_target, p, 96)
        assert res["stats"]["fallback_rounds"] == 0
        plain += res["stats"]["plain_rounds"]
    with ControlClient(target_ep) as cc:
        stats = cc.call(Message(MsgType.STATS, {}), timeout_s=30).header["stats"]
    assert stats["draft_max_active"] == 1
    assert stats["crowded_rounds"] == plain > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert f"starsd_target_crowded_rounds_total {float(plain)}" in text
    assert f"starsd_target_plain_rounds_total {float(plain)}" in text
    # alone again, it drafts
    (res,) = run_concurrently([target_ep], [{"id": 9, "prompt_ids": prompts[0], "max_tokens": 32}])
    assert res["stats"]["plain_rounds"] == 0 and res["stats"]["drafted"] > 0, res["stats"]


def test_the_link_keeps_its_heartbeat_while_crowded_rounds_run_without_drafts():
    """Nothing goes to the draft daemon while every round is crowded, and it drops a silent
    peer: the scheduler sends the heartbeat it sends when idle."""
    from types import SimpleNamespace

    class Link:
        beats = 0

        def heartbeat(self):
            self.beats += 1

    link = Link()
    sched = Scheduler(None, lambda: link, draft_timeout_s=1, heartbeat_s=0.0, draft_max_active=1)
    rounds = [SimpleNamespace(plain=False, seq=None), SimpleNamespace(plain=False, seq=7)]
    sched.active = rounds
    sched._keep_link()
    assert link.beats == 0  # a request in flight keeps the link alive
    for a in rounds:
        a.plain, a.seq = True, None
    sched._keep_link()
    sched._keep_link()
    assert link.beats == 2


def test_auto_is_one_on_a_cpu_and_none_with_batching_off(loaded_target):
    """``auto`` resolves per device; an explicit count is kept; a target verifying one
    generation per forward reports 0 (the limit would never apply)."""
    from starsd_target.daemon import CPU_DRAFT_MAX_ACTIVE, TargetConfig, TargetDaemon

    def effective(**kw):
        return TargetDaemon(TargetConfig(draft=None, **kw), loaded=loaded_target).draft_max_active

    assert CPU_DRAFT_MAX_ACTIVE == 1
    assert effective() == 1
    assert effective(draft_max_active=3) == 3 and effective(draft_max_active=0) == 0
    assert effective(max_batch=1) == 0


@pytest.mark.parametrize("text,value", [("auto", None), (" AUTO ", None), ("0", 0), ("3", 3)])
def test_draft_max_active_takes_auto_or_a_count(text, value):
    from starsd_target.cli import _AutoOrCount

    assert _AutoOrCount().convert(text, None, None) == value


@pytest.mark.parametrize("text", ["-1", "2.0", "x", "\u00b2", ""])
def test_draft_max_active_refuses_anything_else(text):
    import click

    from starsd_target.cli import _AutoOrCount

    with pytest.raises(click.BadParameter, match="auto or a whole number"):
        _AutoOrCount().convert(text, None, None)
