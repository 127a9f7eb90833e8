import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from tiny_models import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=1, hidden=48, layers=2)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """An independent, smaller model: most drafts are rejected, which exercises rollback."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=2, hidden=32, layers=1)


@pytest.fixture(scope="session")
def loaded_target(tiny_target):
    from common.models import load_causal_lm

    return load_causal_lm(str(tiny_target))
