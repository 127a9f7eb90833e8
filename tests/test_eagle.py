"""The EAGLE-1 draft backend: compatibility shims, loading heads in EAGLE's published layouts with
only the target tensors they need, exact cache rollback, sampling proposals, and training."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models import ModelLoadError, load_causal_lm
from common.verify import SamplingParams, logits_to_probs
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.backends.eagle import EagleBackend, load_eagle_head
from starsd_draftd.backends.eagle_compat import build_head, cnets_config, restore_rotary_precision
from starsd_draftd.demo.eagle_train import head_config_for, save_eagle_head, train_eagle_head
from tiny_models import make_tiny_checkpoint

HIDDEN = 48  # the conftest's tiny_target


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=259, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


def _random_head(target, out, fmt="safetensors", include_embedding=False, seed=0, **overrides):
    """A random-init head for ``target`` (a LoadedModel) written in EAGLE's layout."""
    cfg = head_config_for(target.model.config, HIDDEN, 259)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(seed)
    head = build_head(cfg, bias=True)
    if include_embedding and head.embed_tokens.weight.shape == target.model.get_input_embeddings().weight.shape:
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    return save_eagle_head(head, cfg, out, fmt, include_embedding=include_embedding)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, loaded_target):
    return _random_head(loaded_target, tmp_path_factory.mktemp("head"), seed=3)


@pytest.fixture(scope="module")
def backend(head_dir, tiny_target):
    return EagleBackend.from_dirs(head_dir, tiny_target, dtype="float32")


def _features(model, tokens):
    """The target's features of every position of ``tokens``: [len, H]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]


# ------------------------------------------------------------------------ compatibility shims


def test_compat_shim_makes_current_configs_readable_by_the_head_class():
    from eagle.model.cnets import LlamaLinearScalingRotaryEmbedding, LlamaRotaryEmbedding, Model

    plain = _llama_config()
    with pytest.raises(KeyError):  # what the shim exists for: rope_scaling is a dict without 'type' now
        Model(plain, load_emb=False, bias=True)
    cfg = cnets_config(plain)
    assert cfg.rope_scaling is None and cfg.pretraining_tp == 1
    assert plain.rope_parameters["rope_type"] == "default"  # the caller's config is not changed
    assert type(build_head(plain, bias=True).layers[0].self_attn.rotary_emb) is LlamaRotaryEmbedding

    linear = cnets_config(_llama_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == {"type": "linear", "factor": 2.0}
    head = build_head(_llama_config(rope_scaling={"type": "linear", "factor": 2.0}), bias=False)
    assert isinstance(head.layers[0].self_attn.rotary_emb, LlamaLinearScalingRotaryEmbedding)
    assert head.fc.bias is None and not head.gradient_checkpointing

    with pytest.raises(ModelLoadError, match="yarn"):
        cnets_config(_llama_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="head_dim"):
        cnets_config(_llama_config(head_dim=16))


def test_compat_rotary_precision_and_cached_positions():
    torch.manual_seed(0)
    head = build_head(_llama_config(), bias=True).eval()
    rot = head.layers[0].self_attn.rotary_emb
    want_cos = rot.cos_cached.clone()
    h = torch.randn(1, 6, HIDDEN)
    ids = torch.randint(3, 259, (1, 6))
    with torch.inference_mode():
        whole, _ = head(h, input_ids=ids, use_cache=True)
        first, past = head(h[:, :4], input_ids=ids[:, :4], use_cache=True)
        rest, past = head(h[:, 4:], input_ids=ids[:, 4:], past_key_values=past, use_cache=True)
    # with a cache the positions continue at the cached length
    assert past[0][0].shape[2] == 6
    assert torch.allclose(torch.cat([first, rest], 1), whole, atol=1e-5)

    head.to(torch.bfloat16)
    assert rot.inv_freq.dtype == torch.bfloat16
    restore_rotary_precision(head)
    assert rot.inv_freq.dtype == torch.float32 and rot.cos_cached.dtype == torch.float32
    assert torch.equal(rot.cos_cached, want_cos)
    with torch.inference_mode():  # the float32 causal mask works with bfloat16 activations
        low, past = head(h[:, :4].bfloat16(), input_ids=ids[:, :4], use_cache=True)
        low2, _ = head(h[:, 4:].bfloat16(), input_ids=ids[:, 4:], past_key_values=past, use_cache=True)
    low = torch.cat([low, low2], 1).float()
    assert torch.isfinite(low).all()
    assert (low - whole).abs().max() < 0.05 * whole.abs().max()


# ------------------------------------------------------------------------ loading


def _tensor_only_target(src, dst):
    """A copy of a target directory with only config, weights and tokenizer files."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.parametrize("fmt, include_embedding", [("bin", True), ("safetensors", False), ("bin", False)])
