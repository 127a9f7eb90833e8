"""The draft model's output layer cut to a vocabulary (``--draft-vocab``, ``starsd-draftd vocab``):
logits unchanged on the kept ids and -inf elsewhere, bad files refused with a clear error, the
file the CLI writes read by serve, and through the daemon greedy output equal to the target's own
generate while sampled output follows the target's distribution although the draft can never
propose some of the target's tokens."""

import json
import math
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from common.control import ControlClient
from common.draft_vocab import (DraftVocab, DraftVocabError, SubsetHead, VOCAB_FILE, choose_ids, load_vocab,
                                resolve_vocab)
from common.fp16_weights import fp16_weights_available
from common.models import load_causal_lm
from common.runner import ModelRunner
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, run_concurrently, running_server, samples_for, speculate
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.cli import main as draftd_cli
from starsd_draftd.demo.byte_tokenizer import BYTE_OFFSET, BYTE_VOCAB_SIZE, EOS_ID
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from tiny_models import make_near_copy, reference_greedy

TEXT = "def parse(line):\n    return line.split(',')\n" * 20 + "import os\nimport sys\nclass Point:\n    x = 1\n"


def _vocab_file(path, ids, model: "LoadedModel | None" = None, **override) -> "Path":  # noqa: F821
    data = {"starsd_draft_vocab": 1, "logits_size": BYTE_VOCAB_SIZE,
            "fingerprint": None if model is None else model.fingerprint, "ids": list(ids)}
    data.update(override)
    path.write_text(json.dumps(data))
    return path


def _some_ids(n=100):
    return sorted({EOS_ID, *range(BYTE_OFFSET, BYTE_OFFSET + n - 1)})


