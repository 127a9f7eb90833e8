"""--dtype fp16-weights: linear weights in float16 through fbgemm, float32 activations."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.fp16_weights import FP16_WEIGHTS, Fp16Linear, fp16_weights_available, pack_linears
from common.models import ModelLoadError, load_causal_lm, resolve_dtype
from common.verify import SamplingParams
from fakes import speculate_with
from starsd_draftd.backends.model import ModelBackend
from starsd_target.engine import TargetEngine
from tiny_models import EOS_ID, PAD_ID

pytestmark = pytest.mark.skipif(not fp16_weights_available(),
                                reason="fbgemm is x86-only; the CPU-format test needs an x86 build of PyTorch")


def _fp16_rounded(model_dir):
    """The checkpoint with its linear weights rounded to float16 and computed in float32: what
    fp16-weights serves, built the plain way."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.half().float())
    return model


def test_fp16_linear_matches_float32_on_rounded_weights_row_by_row():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lin = Fp16Linear(w, b)
    x = torch.randn(2, 7, 40, generator=g)
    want = torch.nn.functional.linear(x, w.half().float(), b)
    got = lin(x)
    assert got.shape == (2, 7, 96) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # no activation is quantized: the rows beside a row change its result by float rounding only
    one = lin(x[:1, 3:4])
    assert torch.allclose(one[0, 0], got[0, 3], atol=1e-5, rtol=1e-5)


def test_loading_packs_every_linear_and_keeps_the_models_logits(tiny_target):
    loaded = load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS)
    mods = list(loaded.model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in mods)
    assert sum(isinstance(m, Fp16Linear) for m in mods) == 2 * 7 + 1  # q k v o gate up down per layer, head
    assert loaded.dtype == torch.float32 and loaded.logits_size == loaded.vocab_size
    ids = torch.tensor([[1, 5, 9, 30, 2, 77]])
    with torch.inference_mode():
        got = loaded.model(input_ids=ids).logits
        want = _fp16_rounded(tiny_target)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_speculation_in_fp16_weights_is_exact_and_speculates(tiny_target, near_draft):
    target = load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS)
    engine = TargetEngine(target, depth=4)
    prompt = engine.encode("def parse(line):\n    ")
    ref_model = _fp16_rounded(tiny_target)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID)[0, len(prompt):].tolist()
    alone = engine.generate(prompt, 40, SamplingParams())
    assert alone.token_ids == ref  # the same model, decoded the plain way
    backend = ModelBackend(load_causal_lm(str(near_draft), dtype=FP16_WEIGHTS))
    r = speculate_with(backend, engine, prompt, 40, SamplingParams())
    assert r.token_ids == ref
    assert r.stats.fallback_rounds == 0 and r.stats.accepted > 0


def test_fp16_weights_refuses_what_it_cannot_do(monkeypatch):
    with pytest.raises(ModelLoadError, match="CPU format"):
        resolve_dtype(FP16_WEIGHTS, torch.device("cuda"))
    import common.fp16_weights as fw

    monkeypatch.setattr(fw, "fp16_weights_available", lambda: False)  # as on an ARM build (Jetson)
    with pytest.raises(ModelLoadError, match="fbgemm"):
        resolve_dtype(FP16_WEIGHTS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="fbgemm"):
        pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_the_demo_picks_the_fastest_exact_cpu_format(monkeypatch):
    import common.fp16_weights as fw
    from starsd_draftd.demo import run

    cfg = run.DemoConfig()
    monkeypatch.setattr(fw, "fp16_weights_available", lambda: True)
    for native in (True, False):  # fp16-weights first: exact (float32 compute), and the faster one measured
        monkeypatch.setattr(run, "cpu_has_native_bf16", lambda: native)
        assert run.demo_dtype(cfg) == FP16_WEIGHTS
    monkeypatch.setattr(fw, "fp16_weights_available", lambda: False)
    assert run.demo_dtype(cfg) == "auto"
    monkeypatch.setattr(run, "cpu_has_native_bf16", lambda: True)
    assert run.demo_dtype(cfg) == "bfloat16"  # no fbgemm (an ARM board, say): native bfloat16
    assert run.demo_dtype(run.DemoConfig(dtype="float32")) == "float32"  # an explicit choice stands


def test_layers_packed_side_by_side_are_the_ones_packed_one_at_a_time():
    """``pack_linears`` packs several layers at once on threads: the same packed weights, each
    layer in its place, and ``done`` told of every weight in the model's order."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(16 + i, 8 + i, bias=i % 2 == 0) for i in range(7)])

    outs = []
    for workers in (1, 3):
        m = model()
        weights = [lin.weight for lin in m]
        told: list = []
        assert pack_linears(m, done=told.append, workers=workers) == 7
        assert [w is t for w, t in zip(weights, told)] == [True] * 7
        x = [torch.randn(2, 16 + i, generator=torch.Generator().manual_seed(i)) for i in range(7)]
        outs.append([layer(xi) for layer, xi in zip(m, x)])
        assert all(type(layer) is Fp16Linear for layer in m)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
