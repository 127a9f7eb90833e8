"""Target features for feature-based draft backends: the target sends, with each request, exactly
the final hidden states of the newly verified positions, taken from its verification forward."""

import numpy as np
import torch

from common.tensors import as_torch
from common.verify import SamplingParams
from fakes import CountingBackend, RawPeer, running_server, speculate
from starsd_target.client import DraftClient, HandshakeRefused
from starsd_target.engine import TargetEngine
from tiny_models import reference_greedy

import pytest


class RecordingFeatureBackend(CountingBackend):
    """Keeps every feature row it receives, per session; drafts like CountingBackend."""

    name = "recording"

    def __init__(self, feature_size: int, fingerprint: str = "fake-tok"):
        super().__init__(fingerprint=fingerprint)
        self.feature_size = feature_size
        self.sessions = []

    def new_state(self, params):
        st = {"calls": 0, "features": [], "verified": None}
        self.sessions.append(st)
        return st

    def draft(self, state, verified, depth, new_features=None):
        state["features"].append(as_torch(new_features).float().clone())  # backends get wire arrays
        state["verified"] = list(verified)
        assert sum(f.shape[0] for f in state["features"]) == len(verified) - 1
        return super().draft(state, verified, depth)


def test_features_match_the_targets_hidden_states(loaded_target, tiny_target):
    backend = RecordingFeatureBackend(loaded_target.feature_size, loaded_target.fingerprint)
    engine = TargetEngine(loaded_target, depth=3)
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             feature_size=loaded_target.feature_size)
        assert client.handshake(10).feature_size == loaded_target.feature_size
        prompt = engine.encode("def parse(line):\n    ")
        r = speculate(engine, client, prompt, 30, SamplingParams(), 30)
        client.close()
    assert r.token_ids == reference_greedy(tiny_target, prompt, 30)
    assert r.stats.fallback_rounds == 0
    st = backend.sessions[-1]
    got = torch.cat(st["features"])
    ids = torch.tensor([st["verified"][:-1]])
    with torch.inference_mode():
        want = loaded_target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    assert got.shape == want.shape
    # sent as float16: equal to the full forward's hidden states up to half precision
    assert torch.allclose(got, want, atol=2e-2, rtol=1e-2)


def test_hidden_size_mismatch_is_refused(loaded_target):
    backend = RecordingFeatureBackend(loaded_target.feature_size + 16, loaded_target.fingerprint)
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                             feature_size=loaded_target.feature_size)
        with pytest.raises(HandshakeRefused) as info:
            client.handshake(10)
        assert str(loaded_target.feature_size) in str(info.value)
        assert str(loaded_target.feature_size + 16) in str(info.value)
        client.close()


def test_feature_requests_are_validated():
    from common.protocol import ErrorCode, Message, MsgType

    backend = RecordingFeatureBackend(8)
    with running_server(backend) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.send(Message(MsgType.HELLO, {"vocab_size": 259, "tokenizer": "fake-tok", "feature_size": 8}))
        assert peer.recv().header["feature_size"] == 8
        peer.open(1, [5, 6, 7])

        def draft(seq, feats):
            peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": seq, "accepted": 0, "new": [], "pos": 3,
                                              "depth": 2}, {} if feats is None else {"features": feats}))
            return peer.recv()

        def code(m):
            return ErrorCode(m.header["code"]).name

        assert code(draft(1, None)) == "BAD_REQUEST"
        assert code(draft(2, torch.zeros(2, 4, dtype=torch.float16))) == "BAD_REQUEST"
        assert code(draft(3, torch.zeros(2, 8, dtype=torch.int32))) == "BAD_REQUEST"
        assert code(draft(4, torch.full((2, 8), float("nan"), dtype=torch.float16))) == "BAD_REQUEST"
        assert code(draft(5, torch.zeros(3, 8, dtype=torch.float16))) == "DESYNC"
        ok = draft(6, torch.zeros(2, 8, dtype=torch.bfloat16))
        assert ok.type is MsgType.DRAFTED and ok.header["tokens"] == [8, 9]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_feature_buffer_hands_out_wire_views_of_its_rows(dtype):
    from common.tensors import BFLOAT16, encode_tensor
    from starsd_target.engine import FeatureBuffer

    buf = FeatureBuffer(4, dtype)
    rows = torch.randn(50, 4)
    buf.append(rows[:30])
    first = buf.view()
    assert first.shape == (30, 4) and first.dtype == (BFLOAT16 if dtype is torch.bfloat16 else np.float16)
    buf.append(rows[30:])  # 50 rows: still the first 64-row buffer
    buf.append(rows[:40])  # 90: it grows
    v = buf.view()
    assert v.shape == (90, 4)
    want = torch.cat([rows, rows[:40]]).to(dtype)
    assert torch.equal(as_torch(v), want)
    assert torch.equal(as_torch(first), want[:30])  # a view handed out earlier keeps its rows
    spec, frame = encode_tensor(v[60:])  # what goes out: the rows not sent yet, as they are
    assert spec == {"dtype": "float16" if dtype is torch.float16 else "bfloat16", "shape": [30, 4]}
    assert bytes(frame) == bytes(encode_tensor(want[60:])[1])
