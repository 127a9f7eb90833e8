"""Batched verification: several generations' rounds in one target forward (rows of one slot
pool, ragged feeds) give exactly the outputs of one at a time, greedy and seeded sampling, with
drafts accepted; a failed batch leaves every cache as it was."""

import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import LocalDrafts, running_server
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from starsd_target.scheduler import Job, Scheduler
from tiny_models import reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\nimport re\n", "class Point:\n", "for i in range(10):"]
PARAMS = [SamplingParams(), SamplingParams(), SamplingParams(0.8, 40, seed=3), SamplingParams(1.0, 0, 0.9, seed=4)]


@pytest.fixture(scope="module")
def backend(near_draft):
    return ModelBackend(load_causal_lm(str(near_draft)))


def _lockstep(engine, backend, prompts, params, max_tokens, skip_every=0):
    """Drive the generations round by round, all verified in one ``verify_batch`` per step; with
    ``skip_every``, some rounds go without drafts (a ragged batch of feeds of length 1 and more)."""
    gens = [engine.start(engine.encode(p), max_tokens, sp) for p, sp in zip(prompts, params)]
    drafts = [LocalDrafts(backend, sp) for sp in params]
    for g in gens:
        while g.prefilling:
            g.prefill()
    step = batches = 0
    while not all(g.done for g in gens):
        live = [(g, d) for g, d in zip(gens, drafts) if not g.done]
        rounds = []
        for i, (g, d) in enumerate(live):
            skip = skip_every and (step + i) % skip_every == 0
            rounds.append((g, None if skip else d.propose(g.tokens, g.draft_depth()), True))  # skipped: drafts lost
        outcomes = engine.verify_batch(rounds)
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        batches += len(rounds) > 1
        step += 1
    return [g.result() for g in gens], batches


