import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from common.models import DEMO_BUILD_COMMANDS, ModelLoadError, cache_root, resolve_model_path
from starsd_draftd.demo import corpus, pair as demo_models
from starsd_draftd.demo.byte_tokenizer import BYTE_VOCAB_SIZE
from starsd_draftd.demo.corpus import load_corpus
from starsd_draftd.demo.checkpoints import demo_path
from starsd_draftd.demo.pair import ModelShape, train_demo_pair

TINY_TARGET = ModelShape(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64
)
TINY_DRAFT = ModelShape(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32
)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_pair")
    report = train_demo_pair(
        out,
        target_steps=4,
        draft_steps=3,
        progress=False,
        batch_size=2,
        seq_len=32,
        corpus_bytes=200_000,
        eval_windows=2,
        sample_tokens=8,
        use_bf16=False,
        target=TINY_TARGET,
        draft=TINY_DRAFT,
    )
    return out, report


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("STARSD_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "starsd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "starsd"


def test_resolve_non_demo_name_unchanged(monkeypatch, tmp_path):
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo_models, "train_demo_pair", _forbidden_training)
    assert resolve_model_path("/some/where/model") == Path("/some/where/model")
    assert resolve_model_path("relative/dir") == Path("relative/dir")
    assert resolve_model_path("demo-other") == Path("demo-other")
    assert demo_path("relative/dir") == Path("relative/dir")
    assert list(tmp_path.iterdir()) == []


def test_the_daemons_resolver_never_trains_and_names_the_build_command(monkeypatch, tmp_path):
    from starsd_draftd.demo import checkpoints, eagle_train

    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoints, "build_demo_checkpoints", _forbidden_training)
    monkeypatch.setattr(eagle_train, "train_eagle_head", _forbidden_training)
    for name in ("demo", "demo-draft", "demo-eagle"):
        with pytest.raises(ModelLoadError, match="not built yet") as err:
            resolve_model_path(name)
        assert DEMO_BUILD_COMMANDS[name] in str(err.value)
    assert list(tmp_path.iterdir()) == []


def _forbidden_training(*args, **kwargs):
    raise AssertionError("training must not run")


def test_corpus_is_deterministic_and_disjoint():
    train_a, held_a, info_a = load_corpus(byte_budget=100_000, heldout_bytes=10_000, seed=3)
    train_b, held_b, info_b = load_corpus(byte_budget=100_000, heldout_bytes=10_000, seed=3)
    assert train_a == train_b and held_a == held_b and info_a == info_b
    assert len(train_a) == 100_000
    assert len(held_a) >= 10_000
    assert b"def " in train_a and b"import " in train_a
    # Held-out text comes from other files than the training text.
    assert held_a[:2000] not in train_a


def test_tiny_training_report(tiny_pair):
    out, report = tiny_pair
    on_disk = json.loads((out / "train_report.json").read_text())
    assert on_disk == report
    assert report["recipe_version"] == demo_models.RECIPE_VERSION
    assert report["phases"]["target"]["steps"] == 4
    assert report["phases"]["draft"]["steps"] == 3
    for role in ("target", "draft"):
        assert report[role]["params"] > 0
        assert 0.0 < report[role]["heldout_loss"] < 10.0
        assert 0.0 < report[role]["train_loss"] < 10.0
    assert report["target"]["params"] > report["draft"]["params"]
    assert 0.0 <= report["agreement"]["heldout_top1"] <= 1.0
    assert set(report["wall_s"]) == {"data", "target", "draft", "eval", "save"}
    assert isinstance(report["greedy_samples"]["def "], str)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_tiny_checkpoints_load_and_generate(tiny_pair, role):
    out, _ = tiny_pair
    path = out / role
    assert (path / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.vocab_size == BYTE_VOCAB_SIZE
    shape = TINY_TARGET if role == "target" else TINY_DRAFT
    assert model.config.hidden_size == shape.hidden_size
    assert model.config.num_hidden_layers == shape.num_hidden_layers
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.bos_token_id == 1
    assert model.generation_config.pad_token_id == 0
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("def ", return_tensors="pt").input_ids
    assert ids.tolist() == [[ord(c) + 3 for c in "def "]]
    with torch.no_grad():
        out_ids = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False
        )
    assert out_ids.shape[0] == 1 and ids.shape[1] < out_ids.shape[1] <= ids.shape[1] + 5
    assert out_ids[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert isinstance(tok.decode(out_ids[0]), str)


def test_tiny_checkpoint_kv_cache_consistent(tiny_pair):
    """Incremental decoding with the cache matches a full forward pass."""
    out, _ = tiny_pair
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "target")).eval()
    ids = torch.tensor([[3 + b for b in b"import os\n"]])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :-3], use_cache=True)
        rest = model(input_ids=ids[:, -3:], cache=first.cache, use_cache=True).logits
    torch.testing.assert_close(rest, full[:, -3:], rtol=1e-4, atol=1e-4)


