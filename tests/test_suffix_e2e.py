"""Suffix drafts in speculation: sampled output with them follows the target's distribution
(chi-square on the joint of the first tokens), and seeded output repeats however the shared
index changes around it."""

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, running_server, samples_for, speculate
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from tiny_models import make_near_copy

REPEATED = "x = 1\nx = 1\nx = 1\nx = "  # its own text, and every earlier sample's output, repeat


def test_sampled_output_with_suffix_drafts_follows_the_target(tiny_target, loaded_target, tmp_path):
    """Unseeded sampled sessions read the shared index: each is drafted from its own prompt and
    the earlier samples' outputs (q one-hot at each drafted token), and the first three tokens
    still follow the target's own joint distribution (each generation runs on a few rounds more,
    so that its suffix drafts' outcomes are reported and learnt)."""
    backend = ModelBackend(load_causal_lm(str(make_near_copy(tiny_target, tmp_path / "near", noise=0.05))))
    params = SamplingParams(temperature=1.5, top_k=2)
    engine = TargetEngine(loaded_target, depth=3)
    prompt = engine.encode(REPEATED)
    length = 3
    exact = exact_joint(loaded_target.model, prompt, params, length)
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    with running_server(backend, suffix=True, max_depth=3) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        for _ in range(samples):
            r = speculate(engine, client, prompt, 3 * length, params, 30)
            assert r.stats.fallback_rounds == 0 and r.stats.invalid_drafts == 0
            first = tuple(r.token_ids[:length])
            counts[first] = counts.get(first, 0) + 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
        snap = server.snapshot()["suffix"]
        client.close()
    # suffix drafts answered most rounds and some of their tokens were kept (and some not)
    assert snap["requests"] > samples // 2 and 0 < snap["kept"] < snap["tokens"], snap
    assert 10 <= accepted < drafted
    assert_follows(counts, exact, samples)


def test_seeded_output_repeats_while_the_shared_index_changes(tiny_target, loaded_target, near_draft):
    backend = ModelBackend(load_causal_lm(str(near_draft)))
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode(REPEATED)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=123)
    with running_server(backend, suffix=True, max_depth=4) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        first = speculate(engine, client, prompt, 24, seeded, 30)
        used = server.snapshot()["suffix"]["requests"]
        for i in range(3):  # other sessions' outputs after the same prompt fill the shared index
            speculate(engine, client, prompt, 24, SamplingParams(temperature=0.9, top_k=20), 30)
            again = speculate(engine, client, prompt, 24, seeded, 30)
            assert again.token_ids == first.token_ids, i
        client.close()
    assert used > 0 and first.stats.accepted > 0  # its own repeated prompt gave it suffix drafts


def test_greedy_output_stays_the_targets_when_idle_passes_feed_the_draft_model(loaded_target, near_draft):
    """Rounds the suffix index answers leave the draft model behind; idle passes (here one runs
    between every two rounds: the target waits for the daemon's passes) feed it what it missed,
    and the rounds it drafts after that are kept as before, the output the target's own."""
    import time

    backend = ModelBackend(load_causal_lm(str(near_draft)))
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode(REPEATED)
    alone = engine.generate(prompt, 32, SamplingParams())
    with running_server(backend, suffix=True, max_depth=4) as (server, ctx):
        def passes(*_):
            for _ in range(2):  # the second pass begins after an idle feed the first could run
                mark = server.last_pass
                while server.last_pass <= mark:
                    time.sleep(0.001)

        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        runs = [speculate(engine, client, prompt, 32, SamplingParams(), 30, on_round=passes) for _ in range(2)]
        snap = server.snapshot()
        client.close()
    for r in runs:
        assert r.token_ids == alone.token_ids and r.stats.fallback_rounds == 0
    assert snap["catch_up"]["tokens"] >= snap["catch_up"]["feeds"] > 0
    assert snap["requests"] > snap["suffix"]["requests"] > 0  # both the index and the model drafted
    assert runs[0].stats.accepted > 0 and runs[1].stats.accepted > runs[1].stats.drafted // 2
