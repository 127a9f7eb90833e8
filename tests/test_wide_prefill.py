"""Wide prefill: fp16-weights prompt chunks of WIDE_ROWS (a bfloat16 checkpoint) or
WIDE_ROWS_CONVERTED (a float32 one) or more multiply the checkpoint's own weights in bfloat16
with float32 accumulation (common.fp16_weights, "Wide prefill"); nothing else
does, and speculation stays exact."""

import pytest
import torch

from common import lean as lean_mod
from common.fp16_weights import (FP16_WEIGHTS, WIDE_ROWS, WIDE_ROWS_CONVERTED, fp16_weights_available, wide_linear,
                                 wide_prefill_available)
from common.models import load_causal_lm
from common.runner import ModelRunner
from common.verify import SamplingParams
from fakes import speculate_with
from starsd_draftd.backends.model import ModelBackend
from starsd_target.engine import TargetEngine
from tiny_models import mapped_resident_kib

pytestmark = pytest.mark.skipif(not (fp16_weights_available() and wide_prefill_available()[0]),
                                reason="wide prefill needs fbgemm and a CPU with AMX or AVX-512 BF16 "
                                       f"({wide_prefill_available()[1]})")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def count_wide(monkeypatch):
    """How many wide forwards ran since the test began (the lean forward ends each with wide_done)."""
    calls = []
    real = lean_mod.wide_done

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(lean_mod, "wide_done", spy)
    return lambda: len(calls)


def test_wide_linear_on_float32_weights_is_bfloat16_products_with_float32_sums_whatever_the_rows_beside():
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(96, 80, generator=g), torch.randn(40, 80, generator=g)
    b1 = torch.randn(96, generator=g)
    x = torch.randn(300, 80, generator=g)
    got = wide_linear([(w1, b1), (w2, None)], x)
    assert got.shape == (300, 136) and got.dtype == torch.float32
    rounded = x.bfloat16().double()
    want = torch.cat([rounded @ w1.bfloat16().double().T + b1.double(), rounded @ w2.bfloat16().double().T], -1)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)  # float32 sums of exact bf16 products
    exact = torch.cat([x.double() @ w1.double().T + b1.double(), x.double() @ w2.double().T], -1)
    assert (got.double() - exact).abs().max() > 1e-3  # the inputs were rounded: it did go bfloat16
    for rows in (WIDE_ROWS, 100, 299):  # a row's bits do not depend on the rows beside it
        assert torch.equal(wide_linear([(w1, b1), (w2, None)], x[:rows]), got[:rows])
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # the mode is put back


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_linear_on_16_bit_weights(dtype):
    """A bfloat16 checkpoint's weights as read, a bfloat16 model's arithmetic (outputs rounded
    to bfloat16, the bias added after); a float16 one's widened, as float32 weights go."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 48, generator=g).to(dtype), torch.randn(64, generator=g)
    x = torch.randn(40, 48, generator=g)
    got = wide_linear([(w, b)], x)
    assert got.dtype == torch.float32
    products = x.bfloat16().double() @ w.bfloat16().double().T
    if dtype == torch.bfloat16:
        assert torch.equal(got, torch.nn.functional.linear(x.bfloat16(), w).float() + b)
        want = products.to(torch.bfloat16).double() + b.double()
        assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)
    else:
        assert torch.allclose(got.double(), products + b.double(), rtol=1e-5, atol=1e-4)


def test_only_a_long_prefill_goes_wide_and_its_cache_is_the_plain_one_to_bfloat16_precision(tmp_path, count_wide):
    from tiny_models import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path, "llama", seed=5, hidden=256, layers=1)
    path = src / "model.safetensors"
    runner = ModelRunner(load_causal_lm(str(src), dtype=FP16_WEIGHTS))
    lean = runner.lean
    assert lean is not None and lean.wide_layers is None and runner.wide_prefill_rows == 0  # a draft's runner
    assert runner.enable_wide_prefill()  # as a target's engine asks
    assert lean.wide_layers is not None and runner.wide_prefill_rows == WIDE_ROWS_CONVERTED
    source_kib = sum(w.numel() * w.element_size() for w in lean._wide_weights) // 1024
    assert source_kib >= 2048  # the layer's float32 weights, read from the mapped file
    before = mapped_resident_kib(path)
    prompt = _prompt(WIDE_ROWS_CONVERTED + 20)
    wide_cache = runner.new_cache()
    runner.forward(wide_cache, prompt, logits="none")
    assert count_wide() == 1
    # the pages it read are given back after the forward (the embedding rows looked up stay)
    assert mapped_resident_kib(path) - before <= 128
    # a verification of as many rows (every row's logits), a short prefill and a step stay in float32
    verify_cache = runner.new_cache()
    runner.forward(verify_cache, prompt, logits="all")
    runner.forward(runner.new_cache(), prompt[: WIDE_ROWS_CONVERTED - 1], logits="none")
    step, _ = runner.forward(wide_cache, prompt[-1:], logits="last")
    assert count_wide() == 1
    # the plain cache (float32 arithmetic) and the wide one agree to bfloat16's precision, not bit for bit
    for plain, wide in zip(verify_cache.layers, wide_cache.layers):
        k_plain, k_wide = plain.keys[..., : len(prompt), :], wide.keys[..., : len(prompt), :]
        assert (k_plain - k_wide).abs().max() <= 0.01 * k_plain.abs().max()  # measured: 0.24%
        assert not torch.equal(k_plain, k_wide)
    # the next step's logits (a random model this small amplifies the keys' differences: 5.7% measured)
    plain_step, _ = runner.forward(verify_cache, prompt[-1:], logits="last")
    assert (plain_step - step).abs().max() <= 0.15 * plain_step.abs().max()


def test_wide_prefill_stays_off_when_asked(tiny_target, monkeypatch):
    monkeypatch.setenv("STARSD_WIDE_PREFILL", "0")
    engine = TargetEngine(load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS), depth=4)
    assert engine.runner.lean.wide_layers is None and engine.runner.wide_prefill_rows == 0
    assert "STARSD_WIDE_PREFILL=0" in engine.runner.lean.wide_reason


def test_a_target_goes_wide_and_a_draft_daemon_does_not(tiny_target):
    """A draft's prefill runs while the target's does; a seeded sampled session's draws follow
    its draft forwards' rounding, which must not depend on the feeds batched beside it."""
    engine = TargetEngine(load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS), depth=4)
    assert engine.runner.wide_prefill_rows == WIDE_ROWS_CONVERTED
    backend = ModelBackend(load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS))
    assert backend.runner.wide_prefill_rows == 0


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_a_batched_prefill_runs_wide_chunks_alone(tiny_target, tmp_path, saved, count_wide):
    """Chunks on either side of WIDE_ROWS prefilled together: each cache holds, bit for bit, what
    prefilling its prompt alone gives (a wide chunk's rounding follows its own length alone)."""
    src = tiny_target
    if saved != torch.float32:
        from transformers import AutoModelForCausalLM

        src = tmp_path / "bf16"
        AutoModelForCausalLM.from_pretrained(tiny_target, dtype=saved).save_pretrained(src)
    loaded = load_causal_lm(str(src), dtype=FP16_WEIGHTS)
    # a bfloat16 checkpoint's weights go wide as they are; a float32 one's are converted each call
    W = WIDE_ROWS if saved == torch.bfloat16 else WIDE_ROWS_CONVERTED
    prompts = [_prompt(3 * W + 1, 1), _prompt(8, 2), _prompt(2 * W + 1, 3), _prompt(6, 4)]
    caches = []
    for max_batch in (4, 1):
        engine = TargetEngine(loaded, depth=4, max_batch=max_batch, prefill_chunk=2 * W)
        assert engine.runner.wide_prefill_rows == W
        gens = [engine.start(p, 8, SamplingParams()) for p in prompts]
        while any(g.prefilling for g in gens):
            engine.prefill_batch([g for g in gens if g.prefilling])
        assert all(g.prefilled == g.to_prefill for g in gens)
        caches.append([[layer.keys[..., : g.prefilled, :].clone() for layer in g.cache.layers] for g in gens])
    # the first prompt's two chunks (2W, W) and the third's one (2W), together and then apart
    assert count_wide() == 6
    for batched, apart in zip(*caches):
        assert all(torch.equal(a, b) for a, b in zip(batched, apart))


