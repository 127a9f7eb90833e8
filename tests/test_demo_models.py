"""The demo's cache directory, its checkpoint names (never trained by a daemon) and its corpus."""

from pathlib import Path

import pytest

from common.models import DEMO_BUILD_COMMANDS, ModelLoadError, cache_root, resolve_model_path
from starsd_draftd.demo import corpus
from starsd_draftd.demo.checkpoints import demo_path
from starsd_draftd.demo.corpus import load_corpus


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
