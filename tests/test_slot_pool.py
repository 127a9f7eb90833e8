"""The slot pool: several sequences' caches as rows of one buffer, fed together in one forward
with each row's own length, give what feeding each alone gives; rollback, growth and row reuse
included."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.models import crop_cache
from common.slot_cache import PoolBatch, SlotCache, SlotPool
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def rotary_model(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=4, hidden=32, layers=2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batched(model, caches, feeds):
    batch = PoolBatch(caches, [len(f) for f in feeds])
    M = batch.M
    ids = torch.tensor([f + [f[-1]] * (M - len(f)) for f in feeds])
    out = model(input_ids=ids, cache=batch, use_cache=True, attention_mask=batch.mask(model.dtype, "cpu"),
                position_ids=batch.positions("cpu"))
    batch.commit()
    return [out.logits[b, : len(f)] for b, f in enumerate(feeds)]


@torch.inference_mode()
@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2]])  # adjacent rows (views), and a gather
def test_batched_rows_equal_one_at_a_time(rotary_model, rows):
    torch.manual_seed(1)
    pool = SlotPool(rotary_model.config, rows=3, capacity=8)  # grows during the test
    caches = [pool.acquire(8) for _ in range(3)]
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (5, 19, 11)]
    refs = [SlotCache(rotary_model.config) for _ in prompts]
    for cache, ref, p in zip(caches, refs, prompts):  # prefill each alone, as the engine does
        rotary_model(input_ids=torch.tensor([p]), cache=cache, use_cache=True)
        rotary_model(input_ids=torch.tensor([p]), cache=ref, use_cache=True)
    for step in range(4):  # rounds of ragged feeds with rollbacks between them
        feeds = [torch.randint(3, 250, (1 + (step + b) % 4,)).tolist() for b in range(3)]
        chosen = [caches[r] for r in rows]
        got = _batched(rotary_model, chosen, [feeds[r] for r in rows])
        for r, g in zip(rows, got):
            want = rotary_model(input_ids=torch.tensor([feeds[r]]), cache=refs[r], use_cache=True).logits[0]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
            assert caches[r].get_seq_length() == refs[r].get_seq_length()
            keep = refs[r].get_seq_length() - (step % len(feeds[r]))  # reject some of the feed
            crop_cache(caches[r], keep)
            crop_cache(refs[r], keep)
    assert pool.slots > 8  # it grew, under live rows
    # a single-row forward after batched ones reads the same cache
    for r in rows:
        nxt = torch.tensor([[7]])
        a = rotary_model(input_ids=nxt, cache=caches[r], use_cache=True).logits
        b = rotary_model(input_ids=nxt, cache=refs[r], use_cache=True).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_rows_are_reused_and_bounded(rotary_model):
    """Outside inference mode too, as the scheduler's thread acquires, grows, scrubs and releases rows."""
    pool = SlotPool(rotary_model.config, rows=2)
    a, b = pool.acquire(), pool.acquire()
    assert pool.acquire() is None  # every row taken
    with torch.inference_mode():  # as the runner feeds
        rotary_model(input_ids=torch.tensor([[5, 6, 7]]), cache=a, use_cache=True)
    assert pool.k[0][a.row, :, :3].abs().sum() > 0
    pool.reserve(pool.slots + 10)  # growth with a live row, outside inference mode
    assert a.get_seq_length() == 3 and a.layers[0].keys.shape[2] == 3
    assert a.layers[0].keys.data_ptr() == pool.k[0][a.row].data_ptr()  # read from the grown buffer
    with pytest.raises(AttributeError, match="slots in the pool"):
        a.layers[0].keys = torch.zeros(1, 1, 3, 4)
    a.scrub()  # after a failure: the row's slots zeroed (a NaN there would spread through masked reads)
    assert all(pool.k[li][a.row].abs().sum() == 0 and pool.v[li][a.row].abs().sum() == 0
               for li in range(pool.n_layers))
    a.release()
    c = pool.acquire()
    assert c.row == a.row and c.get_seq_length() == 0  # a fresh sequence in the freed row
    with pytest.raises(ValueError, match="distinct rows"):
        PoolBatch([b, b], [1, 1])
    with pytest.raises(ValueError, match="one sequence"), torch.inference_mode():
        rotary_model(input_ids=torch.tensor([[5], [6]]), cache=b, use_cache=True)


def test_pool_supports_full_attention_models_only(rotary_model):
    from transformers import Qwen2Config

    assert SlotPool.supports(rotary_model.config)
    sliding = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=64, vocab_size=64, use_sliding_window=True, sliding_window=4,
                          max_window_layers=0)
    assert not SlotPool.supports(sliding)


@torch.inference_mode()
def test_a_forward_that_fails_part_way_changes_no_row(rotary_model):
    """A batched forward that raises in its second layer (after the first layer wrote) leaves
    every row's length as it was, in every layer, and the rows go on exactly."""
    torch.manual_seed(3)
    pool = SlotPool(rotary_model.config, rows=2)
    caches = [pool.acquire() for _ in range(2)]
    refs = [SlotCache(rotary_model.config) for _ in range(2)]
    for c, r, n in zip(caches, refs, (6, 9)):
        p = torch.randint(3, 250, (1, n))
        rotary_model(input_ids=p, cache=c, use_cache=True)
        rotary_model(input_ids=p, cache=r, use_cache=True)

    def boom(*args, **kwargs):
        raise RuntimeError("out of memory")

    hook = rotary_model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="memory"):
            _batched(rotary_model, caches, [[5, 6, 7], [8]])
    finally:
        hook.remove()
    assert [[layer.n for layer in c.layers] for c in caches] == [[6, 6], [9, 9]]
    feeds = [[11, 12], [13, 14, 15]]
    got = _batched(rotary_model, caches, feeds)
    for g, r, f in zip(got, refs, feeds):
        torch.testing.assert_close(g, rotary_model(input_ids=torch.tensor([f]), cache=r, use_cache=True).logits[0],
                                   rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [[0, 1], [0, 2]])
def test_a_first_forward_on_fresh_rows_may_be_batched(rotary_model, rows):
    """Rows that never held a position (the pool's buffers not even allocated) fed together in
    one forward: each gets what a forward of its own gives, and its layers are marked in use."""
    torch.manual_seed(5)
    pool = SlotPool(rotary_model.config, rows=3)
    caches = [pool.acquire() for _ in range(3)]
    assert all(t is None for t in pool.k)
    feeds = [torch.randint(3, 250, (n,)).tolist() for n in (4, 7)]
    got = _batched(rotary_model, [caches[r] for r in rows], feeds)
    for g, r, f in zip(got, rows, feeds):
        ref = SlotCache(rotary_model.config)
        torch.testing.assert_close(g, rotary_model(input_ids=torch.tensor([f]), cache=ref, use_cache=True).logits[0],
                                   rtol=1e-4, atol=1e-4)
        assert all(layer.is_initialized and layer.n == len(f) for layer in caches[r].layers)
        torch.testing.assert_close(caches[r].layers[1].keys, ref.layers[1].keys, rtol=1e-5, atol=1e-5)
    assert [layer.is_initialized for layer in caches[1 if rows == [0, 2] else 2].layers] == [False, False]
