"""How the draft daemon sizes the trees it serves, and what a target asks of a daemon that drafts
chains only."""

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import CountingBackend, running_server, speculate
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.server import DraftServer, ServerConfig
from starsd_draftd.sessions import Session
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine


class TreeCounting(CountingBackend):
    tree_topk = 4


def _session(params: SamplingParams) -> Session:
    return Session(key=(b"peer", 1), params=params, state=None, verified=[1, 2, 3])


def test_trees_shrink_behind_a_queue_except_seeded_sampled_ones():
    server = DraftServer(TreeCounting(), ServerConfig(bind="tcp://127.0.0.1:0"))
    ask = {"depth": 4, "tree_tokens": 16}
    greedy, unseeded, seeded = (_session(SamplingParams()), _session(SamplingParams(temperature=0.8)),
                                _session(SamplingParams(temperature=0.8, seed=5)))
    assert [server._tree_budget(s, ask) for s in (greedy, unseeded, seeded)] == [16, 16, 16]
    server.q_in.append(("a request waiting",))
    assert [server._tree_budget(s, ask) for s in (greedy, unseeded, seeded)] == [8, 8, 16]
    assert server.stats.trees["shrunk"] == 2
    assert server._tree_budget(greedy, {"depth": 4, "tree_tokens": 4}) == 0  # no room beyond a chain
    # cache room: a greedy tree feeds its frontier (16 / 4 = 4 nodes) at 3 levels; a sampled one its chain
    assert server._tree_room(greedy, 4, 16) == 12 and server._tree_room(unseeded, 4, 16) == 4
    assert server._tree_room(greedy, 4, 0) == 4


def test_a_draft_model_without_tree_masks_drafts_chains(tiny_draft):
    loaded = load_causal_lm(str(tiny_draft))
    assert ModelBackend(loaded, tree_topk=4).tree_topk == 4
    loaded.model.config._attn_implementation = "flash_attention_2"  # takes no custom 4-D mask
    assert ModelBackend(loaded, tree_topk=4).tree_topk == 1


def test_a_chains_only_daemon_gets_chain_requests_of_the_adaptive_length(loaded_target, near_draft):
    """A target with --draft-tokens above its depth, linked to a daemon that drafts chains: its
    rounds ask for chains (counted as such), with adaptive depth still choosing their length."""
    engine = TargetEngine(loaded_target, depth=4, draft_tokens=12)
    with running_server(ModelBackend(load_causal_lm(str(near_draft)), tree_topk=1)) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        assert not client.welcome.trees
        r = speculate(engine, client, engine.encode("def f(x):"), 24, SamplingParams(), 30)
        client.close()
    s = r.stats
    assert s.tree_rounds == 0 and s.accepted > 0 and s.fallback_rounds == 0
    assert s.asked_tokens <= 4 * s.rounds  # chains of at most the depth, not the tree budget
