"""The model runner: in-place slot caches equal transformers' own cache, and compiled forwards
equal eager ones (logits within float tolerance, greedy tokens identical), rollback included."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from common.models import crop_cache, load_causal_lm
from common.runner import ModelRunner, inductor_cache_dir
from common.slot_cache import SlotCache, SlotLayer
from common.verify import SamplingParams
from starsd_draftd.backends.model import ModelBackend
from starsd_target.engine import TargetEngine
from tiny_models import make_tiny_checkpoint, reference_greedy


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def arch_model(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3, hidden=32, layers=2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def test_slot_cache_equals_dynamic_cache_with_rollback_and_growth(arch_model):
    """Feeding in pieces, rolling back and re-feeding other tokens, and growing past the
    preallocated slots gives the logits one uncached forward over the same sequence gives."""
    torch.manual_seed(0)
    seq = torch.randint(3, 250, (1, 90))
    other = torch.randint(3, 250, (1, 10))
    full = arch_model(input_ids=seq).logits
    slot = SlotCache(arch_model.config, capacity=16)  # 64 slots at least: grows once, to 128
    assert all(isinstance(layer, SlotLayer) for layer in slot.layers)
    arch_model(input_ids=seq[:, :40], cache=slot, use_cache=True)
    arch_model(input_ids=other, cache=slot, use_cache=True)  # a rejected draft ...
    crop_cache(slot, 40)  # ... rolled back by moving the position
    assert slot.get_seq_length() == 40
    parts = [arch_model(input_ids=seq[:, a:b], cache=slot, use_cache=True).logits
             for a, b in ((40, 41), (41, 46), (46, 90))]
    assert slot.get_seq_length() == 90
    assert slot.layers[0].capacity >= 90
    torch.testing.assert_close(torch.cat(parts, dim=1), full[:, 40:], rtol=1e-4, atol=1e-4)
    # the same steps on transformers' own cache give the same logits
    dyn = DynamicCache(config=arch_model.config)
    arch_model(input_ids=seq[:, :45], cache=dyn, use_cache=True)
    crop_cache(slot, 45)
    a = arch_model(input_ids=seq[:, 45:50], cache=dyn, use_cache=True).logits
    b = arch_model(input_ids=seq[:, 45:50], cache=slot, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_slot_layer_refuses_what_it_cannot_hold():
    layer = SlotLayer(4)
    k = torch.zeros(1, 2, 3, 8)
    layer.update(k, k)
    with pytest.raises(ValueError, match="batch"):
        layer.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)
    layer.crop(-2)
    assert layer.get_seq_length() == 1 and layer.keys.shape[2] == 1
    buf = layer.k_buf
    layer.replace(torch.ones(1, 2, 6, 8), torch.ones(1, 2, 6, 8))  # fits: the buffer is reused
    assert layer.k_buf is buf and layer.get_seq_length() == 6 and bool((layer.values == 1).all())
    big = torch.arange(100.0).view(1, 1, 100, 1).expand(1, 2, 100, 8)
    layer.replace(big, big)  # does not fit: grown, and holds exactly the new contents
    assert layer.capacity >= 100 and layer.get_seq_length() == 100
    assert torch.equal(layer.keys, big)


def test_engine_on_slot_cache_equals_generate(tiny_target, loaded_target):
    """The target alone, on the runner's cache, is the model's own greedy decoding."""
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode("def parse(line):\n    ")
    out = engine.generate(prompt, 40, SamplingParams())
    assert out.token_ids == reference_greedy(tiny_target, prompt, 40)


# ---------------------------------------------------------------- compiled forwards
@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Compiled artifacts in a directory of this module's own (not the user's cache)."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("inductor")
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def one_layer_pair(tmp_path_factory):
    """A one-layer target and a draft close to it: the compiled end-to-end tests' models (a graph's
    compile time grows with the layers it lowers; what they check does not)."""
    from tiny_models import make_near_copy

    target = make_tiny_checkpoint(tmp_path_factory.mktemp("target1"), "llama", seed=1, hidden=32, layers=1)
    return target, make_near_copy(target, tmp_path_factory.mktemp("near1"), noise=0.02)


def test_inductor_cache_lives_under_starsd_cache(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    assert inductor_cache_dir() == tmp_path / "inductor"
    # what importing torch._dynamo does when nothing set it, as loading a model does: the
    # variable then names torch's default under /tmp, which is not the user's choice
    cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
    assert inductor_cache_dir() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert inductor_cache_dir() == tmp_path / "mine"


def _assert_compiled_equals_eager_with_rollback(compiled: ModelRunner, eager: ModelRunner) -> None:
    """A compiled runner (symbolic lengths: a graph for one token, one for several) gives eager's
    logits on decode, verification and rolled-back steps."""
    assert compiled.compiled and not eager.compiled
    torch.manual_seed(1)
    prompt = torch.randint(3, 250, (30,)).tolist()
    ce, cc = eager.new_cache(64), compiled.new_cache(64)
    for runner, cache in ((eager, ce), (compiled, cc)):
        runner.forward(cache, prompt, "none")
    for step, ids in enumerate(([5], [7, 8, 9, 10, 11], [12, 13], [14], [15, 16, 17])):
        a, _ = eager.forward(ce, ids)
        b, _ = compiled.forward(cc, ids)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert b.argmax(-1).tolist() == a.argmax(-1).tolist()
        if step % 2:  # roll back all but the first of the fed tokens, as a rejected draft does
            for cache in (ce, cc):
                crop_cache(cache, cache.get_seq_length() - len(ids) + 1)
    assert cc.get_seq_length() == ce.get_seq_length()


@pytest.mark.slow
def test_compiled_star_parts_stay_exact_and_need_no_compile_after_warm_up(one_layer_pair, compile_cache):
    """Target engine and draft backend on compiled runners, warmed up as the daemons warm them
    up, then served with any further compilation an error (``fail_on_recompile``): the compiled
    target's logits equal eager's on decode, verification and rolled-back steps; greedy
    speculation (lookup on), over several prefill chunks, and a sampled generation all run on
    the warm-up's graphs, and greedy output equals generate(). (One test: each compiled runner
    costs tens of seconds of compilation here.)"""
    from fakes import LocalDrafts
    from starsd_draftd.suffix import SuffixIndex

    tiny_target, near_draft = one_layer_pair
    target = load_causal_lm(str(tiny_target))
    draft = load_causal_lm(str(near_draft))
    engine = TargetEngine(target, depth=4, prefill_chunk=8, runner=ModelRunner(target, compile=True))
    backend = ModelBackend(draft, lookup=SuffixIndex(), runner=ModelRunner(draft, compile=True))
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    assert engine.warm_up() > 0
    # a first prefill chunk (no mask over cached positions), a later one, one row (a decode step
    # and a round without drafts alike), and rows with every row's logits (a verification)
    assert counters["stats"]["unique_graphs"] - graphs == 4
    # batch_max=1: the batched graphs (drafted the same way) would double this test's compile time
    assert backend.warm_up(batch_max=1) > 0
    assert engine.runner.warm and backend.runner.warm
    engine.runner.serving_stance = backend.runner.serving_stance = "fail_on_recompile"
    assert compile_cache.exists() and any(compile_cache.iterdir())  # artifacts went to the configured cache
    _assert_compiled_equals_eager_with_rollback(engine.runner, ModelRunner(target))
    prompt = engine.encode("import os\nimport sys\nimport json\n")  # 32 positions: 4 prefill chunks
    out = engine.generate(prompt, 40, SamplingParams(), drafts=LocalDrafts(backend))
    assert out.token_ids == reference_greedy(tiny_target, prompt, 40)
    assert out.stats.accepted > 0 and out.stats.fallback_rounds == 0
    sampled = SamplingParams(temperature=0.8, seed=5)
    engine.generate(prompt, 16, sampled, drafts=LocalDrafts(backend, sampled))


@pytest.mark.slow
def test_compiled_fp16_weights_forward_equals_eager(tmp_path, compile_cache):
    """fp16-weights' fbgemm GEMM runs inside compiled graphs (through its registered op)."""
    from common.fp16_weights import fp16_weights_available

    if not fp16_weights_available():
        pytest.skip("this PyTorch build has no fbgemm (not an x86 CPU)")
    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=4, hidden=32, layers=1)
    loaded = load_causal_lm(str(path), dtype="fp16-weights")
    eager, compiled = ModelRunner(loaded), ModelRunner(loaded, compile=True)
    ids = list(range(3, 23))
    ce, cc = eager.new_cache(), compiled.new_cache()
    a, _ = eager.forward(ce, ids)
    b, _ = compiled.forward(cc, ids)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    a, _ = eager.forward(ce, [30])
    b, _ = compiled.forward(cc, [30])
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_draftd_serve_compile_builds_a_compiled_runner_and_warms_it_up(one_layer_pair, monkeypatch):
    """`starsd-draftd serve --compile`, through its command line: the draft model's runner is
    compiled and warmed up for the server's batch size before the daemon serves. (What the warm-up
    compiles, and that a compiled draft backend drafts exactly, the compiled star parts test
    shows; the target daemon compiles end to end below.)"""
    from click.testing import CliRunner

    from starsd_draftd import app
    from starsd_draftd.backends.model import ModelBackend
    from starsd_draftd.cli import main

    seen: dict = {}

    def serve(cfg):  # app.run up to the serving loop
        backend = app.build_backend(cfg)
        seen["compiled"], seen["kind"] = backend.runner.compiled, backend.runner.forward_kind

    monkeypatch.setattr(app, "run", serve)
    monkeypatch.setattr(ModelBackend, "warm_up", lambda self, batch_max=1: seen.setdefault("warm_up", batch_max))
    res = CliRunner().invoke(main, ["serve", "--model", str(one_layer_pair[1]), "--compile", "--batch-max", "3",
                                    "--bind", "tcp://127.0.0.1:0"])
    assert res.exit_code == 0, res.output
    assert seen == {"compiled": True, "kind": "compiled", "warm_up": 3}


