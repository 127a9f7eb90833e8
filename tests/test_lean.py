"""The lean forward (common.lean) gives the model's own forward's tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch

from common.fp16_weights import Fp16Linear, Fp16Part, fp16_weights_available
from common.lean import LeanForward, fuse_fp16
from common.models import crop_cache, load_causal_lm
from common.runner import ModelRunner
from common.slot_cache import PoolBatch, SlotPool
from tiny_models import make_tiny_checkpoint

DTYPES = ["float32", "bfloat16"] + (["fp16-weights"] if fp16_weights_available() else [])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return {arch: make_tiny_checkpoint(root / arch, arch, seed=11, hidden=64, layers=3)
            for arch in ("llama", "qwen2", "gpt2")}


def _pair(path, dtype):
    """The same checkpoint loaded twice: one runner lean, one through transformers."""
    lean = ModelRunner(load_causal_lm(str(path), dtype=dtype))
    plain = ModelRunner(load_causal_lm(str(path), dtype=dtype), lean=False)
    assert lean.forward_kind == "lean", lean.lean_reason
    assert plain.forward_kind == "transformers" and plain.lean is None
    if dtype == "fp16-weights":  # the CPU serving default: its layers run as TorchScript (common.lean_script)
        assert lean.lean.scripted is not None or "one op" in lean.lean.script_reason, lean.lean.script_reason
    else:
        assert lean.lean.scripted is None
    lean.model.forward = _not_called  # every comparison below is lean against transformers
    # a bfloat16 verification's rows run as one-row steps compute them (tests/test_bf16_packed.py);
    # here the rest of the lean forward is held to transformers' own bits
    lean.lean.row_exact_rows = 0
    return lean, plain


def _not_called(*args, **kwargs):
    raise AssertionError("the lean runner fell back to the model's own forward")


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


def _caches_equal(ca, cb):
    assert ca.get_seq_length() == cb.get_seq_length()
    for la, lb in zip(ca.layers, cb.layers):
        _same(la.keys, lb.keys)
        _same(la.values, lb.values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_is_bit_exact(checkpoints, arch, dtype):
    """Prefill, decode, verification, rollback and re-feed, logits all / last, hidden states
    (final and named layers): every tensor equal to transformers' forward, and the caches too."""
    lean, plain = _pair(checkpoints[arch], dtype)
    torch.manual_seed(3)
    prompt = torch.randint(3, 250, (37,)).tolist()
    ca, cb = lean.new_cache(16), plain.new_cache(16)  # small: the caches grow during the test
    for r, c in ((lean, ca), (plain, cb)):
        r.forward(c, prompt[:20], "none")
    ha, hb = lean.forward(ca, prompt[20:], "all", hidden=True, layers=(0, 2))[1], \
        plain.forward(cb, prompt[20:], "all", hidden=True, layers=(0, 2))[1]
    _same(ha, hb)
    for step, ids in enumerate(([5], [7, 8, 9, 10, 11], [12, 13], [14], [15, 16, 17, 18, 19, 20, 21, 22, 23])):
        kind = "last" if step == 3 else "all"
        (la, fa), (lb, fb) = lean.forward(ca, ids, kind, hidden=True), plain.forward(cb, ids, kind, hidden=True)
        _same(la, lb)
        _same(fa, fb)
        if step % 2:  # a rejected draft: roll back all but the first fed token
            for c in (ca, cb):
                crop_cache(c, c.get_seq_length() - len(ids) + 1)
    _caches_equal(ca, cb)