def test_published_layouts_load_without_building_the_target(tmp_path, monkeypatch, tiny_target, loaded_target,
                                                            fmt, include_embedding):
    import transformers

    head_dir = _random_head(loaded_target, tmp_path / "head", fmt, include_embedding)
    weights = {"bin": "pytorch_model.bin", "safetensors": "model.safetensors"}[fmt]
    assert sorted(p.name for p in head_dir.iterdir()) == ["config.json", weights]
    target_dir = _tensor_only_target(tiny_target, tmp_path / "target")

    def refuse(*a, **k):
        raise AssertionError("the EAGLE loader must not build the target model")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    b = EagleBackend.from_dirs(head_dir, target_dir, dtype="float32")
    monkeypatch.undo()

    ref = load_file(str(tiny_target / "model.safetensors"))
    assert torch.equal(b.head.lm_head_weight, ref["lm_head.weight"])
    assert torch.equal(b.head.module.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert (b.vocab_size, b.fingerprint) == (loaded_target.vocab_size, loaded_target.fingerprint)
    assert b.feature_size == HIDDEN and b.name == "eagle"
    prompt = list(range(40, 52))
    d = b.draft(b.new_state(SamplingParams()), prompt, 4, _features(loaded_target.model, prompt)[:-1])
    assert len(d.tokens) == 4 and all(0 <= t < b.vocab_size for t in d.tokens) and d.q_ids is None


def _shard(state, out, fmt):
    """Write ``state`` as two shards plus an index, as save_pretrained does for large models."""
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        shard = f"model-0000{i + 1}-of-00002.{'safetensors' if fmt == 'safetensors' else 'bin'}"
        tensors = {k: state[k].contiguous() for k in part}
        if fmt == "safetensors":
            save_file(tensors, str(out / shard))
        else:
            torch.save(tensors, out / shard)
        weight_map.update({k: shard for k in part})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (out / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["bin", "sharded-safetensors", "sharded-bin"])
def test_target_tensors_are_read_by_name_from_every_layout(tmp_path, tiny_target, head_dir, layout):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / name, target_dir / name)
    state = load_file(str(tiny_target / "model.safetensors"))
    if layout == "bin":
        torch.save(state, target_dir / "pytorch_model.bin")
    else:
        _shard(state, target_dir, layout.split("-")[1])
    head = load_eagle_head(head_dir, target_dir, dtype="float32")
    assert torch.equal(head.lm_head_weight, state["lm_head.weight"])
    assert torch.equal(head.embed_weight, state["model.embed_tokens.weight"])


def test_tied_gpt2_target_uses_its_embedding_as_lm_head(tmp_path):
    target_dir = make_tiny_checkpoint(tmp_path / "gpt2", "gpt2", seed=4, hidden=32, layers=1)
    loaded = load_causal_lm(str(target_dir))
    cfg = head_config_for(loaded.model.config, 32, 259)
    head_dir = save_eagle_head(build_head(cfg, bias=True), cfg, tmp_path / "head")
    b = EagleBackend.from_dirs(head_dir, target_dir, dtype="float32")
    assert torch.equal(b.head.lm_head_weight, loaded.model.get_output_embeddings().weight)
    assert (b.vocab_size, b.fingerprint) == (loaded.vocab_size, loaded.fingerprint)
    prompt = list(range(60, 70))
    assert len(b.draft(b.new_state(SamplingParams()), prompt, 3, _features(loaded.model, prompt)[:-1]).tokens) == 3


