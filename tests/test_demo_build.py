"""The demo's checkpoint build, end to end on a tiny GGUF the test writes: import, a one-layer draft
cut from the target and distilled on its outputs, both loaded like user checkpoints, and
speculation with the pair exact against the target's own greedy decoding."""

import dataclasses
import json

import pytest
import torch

from common.draft_vocab import VOCAB_FILE, load_vocab
from common.models import load_causal_lm
from common.runner import ModelRunner
from common.verify import SamplingParams
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.demo.checkpoints import TEACHER_NAME, build_demo_checkpoints, load_teacher
from starsd_draftd.demo.distill import distill, first_layers_draft, target_generations
from starsd_target.engine import TargetEngine
from fakes import LocalDrafts
from tiny_gguf import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-build")
    gguf = root / "src" / "tiny.gguf"
    write_tiny_llama_gguf(gguf, seed=3)
    out = root / "out"
    report = build_demo_checkpoints(out, progress=False, threads=1, teacher_budget_s=1.0, distill_budget_s=1.5,
                                    layers=1, gguf=gguf, corpus_bytes=120_000)  # the tiny target has 2
    return out, report


def test_the_build_writes_both_checkpoints_and_a_report(built):
    out, report = built
    assert json.loads((out / "build_report.json").read_text()) == report
    assert report["draft"]["layers"] == 1 and report["draft"]["steps"] > 0
    assert report["draft"]["teacher_rows"] > 0 and 0.0 <= report["draft"]["heldout_top1_agreement"] <= 1.0
    teacher = load_teacher(out / TEACHER_NAME)  # kept for the EAGLE head
    rows, length = teacher["ids"].shape
    assert rows == report["draft"]["teacher_rows"] and teacher["hidden"].shape[:2] == (rows, length)
    target, draft = load_causal_lm(str(out / "target")), load_causal_lm(str(out / "draft"))
    assert draft.model.config.num_hidden_layers == 1 < target.model.config.num_hidden_layers
    assert (draft.vocab_size, draft.fingerprint) == (target.vocab_size, target.fingerprint)  # the handshake's check
    # the draft's output-layer vocabulary, counted on the corpus: half of this tiny tokenizer's ids
    vocab = load_vocab(out / "draft" / VOCAB_FILE)
    assert len(vocab.ids) == report["draft"]["vocab"]["size"] == draft.logits_size // 2
    assert vocab.fingerprint == draft.fingerprint and 0.5 < vocab.coverage <= 1.0
    assert set(target.eos_token_ids) <= set(vocab.ids)


def test_speculation_with_the_built_pair_is_exact_and_drafts_are_used(built):
    out, _ = built
    target = load_causal_lm(str(out / "target"))
    engine = TargetEngine(target, depth=4)
    cut = load_vocab(out / "draft" / VOCAB_FILE)
    backend = ModelBackend(load_causal_lm(str(out / "draft"), draft_vocab=cut))  # as the daemon serves it

    prompt = target.tokenizer.encode("the quick brown fox", add_special_tokens=False)
    result = engine.generate(prompt, 24, SamplingParams(), LocalDrafts(backend))
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # the target's own generate, with the end-of-turn ids the engine stops at
        own = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                    eos_token_id=sorted(target.eos_token_ids), pad_token_id=sorted(target.eos_token_ids)[0])
    assert result.token_ids == own[0, len(prompt):].tolist()
    assert result.stats.drafted > 0 and result.stats.fallback_rounds == 0
    # a draft cut with every layer is the target itself: all its drafts are kept
    full = first_layers_draft(target.model, target.model.config.num_hidden_layers)
    backend.runner = ModelRunner(dataclasses.replace(backend.loaded, model=full))
    copy = engine.generate(prompt, 24, SamplingParams(), LocalDrafts(backend))
    assert copy.token_ids == result.token_ids
    assert copy.stats.accepted == copy.stats.drafted > 0


def test_a_cut_draft_copies_the_first_layers_and_distilling_trains_only_them(built):
    out, _ = built
    target = load_causal_lm(str(out / "target")).model
    draft = first_layers_draft(target, 1)
    t_sd, d_sd = target.state_dict(), draft.state_dict()
    for name, value in d_sd.items():
        assert torch.equal(value, t_sd[name]) and value.data_ptr() != t_sd[name].data_ptr()
    prompts = torch.randint(3, target.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    teacher = target_generations(target, prompts, 10, time_budget_s=60.0, topk=8, rows=2, progress=False)
    assert teacher["hidden"].shape == (4, 16, target.config.hidden_size) and teacher["topk_ids"].shape == (4, 16, 8)
    ids = teacher["ids"]
    assert torch.equal(ids[:, :6], prompts)
    with torch.inference_mode():  # what follows the prompt is the target's own greedy choice, and the top-1
        logits = target(input_ids=ids).logits
    assert torch.equal(logits[:, 5:-1].argmax(-1), ids[:, 6:])
    assert torch.equal(teacher["topk_ids"][:, 5:-1, 0], ids[:, 6:])
    embed_before = draft.model.embed_tokens.weight.clone()
    layer_before = draft.model.layers[0].mlp.down_proj.weight.clone()
    summary = distill(draft, teacher, time_budget_s=0.5, rows_per_step=2, full_positions=8, progress=False)
    assert summary["steps"] > 0
    assert torch.equal(draft.model.embed_tokens.weight, embed_before)
    assert not torch.equal(draft.model.layers[0].mlp.down_proj.weight, layer_before)


def test_earlier_recipes_are_named_not_removed(tmp_path):
    """Beside a new recipe's build, complete builds of other recipes are listed with their sizes
    (the log names them); incomplete ones, lock files and the current build are not."""
    from starsd_draftd.demo.checkpoints import REPORT_NAME, earlier_recipes

    def build(name: str, complete: bool = True) -> None:
        for sub in ("target", "draft"):
            (tmp_path / name / sub).mkdir(parents=True)
            if complete:
                (tmp_path / name / sub / "config.json").write_text("{}")
        if complete:
            (tmp_path / name / REPORT_NAME).write_text("x" * 100)

    build("demo-old-v1")
    build("demo-half", complete=False)
    build("demo-now")
    (tmp_path / "demo-old-v1.lock").write_text("")
    got = earlier_recipes(tmp_path / "demo-now")
    assert [(p.name, n) for p, n in got] == [("demo-old-v1", 104)]
    assert (tmp_path / "demo-old-v1" / REPORT_NAME).is_file()  # left in place



def test_a_real_cost_draft_is_cut_from_the_built_target_and_distilled(built, tmp_path):
    from starsd_draftd.demo.checkpoints import build_real_cost_draft

    out, _ = built
    report = build_real_cost_draft(out, tmp_path / "third", layers=1, budget_s=0.5, threads=1, progress=False)
    assert report["layers"] == 1 and report["of"] == 2 and report["steps"] > 0
    assert json.loads((tmp_path / "third" / "build_report.json").read_text()) == report
    # the demo draft's output-layer vocabulary, which the daemon cuts the real-cost draft's head to
    assert (tmp_path / "third" / VOCAB_FILE).read_bytes() == (out / "draft" / VOCAB_FILE).read_bytes()
    draft = load_causal_lm(str(tmp_path / "third"))
    assert draft.model.config.num_hidden_layers == 1 and draft.vocab_size == load_causal_lm(str(out / "target")).vocab_size
    with pytest.raises(ValueError, match="1..1 of the target's layers"):
        build_real_cost_draft(out, tmp_path / "bad", layers=2, budget_s=0.1, threads=1, progress=False)
