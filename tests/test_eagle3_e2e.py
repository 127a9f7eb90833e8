"""EAGLE-3 heads end to end: a draft daemon process serving a published-layout EAGLE-3 head to
three target processes at once (greedy identity, drafts served every round), speculative
sampling through it following the target's distribution, and the refusals of heads and targets
that do not fit, on load and at the handshake."""


import pytest
import torch

from common.control import ControlClient
from common.models import ModelLoadError, load_causal_lm
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, run_concurrently, running_server, samples_for, speculate
from starsd_draftd.backends.eagle3 import Eagle3Backend, load_eagle3_head
from starsd_target.client import DraftClient, HandshakeRefused, Welcome
from starsd_target.engine import TargetEngine
from tiny_models import make_eagle3_head, make_tiny_checkpoint, reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n"]
LAYERS = 8  # the default fused layers are then 2, 4 and 5


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("deep-target"), layers=LAYERS, seed=3)


@pytest.fixture(scope="module")
def loaded_deep(deep_target):
    return load_causal_lm(str(deep_target), dtype="float32")


@pytest.fixture(scope="module")
def head3(deep_target, tmp_path_factory):
    """A published-layout EAGLE-3 head for the deep target, trained briefly (a few seconds):
    enough for some of its drafts to be kept."""
    from starsd_draftd.demo.eagle3_train import train_eagle3_head

    out = tmp_path_factory.mktemp("eagle3")
    train_eagle3_head(deep_target, out, steps=60, time_budget_s=None, progress=False, batch_size=4, seq_len=48,
                      corpus_bytes=200_000, num_threads=1, eval_windows=2, eval_prompts=1, eval_tokens=8,
                      draft_vocab=200)
    return out


@pytest.mark.slow
def test_eagle3_daemon_serves_three_targets_exactly(deep_target, head3, loaded_deep, star):
    draft_ep = star.serve_drafts(["--backend", "eagle3", "--eagle-head", str(head3), "--base-model", str(deep_target),
                                  "--depth", "4", "--dtype", "float32"], ready=False)
    eps = [star.job_endpoint(f"t{i}") for i in range(len(PROMPTS))]
    for i, ep in enumerate(eps):
        # the second target verifies trees, the others chains
        extra = ["--draft-tokens", "10"] if i == 1 else []
        star.start(f"t{i}", "starsd_target", "serve", "--model", str(deep_target), "--draft", draft_ep,
                   "--listen", ep, "--depth", "4", "--draft-timeout", "30", "--connect-timeout", "120",
                   "--dtype", "float32", "--no-adaptive-depth", *extra)  # every round drafts: the head's path is tested
    star.wait_ready("draftd", draft_ep)
    for i, ep in enumerate(eps):
        star.wait_ready(f"t{i}", ep)
    engine = TargetEngine(loaded_deep)
    results = run_concurrently(eps, [{"id": i, "prompt": p, "max_tokens": 40} for i, p in enumerate(PROMPTS)])
    for i, res in enumerate(results):
        assert res is not None, f"target {i} gave no result"
        assert res["token_ids"] == reference_greedy(deep_target, engine.encode(PROMPTS[i]), 40)
        st = res["stats"]
        assert st["fallback_rounds"] == 0 and st["invalid_drafts"] == 0, str(st)
        assert st["drafted"] >= st["rounds"] - 1, st  # drafts every round (the last may need none)
    assert results[1]["stats"]["tree_rounds"] > 0
    assert sum(r["stats"]["accepted"] for r in results) > 0
    with ControlClient(draft_ep) as cc:
        stats = cc.stats()
    assert stats["peers"] == 3, stats


