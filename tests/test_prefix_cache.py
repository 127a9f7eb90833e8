"""Prompt prefixes kept across generations (common.prefix_cache): a later prompt that
begins alike reuses whole prefill chunks, bit for bit what its own prefill would compute, and
the store keeps within its budget."""

import pytest
import torch

from common.slot_cache import SlotCache
from common.verify import SamplingParams
from starsd_target.engine import TargetEngine
from common.prefix_cache import PrefixCache

CHUNK = 8


def _finish(g) -> list[int]:
    """Prefill ``g`` and run it to its end alone, then release it as the scheduler does."""
    while g.prefilling:
        g.prefill()
    while not g.done:
        g.verify(None, wanted=False)
    out = list(g.out)
    g.release()
    return out


def _kv(cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in cache.layers]


@pytest.mark.parametrize("max_batch", [1, 2], ids=["own-cache", "pool-row"])
def test_a_reused_prefix_holds_the_bits_a_fresh_prefill_computes(loaded_target, max_batch):
    """A second prompt sharing 21 tokens with a finished one takes its first two whole chunks
    (16 positions, not 21: a chunk cut short was computed with other rows), and its cache after
    prefill, and its output, are bit for bit a fresh engine's."""
    engine = TargetEngine(loaded_target, depth=3, prefill_chunk=CHUNK, max_batch=max_batch,
                          prefix_cache_bytes=16 << 20)
    fresh = TargetEngine(loaded_target, depth=3, prefill_chunk=CHUNK, max_batch=max_batch)
    first = engine.encode("def area(w, h):\n    return w * h\n")
    second = first[:21] + engine.encode("print(area(3, 4))\n")[1:]
    params = SamplingParams()
    _finish(engine.start(first, 6, params))
    assert engine.prefix.snapshot()["prompts"] == 1

    g = engine.start(second, 12, params)
    want = fresh.start(second, 12, params)
    assert g.stats.cached_prompt_tokens == g.prefilled == 16 and want.prefilled == 0
    for gen in (g, want):
        while gen.prefilling:
            gen.prefill()
    n = g.to_prefill
    for (k, v), (k0, v0) in zip(_kv(g.cache, n), _kv(want.cache, n)):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert _finish(g) == _finish(want)
    assert engine.prefix.stats["hits"] == 1 and engine.prefix.stats["tokens_reused"] == 16


def test_no_reuse_where_it_would_not_be_exact(loaded_target):
    """Prompts shorter than a chunk keep nothing; a generation that collects features (EAGLE)
    neither reuses nor keeps; an engine whose chunk length changed since (the warm-up's) ignores
    what was kept at the other length; a failed generation (scrubbed) keeps nothing."""
    engine = TargetEngine(loaded_target, depth=3, prefill_chunk=CHUNK, prefix_cache_bytes=16 << 20)
    prompt = engine.encode("for i in range(10):\n    print(i)\n")
    params = SamplingParams()
    _finish(engine.start(prompt[:CHUNK], 2, params))  # 7 positions to prefill: no whole chunk
    assert len(engine.prefix) == 0
    _finish(engine.start(prompt, 2, params, features=True))
    assert len(engine.prefix) == 0
    g = engine.start(prompt, 2, params)
    while g.prefilling:
        g.prefill()
    g.release(scrub=True)
    assert len(engine.prefix) == 0
    _finish(engine.start(prompt, 2, params))
    assert len(engine.prefix) == 1
    assert engine.start(prompt, 2, params, features=True).prefilled == 0
    engine.prefill_chunk = 4
    assert engine.start(prompt, 2, params).prefilled == 0
    engine.prefill_chunk = CHUNK
    assert engine.start(prompt, 2, params).prefilled == (len(prompt) - 1) // CHUNK * CHUNK