@pytest.mark.parametrize("dtype", ["float32", "fp16-weights"])
def test_cut_head_keeps_the_models_logits_on_its_ids(dtype, tiny_draft, tmp_path):
    if dtype == "fp16-weights" and not fp16_weights_available():
        pytest.skip("fp16-weights needs fbgemm (x86 CPUs)")
    full = load_causal_lm(str(tiny_draft), dtype=dtype)
    ids = _some_ids()
    cut = load_causal_lm(str(tiny_draft), dtype=dtype,
                         draft_vocab=load_vocab(_vocab_file(tmp_path / "v.json", ids, full)))
    assert isinstance(cut.model.get_output_embeddings(), SubsetHead)
    assert (cut.vocab_size, cut.logits_size, cut.fingerprint) == (full.vocab_size, full.logits_size, full.fingerprint)
    feed = [1, *range(BYTE_OFFSET + 40, BYTE_OFFSET + 52)]
    a, b = ModelRunner(full), ModelRunner(cut)
    ca, cb = a.new_cache(64), b.new_cache(64)
    for chunk in (feed[:9], feed[9:10], feed[10:]):  # a prefill, a decode step, a verification-like feed
        la, _ = a.forward(ca, chunk)
        lb, _ = b.forward(cb, chunk)
        keep = torch.zeros(full.logits_size, dtype=torch.bool)
        keep[ids] = True
        torch.testing.assert_close(lb[:, keep], la[:, keep], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(lb[:, ~keep]).all()
        # the draft's pick is the model's best among the kept ids
        assert torch.equal(lb.argmax(-1), torch.tensor(ids)[la[:, keep].argmax(-1)])


@pytest.mark.parametrize("change, message", [
    (lambda p: p.write_text("{not json"), "not JSON"),
    (lambda p: p.write_text(json.dumps({"ids": [1, 2]})), "not a StarSD draft vocabulary"),
    (lambda p: _vocab_file(p, _some_ids(), logits_size=0), "logits_size must be a positive integer"),
    (lambda p: _vocab_file(p, [*_some_ids(), 3.5]), "ids must be a list of integers"),
    (lambda p: _vocab_file(p, [*_some_ids(), EOS_ID]), "distinct"),
    (lambda p: _vocab_file(p, [*_some_ids(), BYTE_VOCAB_SIZE]), f"each in 0..{BYTE_VOCAB_SIZE - 1}"),
    (lambda p: _vocab_file(p, [*_some_ids(), -1]), "each in"),
    (lambda p: _vocab_file(p, _some_ids(10)), "at least 64"),
    (lambda p: _vocab_file(p, _some_ids(), fingerprint=7), "fingerprint must be a string"),
])
def test_bad_vocabulary_files_are_refused_with_the_reason(change, message, tmp_path):
    path = tmp_path / "v.json"
    change(path)
    with pytest.raises(DraftVocabError, match=message):
        load_vocab(path)


def test_a_vocabulary_for_another_model_is_refused(tiny_draft, tmp_path):
    loaded = load_causal_lm(str(tiny_draft))
    wide = load_vocab(_vocab_file(tmp_path / "a.json", _some_ids(), logits_size=BYTE_VOCAB_SIZE + 5))
    with pytest.raises(DraftVocabError, match=f"this model has {BYTE_VOCAB_SIZE}"):
        load_causal_lm(str(tiny_draft), draft_vocab=wide)
    other = load_vocab(_vocab_file(tmp_path / "b.json", _some_ids(), fingerprint="0123456789abcdef"))
    with pytest.raises(DraftVocabError, match=f"another tokenizer .* this model's {loaded.fingerprint}"):
        load_causal_lm(str(tiny_draft), draft_vocab=other)
    with pytest.raises(DraftVocabError, match="cannot read"):
        resolve_vocab(str(tmp_path / "missing.json"), tiny_draft)


def test_a_vocabulary_must_keep_enough_ids_the_tokenizer_knows():
    """A padded output layer has ids past the tokenizer's; drafts come from the known ones only."""
    v = DraftVocab(tuple(range(40, 300)), 300, None)
    v.check(300, "fp", vocab_size=120)  # 80 known ids
    with pytest.raises(DraftVocabError, match="keeps 20 ids the tokenizer knows"):
        v.check(300, "fp", vocab_size=60)


def test_every_drafting_path_proposes_only_kept_ids(tiny_target, tmp_path):
    """Chains (alone, stopped, batched), lookahead's rows, greedy trees and sampled chains and
    trees: every drafted token and every id q gives mass to is a kept id, and q has no NaN."""
    from starsd_draftd.backends.base import DraftRequest

    near = make_near_copy(tiny_target, tmp_path / "near", noise=0.05)
    keep = sorted({EOS_ID, *range(BYTE_OFFSET + 40, BYTE_OFFSET + 140)})
    backend = ModelBackend(load_causal_lm(str(near), draft_vocab=load_vocab(_vocab_file(tmp_path / "v.json", keep))),
                           tree_topk=3)
    kept = set(keep)
    prompt = [1, *range(BYTE_OFFSET + 30, BYTE_OFFSET + 50)]  # partly outside the kept ids

    def check(d):
        assert d.tokens and set(d.tokens) <= kept, d.tokens
        if d.q_ids is not None:
            q_ids, q_probs = torch.as_tensor(d.q_ids), torch.as_tensor(d.q_probs)
            assert not torch.isnan(q_probs).any()
            assert set(q_ids[q_probs > 0].tolist()) <= kept

    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.5, seed=3)
    st = backend.new_state(greedy)
    sent = backend.draft(st, prompt, 6)
    check(sent)
    check(backend.draft(backend.new_state(greedy), prompt, 6, min_survival=0.3))
    check(backend.draft(backend.new_state(greedy), prompt, 3, tree_tokens=9))
    check(backend.draft(backend.new_state(sampled), prompt, 3, tree_tokens=9))
    for d in backend.draft_many([DraftRequest(backend.new_state(p), prompt[: 10 + i], 4, min_survival=0.2 * (i % 2))
                                 for i, p in enumerate([greedy, sampled, greedy, sampled])]):
        check(d)
    task = backend.lookahead(st, prompt, sent, 4)
    while not task.step():
        pass
    assert task.result
    for d in task.result:
        check(d)


