"""The EAGLE-3 backend against an independent reference of the published head forward.

The reference below is written from the EAGLE-3 description (Li et al. 2025) in plain float32
torch, without the backend's module: the fused feature of position i is the concatenation of the
target's hidden states entering layers 2, L//2 and L-3 (or the head config's ids, in their
order); ``fc`` maps it to the head's width; the head's one layer attends (Llama RoPE, causal, GQA)
over [input_layernorm(embedding), hidden_norm(hidden)], with the hidden state as the residual,
then the gated MLP; ``lm_head(norm(out))`` scores the draft vocabulary, mapped to target ids by
``d2t``. The pairs are (f_i, embed(t_{i+1})) at position i; each draft step feeds the head's own
pre-norm output back with the drafted token's embedding, at the next position.

The reference recomputes everything from scratch (no cache) for every draft token, so it also
pins the backend's cache handling across rounds, its batching of sessions and its tree masks.
The heads are written here, tensor by tensor, in the published layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.tree import ROOT
from common.verify import SamplingParams
from starsd_draftd.backends.base import DraftRequest, frontier_width
from starsd_draftd.backends.eagle3 import Eagle3Backend
from starsd_draftd.backends.trees import GreedyTree
from tiny_models import make_tiny_checkpoint

VOCAB = 259  # the tiny targets' byte vocabulary
DRAFT_VOCAB = 200
MIN_MARGIN = 1e-2  # the reference's top-2 logit margin must sit far above float32 rounding (~1e-5 here)


# ---------------------------------------------------------------- a head in the published layout


def write_head(target_dir: Path, out: Path, *, seed: int, hidden: int | None = None, heads: int = 4,
               kv_heads: int = 2, layer_ids: list[int] | None = None, own_embedding: bool = False,
               rope_theta: float = 10000.0, scale: float = 0.35, draft_vocab: int = DRAFT_VOCAB) -> Path:
    """A random EAGLE-3 head for the target in ``target_dir``: ``config.json`` (Llama style, with
    ``draft_vocab_size`` and optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
    ``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, and
    ``embed_tokens`` if asked). The draft vocabulary is a random subset of the target's, never
    holding token 0, so d2t is > 0 everywhere."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    th, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    h = hidden or th
    hd = h // heads
    inter = 5 * h // 2
    k = 3 if layer_ids is None else len(layer_ids)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).contiguous()

    ids = (1 + torch.randperm(vocab - 1, generator=g)[:draft_vocab]).sort().values
    d2t = (ids - torch.arange(draft_vocab)).long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": rnd(h, k * th, s=scale / 2),
        "midlayer.input_layernorm.weight": 1 + rnd(h, s=0.2),
        "midlayer.hidden_norm.weight": 1 + rnd(h, s=0.2),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h, s=0.2),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": 1 + rnd(h, s=0.2),
        "lm_head.weight": rnd(draft_vocab, h, s=4 * scale),
        "d2t": d2t,
        "t2d": t2d,
    }
    lm = state["lm_head.weight"]  # rows of one norm: no token wins by the size of its row alone
    state["lm_head.weight"] = (lm / lm.norm(dim=-1, keepdim=True) * lm.norm(dim=-1).mean()).contiguous()
    if own_embedding:
        state["embed_tokens.weight"] = rnd(vocab, h, s=1.0)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "max_position_embeddings": 2048, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    if h != th:
        cfg["target_hidden_size"] = th
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out / "model.safetensors"))
    return out


# ---------------------------------------------------------------- the target's fused features