@pytest.mark.parametrize("one_token", [False, True], ids=["verify", "decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_batched_and_tree_forwards_are_bit_exact(checkpoints, dtype, one_token, monkeypatch):
    """The runner's masked calls: a pool batch of rows with different lengths and feeds, one of
    them a draft tree, with hidden states; and a batch of one token per row (one query with a
    mask: attention packs the query heads per key head)."""
    lean, plain = _pair(checkpoints["qwen2"], dtype)
    # several masked queries read the key heads as they are (SDPA's own GQA, the bits checked at the
    # build): the comparisons below hold that path to transformers' repeated keys
    assert {torch.float32, torch.bfloat16} <= lean.lean.layers[0].mask_gqa
    torch.manual_seed(4)
    out = []
    real_update, updates = PoolBatch._update, []
    monkeypatch.setattr(PoolBatch, "_update", lambda self, *a: updates.append(1) or real_update(self, *a))
    for runner in (lean, plain):
        pool = SlotPool(runner.model.config, rows=3, capacity=8)
        rows = [pool.acquire(8) for _ in range(3)]
        for row, n in zip(rows, (9, 4, 13)):
            runner.forward(row, list(range(30, 30 + n)), "none")
        feeds, trees = [[40], [41, 42, 43, 44, 45], [46, 47, 48, 49]], [None, None, [-1, -1, 0]]
        if one_token:
            feeds, trees = [[40], [41], [42]], None
        batch = PoolBatch(rows, [len(f) for f in feeds], trees)
        ids = torch.tensor([f + [f[-1]] * (batch.M - len(f)) for f in feeds])
        updates.clear()
        with torch.inference_mode():  # as the engine's batched verification runs
            res = runner.eager(input_ids=ids, cache=batch, use_cache=True, output_hidden_states=True,
                               attention_mask=batch.mask(runner.loaded.dtype, runner.device),
                               position_ids=batch.positions(runner.device))
        batch.commit()
        # scripted layers write adjacent rows' keys and values in their own call (pool_step)
        assert (updates == []) == (runner is lean and runner.lean.scripted is not None), len(updates)
        out.append((res.logits, res.hidden_states, [pool.k[i].clone() for i in range(3)] + [pool.v[i].clone() for i in range(3)]))
    (la, ha, ka), (lb, hb, kb) = out
    _same(la, lb)
    assert len(ha) == len(hb) == 4
    for a, b in zip(ha + tuple(ka), hb + tuple(kb)):
        _same(a, b)


def test_models_the_lean_forward_does_not_take_run_through_transformers(checkpoints):
    gpt2 = ModelRunner(load_causal_lm(str(checkpoints["gpt2"])))
    assert gpt2.forward_kind == "transformers" and "GPT2LMHeadModel" in gpt2.lean_reason
    assert gpt2.eager is gpt2.model
    loaded = load_causal_lm(str(checkpoints["llama"]))
    handle = loaded.model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        hooked = ModelRunner(loaded)
        assert hooked.lean is None and "hooks" in hooked.lean_reason
    finally:
        handle.remove()
    lean = ModelRunner(loaded)  # hooks set after the build run: calls then go through the model
    assert lean.forward_kind == "lean"
    seen = []
    handle = loaded.model.model.layers[1].mlp.register_forward_pre_hook(lambda *a: seen.append(1))
    try:
        assert lean.forward_kind == "transformers (forward hooks set)"
        lean.forward(lean.new_cache(), [5, 6, 7], hidden=True)  # also installs transformers' own recording hooks
    finally:
        handle.remove()
    assert seen == [1]
    real = loaded.model.forward
    loaded.model.forward = _not_called  # the hook gone, calls are lean again
    try:
        assert lean.forward_kind == "lean"
        lean.forward(lean.new_cache(), [5, 6, 7], hidden=True)
        assert ModelRunner(loaded).forward_kind == "lean"  # recording hooks do not refuse a build
    finally:
        loaded.model.forward = real
    assert seen == [1]
    assert ModelRunner(loaded, compile=True).lean is None  # compiled graphs trace the model itself
    loaded.model.config.tie_last_hidden_states = False  # the last hidden state then comes before the norm
    try:
        assert "tie_last_hidden_states" in LeanForward.build(loaded.model)[1]
    finally:
        del loaded.model.config.tie_last_hidden_states
    loaded.model.train()
    try:
        assert "training" in LeanForward.build(loaded.model)[1]
    finally:
        loaded.model.eval()
    eager_attn = load_causal_lm(str(checkpoints["llama"]))
    eager_attn.model.config._attn_implementation = "eager"
    reason = LeanForward.build(eager_attn.model)[1]
    assert reason is not None and "'eager'" in reason


@pytest.mark.skipif(not fp16_weights_available(), reason="fp16-weights needs fbgemm (x86 PyTorch builds)")
def test_fp16_fusion_keeps_the_models_own_forward_exact_and_its_memory(checkpoints):
    """With fp16-weights the lean forward fuses q/k/v and gate/up; the model's own modules then
    serve from the fused weights (same bits, no second copy)."""
    fused = load_causal_lm(str(checkpoints["qwen2"]), dtype="fp16-weights")  # q/k/v with biases
    apart = load_causal_lm(str(checkpoints["qwen2"]), dtype="fp16-weights")
    handle = fused.model.lm_head.register_forward_hook(lambda *a: None)
    refused = ModelRunner(fused)
    handle.remove()
    assert refused.lean is None and not any(type(m) is Fp16Part for m in fused.model.modules())  # left as it was
    runner = ModelRunner(fused)
    assert runner.lean.fused
    attn = fused.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp16Part) and attn.q_proj.whole is attn.v_proj.whole
    n_packed = sum(isinstance(m, Fp16Linear) for m in fused.model.modules())
    assert n_packed == 3 * (2 + 2) + 1  # per layer qkv, o, gate_up, down; the LM head
    ids = torch.randint(3, 250, (1, 12))
    with torch.inference_mode():
        a = fused.model(input_ids=ids).logits  # transformers' forward through the parts
        b = apart.model(input_ids=ids).logits
    _same(a, b)


@pytest.mark.skipif(not fp16_weights_available(), reason="fp16-weights needs fbgemm (x86 PyTorch builds)")
def test_fp16_fusion_is_refused_when_any_bit_differs(checkpoints, monkeypatch):
    """A fused GEMM that rounds differently from the separate ones leaves the layers apart."""
    loaded = load_causal_lm(str(checkpoints["llama"]), dtype="fp16-weights")
    real = Fp16Linear.fuse.__func__

    def off_by_a_bit(cls, linears):
        whole = real(cls, linears)
        w, b = torch.ops.quantized.linear_unpack_fp16(whole._packed)
        w[0, 0] = torch.nextafter(w[0, 0].half(), torch.tensor(10.0, dtype=torch.half)).float()
        return cls(w, b)

    monkeypatch.setattr(Fp16Linear, "fuse", classmethod(off_by_a_bit))
    assert fuse_fp16(loaded.model) is False
    assert all(type(m) is not Fp16Part for m in loaded.model.modules())
    runner = ModelRunner(loaded)
    assert runner.forward_kind == "lean" and not runner.lean.fused
    plain = ModelRunner(load_causal_lm(str(checkpoints["llama"]), dtype="fp16-weights"), lean=False)
    ca, cb = runner.new_cache(), plain.new_cache()
    _same(runner.forward(ca, list(range(40, 60)))[0], plain.forward(cb, list(range(40, 60)))[0])


def test_float32_norms_run_as_one_op_only_where_it_gives_the_same_bits(checkpoints, monkeypatch):
    """In float32 each RMS norm runs as ``torch.rms_norm`` once a check on its width found it
    bit for bit equal to the norm's own ops (the exactness tests above then cover it); a
    ``torch.rms_norm`` that differs in any bit leaves the norms' ops apart, and still exact."""
    import common.lean as lean_mod

    model = load_causal_lm(str(checkpoints["llama"]), dtype="float32").model
    norm = model.model.layers[0].input_layernorm
    monkeypatch.setattr(lean_mod, "_NORM_CHECKS", {})
    matches = lean_mod._one_op_norm_matches(norm.weight, norm.variance_epsilon)  # on this build
    assert lean_mod._norm(norm).__name__ == ("rms_one_op" if matches else "rms")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape[0]))  # not the ones a fresh checkpoint holds
    x = torch.randn(5, norm.weight.shape[0])
    _same(lean_mod._norm(norm)(x), norm(x))

    real = torch.rms_norm
    monkeypatch.setattr(lean_mod, "_NORM_CHECKS", {})
    monkeypatch.setattr(torch, "rms_norm", lambda *a, **k: torch.nextafter(real(*a, **k), torch.tensor(1e30)))
    apart = lean_mod._norm(norm)
    assert apart.__name__ == "rms"
    _same(apart(x), norm(x))
    bf16 = load_causal_lm(str(checkpoints["llama"]), dtype="bfloat16").model.model.layers[0].input_layernorm
    assert lean_mod._norm(bf16).__name__ == "rms"  # a bfloat16 weight keeps transformers' casts


