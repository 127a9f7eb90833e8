"""The target's scheduler: concurrent generations stay exact, interleave while drafts are in
flight (work conservation at the target), and overload and shutdown are answered cleanly."""

import time

import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import running_server
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from starsd_target.scheduler import Job, Overloaded, Scheduler, ShuttingDown
from tiny_models import make_near_copy, reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):"]


class SlowBackend(ModelBackend):
    """A real draft model that takes a while per request, like a remote daemon under load."""

    def draft_many(self, requests):
        time.sleep(0.02)
        return super().draft_many(requests)


@pytest.fixture(scope="module")
def backend(tiny_target, tmp_path_factory):
    return SlowBackend(load_causal_lm(str(make_near_copy(tiny_target, tmp_path_factory.mktemp("near"), 0.02))))


def _scheduler(engine, client, **kw):
    s = Scheduler(engine, lambda: client, draft_timeout_s=10, **kw)
    s.start()
    return s


def test_concurrent_generations_are_exact_and_interleave(loaded_target, tiny_target, backend):
    engine = TargetEngine(loaded_target, depth=4)
    with running_server(backend, batch_max=1) as (server, ctx):
        # a floor of half a second on the acknowledgement's deadline: this test is about exactness and
        # interleaving, and a suite running beside it can starve the daemon's socket thread for 50 ms
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             rtt_floor_s=0.5)
        client.handshake(10)
        sched = _scheduler(engine, client, max_active=4)
        order = []
        sched.on_round = lambda gen, n, wanted, s: order.append(id(gen))
        jobs = [Job(engine.encode(p), 40, SamplingParams()) for p in PROMPTS]
        futures = [sched.submit(j) for j in jobs]
        results = [f.result(120) for f in futures]
        sampled = [sched.submit(Job(engine.encode(PROMPTS[0]), 30, SamplingParams(0.8, 40, seed=s)))
                   for s in (1, 1, 2)]
        a, b, c = (f.result(120).token_ids for f in sampled)
        sched.stop()
        client.close()
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == reference_greedy(tiny_target, engine.encode(p), 40)
        assert r.stats.accepted > 0 and r.stats.fallback_rounds == 0
    assert a == b and a != c
    # while one generation waited for its drafts, others were verified: rounds interleave
    first_four = order[: sum(r.stats.rounds for r in results)]
    switches = sum(1 for x, y in zip(first_four, first_four[1:]) if x != y)
    assert switches > len(PROMPTS) * 2


def test_overload_and_shutdown_are_clean(loaded_target):
    engine = TargetEngine(loaded_target, depth=4)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=1, max_active=1, max_queue=2)
    # not started: jobs stay queued, so the bound is reached deterministically
    f1 = sched.submit(Job(engine.encode("a"), 5, SamplingParams()))
    f2 = sched.submit(Job(engine.encode("b"), 5, SamplingParams()))
    with pytest.raises(Overloaded):
        sched.submit(Job(engine.encode("c"), 5, SamplingParams()))
    sched.stop()
    for f in (f1, f2):
        with pytest.raises(ShuttingDown):
            f.result(5)
    with pytest.raises(ShuttingDown):
        sched.submit(Job(engine.encode("d"), 5, SamplingParams()))


def test_a_bad_job_fails_alone(loaded_target, tiny_target):
    engine = TargetEngine(loaded_target, depth=4)
    sched = _scheduler(engine, None, max_active=2)
    bad = sched.submit(Job([], 5, SamplingParams()))
    good = sched.submit(Job(engine.encode("x = 1"), 10, SamplingParams()))
    with pytest.raises(ValueError):
        bad.result(30)
    assert good.result(30).token_ids == reference_greedy(tiny_target, engine.encode("x = 1"), 10)
    sched.stop()