def test_sampling_through_an_eagle3_head_follows_the_target(deep_target, head3, loaded_deep):
    backend = Eagle3Backend.from_dirs(head3, deep_target, dtype="float32")
    params = SamplingParams(temperature=1.5, top_k=2)
    draft_params = SamplingParams(temperature=3.0)  # a broad q: drafts inside and outside the target's support
    engine = TargetEngine(loaded_deep, depth=2)
    prompt = engine.encode("x = ")
    length = 3
    exact = exact_joint(loaded_deep.model, prompt, params, length)
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_deep.vocab_size, loaded_deep.fingerprint, ctx=ctx,
                             feature_size=loaded_deep.feature_size, num_layers=loaded_deep.num_layers)
        client.handshake(10)
        assert client.welcome.feature_layers == (2, 4, 5)
        assert client.welcome.feature_size == 3 * loaded_deep.feature_size
        for i in range(samples):
            p = SamplingParams(params.temperature, params.top_k, seed=10_000 + i)
            q = SamplingParams(draft_params.temperature, seed=20_000 + i)
            r = speculate(engine, client, prompt, length, p, 30, draft_params=q)
            assert r.stats.fallback_rounds == 0
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
        client.close()
    assert 10 <= accepted < drafted, (accepted, drafted)  # both verification branches ran
    assert_follows(counts, exact, samples)


def test_q_of_tokens_outside_the_draft_vocabulary_is_zero(deep_target, tmp_path):
    head = make_eagle3_head(deep_target, tmp_path / "h", draft_vocab=50)
    b = Eagle3Backend.from_dirs(head, deep_target, dtype="float32")
    loaded = load_causal_lm(str(deep_target), dtype="float32")
    ids = list(range(60, 80))
    with torch.no_grad():
        hs = loaded.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    from common.features import fused_features

    feats = fused_features(hs, b.feature_layers)[0]
    st = b.new_state(SamplingParams(temperature=5.0, seed=1))
    d = b.draft(st, ids, 4, feats[:-1])
    allowed = set(b.head.draft_ids.tolist())
    assert len(allowed) == 50 and set(d.tokens) <= allowed
    q_ids = torch.as_tensor(d.q_ids)
    q = torch.as_tensor(d.q_probs)
    assert set(q_ids[q > 0].tolist()) <= allowed  # no probability outside the draft vocabulary


# ---------------------------------------------------------------- refusals