@pytest.mark.skipif(not fp16_weights_available(), reason="fp16-weights needs fbgemm (x86 PyTorch builds)")
def test_scripted_layers_are_refused_when_any_bit_differs(checkpoints, monkeypatch):
    """The scripted layers are checked against the lean forward's Python ops before use: a
    scripted layer that rounds differently anywhere leaves the layers in Python, still exact."""
    import common.lean_script as script_mod

    class OffByABit(script_mod.ScriptedLayer):  # its input norm's epsilon not the model's
        def __init__(self, *args):
            super().__init__(*args)
            self.in_eps = self.in_eps + 1e-3

    good = ModelRunner(load_causal_lm(str(checkpoints["llama"]), dtype="fp16-weights"))
    if good.lean.scripted is None:
        pytest.skip(f"no scripted layers on this build ({good.lean.script_reason})")
    monkeypatch.setattr(script_mod, "ScriptedLayer", OffByABit)
    runner = ModelRunner(load_causal_lm(str(checkpoints["llama"]), dtype="fp16-weights"))
    assert runner.forward_kind == "lean" and runner.lean.scripted is None
    assert "differs" in runner.lean.script_reason
    plain = ModelRunner(load_causal_lm(str(checkpoints["llama"]), dtype="fp16-weights"), lean=False)
    for r in (good, runner):
        ca, cb = r.new_cache(), plain.new_cache()
        _same(r.forward(ca, list(range(40, 60)))[0], plain.forward(cb, list(range(40, 60)))[0])
        _same(r.forward(ca, [61])[0], plain.forward(cb, [61])[0])
