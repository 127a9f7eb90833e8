"""bfloat16 linears packed for oneDNN at load (common.bf16_packed): the same bits as plain ones at
one row, the tied output layer left plain, plain again for torch.compile, a kernel that fails or
differs on the probe left unused, and a small bfloat16 model's greedy output unchanged."""

from __future__ import annotations

import platform

import pytest
import torch

from common import bf16_packed
from common.bf16_packed import Bf16FbgemmLinear, Bf16Linear, pack_bf16, packed_bf16_available, unpack_bf16
from common.models import load_causal_lm
from common.runner import ModelRunner
from common.verify import SamplingParams
from tiny_models import make_tiny_checkpoint

AVAILABLE = packed_bf16_available()


def _linear(out_f: int, in_f: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16).eval()


def test_the_kernel_is_there_where_the_cpu_computes_bfloat16():
    """A CPU with AVX-512 bfloat16 or AMX instructions (the machines the suite runs on) gets the
    packed kernel: a build that lost it would quietly serve bfloat16 a third slower."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's instructions from")
    if not {"avx512_bf16", "amx_bf16"} & flags:
        pytest.skip("this CPU has no bfloat16 instructions: plain bfloat16 layers are expected")
    assert AVAILABLE


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 64), (40, 300)])
def test_a_packed_layer_gives_the_plain_layers_bits_at_one_row(shape, bias):
    lin = _linear(*shape, bias)
    packed = Bf16Linear.from_linear(lin)
    with torch.inference_mode():
        for x in (torch.randn(1, shape[1]), torch.randn(1, 1, shape[1]), torch.randn(2, 1, shape[1])):
            x = x.to(torch.bfloat16)
            y = packed(x)
            assert y.dtype == torch.bfloat16 and y.shape == (*x.shape[:-1], shape[0])
            assert torch.equal(y, lin(x))
        many = torch.randn(1, 7, shape[1]).to(torch.bfloat16)  # rows: the same values up to rounding
        torch.testing.assert_close(packed(many).float(), lin(many).float(), rtol=2e-2, atol=2e-2)
    back = packed.to_linear()  # what torch.compile gets: the same weights, plain
    assert torch.equal(back.weight, lin.weight) and (not bias or torch.equal(back.bias, lin.bias))


def test_a_float32_or_gpu_weight_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16Linear(torch.zeros(4, 4))


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
@pytest.mark.parametrize("tied", [False, True])
def test_a_bfloat16_model_is_packed_at_load_and_decodes_as_before(tmp_path, monkeypatch, tied):
    """Every linear is packed but a tied output layer; greedy output from a one-token prompt
    (every forward one row) equals the plain model's; ``unpack_bf16`` gives back plain layers
    with the same weights (what --compile traces)."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3, hidden=48, layers=2, tied=tied)
    loaded = load_causal_lm(str(ckpt), dtype="bfloat16")
    model = loaded.model
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Bf16Linear))}
    assert kinds.pop("lm_head") is (torch.nn.Linear if tied else Bf16Linear)
    assert kinds and set(kinds.values()) == {Bf16Linear}
    monkeypatch.setattr(bf16_packed, "packed_bf16_available", lambda: False)  # what a CPU without it gets
    plain = load_causal_lm(str(ckpt), dtype="bfloat16").model
    assert not any(isinstance(m, Bf16Linear) for m in plain.modules())
    prompt = torch.tensor([[5]])  # every forward one row: where the packed kernel gives the plain one's bits
    with torch.inference_mode():
        want = plain.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        got = model.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        runner = ModelRunner(loaded)  # the serving path: the lean forward calls the packed kernel directly
        assert runner.forward_kind == "lean"
        cache = runner.new_cache(32)
        lean_logits, _ = runner.forward(cache, prompt[0].tolist(), logits="last")
        plain_logits = plain(prompt).logits[0, -1]
    assert torch.equal(got, want)
    assert torch.equal(lean_logits.reshape(-1).float(), plain_logits.reshape(-1).float())
    assert unpack_bf16(model) == len(kinds) + (not tied)
    for (name, m), (_, p) in zip(model.named_modules(), plain.named_modules()):
        if isinstance(m, torch.nn.Linear):
            assert torch.equal(m.weight, p.weight), name


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_pack_bf16_leaves_other_dtypes_alone():
    model = torch.nn.Sequential(_linear(8, 8, True), torch.nn.Linear(8, 8))
    assert pack_bf16(model) == (1, None)
    assert type(model[0]) is Bf16Linear and type(model[1]) is torch.nn.Linear


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_a_kernel_that_fails_or_differs_on_the_probe_packs_nothing(monkeypatch):
    """Where the packed kernel raises or gives other bits (another CPU's oneDNN), every layer stays plain."""
    model = torch.nn.Sequential(_linear(8, 8, True), _linear(8, 8, False, seed=1))

    def off_by_one(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "") + 1

    monkeypatch.setattr(Bf16Linear, "forward", off_by_one)
    n, why = pack_bf16(model)
    assert n == 0 and "differ" in why and all(type(m) is torch.nn.Linear for m in model)

    def refuse(self, weight, bias=None):
        raise RuntimeError("no blocked layout here")

    monkeypatch.setattr(Bf16Linear, "__init__", refuse)
    n, why = pack_bf16(model)
    assert n == 0 and "no blocked layout here" in why and all(type(m) is torch.nn.Linear for m in model)


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_a_failure_on_a_later_layer_leaves_every_layer_plain(monkeypatch):
    model = torch.nn.Sequential(*[_linear(8, 8, i % 2 == 0, seed=i) for i in range(4)])
    weights = [lin.weight.clone() for lin in model]
    made = []
    real = Bf16Linear.__init__

    def third_fails(self, weight, bias=None):
        if len(made) == 2:
            raise RuntimeError("out of blocked layouts")
        made.append(1)
        real(self, weight, bias)

    monkeypatch.setattr(Bf16Linear, "__init__", third_fails)
    n, why = pack_bf16(model)
    assert n == 0 and "out of blocked layouts" in why
    assert all(type(m) is torch.nn.Linear for m in model)
    assert all(torch.equal(m.weight, w) for m, w in zip(model, weights))


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_a_draft_with_a_cut_head_loads_in_bfloat16_packed(tmp_path):
    """A cut output layer (--draft-vocab) has no weight of its own to compare with the embedding
    table: it is packed like any other layer, and keeps its logits."""
    from common.draft_vocab import DraftVocab

    ckpt = make_tiny_checkpoint(tmp_path / "m", "llama", seed=4, hidden=32, layers=1, tied=True)
    ids = list(range(0, 200, 3))
    plain = load_causal_lm(str(ckpt), dtype="bfloat16")
    vocab = DraftVocab(tuple(ids), plain.logits_size, plain.fingerprint)
    cut = load_causal_lm(str(ckpt), dtype="bfloat16", draft_vocab=vocab)
    assert any(isinstance(m, Bf16Linear) for m in cut.model.get_output_embeddings().modules())
    with torch.inference_mode():
        x = torch.tensor([[7]])
        full, kept = plain.model(x).logits[0, -1], cut.model(x).logits[0, -1]
    assert torch.equal(kept[ids].float(), full[ids].float()) and bool(torch.isinf(kept[1]))


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bfloat16_verification_gives_each_row_a_one_row_steps_bits(tmp_path, arch):
    """Where the packed kernel keeps a row's bits whatever the row count, a verification's rows
    (a chain, and a tree's) get the logits one-row decoding steps give them, bit for bit, so
    that speculation in bfloat16 keeps exactly the tokens of the target alone."""
    from dataclasses import dataclass

    from common.models import crop_cache
    from starsd_target.engine import TargetEngine

    ckpt = make_tiny_checkpoint(tmp_path / arch, arch, seed=5, hidden=64, layers=2)
    loaded = load_causal_lm(str(ckpt), dtype="bfloat16")
    engine = TargetEngine(loaded, depth=4)
    rows = engine.runner.lean.row_exact_rows
    if rows == 0:
        pytest.skip("this CPU's packed kernel gives a row other bits at two rows: verifications keep one pass")
    assert rows >= 5
    runner = engine.runner
    ids = torch.randint(3, 250, (30 + rows,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = runner.new_cache(64)
    runner.forward(cache, ids[:30], logits="none")
    steps = []
    for t in ids[30:30 + rows]:
        steps.append(runner.forward(cache, [t], logits="all")[0][0].clone())
    crop_cache(cache, 30)
    together, _ = runner.forward(cache, ids[30:30 + rows], logits="all")
    for r in range(rows):
        assert torch.equal(together[r], steps[r]), r

    @dataclass
    class Drafts:
        tokens: list
        parents: list | None = None
        q_ids: None = None
        q_probs: None = None

    params = SamplingParams()
    for prompt in ([5, 9, 2, 7], [11, 3, 8, 8, 1, 4]):
        alone = engine.generate(prompt, 40, params).token_ids
        for tree in (False, True):
            gen = engine.start(prompt, 40, params)
            while gen.prefilling:
                gen.prefill()
            while not gen.done:
                nxt = list(alone[len(gen.out): len(gen.out) + 3])
                if tree and len(gen.out) + 5 <= 40:  # the right path beside a wrong first token
                    wrong = 3 + (nxt[0] + 1) % 250
                    gen.verify(Drafts([nxt[0], wrong, nxt[1], nxt[2]], [-1, -1, 0, 2]))
                else:
                    gen.verify(Drafts(nxt))
            assert list(gen.out) == list(alone), (prompt, tree)
            s = gen.stats
            # every round kept its whole right path: rows gave the target alone's argmax each time
            assert s.accepted + s.rounds == len(alone) and s.invalid_drafts == 0 and (s.tree_rounds > 0) == tree


@pytest.mark.slow
@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_a_bfloat16_star_keeps_exactly_its_target_alones_tokens(tiny_target, near_draft, star):
    """Both daemons in bfloat16, one target verifying chains and one trees: each output equals
    the same target daemon's own without drafts, and drafts were kept with no round without."""
    from fakes import run_concurrently

    from starsd_target.engine import TargetEngine

    engine_rows = TargetEngine(load_causal_lm(str(tiny_target), dtype="bfloat16")).runner.lean.row_exact_rows
    if engine_rows < 8:
        pytest.skip(f"this CPU's packed kernel keeps a row's bits up to {engine_rows} rows: trees of 8 run in one pass")
    draft_ep = star.draftd(near_draft, "--dtype", "bfloat16", ready=False)
    chains = star.targets(tiny_target, draft_ep, 1, "--dtype", "bfloat16", "--connect-timeout", "120", prefix="c")
    trees = star.targets(tiny_target, draft_ep, 1, "--dtype", "bfloat16", "--draft-tokens", "8", prefix="t")
    prompts = ["def parse(line):\n    ", "import os\nimport sys\n"]
    eps = chains + trees
    for p in prompts:
        spec = run_concurrently(eps, [{"id": 1, "prompt": p, "max_tokens": 40}] * 2)
        alone = run_concurrently(eps, [{"id": 2, "prompt": p, "max_tokens": 40, "no_draft": True}] * 2)
        for s, a in zip(spec, alone):
            assert s["token_ids"] == a["token_ids"] and a["stats"]["drafted"] == 0
        star.assert_speculated(spec[:1], prefix="c")
        star.assert_speculated(spec[1:], prefix="t")
    assert spec[1]["stats"]["tree_rounds"] > 0


@pytest.mark.skipif(not AVAILABLE, reason="this CPU has no packed bfloat16 kernel (the loader keeps plain layers)")
def test_row_exact_verification_is_a_targets_and_stops_where_a_linear_differs(tmp_path, monkeypatch):
    """A runner alone (a draft's) keeps one pass; a target's engine turns row-exact rows on, up
    to the row count before the first at which a linear gives a row other bits."""
    from common import lean as lean_mod
    from starsd_target.engine import TargetEngine

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=6, hidden=32, layers=1)
    loaded = load_causal_lm(str(ckpt), dtype="bfloat16")
    assert ModelRunner(loaded).lean.row_exact_rows == 0
    assert TargetEngine(loaded).runner.lean.row_exact_rows == lean_mod.ROW_EXACT_MAX
    real = Bf16Linear.forward

    def off_at_seven(self, x):
        y = real(self, x)
        return y + 1 if x.dim() == 2 and x.shape[0] == 7 else y

    monkeypatch.setattr(Bf16Linear, "forward", off_at_seven)
    assert ModelRunner(loaded).lean.enable_row_exact() == 6


# bfloat16 layers held for fbgemm, where the CPU has no bfloat16 units (``Bf16FbgemmLinear``)

needs_fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                  reason="this PyTorch build has no fbgemm")