@pytest.mark.slow
@pytest.mark.timeout(900)  # the target compiles before it serves (about a minute here)
def test_daemons_with_compile_stay_exact(star, one_layer_pair, compile_cache):
    """The target daemon started with --compile, as a user starts it: it compiles before it
    takes work, then serves greedy output equal to the model's own generate, with drafts kept
    and no round without drafts; STATS says it is compiled and what its warm-up cost. (Its draft
    daemon runs eagerly: two daemons compiling side by side here doubled this test's time.)"""
    from common.control import ControlClient
    from common.protocol import Message, MsgType
    from common.sockets import free_tcp_endpoint

    tiny_target, near_draft = one_layer_pair
    draft_ep, target_ep = free_tcp_endpoint(), star.job_endpoint("t0")
    star.start("draftd", "starsd_draftd", "serve", "--model", str(near_draft), "--bind", draft_ep, "--depth", "4")
    star.wait_ready("draftd", draft_ep, timeout_s=600)
    star.start("t0", "starsd_target", "serve", "--model", str(tiny_target), "--draft", draft_ep, "--listen",
               target_ep, "--depth", "4", "--compile", "--connect-timeout", "60")
    star.wait_ready("t0", target_ep, timeout_s=600)
    engine = TargetEngine(load_causal_lm(str(tiny_target)))
    prompt = engine.encode("class Point:\n")
    with ControlClient(target_ep) as cc:
        res = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt_ids": prompt, "max_tokens": 40}), timeout_s=300).header
        stats = cc.call(Message(MsgType.STATS, {}), timeout_s=30).header["stats"]
    assert res["token_ids"] == reference_greedy(tiny_target, prompt, 40)
    assert res["stats"]["accepted"] > 0 and res["stats"]["fallback_rounds"] == 0
    assert stats["compiled"] is True and stats["compile_s"] > 0