def test_speculation_after_a_wide_prefill_is_exact_and_speculates(tiny_target, near_draft, count_wide):
    target = load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS)
    engine = TargetEngine(target, depth=4)
    prompt = _prompt(3 * WIDE_ROWS_CONVERTED, 4)
    alone = engine.generate(prompt, 40, SamplingParams())
    assert count_wide() == 1  # the prompt's tokens before the last, one chunk
    backend = ModelBackend(load_causal_lm(str(near_draft), dtype=FP16_WEIGHTS))
    r = speculate_with(backend, engine, prompt, 40, SamplingParams())
    assert count_wide() == 2  # the target's prefill went wide again; the draft daemon's did not
    assert r.token_ids == alone.token_ids
    assert r.stats.fallback_rounds == 0 and r.stats.accepted > 0


def test_the_scheduler_runs_a_wide_chunk_alone_and_counts_its_forwards(tiny_target):
    """Two prompts whose chunks go wide and two short ones, all at once: each wide chunk in a
    forward of its own, the short ones together; outputs as the target alone gives them."""
    from starsd_target.scheduler import Job, Scheduler

    engine = TargetEngine(load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS), depth=4, max_batch=4,
                         prefill_chunk=256)
    prompts = [_prompt(WIDE_ROWS_CONVERTED + 5, 5), _prompt(WIDE_ROWS_CONVERTED + 9, 6), _prompt(5, 7), _prompt(6, 8)]
    sched = Scheduler(engine, lambda: None, draft_timeout_s=10, max_active=4, admit_window_s=0.5)
    futures = [sched.submit(Job(p, 6, SamplingParams(), no_draft=True)) for p in prompts]
    sched.start()
    outs = [f.result(120) for f in futures]
    load = sched.load()
    sched.stop()
    assert (load["prefill_forwards"], load["batched_prefills"]) == (3, 2)
    alone = TargetEngine(load_causal_lm(str(tiny_target), dtype=FP16_WEIGHTS), depth=4)
    assert [o.token_ids for o in outs] == [alone.generate(p, 6, SamplingParams()).token_ids for p in prompts]


def test_no_wide_prefill_on_a_pytorch_without_the_bf16_math_mode(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.backends, "mkldnn", SimpleNamespace(is_available=lambda: True))
    ok, why = wide_prefill_available()
    assert not ok and "bf16 math mode" in why