def _one_at_a_time(engine, backend, prompts, params, max_tokens):
    return [engine.generate(engine.encode(p), max_tokens, sp, drafts=LocalDrafts(backend, sp))
            for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("skip_every", [0, 3])
def test_a_batch_of_four_equals_one_at_a_time(loaded_target, tiny_target, backend, skip_every):
    batched = TargetEngine(loaded_target, depth=4, max_batch=4)
    assert batched.max_batch == 4 and batched.batch_off is None
    alone = TargetEngine(loaded_target, depth=4)
    got, batches = _lockstep(batched, backend, PROMPTS, PARAMS, 40, skip_every)
    want, alone_batches = _lockstep(alone, backend, PROMPTS, PARAMS, 40, skip_every)  # the same rounds, one per forward
    assert batches >= 5 and alone.pool is None
    for g, w, p, sp in zip(got, want, PROMPTS, PARAMS):
        assert g.token_ids == w.token_ids
        assert (g.stats.rounds, g.stats.accepted, g.stats.fallback_rounds) == \
            (w.stats.rounds, w.stats.accepted, w.stats.fallback_rounds)
        assert g.stats.accepted > 0
        if sp.greedy:
            assert g.token_ids == reference_greedy(tiny_target, batched.encode(p), 40)
        # rounds without drafts were verified in the batches beside rounds with them, or none were
        assert (g.stats.fallback_rounds > 0) == bool(skip_every)
    if not skip_every:  # and the engine's own one-generation loop agrees
        assert [r.token_ids for r in _one_at_a_time(alone, backend, PROMPTS, PARAMS, 40)] == [g.token_ids for g in got]
    assert not batched.pool.live and len(batched.pool.free) == 4  # every row back in the pool


@pytest.mark.parametrize("where", ["in the forward", "after the forward"])
def test_a_failed_batch_leaves_caches_and_generators_as_they_were(loaded_target, backend, monkeypatch, where):
    """A batch that fails in its forward (part way through the layers) or after it (in
    verification) changes no cache and no random generator: verified one at a time afterwards,
    greedy and seeded sampling give exactly what they would have."""
    import torch

    from starsd_target.engine import BatchFailed

    params = [SamplingParams(), SamplingParams(0.9, 0, 1.0, seed=11)]
    engine = TargetEngine(loaded_target, depth=4, max_batch=2)
    gens = [engine.start(engine.encode(p), 20, sp) for p, sp in zip(PROMPTS[:2], params)]
    drafts = [LocalDrafts(backend, sp) for sp in params]
    for g in gens:
        while g.prefilling:
            g.prefill()
    lengths = [g.cache.get_seq_length() for g in gens]
    states = [g.gen.get_state() for g in gens]
    props = [d.propose(g.tokens, 4) for g, d in zip(gens, drafts)]
    if where == "in the forward":
        def boom(*args, **kwargs):
            raise RuntimeError("the device fell over")

        hook = engine.model.model.layers[1].register_forward_pre_hook(boom)
    else:
        real = engine._forward_batch

        def half(caches, feeds, features, trees=None, layers=None):  # the forward runs, then verification fails
            real(caches, feeds, features, trees, layers)
            raise RuntimeError("the device fell over")

        monkeypatch.setattr(engine, "_forward_batch", half)
    with pytest.raises(BatchFailed, match="fell over"):
        engine.verify_batch([(g, p, True) for g, p in zip(gens, props)])
    if where == "in the forward":
        hook.remove()
    monkeypatch.undo()
    assert [[layer.n for layer in g.cache.layers] for g in gens] == [[n] * len(g.cache.layers)
                                                                      for g, n in zip(gens, lengths)]
    assert all(torch.equal(g.gen.get_state(), st) for g, st in zip(gens, states))
    assert all(g.stats.rounds == 0 and g.stats.fallback_rounds == 0 for g in gens)
    # one at a time from where they were, to the end: exactly the outputs of an untroubled run
    first = True
    while not all(g.done for g in gens):
        for g, d, p in zip(gens, drafts, props):
            if not g.done:
                n = g.verify(p if first else d.propose(g.tokens, g.draft_depth()))
                if n is not None:
                    d.kept(n)
        first = False
    alone = TargetEngine(loaded_target, depth=4)
    want = [alone.generate(alone.encode(p), 20, sp, drafts=LocalDrafts(backend, sp)) for p, sp in
            zip(PROMPTS[:2], params)]
    assert [g.result().token_ids for g in gens] == [w.token_ids for w in want]


@pytest.mark.parametrize("features", [False, True])
def test_batched_prefill_equals_one_at_a_time(loaded_target, backend, features):
    """Prompts of different lengths prefilled together, chunk by chunk (some finish before others,
    a ragged batch each time): every cache holds what prefilling it alone gives, the features
    collected are the same (float tolerance), and the generations then run as they would have."""
    import torch

    prompts = [PROMPTS[1] * 2, PROMPTS[0], PROMPTS[2] * 3]
    caught = {}
    for max_batch in (3, 1):
        engine = TargetEngine(loaded_target, depth=4, max_batch=max_batch, prefill_chunk=6)
        gens = [engine.start(engine.encode(p), 16, SamplingParams(), features=features) for p in prompts]
        forwards = 0
        while any(g.prefilling for g in gens):
            engine.prefill_batch([g for g in gens if g.prefilling])
            forwards += 1
        assert all(g.prefilled == g.to_prefill == len(g.tokens) - 1 for g in gens)
        assert [[layer.n for layer in g.cache.layers] for g in gens] == [[g.prefilled] * len(g.cache.layers)
                                                                          for g in gens]
        keys = [[layer.keys.clone() for layer in g.cache.layers] for g in gens]
        feats = [torch.from_numpy(g.features().astype("float32")) for g in gens] if features else None
        drafts = [LocalDrafts(backend) for _ in gens]
        while not all(g.done for g in gens):
            engine.verify_batch([(g, d.propose(g.tokens, g.draft_depth()), True)
                                 for g, d in zip(gens, drafts) if not g.done])
        caught[max_batch] = (forwards, keys, feats, [g.result() for g in gens])
    longest = max(len(TargetEngine(loaded_target).encode(p)) - 1 for p in prompts)
    assert caught[3][0] == -(-longest // 6)  # one forward per chunk of the longest prompt
    for a, b in zip(caught[3][1], caught[1][1]):
        for ka, kb in zip(a, b):
            torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
    if features:
        for a, b in zip(caught[3][2], caught[1][2]):
            assert a.shape == b.shape and a.shape[0] > 6
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    for a, b in zip(caught[3][3], caught[1][3]):
        assert a.token_ids == b.token_ids and a.stats.accepted > 0


def test_a_failed_batched_prefill_leaves_every_generation_as_it_was(loaded_target):
    from starsd_target.engine import BatchFailed

    engine = TargetEngine(loaded_target, depth=4, max_batch=2, prefill_chunk=4)
    gens = [engine.start(engine.encode(p), 8, SamplingParams()) for p in PROMPTS[:2]]
    engine.prefill_batch(gens)
    before = [(g.prefilled, g.stats.prefill_s, [layer.n for layer in g.cache.layers]) for g in gens]
    assert all(p == 4 for p, _, _ in before)

    def boom(*args, **kwargs):
        raise RuntimeError("the device fell over")

    hook = engine.model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(BatchFailed, match="fell over"):
            engine.prefill_batch(gens)
    finally:
        hook.remove()
    assert [(g.prefilled, g.stats.prefill_s, [layer.n for layer in g.cache.layers]) for g in gens] == before
    engine.prefill_batch(gens)  # and it goes on from there
    assert [g.prefilled for g in gens] == [min(8, g.to_prefill) for g in gens]


def test_one_generation_failing_in_a_batch_fails_alone(loaded_target, backend, monkeypatch):
    engine = TargetEngine(loaded_target, depth=4, max_batch=2)
    gens = [engine.start(engine.encode(p), 20, SamplingParams()) for p in PROMPTS[:2]]
    for g in gens:
        while g.prefilling:
            g.prefill()

    def broken(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode")

    monkeypatch.setattr(gens[0], "apply_outcome", broken)
    outcomes = engine.verify_batch([(g, LocalDrafts(backend).propose(g.tokens, 4), True) for g in gens])
    assert isinstance(outcomes[0], UnicodeDecodeError)
    assert isinstance(outcomes[1], int) and gens[1].stats.rounds == 1 and len(gens[1].out) == outcomes[1] + 1


def test_engines_refuse_batching_they_cannot_do(tmp_path):
    from tiny_models import make_tiny_checkpoint

    gpt2 = load_causal_lm(str(make_tiny_checkpoint(tmp_path / "g", "gpt2", seed=1)))
    engine = TargetEngine(gpt2, depth=2, max_batch=4)
    assert engine.max_batch == 1 and "gpt2" in engine.batch_off and engine.pool is None
    with pytest.raises(ValueError, match="max_batch"):
        TargetEngine(gpt2, max_batch=0)


def test_the_scheduler_batches_concurrent_generations_exactly(loaded_target, backend):
    """Four concurrent jobs through the scheduler with a draft server: their rounds share
    forwards (batched_rounds > 0) and each output equals the same job run alone."""
    outs = {}
    for max_batch in (4, 1):
        # four prompts' padded chunks within one chunk's positions: a GPU's default chunk
        engine = TargetEngine(loaded_target, depth=4, max_batch=max_batch, rows=4, prefill_chunk=256)
        with running_server(backend, batch_max=4) as (server, ctx):
            client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
            client.handshake(10)
            sched = Scheduler(engine, lambda: client, draft_timeout_s=10, max_active=4)
            # queued before the loop starts: its first pass admits all four, and prefills them together
            futures = [sched.submit(Job(engine.encode(p), 40, sp)) for p, sp in zip(PROMPTS, PARAMS)]
            sched.start()
            outs[max_batch] = [f.result(120) for f in futures]
            load = sched.load()
            sched.stop()
            client.close()
        if max_batch == 4:
            assert load["batched_rounds"] > 0 and load["verify_forwards"] < sum(r.stats.rounds for r in outs[4])
            assert load["prefill_forwards"] == 1 and load["batched_prefills"] == 4
        else:
            assert load["batched_rounds"] == 0 and load["batched_prefills"] == 0
            assert load["prefill_forwards"] == 4
    for a, b in zip(outs[4], outs[1]):
        assert a.token_ids == b.token_ids
        assert a.stats.accepted > 0 and a.stats.fallback_rounds == 0


def test_prefill_batches_stay_within_one_chunk(loaded_target):
    """The scheduler prefills prompts together only while their padded chunks fit one chunk's
    positions: a long prompt's chunk goes alone, two short prompts go together, turns go round,
    and every output equals the target alone one at a time."""
    engine = TargetEngine(loaded_target, depth=4, max_batch=4, prefill_chunk=8)
    long_prompt = list(range(10, 31))  # 20 positions to prefill: chunks of 8, 8 and 4
    short = [[40, 41, 42, 43], [50, 51, 52, 53]]  # 3 each
    sched = Scheduler(engine, lambda: None, draft_timeout_s=10, max_active=4)
    futures = [sched.submit(Job(p, 6, SamplingParams(), no_draft=True)) for p in [long_prompt, *short]]
    sched.start()
    outs = [f.result(120) for f in futures]
    load = sched.load()
    sched.stop()
    # the long prompt's first chunk (8 positions: no room for another); the two short ones
    # together (2 x 3); then the long prompt's two other chunks
    assert (load["prefill_forwards"], load["batched_prefills"]) == (4, 2)
    alone = TargetEngine(loaded_target, depth=4)
    for p, out in zip([long_prompt, *short], outs):
        assert out.token_ids == alone.generate(p, 6, SamplingParams()).token_ids


@pytest.mark.parametrize("window_s", [2.0, 0.0])
def test_an_idle_target_starts_a_burst_of_requests_together(loaded_target, window_s):
    """Requests that reach an idle scheduler one after another, each within the admission window
    of the last, start together: one prefill forward, their rounds verified together from the
    first. With no window the first starts alone, a pass ahead. Outputs are the same either way.
    (The window is 20 of the gaps between the requests: a loaded test machine stretched a 0.5 s
    window's gaps past it.)"""
    import time

    engine = TargetEngine(loaded_target, depth=4, max_batch=4, prefill_chunk=256)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=10, max_active=4, admit_window_s=window_s)
    sched.start()
    futures = []
    for p in PROMPTS:
        futures.append(sched.submit(Job(engine.encode(p), 8, SamplingParams(), no_draft=True)))
        time.sleep(0.1)  # far longer than a pass of this tiny model, far shorter than the window
    outs = [f.result(120) for f in futures]
    load = sched.load()
    sched.stop()
    if window_s:
        assert (load["prefill_forwards"], load["batched_prefills"]) == (1, 4)
        assert load["verify_forwards"] == 8 and load["batched_rounds"] == 32  # every round with all four
    else:
        assert load["prefill_forwards"] >= 2
    alone = TargetEngine(loaded_target, depth=4)
    assert [o.token_ids for o in outs] == [alone.generate(alone.encode(p), 8, SamplingParams()).token_ids
                                           for p in PROMPTS]
    with pytest.raises(ValueError, match="admit_window_s"):
        Scheduler(engine, lambda: None, draft_timeout_s=10, admit_window_s=-1)


@pytest.mark.parametrize("where", ["the forward", "one generation's features"])
def test_a_failed_batched_prefill_in_the_scheduler_fails_no_other_job(loaded_target, monkeypatch, where):
    """A batched prefill whose forward fails is retried one generation at a time (every output as
    it would have been); one whose failure is one generation's own (its features) fails that job
    alone, and the others go on exactly."""
    engine = TargetEngine(loaded_target, depth=4, max_batch=4, prefill_chunk=256)
    real = engine._forward_batch
    calls = []

    def flaky(caches, feeds, features, trees=None, layers=None, logits=True):
        out = real(caches, feeds, features, trees, layers, logits)
        calls.append(logits)
        if not logits and len(calls) == 1 and where == "the forward":
            raise RuntimeError("the device fell over")  # after the rows' lengths moved: they go back
        return out

    monkeypatch.setattr(engine, "_forward_batch", flaky)
    if where == "one generation's features":
        from starsd_target.engine import Generation

        real_prefilled = Generation.record_prefill

        def broken(self, end, hidden, seconds):
            if self.tokens[:3] == engine.encode(PROMPTS[1])[:3]:
                raise MemoryError("no room for its features")
            real_prefilled(self, end, hidden, seconds)

        monkeypatch.setattr(Generation, "record_prefill", broken)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=10, max_active=4)
    futures = [sched.submit(Job(engine.encode(p), 8, SamplingParams(), no_draft=True)) for p in PROMPTS]
    sched.start()
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result(120).token_ids)
        except Exception as exc:
            outcomes.append(exc)
    load = sched.load()
    sched.stop()
    monkeypatch.undo()
    alone = TargetEngine(loaded_target, depth=4)
    want = [alone.generate(alone.encode(p), 8, SamplingParams()).token_ids for p in PROMPTS]
    if where == "the forward":
        assert outcomes == want
        assert (load["prefill_forwards"], load["batched_prefills"]) == (4, 0)  # after the failed one, one each
    else:
        assert isinstance(outcomes[1], MemoryError) and load["failed"] == 1
        assert [o for i, o in enumerate(outcomes) if i != 1] == [w for i, w in enumerate(want) if i != 1]
        assert (load["prefill_forwards"], load["batched_prefills"]) == (1, 4)