def test_missing_files_and_tensors_fail_clearly(tmp_path, tiny_target, head_dir):
    state = load_file(str(tiny_target / "model.safetensors"))

    def target_with(tensors):
        d = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        shutil.copy(tiny_target / "config.json", d / "config.json")  # says tie_word_embeddings: false
        if tensors is not None:
            save_file(tensors, str(d / "model.safetensors"))
        return d

    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_eagle_head(head_dir, target_with({k: v for k, v in state.items() if k != "lm_head.weight"}))
    with pytest.raises(ModelLoadError, match="model.embed_tokens.weight"):
        load_eagle_head(head_dir, target_with({k: v for k, v in state.items() if "embed" not in k}))
    with pytest.raises(ModelLoadError, match="holds no weights"):
        load_eagle_head(head_dir, target_with(None))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle_head(tmp_path / "nowhere", tiny_target)
    bare = tmp_path / "bare-head"
    bare.mkdir()
    shutil.copy(head_dir / "config.json", bare / "config.json")
    with pytest.raises(ModelLoadError, match="no EAGLE head weights"):
        load_eagle_head(bare, tiny_target)


def test_head_that_does_not_fit_the_target_names_both_sizes(tmp_path, loaded_target, tiny_target):
    wide = _random_head(loaded_target, tmp_path / "wide", hidden_size=64, intermediate_size=128)
    with pytest.raises(ModelLoadError, match="hidden size 64") as info:
        load_eagle_head(wide, tiny_target)
    assert "48" in str(info.value)
    big = _random_head(loaded_target, tmp_path / "big", vocab_size=300)
    with pytest.raises(ModelLoadError, match="vocabulary size 300") as info:
        load_eagle_head(big, tiny_target)
    assert "259" in str(info.value)


# ------------------------------------------------------------------------ drafting