def _held_weight(layer: Bf16FbgemmLinear) -> torch.Tensor:
    """The weight ``layer`` multiplies by, in float32: its float16 values scaled back."""
    scaled, _ = torch.ops.quantized.linear_unpack_fp16(layer.inner._packed)
    return scaled.float() * layer.unscale[:, None]


@needs_fbgemm
def test_a_layer_held_for_fbgemm_keeps_the_bfloat16_values_of_rows_of_any_scale():
    """Rows whose values lie far outside float16's range (1e-9, 1e6) or span 2**30 within a row
    are held exactly, a zero row too; only a value more than 2**32 below its row's largest is
    rounded, and counted."""
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    w[1] *= 1e-9
    w[2] *= 1e6
    w[3] = (torch.rand(64) + 1) * torch.sign(w[3])
    w[3, :32] *= 2.0 ** -30  # [1, 2) and [2**-30, 2**-29) in one row
    w[4] = 0
    w = w.to(torch.bfloat16)
    layer = Bf16FbgemmLinear(w)
    assert layer.inexact == 0
    assert torch.equal(_held_weight(layer), w.float())
    w[5, 0] = w[5].float().abs().max() * 2.0 ** -31.5  # within 2**32 of its row's largest: exact
    assert Bf16FbgemmLinear(w).inexact == 0 and torch.equal(_held_weight(Bf16FbgemmLinear(w)), w.float())
    w[5, 0] = w[5].float().abs().max() * 2.0 ** -40
    assert Bf16FbgemmLinear(w).inexact == 1
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16FbgemmLinear(torch.zeros(4, 4))


