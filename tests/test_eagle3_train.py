"""The EAGLE-3 trainer: its training forward is the serving forward (step 0 as the module computes
it, later TTT steps as the backend's cache sees them), a short run lowers the loss and writes a
head the backend loads and drafts with, and the CLI refuses what it cannot train."""

import json

import pytest
import torch
from click.testing import CliRunner

from common.features import default_feature_layers, fused_features
from common.models import load_causal_lm
from common.verify import SamplingParams
from starsd_draftd.backends.eagle3 import Eagle3Backend, Eagle3Module
from starsd_draftd.demo.eagle3_train import (draft_vocabulary, teacher_targets, train_eagle3_head, ttt_forward,
                                             vocab_maps)
from starsd_draftd.demo.eagle_train import head_config_for
from tiny_models import make_tiny_checkpoint

LAYERS = 8


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("deep"), "llama", seed=3, hidden=32, layers=LAYERS)


@pytest.fixture(scope="module")
def trained(deep_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3") / "head"
    report = train_eagle3_head(deep_target, out, steps=30, time_budget_s=None, progress=False, batch_size=4,
                               seq_len=48, draft_vocab=120, corpus_bytes=200_000, num_threads=1, eval_windows=2,
                               eval_prompts=1, eval_tokens=8, lr=1e-2)
    return out, report


def _random_head(target, seed=0):
    """A random head with a draft vocabulary, GQA and sharp-ish weights (so mismatches would show)."""
    torch.manual_seed(seed)
    embed = target.get_input_embeddings().weight.detach()
    hidden, vocab = int(embed.shape[1]), int(embed.shape[0])
    cfg = head_config_for(target.config, hidden, vocab)
    cfg.draft_vocab_size = 50
    layers = default_feature_layers(target.config.num_hidden_layers)
    m = Eagle3Module(cfg, hidden * len(layers))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape) * 0.2)
        m.embed_tokens.weight.copy_(embed)
    return m.eval(), layers


def _features(target, ids, layers):
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    return fused_features(hs, layers)


def test_training_forward_is_the_serving_forward(deep_target):
    target = load_causal_lm(str(deep_target), dtype="float32").model
    module, layers = _random_head(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 13), generator=g)
    f = _features(target, ids, layers)[:, :-1]  # positions 0..11 with tokens 1..12
    with torch.no_grad():
        outs = ttt_forward(module, f, ids, 3)
        assert [o.shape[1] for o in outs] == [12, 11, 10]
        # step 0: the module's own forward over the real pairs
        torch.testing.assert_close(outs[0], module(f, input_ids=ids[:, 1:]), rtol=1e-4, atol=1e-4)
        # steps 1 and 2 at index i: the real pairs 0..i cached, then the predicted pairs, as the backend feeds them
        for i in (0, 4, 9):
            o0, past = module(f[:, : i + 1], input_ids=ids[:, 1: i + 2], use_cache=True)
            o1, past = module(o0[:, -1:], input_ids=ids[:, i + 2: i + 3], past_key_values=past, use_cache=True)
            torch.testing.assert_close(o1[:, 0], outs[1][:, i], rtol=1e-4, atol=1e-4)
            o2 = module(o1, input_ids=ids[:, i + 3: i + 4], past_key_values=past)
            torch.testing.assert_close(o2[:, 0], outs[2][:, i], rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_and_teacher_mapping():
    ids = torch.tensor([[5, 5, 5, 7, 7, 9, 2]])
    kid = torch.tensor([[[3, 4, 1]]])
    klp = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    # by count (5, 7, then 2 and 9), then by the teacher's mass (3), sorted by id
    assert draft_vocabulary(ids, 12, 4, kid, klp).tolist() == [2, 5, 7, 9]
    vocab = draft_vocabulary(ids, 12, 5, kid, klp)
    assert vocab.tolist() == [2, 3, 5, 7, 9]
    d2t, t2d, index = vocab_maps(vocab, 12)
    assert (torch.arange(5) + d2t).tolist() == vocab.tolist() and t2d.sum() == 5 and index[7] == 3
    didx, p, ok, top1 = teacher_targets(torch.tensor([[[3, 4, 7]], [[4, 4, 4]]]),
                                        torch.log(torch.tensor([[[0.5, 0.3, 0.2]], [[0.5, 0.3, 0.2]]])), index)
    torch.testing.assert_close(p[0, 0], torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    assert ok.tolist() == [[True], [False]] and top1.tolist() == [[1], [-1]] and didx[0, 0].tolist() == [1, 0, 3]


def test_training_lowers_the_loss_and_the_head_drafts(deep_target, trained):
    out, report = trained
    assert report["kind"] == "eagle3" and report["steps"] == 30 and report["ttt_steps"] == 3
    hist = report["losses"]
    assert hist["final_ema"]["loss"] < hist["first"]["loss"]
    assert report["draft_vocab"]["size"] == 120 and 0 < report["draft_vocab"]["coverage_train_next_tokens"] <= 1
    assert json.loads((out / "train_report.json").read_text())["steps"] == 30
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 120
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(default_feature_layers(LAYERS))
    backend = Eagle3Backend.from_dirs(out, deep_target, dtype="float32")
    target = load_causal_lm(str(deep_target), dtype="float32").model
    ids = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(1))
    feats = _features(target, ids, backend.feature_layers)[0, :-1].half()
    st = backend.new_state(SamplingParams())
    draft = backend.draft(st, ids[0].tolist(), 4, feats)
    assert len(draft.tokens) == 4 and all(backend.module.t2d[t] for t in draft.tokens)
    # the loaded head computes what the trainer evaluated: its first draft from the same features
    assert report["greedy_path"]["rounds"] > 0


def test_ttt_steps_below_two_are_refused(deep_target, tmp_path):
    with pytest.raises(ValueError, match="at least 2"):
        train_eagle3_head(deep_target, tmp_path / "h", steps=1, time_budget_s=None, ttt_steps=1, progress=False)
    from starsd_draftd.demo.cli import train_eagle

    res = CliRunner().invoke(train_eagle, ["--base-model", str(deep_target), "--out", str(tmp_path / "h"),
                                           "--kind", "eagle3", "--ttt-steps", "1"])
    assert res.exit_code == 2 and "ttt-steps" in res.output
    res = CliRunner().invoke(train_eagle, ["--base-model", str(deep_target), "--out", str(tmp_path / "h"),
                                           "--ttt-steps", "3"])
    assert res.exit_code != 0 and "--kind eagle3" in res.output


def test_a_shallow_target_is_a_clean_error(tiny_target, tmp_path):
    from starsd_draftd.demo.cli import train_eagle

    res = CliRunner().invoke(train_eagle, ["--base-model", str(tiny_target), "--out", str(tmp_path / "h"),
                                           "--kind", "eagle3", "--time-budget", "10"])
    assert res.exit_code != 0 and "at least 7 layers" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_recorded_features_are_the_fused_hidden_states(arch, tmp_path):
    from starsd_draftd.demo.eagle3_train import record_fused_features

    target = load_causal_lm(str(make_tiny_checkpoint(tmp_path / arch, arch, seed=4, hidden=32, layers=LAYERS)),
                            dtype="float32").model
    ids = torch.randint(3, 250, (5, 9), generator=torch.Generator().manual_seed(2))
    layers = default_feature_layers(LAYERS)
    got, _ = record_fused_features(target, ids, layers, rows_per_batch=2, progress=False)
    torch.testing.assert_close(got, _features(target, ids, layers).half())