@torch.inference_mode()
def test_compact_keeps_a_path_as_if_only_it_had_been_fed(arch_model):
    """A two-branch draft tree fed in one forward with a tree mask, then compacted to one
    branch's path: the cache is the one feeding that path alone leaves (next logits agree)."""
    if arch_model.config.model_type == "gpt2":
        pytest.skip("GPT-2 takes no custom 4-D mask in this check; the rotary models do")
    torch.manual_seed(2)
    prefix = torch.randint(3, 250, (1, 12))
    a, x, b = 40, 41, 42  # the tree: a at position 12, then two children of a: x (rejected) and b
    slot = SlotCache(arch_model.config)
    arch_model(input_ids=prefix, cache=slot, use_cache=True)
    allowed = torch.zeros(3, 15, dtype=torch.bool)
    allowed[:, :12] = True
    allowed[0, 12] = True  # a sees the prefix and itself
    allowed[1, [12, 13]] = True  # x sees a and itself
    allowed[2, [12, 14]] = True  # b sees a and itself, not its sibling x
    mask = torch.zeros(1, 1, 3, 15).masked_fill(~allowed, torch.finfo(torch.float32).min)
    arch_model(input_ids=torch.tensor([[a, x, b]]), cache=slot, use_cache=True, attention_mask=mask,
               position_ids=torch.tensor([[12, 13, 13]]))
    slot.compact(torch.tensor([*range(12), 12, 14]))
    assert slot.get_seq_length() == 14
    nxt = torch.tensor([[7]])
    got = arch_model(input_ids=nxt, cache=slot, use_cache=True).logits
    ref = SlotCache(arch_model.config)
    arch_model(input_ids=torch.cat([prefix, torch.tensor([[a, b]])], dim=1), cache=ref, use_cache=True)
    want = arch_model(input_ids=nxt, cache=ref, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="positions"):
        slot.compact(torch.tensor([0, 99]))