def test_heads_that_do_not_fit_the_target_are_refused(deep_target, tmp_path):
    narrow = make_tiny_checkpoint(tmp_path / "narrow", layers=LAYERS, hidden=48)
    head = make_eagle3_head(deep_target, tmp_path / "h")
    with pytest.raises(ModelLoadError, match="hidden size 32.*hidden size 48"):
        load_eagle3_head(head, narrow)
    # explicit layer ids beyond the target's layers
    deep_ids = make_eagle3_head(deep_target, tmp_path / "ids", layer_ids=[2, 4, 9])
    with pytest.raises(ModelLoadError, match=r"layers \[2, 4, 9\].*0\.\.7"):
        load_eagle3_head(deep_ids, deep_target)
    # a head whose fc reads two layers while its config names three
    two = make_eagle3_head(deep_target, tmp_path / "two", layer_ids=[2, 5])
    cfg_path = two / "config.json"
    import json

    cfg = json.loads(cfg_path.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"fc.weight .* \(32, 64\).*needs \(32, 96\)"):
        load_eagle3_head(two, deep_target)
    # a vocabulary other than the target's
    other = make_eagle3_head(deep_target, tmp_path / "vocab")
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vocabulary size 300 differs from the target's embedding rows 259"):
        load_eagle3_head(other, deep_target)
    # too shallow a target for the default layers
    shallow = make_tiny_checkpoint(tmp_path / "shallow", layers=4)
    with pytest.raises(ModelLoadError, match="names no target layers.*at least 7 layers"):
        load_eagle3_head(make_eagle3_head(shallow, tmp_path / "sh"), shallow)
    # layer ids that are not a list, and attention heads that cannot split the width
    for key, value, message in (("eagle_aux_hidden_state_layer_ids", 5, "expected a list of layer ids"),
                                ("num_attention_heads", 0, "cannot read the EAGLE-3 head config: ZeroDivisionError"),
                                ("num_attention_heads", 5, "not a multiple of the number of attention heads")):
        bad = make_eagle3_head(deep_target, tmp_path / f"bad-{key}", layer_ids=[2, 4, 5])
        cfg = json.loads((bad / "config.json").read_text())
        (cfg["eagle_config"] if key.startswith("eagle_") else cfg)[key] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=message):
            load_eagle3_head(bad, deep_target)
    # a target whose config nests its layer count (a multimodal config's text_config)
    nested = make_tiny_checkpoint(tmp_path / "nested", layers=LAYERS)
    cfg = json.loads((nested / "config.json").read_text())
    cfg["text_config"] = {"num_hidden_layers": cfg.pop("num_hidden_layers")}
    (nested / "config.json").write_text(json.dumps(cfg))
    assert load_eagle3_head(make_eagle3_head(deep_target, tmp_path / "n"), nested).feature_layers == (2, 4, 5)
    # an EAGLE-1 head given as EAGLE-3
    from safetensors.torch import load_file, save_file

    e1 = make_eagle3_head(deep_target, tmp_path / "e1")
    state = load_file(str(e1 / "model.safetensors"))
    state["fc.bias"] = torch.zeros(32)
    save_file(state, str(e1 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fc.bias.*--backend eagle"):
        load_eagle3_head(e1, deep_target)


def test_the_handshake_refuses_a_target_without_the_fused_layers(deep_target, tmp_path):
    """The daemon's head fuses the states entering layers 2, 4 and 5 of an 8-layer target: a
    target of the same width and vocabulary with 4 layers is refused, naming both sides."""
    backend = Eagle3Backend.from_dirs(make_eagle3_head(deep_target, tmp_path / "h"), deep_target, dtype="float32")
    shallow = load_causal_lm(str(make_tiny_checkpoint(tmp_path / "shallow", layers=4)), dtype="float32")
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, shallow.vocab_size, shallow.fingerprint, ctx=ctx,
                             feature_size=shallow.feature_size, num_layers=shallow.num_layers)
        with pytest.raises(HandshakeRefused, match=r"layers \[2, 4, 5\].*0\.\.3 \(the target has 4 layers"):
            client.handshake(10)
        client.close()
        assert server.stats.errors["INCOMPATIBLE_MODEL"] >= 1


def test_the_target_checks_what_the_welcome_asks_for():
    """The target side of the same check: a WELCOME naming layers it lacks, or a width its
    layers do not make, is refused before any feature is sent."""
    c = DraftClient.__new__(DraftClient)
    c.feature_size, c.num_layers = 32, 8

    def welcome(size, layers):
        return Welcome(259, "tok", "eagle3", 4, 32, size, "i", "s", feature_layers=layers)

    assert c._feature_refusal(welcome(96, (2, 4, 5))) is None
    assert "0..7" in c._feature_refusal(welcome(96, (2, 4, 8)))
    assert "fuses them 96 wide" in c._feature_refusal(welcome(64, (2, 4, 5)))
    assert c._feature_refusal(welcome(32, None)) is None
    assert "hidden size is 32" in c._feature_refusal(welcome(48, None))
    assert c._feature_refusal(welcome(0, None)) is None


def test_a_generation_whose_features_the_head_does_not_read_stops_drafting(caplog):
    """A generation fuses the layers named when it started. Features of other layers (the daemon
    restarted with another head of the same width), or none at all (it started before the link
    came up), end its drafting with a log line instead of feeding the head what it does not read."""
    import logging
    import numpy as np

    from common.verify import SamplingParams
    from starsd_target.client import LinkState
    from starsd_target.drafts import RemoteDraftSession

    c = DraftClient.__new__(DraftClient)
    c.welcome = Welcome(259, "tok", "eagle3", 4, 32, 96, "i", "s", feature_layers=(2, 4, 5))
    c.ready = lambda: True
    c.state, c.sessions = LinkState.UP, 0
    c.backoff = type("B", (), {"initial_s": 0.1})()
    c.take_open_refusal = lambda session: None
    opened = []
    c.open = lambda *a: opened.append(a) or True
    c.request = lambda *a: True
    tokens = list(range(6))
    feats = np.zeros((5, 96), np.float16)

    def session():
        return RemoteDraftSession(c, 1, SamplingParams(), 5.0)

    assert session().send(tokens, 3, feats, feature_layers=(2, 4, 5)) is not None
    with caplog.at_level(logging.INFO, logger="starsd.target.client"):
        for layers, f in (((1, 4, 5), feats), (None, np.zeros((5, 32), np.float16)), ((2, 4, 5), None)):
            s = session()
            assert s.send(tokens, 3, f, feature_layers=layers) is None
            assert s.disabled and s.send(tokens, 3, feats, feature_layers=(2, 4, 5)) is None
    assert sum("not what the draft daemon's head reads" in r.message for r in caplog.records) == 2
    assert sum("collected no target features" in r.message for r in caplog.records) == 1
