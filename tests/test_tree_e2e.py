"""Draft trees end to end: a draft daemon drafting trees (--tree-topk) for four target daemons
that verify them (--draft-tokens 16), each its own process, for Llama and Qwen2 targets through
both backends: greedy output token for token equal to the target's own generate, trees
verified and drafts kept. And sampled output through the daemon with trees follows the
target's distribution (chi-square on the joint of the first tokens); seeded output repeats."""

import pytest
from click.testing import CliRunner

from common.control import ControlClient
from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, run_concurrently, running_server, samples_for, speculate
from starsd_draftd.backends.eagle import EagleBackend
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.cli import main as draftd_cli
from starsd_draftd.demo.eagle_train import train_eagle_head
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from tiny_models import make_near_copy, make_tiny_checkpoint, reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):"]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_pair(request, tmp_path_factory):
    """A target of the architecture, a near copy as its draft model, and a briefly trained EAGLE head."""
    root = tmp_path_factory.mktemp(f"trees-{request.param}")
    target = make_tiny_checkpoint(root / "target", request.param, seed=4, hidden=48, layers=2)
    draft = make_near_copy(target, root / "draft", noise=0.05)
    head = root / "eagle"
    train_eagle_head(target, head, steps=40, time_budget_s=None, progress=False, batch_size=4, seq_len=64,
                     corpus_bytes=200_000, num_threads=1, eval_windows=2, eval_prompts=1, eval_tokens=8)
    return request.param, target, draft, head


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["model", "eagle"])
def test_targets_verify_trees_exactly(backend, arch_pair, star):
    """Targets verifying trees drafted by one daemon, concurrently: four targets on the first
    pair (llama, a draft model), two on the other three (the architectures and backends differ;
    what four concurrent targets add, the first case shows, and each target is a process start).
    Trees of the nodes that pay their row beside full ones."""
    arch, target, draft, head = arch_pair
    n = 4 if (arch, backend) == ("llama", "model") else 2
    if backend == "eagle":
        drafter = ["--backend", "eagle", "--eagle-head", str(head), "--base-model", str(target)]
    else:
        drafter = ["--backend", "model", "--model", str(draft)]
    draft_ep = star.serve_drafts([*drafter, "--depth", "4", "--tree-topk", "3"], ready=False)
    args = ("--draft-tokens", "16", "--draft-timeout", "30", "--connect-timeout", "120")
    # half the targets (t*) take trees of the nodes that pay their row, which the targets'
    # measured costs decide (on a CPU core: few, often none); the other half (f*) full trees
    full = n // 2
    eps = star.targets(target, draft_ep, n - full, *args)
    eps += star.targets(target, draft_ep, full, *args, "--no-adaptive-depth", prefix="f")
    engine = TargetEngine(load_causal_lm(str(target)))
    results = run_concurrently(eps, [{"id": i + 1, "prompt": p, "max_tokens": MAX_TOKENS}
                                     for i, p in enumerate(PROMPTS[:n])])
    for i, (p, res) in enumerate(zip(PROMPTS[:n], results)):
        assert res["token_ids"] == reference_greedy(target, engine.encode(p), MAX_TOKENS), (arch, backend, p)
        s = res["stats"]
        assert s["fallback_rounds"] == 0 and s["invalid_drafts"] == 0 and s["tree_tokens"] == 16
        if i >= n - full:  # full trees: every round verifies one
            assert s["tree_rounds"] > 0
    assert sum(r["stats"]["accepted"] for r in results) > 0  # speculation happened
    with ControlClient(draft_ep) as cc:
        st = cc.stats()
    assert st["peers"] == n and st["trees"]["requests"] > 0
    assert st["trees"]["tokens"] > 4 * st["trees"]["requests"] * full / n  # trees, wider than the depth-4 chains
    out = CliRunner().invoke(draftd_cli, ["status", "--connect", draft_ep])  # the command, in this process
    assert out.exit_code == 0 and f"trees: {st['trees']['requests']} requests answered with trees" in out.stdout


@pytest.mark.parametrize("kind", ["eagle", "model"])
def test_sampled_trees_through_the_daemon_follow_the_target(kind, tiny_target, loaded_target, tmp_path, request):
    """Trees of a chain and a second, distinct sibling per position (drawn without replacement)
    verified by recursive rejection sampling: the first three tokens follow the target's own
    joint distribution."""
    if kind == "eagle":  # the head test_eagle_e2e drafts with (trained once a session)
        backend = EagleBackend.from_dirs(request.getfixturevalue("eagle_head"), tiny_target, dtype="float32",
                                         tree_topk=2)
    else:
        near = make_near_copy(tiny_target, tmp_path / "near", noise=0.05)
        backend = ModelBackend(load_causal_lm(str(near)), tree_topk=2)
    params = SamplingParams(temperature=1.5, top_k=2)  # 8 outcomes, none too rare for the statistic
    draft_params = SamplingParams(temperature=3.0)  # a broad q: siblings inside and outside the support
    engine = TargetEngine(loaded_target, depth=2, draft_tokens=4)
    prompt = engine.encode("x = ")
    length = 3
    exact = exact_joint(loaded_target.model, prompt, params, length)
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    drafted = accepted = trees = 0
    with running_server(backend, max_tree_tokens=4) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             feature_size=loaded_target.feature_size)
        client.handshake(10)
        for i in range(samples):
            p = SamplingParams(params.temperature, params.top_k, seed=10_000 + i)
            q = SamplingParams(draft_params.temperature, seed=20_000 + i)
            r = speculate(engine, client, prompt, length, p, 30, draft_params=q)
            assert r.stats.fallback_rounds == 0 and r.stats.invalid_drafts == 0
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
            trees += r.stats.tree_rounds
        client.close()
    assert trees > samples // 2 and 10 <= accepted < drafted, (trees, accepted, drafted)
    assert_follows(counts, exact, samples)


def test_seeded_sampled_trees_repeat(tiny_target, loaded_target, near_draft):
    backend = ModelBackend(load_causal_lm(str(near_draft)), tree_topk=3)
    engine = TargetEngine(loaded_target, depth=3, draft_tokens=9)
    prompt = engine.encode("def f(x):")
    params = SamplingParams(temperature=0.9, top_k=20, seed=123)
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        runs = [speculate(engine, client, prompt, 24, params, 30) for _ in range(3)]
        client.close()
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert all(r.stats.tree_rounds > 0 and r.stats.fallback_rounds == 0 for r in runs)