class Target:
    """A tiny target checkpoint and its fused features (hs[i]: the state entering layer i)."""

    def __init__(self, path: Path):
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.layers = self.model.config.num_hidden_layers

    @torch.no_grad()
    def features(self, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
        """[len(ids) - 1, k * H_t]: f_i for positions 0..len(ids) - 2."""
        hs = self.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert len(hs) == self.layers + 1
        return torch.cat([hs[i][0] for i in layers], dim=-1)[: len(ids) - 1].float().contiguous()


def check_hidden_state_convention(target: Target) -> None:
    """hs[i] is what enters decoder layer i (hs[0] the embeddings): what the reference relies on."""
    seen = {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True) for i, layer in enumerate(target.model.model.layers)]
    try:
        ids = torch.tensor([[3, 70, 80, 90, 100, 110]])
        with torch.no_grad():
            hs = target.model(ids, output_hidden_states=True).hidden_states
    finally:
        for hk in hooks:
            hk.remove()
    for i in range(target.layers):
        assert torch.equal(hs[i], seen[i]), i


# ---------------------------------------------------------------- the reference head


class RefHead:
    """The published EAGLE-3 head forward, float32, recomputed from scratch for every query.

    ``theta`` and ``embed`` override what the checkpoint says (only to show the test notices)."""

    def __init__(self, head_dir: Path, target_dir: Path, theta: float | None = None,
                 embed: torch.Tensor | None = None):
        cfg = json.loads((head_dir / "config.json").read_text())
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in
                  load_file(str(head_dir / "model.safetensors")).items()}
        self.h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.hd = self.h // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = float(theta if theta is not None else cfg.get("rope_theta", 10000.0))
        if embed is None:
            embed = self.w.get("embed_tokens.weight")
        if embed is None:
            with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
                embed = f.get_tensor("model.embed_tokens.weight")
        self.embed = embed.float()
        self.d2t = self.w["d2t"].long()
        assert self.d2t.shape == (DRAFT_VOCAB,)
        assert bool((self.d2t != 0).all()), "d2t must be non-zero everywhere"

    def target_embedding(self, target_dir: Path) -> torch.Tensor:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
            return f.get_tensor("model.embed_tokens.weight").float()

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [heads, T, hd]; Llama's rotate-half RoPE at positions ``pos`` [T]."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        ang = pos.double()[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().float(), ang.sin().float()
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def layer(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """The head's decoder layer over pairs (hidden[i], embed(tokens[i])) at positions 0..T-1."""
        w, t = self.w, hidden.shape[0]
        e = self.embed[torch.tensor(tokens)]
        a = torch.cat([self.rms(e, "midlayer.input_layernorm.weight"),
                       self.rms(hidden, "midlayer.hidden_norm.weight")], dim=-1)
        q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(t, self.heads, self.hd).transpose(0, 1)
        k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.hd).transpose(0, 1)
        v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.hd).transpose(0, 1)
        pos = torch.arange(t)
        q, k = self.rope(q, pos), self.rope(k, pos)
        group = self.heads // self.kv_heads
        k = k[:, None].expand(self.kv_heads, group, t, self.hd).reshape(self.heads, t, self.hd)
        v = v[:, None].expand(self.kv_heads, group, t, self.hd).reshape(self.heads, t, self.hd)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.hd)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v  # [heads, T, hd]
        x = hidden + att.transpose(0, 1).reshape(t, self.heads * self.hd) @ w["midlayer.self_attn.o_proj.weight"].T
        y = self.rms(x, "midlayer.post_attention_layernorm.weight")
        gate = y @ w["midlayer.mlp.gate_proj.weight"].T
        up = y @ w["midlayer.mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms(x, "norm.weight") @ self.w["lm_head.weight"].T

    def to_target(self, draft_id: int) -> int:
        return int(draft_id) + int(self.d2t[int(draft_id)])

    def full_logits(self, small: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits put at their target ids, -inf elsewhere (for the tree reference)."""
        full = torch.full((VOCAB,), float("-inf"))
        full[torch.arange(DRAFT_VOCAB) + self.d2t] = small
        return full

    @torch.no_grad()
    def path_logits(self, verified: list[int], feats: torch.Tensor, path: list[int]) -> list[torch.Tensor]:
        """Draft-vocabulary logits after the verified sequence and after each prefix of ``path``
        (target ids), every one recomputed from scratch: len(path) + 1 of them."""
        n = len(verified) - 1
        assert feats.shape[0] == n and n >= 1
        fused = feats.float() @ self.w["fc.weight"].T  # [n, H]
        out = []
        hidden, tokens = fused, list(verified[1:])
        for j in range(len(path) + 1):
            last = self.layer(hidden, tokens)[-1]
            out.append(self.draft_logits(last))
            if j < len(path):
                hidden = torch.cat([hidden, last[None]])
                tokens.append(path[j])
        return out

    @torch.no_grad()
    def chain(self, verified: list[int], feats: torch.Tensor, depth: int) -> tuple[list[int], float]:
        """The greedy chain of ``depth`` target ids and the smallest top-2 margin along it."""
        n = len(verified) - 1
        fused = feats.float() @ self.w["fc.weight"].T
        hidden, tokens = fused, list(verified[1:])
        chain, margin = [], float("inf")
        for _ in range(depth):
            last = self.layer(hidden, tokens)[-1]
            logits = self.draft_logits(last)
            top = torch.topk(logits, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            tok = self.to_target(int(top.indices[0]))
            chain.append(tok)
            hidden = torch.cat([hidden, last[None]])
            tokens.append(tok)
        assert hidden.shape[0] == n + depth
        return chain, margin

    def tree(self, verified: list[int], feats: torch.Tensor, depth: int, budget: int, topk: int):
        """The EAGLE-2 greedy tree (``trees.GreedyTree``'s layout) grown from reference logits:
        every node's children come from the logits after its own path, recomputed from scratch."""
        t = GreedyTree(topk, frontier_width(topk, depth, budget))
        t.grow(ROOT, self.full_logits(self.path_logits(verified, feats, [])[0]))
        for d in range(1, depth):
            level = t.frontier(d)
            t.feed(level)
            for node in level:
                t.grow(node, self.full_logits(self.path_logits(verified, feats, path_to(t, node))[-1]))
        return t.draft(budget)


def path_to(tree: GreedyTree, node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(tree.token(node))
        node = tree.parent(node)
    return path[::-1]


def checked_chain(ref: RefHead, verified: list[int], feats: torch.Tensor, depth: int) -> list[int]:
    chain, margin = ref.chain(verified, feats, depth)
    assert margin > MIN_MARGIN, f"reference top-2 margin {margin} too close to a tie to compare argmaxes"
    return chain


def first_mismatch(got: list[int], want: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"first mismatch at draft position {i}: backend {got}, reference {want}"


# ---------------------------------------------------------------- fixtures


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + (3 + torch.randint(0, 250, (length - 1,), generator=g)).tolist()


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> Target:
    return Target(make_tiny_checkpoint(tmp_path_factory.mktemp("e3_llama8"), "llama", seed=11, hidden=32, layers=8))


@pytest.fixture(scope="module")
def qwen6(tmp_path_factory) -> Target:
    return Target(make_tiny_checkpoint(tmp_path_factory.mktemp("e3_qwen6"), "qwen2", seed=12, hidden=32, layers=6))


@pytest.fixture(scope="module")
def default_head(llama8, tmp_path_factory) -> Path:
    return write_head(llama8.path, tmp_path_factory.mktemp("e3_head_default"), seed=21)


def backend(head: Path, target: Target, tree_topk: int = 1) -> Eagle3Backend:
    return Eagle3Backend.from_dirs(head, target.path, device="cpu", dtype="float32", tree_topk=tree_topk)


DEFAULT_LAYERS = (2, 4, 5)  # (2, L//2, L-3) for L = 8


# ---------------------------------------------------------------- 1. chains across rounds


def test_default_layers_chain_across_rounds(llama8, default_head):
    check_hidden_state_convention(llama8)
    b = backend(default_head, llama8)
    assert b.feature_layers == (2, llama8.layers // 2, llama8.layers - 3) == DEFAULT_LAYERS
    assert b.feature_size == 3 * 32
    ref = RefHead(default_head, llama8.path)
    depth = 5
    st = b.new_state(SamplingParams())
    verified = prompt(1, 20)
    sent = llama8.features(verified, DEFAULT_LAYERS)  # every feature the session holds, as sent
    new = sent  # first round: f_0..f_{n-1}
    growth = [(2, 77), (0, 200), (depth, 5)]  # per round: drafts kept, then a token of our own
    seen = []
    for rnd in range(len(growth) + 1):
        assert st.features + new.shape[0] == len(verified) - 1
        d = b.draft(st, verified, depth, new)
        want = checked_chain(ref, verified, sent, depth)
        assert d.tokens == want, f"round {rnd} (verified {len(verified)}): {first_mismatch(d.tokens, want)}"
        seen += want
        if rnd == len(growth):
            break
        keep, extra = growth[rnd]
        if keep < depth and want[keep] == extra:
            extra += 1  # a rejection: the target's token differs from the draft there
        verified = verified + want[:keep] + [extra]
        new = llama8.features(verified, DEFAULT_LAYERS)[sent.shape[0]:]
        assert new.shape[0] == keep + 1
        sent = torch.cat([sent, new])
    b.release(st)
    assert len(set(seen)) > 3, f"the reference drafts are degenerate: {seen}"
    assert set(seen) <= set((torch.arange(DRAFT_VOCAB) + ref.d2t).tolist())  # mapped through d2t


def test_fresh_session_equals_long_running_one(llama8, default_head):
    """A session that absorbed the prefix over several rounds and a fresh session given the
    whole prefix at once draft alike (and like the reference)."""
    b = backend(default_head, llama8)
    ref = RefHead(default_head, llama8.path)
    verified = prompt(2, 18)
    feats = llama8.features(verified, DEFAULT_LAYERS)
    long_run = b.new_state(SamplingParams())
    for cut in (5, 9, 17):  # grow the prefix a few tokens at a time, drafting each time
        b.draft(long_run, verified[: cut + 1], 4, feats[long_run.features: cut])
    fresh = b.new_state(SamplingParams())
    want = checked_chain(ref, verified, feats, 4)
    assert b.draft(fresh, verified, 4, feats).tokens == want
    assert b.draft(long_run, verified, 4, feats[17:17]).tokens == want


# ---------------------------------------------------------------- 2. what the head's config says


@pytest.mark.parametrize("variant", ["layer_ids", "rope_theta", "own_embedding", "wider_own_embedding"])
def test_head_config_is_read(variant, llama8, qwen6, tmp_path):
    if variant == "layer_ids":
        target, layers = qwen6, (1, 5, 3)  # not sorted: the order given is the order fused
        head = write_head(target.path, tmp_path / "h", seed=31, layer_ids=list(layers))
    elif variant == "rope_theta":
        target, layers = llama8, DEFAULT_LAYERS
        head = write_head(target.path, tmp_path / "h", seed=32, rope_theta=500000.0)
    elif variant == "own_embedding":
        target, layers = llama8, DEFAULT_LAYERS
        head = write_head(target.path, tmp_path / "h", seed=33, own_embedding=True)
    else:  # a head wider than the target, with its own embedding: fc maps 3 * 32 to 48
        target, layers = llama8, DEFAULT_LAYERS
        head = write_head(target.path, tmp_path / "h", seed=34, own_embedding=True, hidden=48, heads=4, kv_heads=2)
    b = backend(head, target)
    assert b.feature_layers == layers
    ref = RefHead(head, target.path)
    # what a backend that ignored the config would have drafted instead (where computable)
    wrong = None
    if variant == "layer_ids":
        wrong = (RefHead(head, target.path), tuple(sorted(layers)))
    elif variant == "rope_theta":
        wrong = (RefHead(head, target.path, theta=10000.0), layers)
    elif variant == "own_embedding":
        wrong = (RefHead(head, target.path, embed=ref.target_embedding(target.path)), layers)
    depth, differs, seen = 5, False, []
    for seed, length in ((3, 21), (4, 27), (5, 16)):
        st = b.new_state(SamplingParams())
        verified = prompt(seed, length)
        feats = target.features(verified, layers)
        want = checked_chain(ref, verified, feats, depth)
        got = b.draft(st, verified, depth, feats.numpy()).tokens
        assert got == want, f"{variant}, prompt of {length}: {first_mismatch(got, want)}"
        seen += want
        if wrong is not None:
            other_ref, other_layers = wrong
            differs |= other_ref.chain(verified, target.features(verified, other_layers), depth)[0] != want
        b.release(st)
    assert len(set(seen)) >= 4, seen
    if wrong is not None:
        assert differs, f"{variant}: the test cannot tell a backend that ignores it"


def test_default_layers_need_seven(qwen6, tmp_path):
    """Six layers and no ids in the config: the default (2, L//2, L-3) does not apply."""
    from common.models import ModelLoadError

    head = write_head(qwen6.path, tmp_path / "h", seed=35)
    with pytest.raises((ModelLoadError, ValueError)):
        backend(head, qwen6)


# ---------------------------------------------------------------- 3. sessions batched


def test_draft_many_matches_reference(llama8, default_head):
    b = backend(default_head, llama8)
    ref = RefHead(default_head, llama8.path)
    depths = [4, 5, 3]
    prompts = [prompt(5, 9), prompt(6, 23), prompt(7, 15)]
    sent = [llama8.features(p, DEFAULT_LAYERS) for p in prompts]
    states = [b.new_state(SamplingParams()) for _ in prompts]
    alone = [b.new_state(SamplingParams()) for _ in prompts]
    verified = list(prompts)
    new = list(sent)
    for rnd in range(3):
        wants = [checked_chain(ref, v, f, d) for v, f, d in zip(verified, sent, depths)]
        got = b.draft_many([DraftRequest(st, v, d, nf.numpy()) for st, v, d, nf in zip(states, verified, depths, new)])
        for i, (g, w) in enumerate(zip(got, wants)):
            assert g.tokens == w, f"round {rnd}, session {i} of the batch: {first_mismatch(g.tokens, w)}"
        for i, (st, v, d, nf) in enumerate(zip(alone, verified, depths, new)):
            assert b.draft(st, v, d, nf).tokens == wants[i], f"round {rnd}, session {i} alone"
        assert len({tuple(w) for w in wants}) == 3
        # grow each session by a different amount: all kept + one, none kept + one, two kept + one
        grown = []
        for i, (v, w) in enumerate(zip(verified, wants)):
            keep = [len(w), 0, 2][(i + rnd) % 3]
            grown.append(v + w[:keep] + [40 + 7 * i + rnd])
        new = [llama8.features(g, DEFAULT_LAYERS)[f.shape[0]:] for g, f in zip(grown, sent)]
        sent = [torch.cat([f, n]) for f, n in zip(sent, new)]
        verified = grown


# ---------------------------------------------------------------- 4. trees


def test_tree_holds_reference_chain(llama8, default_head):
    topk, budget, depth = 4, 12, 4
    b = backend(default_head, llama8, tree_topk=topk)
    ref = RefHead(default_head, llama8.path)
    prompts = [prompt(8, 20), prompt(9, 13)]
    sent = [llama8.features(p, DEFAULT_LAYERS) for p in prompts]
    states = [b.new_state(SamplingParams()) for _ in prompts]
    verified, new = list(prompts), list(sent)
    chains = [None, None]
    for rnd in range(2):
        for i in range(len(prompts)):
            v, f = verified[i], sent[i]
            chain = checked_chain(ref, v, f, depth)
            if i == 0:
                d = b.draft(states[i], v, depth, new[i], tree_tokens=budget)
            else:  # the second session through draft_many (the batched tree path), alongside a chain
                other = b.new_state(SamplingParams())
                d, c = b.draft_many([DraftRequest(states[i], v, depth, new[i].numpy(), tree_tokens=budget),
                                     DraftRequest(other, prompts[0], 3, sent[0][: len(prompts[0]) - 1])])
                assert c.tokens == checked_chain(ref, prompts[0], sent[0][: len(prompts[0]) - 1], 3)
            assert d.parents is not None and len(d.tokens) == len(d.parents) <= budget
            roots = [t for t, p in zip(d.tokens, d.parents) if p == ROOT]
            assert chain[0] in roots, f"round {rnd}, session {i}: root children {roots}, reference top {chain[0]}"
            # the first-child path from the root
            path, node = [], ROOT
            while True:
                kids = [j for j, p in enumerate(d.parents) if p == node]
                if not kids:
                    break
                node = kids[0]
                path.append(d.tokens[node])
            assert path == chain, f"round {rnd}, session {i}, first-child path: {first_mismatch(path, chain)}"
            # and the whole tree: every node's children from the logits after its own path
            want = ref.tree(v, f, depth, budget, topk)
            assert (d.tokens, d.parents) == (want.tokens, want.parents), f"round {rnd}, session {i}: tree differs"
            assert len(set(d.tokens)) > 3
            chains[i] = chain
        grown = [verified[0] + chains[0][:1] + [99], verified[1] + [123]]  # one draft kept; none kept
        new = [llama8.features(g, DEFAULT_LAYERS)[f.shape[0]:] for g, f in zip(grown, sent)]
        sent = [torch.cat([f, n]) for f, n in zip(sent, new)]
        verified = grown


# ---------------------------------------------------------------- 5. the distributions behind the tokens


def test_sampled_proposals_match_reference(llama8, default_head):
    """Sampling exposes what greedy tokens hide: each draft position's proposal q (top ``q_topk``
    of softmax(logits / T), renormalised) must be the reference's, given the backend's own
    sampled tokens as the path, to float rounding."""
    temperature, depth = 0.7, 5
    b = backend(default_head, llama8)
    ref = RefHead(default_head, llama8.path)
    st = b.new_state(SamplingParams(temperature=temperature, seed=1234))
    verified = prompt(10, 19)
    sent = llama8.features(verified, DEFAULT_LAYERS)
    new = sent
    for rnd in range(3):
        d = b.draft(st, verified, depth, new)
        assert len(d.tokens) == depth and d.q_ids is not None
        q_ids, q_probs = torch.as_tensor(d.q_ids).long(), torch.as_tensor(d.q_probs).float()
        k = q_ids.shape[1]
        for j, logits in enumerate(ref.path_logits(verified, sent, d.tokens)[:depth]):
            p = torch.softmax(logits / temperature, dim=-1)
            top = torch.topk(p, k + 1)
            keep = k if float(top.values[k - 1] - top.values[k]) > 1e-6 else k - 1  # a tie at the cut: leave it out
            want = torch.zeros(VOCAB)
            want[top.indices[:k] + ref.d2t[top.indices[:k]]] = top.values[:k] / top.values[:k].sum()
            got = torch.zeros(VOCAB)
            got[q_ids[j]] = q_probs[j]
            ids = top.indices[:keep] + ref.d2t[top.indices[:keep]]
            assert q_ids[j, :keep].tolist() == ids.tolist(), f"round {rnd}, draft position {j}: q's tokens differ"
            assert torch.allclose(got[ids], want[ids], atol=1e-5, rtol=1e-4), \
                f"round {rnd}, draft position {j}: q differs by {float((got - want).abs().max())}"
            assert d.tokens[j] in q_ids[j].tolist()
        verified = verified + d.tokens[: rnd + 1] + [60 + rnd]
        new = llama8.features(verified, DEFAULT_LAYERS)[sent.shape[0]:]
        sent = torch.cat([sent, new])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
