"""How the draft daemon sizes the trees it serves, and what a target asks of a daemon that drafts
chains only."""

from common.models import load_causal_lm
from common.protocol import Message, MsgType
from common.verify import SamplingParams
from fakes import CountingBackend, RawPeer, running_server, speculate
from starsd_draftd.backends.base import Draft
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
    backend = server.backend
    assert backend.tree_room(4, 16, greedy=True) == 12 and backend.tree_room(4, 16, greedy=False) == 4
    assert backend.tree_room(4, 0, greedy=True) == 4


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


class TreeOrChain(CountingBackend):
    """Answers a tree (a root with several children) when asked for one, else a chain."""

    tree_topk = 4
    kv_bytes_per_token = 1

    def draft(self, state, verified, depth, new_features=None, tree_tokens=0):
        if tree_tokens > depth:
            return Draft([(verified[-1] + i + 1) % self.vocab_size for i in range(tree_tokens)],
                         parents=[-1] * tree_tokens)
        return super().draft(state, verified, depth, new_features)


def _ask_tree(max_session_kv_bytes: int) -> Message:
    with running_server(TreeOrChain(), max_depth=3, max_session_kv_bytes=max_session_kv_bytes,
                        max_peer_kv_bytes=1 << 20, max_kv_bytes=1 << 20) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        assert peer.hello().type is MsgType.WELCOME
        peer.open(1, [5, 6, 7, 8, 9])
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 5, "depth": 3,
                                          "tree_tokens": 12}))
        reply = peer.recv()
        peer.sock.close(linger=0)
        return reply


def test_a_tree_without_room_in_cache_memory_is_drafted_as_a_chain():
    # a greedy 12-token tree of depth 3 feeds 4 nodes at 2 levels: 5 + 8 positions; a chain 5 + 3
    roomy = _ask_tree(100)
    assert roomy.type is MsgType.DRAFTED and len(roomy.header["tokens"]) == 12 and "parents" in roomy.tensors
    tight = _ask_tree(10)
    assert tight.type is MsgType.DRAFTED and len(tight.header["tokens"]) == 3 and "parents" not in tight.tensors
