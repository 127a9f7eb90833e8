"""Per-request control of speculation (off, or a cap on the draft length) and token
log-probabilities: on the engine, through the scheduler and the job socket, and through the
HTTP API (in-process, with a real draft model behind an in-process draft server).

Log-probabilities are checked against the target model run directly with transformers over
prompt and output: the log-softmax of its raw logits at each generated position."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import LocalDrafts
from starsd_draftd.backends.model import ModelBackend
from starsd_target.engine import MAX_LOGPROBS, InvalidRequest, TargetEngine
from tiny_models import reference_greedy

PROMPT = "def parse(line):\n    "
DEPTH = 4


@pytest.fixture(scope="module")
def draft_backend(near_draft):
    return ModelBackend(load_causal_lm(str(near_draft)))


@pytest.fixture(scope="module")
def engine(loaded_target):
    return TargetEngine(loaded_target, depth=DEPTH)


@pytest.fixture(scope="module")
def reference(tiny_target):
    """log-softmax of the target's raw logits (float32) at the positions producing ``out``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], out: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(out)], dim=-1)

    return logprobs


@dataclass
class Recording:
    """A DraftSource around LocalDrafts that records the depth each round asked for."""

    inner: LocalDrafts
    depths: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    feature_size: int = 0

    def propose(self, tokens, depth, features=None):
        self.depths.append(depth)
        prop = self.inner.propose(tokens, depth, features)
        self.lengths.append(len(prop.tokens))
        return prop

    def kept(self, n):
        self.inner.kept(n)

    def close(self):
        self.inner.close()


def assert_matches_reference(result, prompt, ref, top: int) -> None:
    want = ref(prompt, result.token_ids)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, (entry, tok) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.token == tok
        assert entry.logprob == pytest.approx(float(want[i, tok]), abs=1e-4)
        assert len(entry.top) == top
        values, ids = torch.topk(want[i], top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


# ---------------------------------------------------------------- the engine
def test_greedy_logprobs_are_the_targets_log_softmax_with_drafts_kept(engine, draft_backend, reference, tiny_target):
    prompt = engine.encode(PROMPT)
    with_lp = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), logprobs=5)
    without = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend))
    assert with_lp.stats.accepted > 0 and with_lp.stats.drafted > with_lp.stats.accepted  # kept and rejected drafts
    assert with_lp.token_ids == without.token_ids == reference_greedy(tiny_target, prompt, 40)
    assert without.logprobs is None
    assert_matches_reference(with_lp, prompt, reference, top=5)
    # greedy: the produced token is the most likely one
    assert all(e.top[0][0] == e.token for e in with_lp.logprobs)


def test_sampled_logprobs_are_of_the_raw_logits_and_change_nothing(engine, draft_backend, reference):
    prompt = engine.encode(PROMPT)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4)
    runs = [engine.generate(prompt, 30, params, LocalDrafts(draft_backend, params), logprobs=lp)
            for lp in (None, 0, MAX_LOGPROBS)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[2].stats.accepted > 0
    assert_matches_reference(runs[1], prompt, reference, top=0)
    assert_matches_reference(runs[2], prompt, reference, top=MAX_LOGPROBS)  # not tempered, not filtered


def test_logprobs_are_cut_with_the_output_at_a_stop_string(engine, draft_backend):
    prompt = engine.encode(PROMPT)
    whole = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), logprobs=1)
    stop = whole.text[10:12]
    cut = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), stop=[stop], logprobs=1)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    assert len(cut.logprobs) == len(cut.token_ids)
    assert [e.token for e in cut.logprobs] == cut.token_ids
    assert [e.logprob for e in cut.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[: len(cut.token_ids)]],
                                                              abs=1e-5)


def test_max_draft_caps_each_rounds_drafts(engine, draft_backend, tiny_target):
    prompt = engine.encode(PROMPT)
    rec = Recording(LocalDrafts(draft_backend))
    result = engine.generate(prompt, 40, SamplingParams(), rec, max_draft=1)
    assert result.token_ids == reference_greedy(tiny_target, prompt, 40)
    assert rec.depths and max(rec.depths) == 1 and max(rec.lengths) == 1
    assert result.stats.accepted > 0 and result.stats.drafted <= result.stats.rounds
    assert result.stats.accepted_by_position[1:] == [0] * (DEPTH - 1)
    assert result.stats.max_draft_tokens == 1 and result.stats.to_dict()["speculate"] is True
    full = Recording(LocalDrafts(draft_backend))
    engine.generate(prompt, 40, SamplingParams(), full)
    assert max(full.depths) == DEPTH  # without the cap, rounds ask for the target's depth


def test_max_draft_zero_asks_for_no_drafts_and_counts_no_fallback(engine, draft_backend, tiny_target):
    prompt = engine.encode(PROMPT)
    rec = Recording(LocalDrafts(draft_backend))
    result = engine.generate(prompt, 20, SamplingParams(), rec, max_draft=0)
    assert result.token_ids == reference_greedy(tiny_target, prompt, 20)
    assert rec.depths == [] and result.stats.drafted == 0 and result.stats.fallback_rounds == 0
    assert result.stats.rounds == 20 and result.stats.to_dict()["speculate"] is False


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_draft=DEPTH + 1), "max_draft_tokens"),
    (dict(max_draft=-1), "max_draft_tokens"),
    (dict(max_draft=True), "max_draft_tokens"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1.5), "logprobs"),
])
def test_engine_check_bounds_the_speculation_and_logprob_options(engine, kwargs, param):
    with pytest.raises(InvalidRequest) as info:
        engine.check([65, 66], 5, SamplingParams(), (), **kwargs)
    assert info.value.param == param and str(info.value)
    engine.check([65, 66], 5, SamplingParams(), (), max_draft=DEPTH, logprobs=MAX_LOGPROBS)