def _filled(config, tokens: int, seed: int) -> SlotCache:
    torch.manual_seed(seed)
    cache = SlotCache(config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    with torch.inference_mode():
        for li in range(config.num_hidden_layers):
            cache.update(torch.randn(1, heads, tokens, dim), torch.randn(1, heads, tokens, dim), li)
    return cache


def test_the_store_keeps_whole_chunks_longest_match_first_within_its_budget(loaded_target):
    config = loaded_target.model.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    store = PrefixCache(budget_bytes=40 * per_position, chunk=CHUNK)
    a = list(range(100, 130))  # 30 tokens: 3 whole chunks (24 positions)
    store.remember(a, 30, _filled(config, 30, 0))
    assert store.snapshot()["tokens"] == 24 and store.bytes == 24 * per_position
    # a prompt sharing 19 tokens reuses 16, at most what its own prefill would feed
    hit = store.lookup(a[:19] + [7, 7, 7, 7, 7, 7], limit=24)
    assert hit[0] == 16 and hit[1][0][0].shape[2] == 16
    assert store.lookup(a, limit=12)[0] == 8
    assert store.lookup([1] + a[1:], limit=29) is None  # differs in its first chunk
    # a prompt the kept one begins with is held already; one that begins with it replaces it
    store.remember(a[:20], 20, _filled(config, 20, 1))
    assert len(store) == 1 and store.snapshot()["tokens"] == 24
    longer = a + list(range(200, 210))  # 40 tokens: 40 positions
    store.remember(longer, 40, _filled(config, 40, 2))
    assert len(store) == 1 and store.snapshot()["tokens"] == 40
    # over the budget, the prompt used longest ago goes
    b = list(range(300, 317))
    store.remember(b, 17, _filled(config, 17, 3))
    assert len(store) == 1 and store.stats["evicted"] == 1 and store.lookup(longer, 40) is None
    assert store.lookup(b, 16)[0] == 16 and store.bytes <= store.budget_bytes
    # the keys and values handed back are those kept
    want = _filled(config, 17, 3)
    got = store.lookup(b, 16)[1]
    assert all(torch.equal(k, layer.keys[:, :, :16]) for (k, _), layer in zip(got, want.layers))
    assert PrefixCache(0, CHUNK).lookup(b, 16) is None  # off


def test_a_draft_session_takes_what_a_finished_one_of_its_share_computed(near_draft):
    """The draft daemon's model backend: a session's first feed starts from the longest run a
    finished session of the same share had in common with it (any length: drafts are verified),
    never from another share's, and unbound sessions neither keep nor take."""
    from common.models import load_causal_lm
    from starsd_draftd.backends.model import ModelBackend

    backend = ModelBackend(load_causal_lm(str(near_draft)))
    backend.keep_prompts(16 << 20)
    first = list(range(40, 70))
    second = first[:21] + [5, 6, 7, 8]
    params = SamplingParams()

    def session(share=None, bound=True):
        st = backend.new_state(params)
        if bound:
            backend.bind_share(st, share)
        return st

    a = session("tenant-a")
    backend.draft(a, first, 3)
    backend.release(a)
    kept = backend.counters()["kept_prompts"]
    assert kept["prompts"] == 1 and kept["tokens"] >= len(first)
    b = session("tenant-b")  # another share: computes its own
    backend.draft(b, second, 3)
    assert backend.prompts.stats["hits"] == 0
    unbound = session(bound=False)
    backend.draft(unbound, second, 3)
    backend.release(unbound)
    assert backend.prompts.stats["hits"] == 0 and backend.prompts.stats["kept"] == 1
    c = session("tenant-a")
    backend.prefill(c, second, budget=0)  # takes the shared run, feeds nothing more
    assert c.cached == first[:21] and c.cache.get_seq_length() == 21
    assert backend.prompts.stats["hits"] == 1 and backend.prompts.stats["tokens_reused"] == 21
    draft = backend.draft(c, second, 3)
    assert len(draft.tokens) == 3 and c.cached[:len(second)] == second


def test_the_draft_daemon_binds_sessions_to_the_suffix_indexs_partitions(near_draft):
    from common.models import load_causal_lm
    from starsd_draftd.backends.model import ModelBackend
    from starsd_draftd.server import DraftServer, ServerConfig
    from starsd_draftd.sessions import Session

    backend = ModelBackend(load_causal_lm(str(near_draft)))
    greedy, seeded = SamplingParams(), SamplingParams(temperature=0.8, seed=3)
    for share, params, want in (("key", greedy, (True, b"")), ("all", greedy, (True, b"")),
                                ("off", greedy, (False, None)), ("key", seeded, (False, None)),
                                ("key", SamplingParams(temperature=0.8), (True, b""))):
        server = DraftServer(backend, ServerConfig(bind="tcp://127.0.0.1:0", suffix_share=share))
        try:
            st = server._new_state(Session(key=(b"peer-1", 7), params=params, state=None, verified=[1, 2]))
            assert (st.reuses, st.share) == want, (share, params)
        finally:
            server.ingress.stop()
    assert backend.prompts.budget_bytes == ServerConfig().prefix_cache_bytes
    # with CURVE a key's sessions share only among themselves (the suffix index's partitions)
    from starsd_draftd.suffix import partition

    assert (partition("key", b"key-a"), partition("all", b"key-a"), partition("off", b"key-a")) == (b"key-a", b"", None)


@pytest.mark.parametrize("units, dtype, chunk", [(False, "float32", 64), (True, "float32", 64),
                                                  (False, "bfloat16", 64), (True, "bfloat16", 256)])
def test_the_default_prefill_chunk_follows_the_cpus_prefill_arithmetic(tiny_target, monkeypatch, caplog, units,
                                                                       dtype, chunk):
    """``--prefill-chunk 0`` (the default; ``config.prefill_chunk_for``): 64 on a CPU whose prefill
    multiplies in float32 (as cheap a token in chunks of 64 as of 256, with prefixes kept four
    times as finely), 256 on one that prefills in bfloat16 on its matrix units; the prefix cache
    keeps chunks of that length, and the log says which and why. A negative chunk is refused."""
    import logging

    from common import fp16_weights
    from common.models import load_causal_lm
    from starsd_target.config import TargetConfig

    assert TargetConfig.prefill_chunk == 0
    monkeypatch.setattr(fp16_weights, "bf16_matrix_units", lambda: units)
    loaded = load_causal_lm(str(tiny_target), dtype=dtype)
    with caplog.at_level(logging.INFO, logger="starsd.target.engine"):
        engine = TargetEngine(loaded, depth=3, prefix_cache_bytes=1 << 20)
    assert engine.prefill_chunk == engine.prefix.chunk == chunk
    said = [r.getMessage() for r in caplog.records if "prefill chunks of" in r.getMessage()]
    assert said == [f"prefill chunks of {chunk} prompt tokens (--prefill-chunk 0: "
                    + ("a CPU whose prefill multiplies in float32)" if chunk == 64
                       else "a CPU that prefills in bfloat16 on its matrix units)")]
    with pytest.raises(ValueError, match="prefill_chunk"):
        TargetEngine(loaded, prefill_chunk=-1)