@needs_fbgemm
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_held_for_fbgemm_computes_a_bfloat16_linear(bias):
    """bfloat16 in and out, any leading shape; each output is the float32 sum of the exact
    products (plus the bias) rounded to bfloat16: equal to a float64 reference's rounding but for
    a rare tie broken by the order of summation (then one bfloat16 step apart)."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 40, bias=bias).to(torch.bfloat16)
    layer = Bf16FbgemmLinear.from_linear(lin)
    x = torch.randn(2, 7, 300).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 7, 40)
    want = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
    nearest = want.to(torch.bfloat16)
    step = (nearest.float().abs() * 2.0 ** -7).clamp_min(1e-30)
    assert ((got.float() - nearest.float()).abs() <= step).all()
    assert (got == nearest).float().mean() > 0.98


@needs_fbgemm
@pytest.mark.parametrize("tied", [False, True])
def test_a_bfloat16_model_held_for_fbgemm_decodes_as_the_plain_model_up_to_rounding(tmp_path, monkeypatch, tied):
    """On a CPU without bfloat16 units every linear, a tied output layer too, is held for
    fbgemm; the serving path (the lean forward) runs it; its logits are the plain bfloat16
    model's within bfloat16's rounding."""
    from common import fp16_weights

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3, hidden=48, layers=2, tied=tied)
    monkeypatch.setattr(fp16_weights, "bf16_matrix_units", lambda: False)
    monkeypatch.setattr(bf16_packed, "packed_bf16_available", lambda: False)  # an AVX2 CPU's oneDNN
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    loaded = load_causal_lm(str(ckpt), dtype="bfloat16")
    kinds = {type(m) for m in loaded.model.modules() if isinstance(m, (torch.nn.Linear, Bf16FbgemmLinear))}
    assert kinds == {Bf16FbgemmLinear}
    monkeypatch.setenv(bf16_packed.BF16_FBGEMM_ENV, "0")
    plain = load_causal_lm(str(ckpt), dtype="bfloat16").model
    assert not any(type(m) is Bf16FbgemmLinear for m in plain.modules())
    prompt = [5, 9, 200, 17]
    runner = ModelRunner(loaded)
    assert runner.forward_kind == "lean"
    with torch.inference_mode():
        got, _ = runner.forward(runner.new_cache(16), prompt, logits="last")
        want = plain(torch.tensor([prompt])).logits[0, -1]
    got, want = got.reshape(-1).float(), want.reshape(-1).float()
    assert torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