def _run_rounds(backend, target, seed, rounds=10, depth=4):
    """Drive one session through rounds that keep a random number of drafts, then compare each
    round's draft with a fresh session given the whole verified sequence and all features at once."""
    rng = random.Random(seed)
    verified = [rng.randrange(3, 259) for _ in range(rng.randint(1, 6))]
    st = backend.new_state(SamplingParams())
    sent = []
    for r in range(rounds):
        feats = _features(target.model, verified[:-1])[sum(f.shape[0] for f in sent):] if len(verified) > 1 \
            else torch.zeros(0, HIDDEN)
        sent.append(feats.half())  # features travel as float16
        got = backend.draft(st, verified, depth, sent[-1])
        fresh = backend.new_state(SamplingParams())
        want = backend.draft(fresh, list(verified), depth, torch.cat(sent))
        assert got.tokens == want.tokens, (seed, r)
        if len(verified) == 1:
            assert got.tokens == []  # no feature yet
        else:
            assert len(got.tokens) == depth
            # real pairs plus the pairs of the draft's own predicted features (all but the last token's)
            assert st.past[0][0].shape[2] == len(verified) - 1 + depth - 1
        if rng.random() < 0.2:  # the same request again (no new features) gives the same draft
            assert backend.draft(st, verified, depth, torch.zeros(0, HIDDEN)).tokens == got.tokens
            sent.append(torch.zeros(0, HIDDEN))
        kept = rng.choice([0, 0, 1, depth // 2, depth])
        bonus = rng.randrange(3, 259)
        verified = verified + got.tokens[:kept] + [bonus]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_incremental_drafts_equal_a_fresh_session(backend, loaded_target, seed):
    _run_rounds(backend, loaded_target, seed)


def _run_sessions(backend, target, seed, params, batched, n_sessions=5, rounds=6, min_survival=0.0, asked=None):
    """Several sessions (ragged prompts, one of a single token) through rounds that keep a random
    part of each draft, or now and then repeat a request (no new features); every round's
    requests served together or one at a time, greedy chains stopped at ``min_survival``.
    ``asked``: a list that gets each round's depths."""
    rng = random.Random(seed)
    verified = [[rng.randrange(3, 259) for _ in range(1 if i == 0 else rng.randint(2, 12))] for i in range(n_sessions)]
    states = [backend.new_state(params) for _ in range(n_sessions)]
    sent = [0] * n_sessions
    log = []
    for _ in range(rounds):
        reqs = []
        for i in range(n_sessions):
            feats = _features(target.model, verified[i][:-1])[sent[i]:].half() if len(verified[i]) > 1 \
                else torch.zeros(0, HIDDEN)
            sent[i] = len(verified[i]) - 1
            reqs.append(DraftRequest(states[i], list(verified[i]), rng.randint(1, 5), feats, min_survival=min_survival))
        drafts = backend.draft_many(reqs) if batched else \
            [backend.draft(r.state, r.verified, r.depth, r.new_features, min_survival=r.min_survival) for r in reqs]
        if asked is not None:
            asked.append([r.depth for r in reqs])
        log.append([d.tokens for d in drafts])
        for i, d in enumerate(drafts):
            if rng.random() < 0.2:
                continue  # the same request again next round: no new features for this session
            verified[i] += d.tokens[: rng.randint(0, len(d.tokens))] + [rng.randrange(3, 259)]
    return log, states


@pytest.mark.parametrize("seed, params", [(0, SamplingParams()), (1, SamplingParams()),
                                          (2, SamplingParams(temperature=0.9, top_k=30, seed=4))])
def test_batched_drafts_and_caches_equal_one_at_a_time(backend, loaded_target, seed, params):
    one, s1 = _run_sessions(backend, loaded_target, seed, params, batched=False)
    many, s2 = _run_sessions(backend, loaded_target, seed, params, batched=True)
    assert one == many
    assert any(len(round_) > 1 and all(round_) for round_ in many)  # real batches were drafted
    for a, b in zip(s1, s2):
        assert a.pairs == b.pairs
        assert torch.allclose(a.last_hidden, b.last_hidden, atol=1e-5)
        for (ka, va), (kb, vb) in zip(a.past, b.past):
            assert ka.shape == kb.shape and va.shape == vb.shape
            assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_chains_stop_where_one_at_a_time_they_would(backend, loaded_target, seed):
    """Greedy chains stopped by their requests' threshold: batched as one at a time, the same
    drafts and caches; some chains stopped short of their depth beside others that went on."""
    tau = 0.001  # this random head's picks are unsure: chains of 1 to 5 stop beside full ones
    asked: list = []
    one, s1 = _run_sessions(backend, loaded_target, seed, SamplingParams(), batched=False, min_survival=tau,
                            asked=asked)
    many, s2 = _run_sessions(backend, loaded_target, seed, SamplingParams(), batched=True, min_survival=tau)
    assert one == many
    lengths = [(len(t), d) for round_, depths in zip(many, asked) for t, d in zip(round_, depths) if t]
    assert any(n < d for n, d in lengths) and any(n > 1 for n, _ in lengths)
    for a, b in zip(s1, s2):
        assert a.pairs == b.pairs
        for (ka, va), (kb, vb) in zip(a.past, b.past):
            assert ka.shape == kb.shape and torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


def test_feature_count_must_match_the_verified_tokens(backend, loaded_target):
    prompt = list(range(20, 30))
    feats = _features(loaded_target.model, prompt)
    st = backend.new_state(SamplingParams())
    with pytest.raises(ValueError, match="holds 0 features and got 8"):
        backend.draft(st, prompt, 2, feats[:8])
    with pytest.raises(ValueError, match=r"shape \[m, 48\]"):
        backend.draft(st, prompt, 2, torch.zeros(9, 32))
    backend.draft(st, prompt, 2, feats[:9])
    with pytest.raises(ValueError, match="changed"):
        backend.draft(st, [*prompt[:3], 7, *prompt[4:], 40], 2, feats[9:10])


def test_sampling_proposals_are_exact_and_reproducible(head_dir, tiny_target, loaded_target):
    b = EagleBackend.from_dirs(head_dir, tiny_target, dtype="float32", q_topk=16)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    prompt = list(range(70, 90))
    feats = _features(loaded_target.model, prompt)[:-1]
    st = b.new_state(params)
    d = b.draft(st, prompt, 5, feats)
    assert d.q_ids.shape == d.q_probs.shape == (5, 16)
    assert d.q_ids.dtype == torch.int32 and d.q_probs.dtype == torch.float32
    assert torch.allclose(d.q_probs.sum(-1), torch.ones(5), atol=1e-5)
    for tok, row in zip(d.tokens, d.q_ids):
        assert tok in row.tolist()
    # row 0 is the truncated, renormalised top-16 of the head's distribution for x_1
    probs = logits_to_probs(b._logits(st.last_hidden), params)
    top = torch.topk(probs, 16)
    assert torch.equal(d.q_ids[0], top.indices.to(torch.int32))
    assert torch.allclose(d.q_probs[0], top.values / top.values.sum())
    again = b.draft(b.new_state(params), prompt, 5, feats)
    assert again.tokens == d.tokens and torch.equal(again.q_probs, d.q_probs) and torch.equal(again.q_ids, d.q_ids)


def test_bfloat16_backend_keeps_rotary_tables_in_float32(head_dir, tiny_target, backend, loaded_target):
    low = EagleBackend.from_dirs(head_dir, tiny_target, dtype="bfloat16")
    assert low.module.fc.weight.dtype == low.head.lm_head_weight.dtype == torch.bfloat16
    assert low.module.layers[0].self_attn.rotary_emb.inv_freq.dtype == torch.float32
    prompt = list(range(30, 60))
    feats = _features(loaded_target.model, prompt)[:-1].half()
    st_low, st_ref = low.new_state(SamplingParams()), backend.new_state(SamplingParams())
    assert len(low.draft(st_low, prompt, 4, feats).tokens) == 4
    backend.draft(st_ref, prompt, 4, feats)
    want, got = backend._logits(st_ref.last_hidden), low._logits(st_low.last_hidden)
    assert (got - want).abs().max() < 0.03 * want.abs().max()


def test_through_the_draft_server(backend, tiny_target, loaded_target):
    """Real server and client: greedy output equals the target's own generate(); sampling rounds all
    carry valid proposals."""
    from fakes import running_server, speculate
    from starsd_target.client import DraftClient
    from starsd_target.engine import TargetEngine
    from tiny_models import reference_greedy

    engine = TargetEngine(loaded_target, depth=4)
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             feature_size=loaded_target.feature_size)
        assert client.handshake(10).feature_size == HIDDEN
        # "x" is a one-token prompt: the first round has no feature to draft from
        for sid, text in enumerate(["def parse(line):\n    ", "x"], start=1):
            prompt = engine.encode(text)
            r = speculate(engine, client, prompt, 30, SamplingParams(), 30)
            assert r.token_ids == reference_greedy(tiny_target, prompt, 30)
            assert r.stats.fallback_rounds == 0 and r.stats.drafted > 0
        params = SamplingParams(temperature=1.0, top_k=20, seed=5)
        r = speculate(engine, client, engine.encode("import os"), 30, params, 30)
        assert r.stats.fallback_rounds == 0 and r.stats.invalid_drafts == 0 and r.stats.drafted > 0
        client.close()
    assert server.stats.errors == {}


# ------------------------------------------------------------------------ training


def test_training_writes_a_loadable_head(tmp_path, tiny_target, loaded_target):
    out = tmp_path / "eagle"
    kw = dict(time_budget_s=None, progress=False, num_threads=1, batch_size=2, seq_len=32, corpus_bytes=40_000, eval_windows=2,
              eval_prompts=1, eval_tokens=8)
    report = train_eagle_head(tiny_target, out, steps=30, **kw)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "train_report.json"]
    saved = load_file(str(out / "model.safetensors"))
    assert "fc.weight" in saved and "embed_tokens.weight" not in saved  # no target weights
    on_disk = json.loads((out / "train_report.json").read_text())
    assert on_disk["steps"] == report["steps"] == 30
    first, last = report["losses"]["first"], report["losses"]["final_ema"]
    assert last["reg"] < first["reg"] and last["ce"] < first["ce"]  # it learns
    assert 0.0 <= report["heldout"]["top1_agreement"] <= 1.0 and report["greedy_path"]["rounds"] > 0
    b = EagleBackend.from_dirs(out, tiny_target, dtype="float32")
    assert torch.equal(b.module.fc.weight, saved["fc.weight"])
    prompt = list(range(40, 50))
    feats = _features(loaded_target.model, prompt)[:-1]
    assert len(b.draft(b.new_state(SamplingParams()), prompt, 3, feats).tokens) == 3
    # a second run replaces the first, leaving no temporary directories behind
    assert train_eagle_head(tiny_target, out, steps=1, **kw)["steps"] == 1
    assert json.loads((out / "train_report.json").read_text())["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle"]