def test_the_admission_window_waits_only_where_it_can_gain_and_stays_live(loaded_target, monkeypatch):
    """The window's wait, driven directly: no wait at all where generations never share a forward
    (max_batch 1) or with no window; otherwise each wait at most one window, the gathering over
    after ADMIT_WINDOWS_AT_MOST windows whatever keeps coming, and the loop's liveness stamped
    while it waits."""
    import queue

    import starsd_target.scheduler as sched_mod

    class Trickle:  # a job always waiting: the window alone must end the gathering
        def __init__(self):
            self.waits = []

        def get(self, timeout):
            self.waits.append(timeout)
            clock[0] += timeout  # as if the job came at the end of the wait
            return Job([5, 6, 7], 2, SamplingParams(), no_draft=True)

    clock = [100.0]
    monkeypatch.setattr(sched_mod.time, "monotonic", lambda: clock[0])
    for max_batch, window in ((1, 0.5), (4, 0.0)):
        sched = Scheduler(TargetEngine(loaded_target, max_batch=max_batch), lambda: None, draft_timeout_s=10,
                          max_active=8, admit_window_s=window)
        sched.jobs = Trickle()
        sched._gather()
        assert sched.jobs.waits == [] and not sched.active
    sched = Scheduler(TargetEngine(loaded_target, max_batch=4, rows=8), lambda: None, draft_timeout_s=10,
                      max_active=8, admit_window_s=0.5)
    sched.jobs, sched.last_pass = Trickle(), 0.0
    sched._gather()
    assert sched.jobs.waits == [0.5] * sched_mod.ADMIT_WINDOWS_AT_MOST  # a job every window, cut at the cap
    assert len(sched.active) == sched_mod.ADMIT_WINDOWS_AT_MOST < sched.max_active
    assert sched.last_pass == 100.0 + 0.5 * sched_mod.ADMIT_WINDOWS_AT_MOST  # stamped at every turn, the last too
    sched.jobs, sched.active = queue.Queue(), []
    sched.jobs.put(Job([5, 6, 7], 2, SamplingParams(), no_draft=True))
    sched._gather()  # one job behind, then a window with none: done
    assert len(sched.active) == 1