def test_ensure_demo_pair_builds_once_and_reuses(monkeypatch, tmp_path):
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    calls = []

    def fast_train(out_dir, **kwargs):
        calls.append(Path(out_dir))
        return train_demo_pair(
            out_dir,
            target_steps=1,
            draft_steps=1,
            progress=False,
            batch_size=1,
            seq_len=16,
            corpus_bytes=50_000,
            eval_windows=1,
            sample_tokens=2,
            use_bf16=False,
            target=TINY_TARGET,
            draft=TINY_DRAFT,
        )

    monkeypatch.setattr(demo_models, "train_demo_pair", fast_train)
    target_dir, draft_dir = demo_models.ensure_demo_pair(progress=False)
    expected = tmp_path / f"demo-{demo_models.RECIPE_VERSION}"
    assert target_dir == expected / "target" and draft_dir == expected / "draft"
    assert len(calls) == 1
    # Training happened in a temporary directory that was renamed into place.
    assert calls[0] != expected and calls[0].parent == tmp_path and not calls[0].exists()
    assert (target_dir / "model.safetensors").is_file() and (draft_dir / "model.safetensors").is_file()

    assert demo_models.ensure_demo_pair(progress=False) == (target_dir, draft_dir)
    assert len(calls) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".demo-")]
    assert leftovers == []


def test_ensure_demo_pair_ignores_partial_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    version = demo_models.RECIPE_VERSION
    # A temp dir left by a killed build and an incomplete final directory.
    stale = tmp_path / f".demo-{version}.tmp-dead"
    (stale / "target").mkdir(parents=True)
    (stale / "target" / "config.json").write_text("{}")
    partial = tmp_path / f"demo-{version}" / "target"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")

    def failing_train(out_dir, **kwargs):
        (Path(out_dir) / "target").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_models, "train_demo_pair", failing_train)
    with pytest.raises(KeyboardInterrupt):
        demo_models.ensure_demo_pair(progress=False)
    assert not stale.exists()
    assert not (tmp_path / f"demo-{version}").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".demo-")] == []


def test_strip_docs_keeps_code_and_drops_prose():
    import ast

    source = '''"""Module docstring
spanning lines."""
# a comment line
import os  # trailing comment stays


class A:
    """Class doc."""

    x = 1

    def f(self):
        """Only statement, must stay so the body is not empty."""


def g(a):
    """Doc of g."""
    # comment inside
    return a + 1
'''
    out = corpus._strip_docs(source)
    assert out is not None
    ast.parse(out)
    assert "Module docstring" not in out and "Class doc" not in out and "Doc of g" not in out
    assert "# a comment line" not in out and "# comment inside" not in out
    assert "import os  # trailing comment stays" in out
    assert "Only statement" in out
    assert "return a + 1" in out and "x = 1" in out
    assert "\n\n\n\n" not in out
    assert corpus._strip_docs("def broken(:\n") is None