def test_a_tree_ranks_the_subtree_under_a_copied_token_the_head_cannot_score():
    """Lookup may copy a token a cut head gives -inf: that chain node is scored as the head's best
    pick, so its other children compete with the other branches instead of falling below all."""
    from common.tree import ROOT
    from starsd_draftd.backends.trees import GreedyTree

    logits = torch.full((10,), float("-inf"))
    logits[:4] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    tree = GreedyTree(topk=2)
    tree.grow(ROOT, logits, first=9)  # the chain copies id 9, outside the head's ids; id 0 beside it
    tree.grow(tree.chain[0], logits)  # the chain node's children: id 0 (the chain) and id 1
    tree.grow(1, logits)  # the other root child's: ids 0 and 1, scored as the chain's
    assert all(math.isfinite(n.score) for n in tree.nodes)
    assert tree.nodes[0].score == tree.nodes[1].score  # the copy rated as the head's best pick
    d = tree.draft(5)  # ties go to the earlier node: the chain node's second child before the branch's
    under_copy = [t for t, p in zip(d.tokens, d.parents) if p == d.tokens.index(9)]
    assert d.tokens[0] == 9 and under_copy == [0, 1]


def test_choose_ids_keeps_special_tokens_then_the_most_frequent():
    counts = torch.tensor([0, 0, 0, 5, 9, 9, 1, 0])
    assert choose_ids(counts, 4, always=[2]) == [2, 3, 4, 5]  # ties: the lower id first
    assert choose_ids(counts, 2, always=[2]) == [2, 4]
    assert choose_ids(counts, 8) == list(range(8))