def test_batched_rounds_collect_the_same_features(loaded_target, backend):
    """For feature-based drafters (EAGLE) each generation keeps the target's hidden states of its
    kept positions: batched, they are those of one at a time (float tolerance)."""
    import torch

    feats = {}
    for max_batch in (2, 1):
        engine = TargetEngine(loaded_target, depth=4, max_batch=max_batch)
        gens = [engine.start(engine.encode(p), 16, SamplingParams(), features=True) for p in PROMPTS[:2]]
        drafts = [LocalDrafts(backend) for _ in gens]
        for g in gens:
            while g.prefilling:
                g.prefill()
        while not all(g.done for g in gens):
            engine.verify_batch([(g, d.propose(g.tokens, g.draft_depth()), True)
                                 for g, d in zip(gens, drafts) if not g.done])
        assert all(g.stats.accepted > 0 for g in gens)
        feats[max_batch] = [torch.from_numpy(g.features().astype("float32")) for g in gens]
    for a, b in zip(feats[2], feats[1]):
        assert a.shape == b.shape and a.shape[0] > 16
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_warm_up_makes_the_pool_and_leaves_nothing_behind(loaded_target, backend):
    """The daemon's warm-up makes the pool's KV buffers before the first request (they would
    otherwise be made, and zeroed, inside its first forward), with every row free again after,
    once; the generations that follow are exactly those of an engine that was never warmed up."""
    primed = TargetEngine(loaded_target, depth=4, max_batch=4, rows=4)
    assert primed.pool is not None and not primed.pool.allocated and primed.pool.nbytes == 0
    assert primed.warm_up() == 0.0  # eager: nothing compiled
    pool = primed.pool
    assert pool.allocated and pool.nbytes > 0 and pool.free == [0, 1, 2, 3] and not pool.live
    buffers = [id(t) for t in pool.k]
    assert primed.prime_pool() == 0.0 and [id(t) for t in pool.k] == buffers  # once
    cold = TargetEngine(loaded_target, depth=4, max_batch=4, rows=4)
    got, batches = _lockstep(primed, backend, PROMPTS, PARAMS, 24)
    want, _ = _lockstep(cold, backend, PROMPTS, PARAMS, 24)
    assert batches >= 5
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.stats.accepted == w.stats.accepted
    assert sum(g.stats.accepted for g in got) > 0
    assert TargetEngine(loaded_target, depth=4).prime_pool() == 0.0  # no pool: nothing to make


def test_warm_up_with_one_position_per_prefill_chunk(loaded_target):
    """The warm-up's prompts take more than one prefill pass with --prefill-chunk 1: each is
    prefilled to its end before its round."""
    engine = TargetEngine(loaded_target, depth=4, max_batch=4, rows=4, prefill_chunk=1)
    assert engine.prime_pool() > 0 and engine.pool.allocated
    assert engine.pool.free == [0, 1, 2, 3] and not engine.pool.live
