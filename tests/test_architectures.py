"""Greedy identity beyond Llama: Qwen2 and GPT-2 targets through the real draft server and client
(the server runs in this process here; test_e2e covers separate processes)."""

import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient, HandshakeRefused
from starsd_target.engine import TargetEngine
from tiny_models import make_near_copy, make_tiny_checkpoint, reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os", "x = [1, 2"]


@pytest.mark.parametrize("arch, draft_kind", [("qwen2", "near"), ("gpt2", "near"), ("gpt2", "llama")])
def test_greedy_identity_other_architectures(tmp_path, arch, draft_kind):
    target_dir = make_tiny_checkpoint(tmp_path / "t", arch, seed=5, hidden=48, layers=2)
    if draft_kind == "near":
        draft_dir = make_near_copy(target_dir, tmp_path / "d", noise=0.02)
    else:  # a draft of another architecture works as long as the tokenizer is the same
        draft_dir = make_tiny_checkpoint(tmp_path / "d", "llama", seed=6, hidden=32, layers=1)
    target = load_causal_lm(str(target_dir))
    backend = ModelBackend(load_causal_lm(str(draft_dir)))
    engine = TargetEngine(target, depth=4)
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, target.vocab_size, target.fingerprint, ctx=ctx)
        client.handshake(10)
        accepted = 0
        for sid, text in enumerate(PROMPTS, start=1):
            prompt = engine.encode(text)
            ref = reference_greedy(target_dir, prompt, 40)
            r = speculate(engine, client, prompt, 40, SamplingParams(), 30)
            assert r.token_ids == ref, (arch, text)
            assert r.stats.fallback_rounds == 0
            accepted += r.stats.accepted
        client.close()
    if draft_kind == "near":
        assert accepted > 0


def test_target_sees_a_clear_refusal(tiny_target):
    from fakes import CountingBackend

    target = load_causal_lm(str(tiny_target))
    with running_server(CountingBackend(vocab_size=32000, fingerprint="abc")) as (server, ctx):
        client = DraftClient(server.endpoint, target.vocab_size, target.fingerprint, ctx=ctx)
        with pytest.raises(HandshakeRefused) as info:
            client.handshake(10)
        msg = str(info.value)
        assert "INCOMPATIBLE_MODEL" in msg and "32000" in msg and "259" in msg and target.fingerprint in msg
        client.close()
