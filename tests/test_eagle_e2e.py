"""The EAGLE path end to end: a draft daemon process serving an EAGLE head to three target
processes at once (greedy identity), and speculative sampling through it following the target's
distribution exactly. Also: the target package never imports draft-side code."""

import subprocess
import sys

import pytest

from common.control import ControlClient
from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, run_concurrently, running_server, samples_for, speculate
from starsd_draftd.backends.eagle import EagleBackend
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from tiny_models import make_near_copy, reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n"]


@pytest.mark.slow
def test_eagle_daemon_serves_three_targets_exactly(tiny_target, eagle_head, loaded_target, star):
    draft_ep = star.serve_drafts(["--backend", "eagle", "--eagle-head", str(eagle_head), "--base-model",
                                  str(tiny_target), "--depth", "4"], ready=False)
    # every round drafts (--no-adaptive-depth): the test is of the head's path, which a briefly trained
    # head's drafts might not pay for under adaptive depth
    eps = star.targets(tiny_target, draft_ep, len(PROMPTS), "--draft-timeout", "30", "--connect-timeout", "120",
                       "--no-adaptive-depth")
    engine = TargetEngine(loaded_target)
    results = run_concurrently(eps, [{"id": i, "prompt": p, "max_tokens": 48} for i, p in enumerate(PROMPTS)])
    for i, res in enumerate(results):
        assert res["token_ids"] == reference_greedy(tiny_target, engine.encode(PROMPTS[i]), 48)
        assert res["stats"]["fallback_rounds"] == 0 and res["stats"]["drafted"] > 0
    assert sum(r["stats"]["accepted"] for r in results) > 0
    with ControlClient(draft_ep) as cc:
        assert cc.stats()["peers"] == 3


@pytest.mark.parametrize("kind", ["eagle", "model"])
def test_sampling_through_the_daemon_follows_the_target(kind, tiny_target, eagle_head, loaded_target, tmp_path,
                                                       monkeypatch):
    if kind == "eagle":
        backend = EagleBackend.from_dirs(eagle_head, tiny_target, dtype="float32")
    else:
        backend = ModelBackend(load_causal_lm(str(make_near_copy(tiny_target, tmp_path / "near", noise=0.05))))
    params = SamplingParams(temperature=1.5, top_k=2)
    # The drafter samples from a broad q (its own temperature, no top-k), so that it proposes
    # tokens inside and outside the target's two-token support: both verification branches run.
    draft_params = SamplingParams(temperature=3.0)
    engine = TargetEngine(loaded_target, depth=2)
    prompt = engine.encode("x = ")
    length = 3  # rounds of depth 2: accepted drafts, rejections and the bonus token all occur
    exact = exact_joint(loaded_target.model, prompt, params, length)
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             feature_size=loaded_target.feature_size)
        client.handshake(10)
        for i in range(samples):
            p = SamplingParams(params.temperature, params.top_k, seed=10_000 + i)
            # the model backend's draft sessions are unseeded, so that they are drafted ahead (a
            # seeded one is not); their seeds then come from here, to keep the run repeatable
            q = SamplingParams(draft_params.temperature, seed=None if kind == "model" else 20_000 + i)
            monkeypatch.setattr("starsd_draftd.backends.base.secrets.randbits", lambda bits, i=i: 20_000 + i)
            r = speculate(engine, client, prompt, length, p, 30, draft_params=q)
            assert r.stats.fallback_rounds == 0
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
        client.close()
        ahead = server.stats.lookahead
    if kind == "model":  # drafted ahead by default, and the exactness holds with it
        assert ahead["started"] > 0 and ahead["hits"] + ahead["late_hits"] > 0, ahead
    assert 10 <= accepted < drafted, (accepted, drafted)  # both branches ran (the run is seeded)
    assert_follows(counts, exact, samples)


def test_target_package_imports_no_draft_code():
    code = ("import sys, starsd_target.cli, starsd_target.daemon, starsd_target.engine, starsd_target.client; "
            "bad = sorted(m for m in sys.modules if m == 'eagle' or m.startswith(('eagle.', 'starsd_draftd'))); "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"starsd_target imported: {out.stdout.strip()} {out.stderr[-500:]}"