@pytest.mark.skipif(not __import__("common.fp16_weights", fromlist=["x"]).fp16_weights_available(),
                    reason="fbgemm is x86-only")
def test_fp16_weights_backend_packs_the_head_and_the_output_layer(head_dir, tiny_target, backend, loaded_target):
    from common.fp16_weights import Fp16Linear

    packed = EagleBackend.from_dirs(head_dir, tiny_target, dtype="fp16-weights")
    assert isinstance(packed.head.lm_head_packed, Fp16Linear) and isinstance(packed.module.fc, Fp16Linear)
    assert packed.head.dtype == torch.float32
    prompt = list(range(30, 60))
    feats = _features(loaded_target.model, prompt)[:-1].half()
    st_p, st_ref = packed.new_state(SamplingParams()), backend.new_state(SamplingParams())
    assert len(packed.draft(st_p, prompt, 4, feats).tokens) == 4
    backend.draft(st_ref, prompt, 4, feats)
    want, got = backend._logits(st_ref.last_hidden), packed._logits(st_p.last_hidden)
    assert (got - want).abs().max() < 0.01 * want.abs().max()  # float16-rounded weights, float32 sums


def test_auto_packs_a_head_that_fits_float16_and_keeps_float32_for_one_that_does_not(tmp_path, loaded_target,
                                                                                      tiny_target, head_dir):
    """--dtype auto means for an EAGLE head what it means for a target: fp16-weights on an x86 CPU
    where every weight fits float16, float32 where one does not; an explicit fp16-weights is
    refused with the count."""
    from common.fp16_weights import fp16_weights_available

    if not fp16_weights_available():
        pytest.skip("fbgemm is x86-only: auto is float32 on this CPU")
    assert load_eagle_head(head_dir, tiny_target, dtype="auto").lm_head_packed is not None
    cfg = head_config_for(loaded_target.model.config, HIDDEN, 259)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(4)
    head = build_head(cfg, bias=True)
    with torch.no_grad():
        head.fc.weight[0, 0] = 1.0e5  # beyond float16's 65504
    wide = save_eagle_head(head, cfg, tmp_path / "wide", "safetensors")
    loaded = load_eagle_head(wide, tiny_target, dtype="auto")
    assert loaded.lm_head_packed is None and loaded.dtype == torch.float32
    with pytest.raises(ModelLoadError, match=r"1 of \d+ linear weights .* exceed float16's range"):
        load_eagle_head(wide, tiny_target, dtype="fp16-weights")


def test_a_seeded_sampled_session_drafts_the_same_bits_in_a_batch_as_alone(backend, loaded_target):
    """As with the model backend (tests/test_batching.py): which sessions share a batch depends
    on timing, and a seeded session's drafts, q included, must not; it is drafted on its own."""
    seeded = SamplingParams(temperature=0.9, top_k=30, seed=4)
    prompt, other = [3 + (7 * i) % 240 for i in range(20)], [5 + (11 * i) % 200 for i in range(9)]

    def request(params, ids):
        return DraftRequest(backend.new_state(params), ids, 4, _features(loaded_target.model, ids[:-1]).half())

    one = request(seeded, prompt)
    alone = backend.draft(one.state, one.verified, one.depth, one.new_features)
    batched, _ = backend.draft_many([request(seeded, prompt), request(SamplingParams(temperature=0.9), other)])
    assert batched.tokens == alone.tokens
    assert torch.equal(torch.as_tensor(batched.q_probs), torch.as_tensor(alone.q_probs))