def test_vocab_cli_writes_what_serve_reads(tiny_draft, tmp_path):
    from starsd_draftd.app import ServeConfig, build_backend
    from starsd_draftd.server import ServerConfig

    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "a.py").write_text(TEXT)
    (texts / "sub" / "b.py").write_text("while True:\n    pass\n" * 10)
    model = tmp_path / "draft"
    import shutil

    shutil.copytree(tiny_draft, model)
    args = ["vocab", "--model", str(model), "--size", "64", "--no-progress", str(texts)]
    out = CliRunner().invoke(draftd_cli, args)  # the command, in this process
    assert out.exit_code == 0, out.output
    assert f"64 of {BYTE_VOCAB_SIZE} token ids" in out.stdout and "in 2 files" in out.stdout
    v = load_vocab(model / VOCAB_FILE)
    used = {BYTE_OFFSET + b for b in (TEXT + "while True:\n    pass\n").encode()}
    assert EOS_ID in v.ids and used <= set(v.ids) and len(v.ids) == 64
    assert v.coverage == 1.0  # every counted token is kept
    # serve: auto reads the model directory's file, off and a path as asked
    cfg = ServeConfig(server=ServerConfig(), model=str(model), dtype="float32")
    assert isinstance(build_backend(cfg).runner.model.get_output_embeddings(), SubsetHead)
    cfg.draft_vocab = "off"
    assert isinstance(build_backend(cfg).runner.model.get_output_embeddings(), torch.nn.Linear)
    cfg.model, cfg.draft_vocab = str(tiny_draft), str(model / VOCAB_FILE)
    assert isinstance(build_backend(cfg).runner.model.get_output_embeddings(), SubsetHead)
    cfg.backend = "eagle"
    with pytest.raises(ValueError, match="--draft-vocab applies to --backend model"):
        build_backend(cfg)
    # a bad file stops serve with the reason, before it binds anything
    bad = _vocab_file(tmp_path / "bad.json", _some_ids(10))
    out = subprocess.run([sys.executable, "-m", "starsd_draftd", "serve", "--model", str(model), "--draft-vocab",
                          str(bad), "--bind", "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "at least 64" in out.stderr, out.stderr
    out = CliRunner().invoke(draftd_cli, [*args[:-1], str(tmp_path / "empty-dir-does-not-exist")])
    assert out.exit_code == 2 and "does not exist" in out.stderr


@pytest.mark.slow
def test_greedy_through_the_daemons_with_a_cut_head(tiny_target, tmp_path, star):
    """Drafts come only from the kept ids; the target's output is its own generate's, rounds kept
    drafts, and none fell back."""
    draft = make_near_copy(tiny_target, tmp_path / "near", noise=0.02)
    engine = TargetEngine(load_causal_lm(str(tiny_target)))
    prompts = ["def parse(line):\n    ", "import os\nimport sys\n"]
    refs = [reference_greedy(tiny_target, engine.encode(p), 40) for p in prompts]
    # keep what the target writes for the first prompt, and half of what only the second needs
    first = set(refs[0]) | set(engine.encode(prompts[0]))
    only_second = sorted(set(refs[1]) - first)
    assert only_second, "the prompts should need different tokens"
    keep = sorted(first | set(only_second[: len(only_second) // 2]) | {EOS_ID})
    keep += [i for i in range(BYTE_OFFSET, BYTE_VOCAB_SIZE) if i not in keep][: max(0, 64 - len(keep))]
    assert (set(refs[0]) | set(refs[1])) - set(keep), "some of the target's tokens must lie outside the head"
    _vocab_file(draft / VOCAB_FILE, sorted(keep), load_causal_lm(str(draft)))
    draft_ep = star.draftd(draft, "--no-lookahead", ready=False)  # --draft-vocab auto: the file in its directory
    eps = star.targets(tiny_target, draft_ep, 2, "--connect-timeout", "120", "--draft-timeout", "30")
    results = run_concurrently(eps, [{"id": i + 1, "prompt": p, "max_tokens": 40} for i, p in enumerate(prompts)])
    for ref, res in zip(refs, results):
        assert res["token_ids"] == ref
    star.assert_speculated(results)
    star.check_alive("draftd")
    with ControlClient(draft_ep) as cc:  # the daemon says its head is cut
        backend = cc.stats()["backend"]
    assert (backend["output_ids"], backend["logits_size"]) == (len(keep), BYTE_VOCAB_SIZE)
    out = CliRunner().invoke(draftd_cli, ["status", "--connect", draft_ep])  # the command, in this process
    assert f"draft output layer: {len(keep)} of {BYTE_VOCAB_SIZE} token ids" in out.stdout, out.output


def test_sampled_output_follows_the_target_when_the_draft_cannot_propose_some_tokens(tiny_target, loaded_target,
                                                                                    tmp_path):
    """The target's joint over its first three sampled tokens, with a draft whose head lacks one
    of the two tokens the target may take first: q is zero where p is not, and the rejection test
    still gives the target's distribution (chi-square)."""
    params = SamplingParams(temperature=1.5, top_k=2)
    engine = TargetEngine(loaded_target, depth=2)
    prompt = engine.encode("x = ")
    exact = exact_joint(loaded_target.model, prompt, params, 3)
    firsts = sorted({k[0] for k in exact})
    assert len(firsts) == 2
    near = make_near_copy(tiny_target, tmp_path / "near", noise=0.05)
    keep = [i for i in range(BYTE_VOCAB_SIZE) if i != firsts[0]]  # everything but one first token
    vocab = load_vocab(_vocab_file(tmp_path / "v.json", keep, loaded_target))
    backend = ModelBackend(load_causal_lm(str(near), draft_vocab=vocab))
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        for i in range(samples):
            r = speculate(engine, client, prompt, 3, SamplingParams(params.temperature, params.top_k, seed=10_000 + i),
                          30, draft_params=SamplingParams(1.5, seed=20_000 + i))
            assert r.stats.fallback_rounds == 0 and r.stats.invalid_drafts == 0
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
        client.close()
    assert 10 <= accepted < drafted
    assert sum(c for k, c in counts.items() if k[0] == firsts[0]) > 0  # the token the draft lacks still comes
    assert_follows(counts, exact, samples)
