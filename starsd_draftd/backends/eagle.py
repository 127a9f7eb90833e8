"""Draft backend "eagle": an EAGLE-1 head drafts a chain of tokens from the target's own features.

EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").
With verified tokens t_0..t_n and target features f_0..f_{n-1} (f_i is the target's final hidden
state at position i, the one its LM head turns into the distribution of t_{i+1}), the head reads
the pairs (f_i, embed(t_{i+1})) for i = 0..n-1. Its output at the last pair is a predicted feature
f^_n; the target's LM head applied to f^_n gives the distribution of x_1 = t_{n+1}. The pair
(f^_n, embed(x_1)) then gives f^_{n+1} and x_2, and so on.

A target that verifies more tokens than its depth gets a draft tree (``trees``): for greedy
sessions an EAGLE-2 dynamic tree, each level one head forward under the head's ``tree_mask``.

Only the head's weights come from the head checkpoint; the token embedding (when the head does not
carry its own copy) and the LM head are read by name from the target's checkpoint files, so the
target model itself is never loaded here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.fp16_weights import FP16_WEIGHTS, Fp16Linear, pack_linears
from common.models import (ModelLoadError, choose_dtype, fp16_range_refusal, kv_bytes_per_token, resolve_device,
                           resolve_dtype, resolve_model_path, tokenizer_identity)
from common.tensors import as_torch
from common.tree import ROOT
from common.verify import SamplingParams, make_generator
from starsd_draftd.backends.base import (Calibration, Draft, DraftBackend, DraftRequest, Stopping, frontier_width,
                                        request_stopping, session_seed, stopped_sent, top_probs)
from starsd_draftd.backends.batching import left_padded, padded_layout, row_ranges, row_slots
from starsd_draftd.backends.trees import GreedyTree, chain_drafter

log = logging.getLogger("starsd.eagle")

# Where causal LMs keep their token embedding and output layer, most common first.
EMBED_TENSOR_NAMES = (
    "model.embed_tokens.weight",
    "transformer.wte.weight",
    "model.decoder.embed_tokens.weight",
    "gpt_neox.embed_in.weight",
    "embed_tokens.weight",
)
LM_HEAD_TENSOR_NAMES = ("lm_head.weight", "embed_out.weight")
HEAD_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_EMBED_KEY = "embed_tokens.weight"
_IGNORED_HEAD_KEY_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older heads saved; rebuilt on load


@dataclass
class EagleHead:
    """A loaded EAGLE-1 head with the two target tensors it drafts with."""

    module: torch.nn.Module  # eagle.model.cnets.Model, eval mode, no gradients
    embed_weight: torch.Tensor  # [vocab_size, hidden_size], the embedding the head reads tokens with
    lm_head_weight: torch.Tensor  # [logits_size, hidden_size], the target's output layer
    hidden_size: int
    vocab_size: int  # rows of the head's embedding (= the target's embedding rows)
    config: object  # the head's LlamaConfig as written in its config.json
    device: torch.device
    dtype: torch.dtype
    path: Path | None = None
    base_path: Path | None = None
    lm_head_packed: torch.nn.Module | None = None  # --dtype fp16-weights: the output layer, packed

    @property
    def logits_size(self) -> int:
        return int(self.lm_head_weight.shape[0])

    @property
    def feature_size(self) -> int:
        """The width of the target features a request brings: the target's hidden size."""
        return self.hidden_size

    feature_layers = None  # the target's final hidden state (common.features)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The target's output layer applied to predicted features ``x`` [..., H]."""
        if self.lm_head_packed is not None:
            return self.lm_head_packed(x)
        return F.linear(x, self.lm_head_weight)


# ---------------------------------------------------------------- reading tensors by name


def _load_bin(path: Path) -> dict:
    # Local checkpoint file only; weights_only=True is the restricted unpickler (tensors and containers).
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # files in the pre-zip serialisation format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


class CheckpointTensors:
    """Named tensors of a checkpoint directory, read one by one without building the model.

    Handles ``model.safetensors``, ``model.safetensors.index.json`` shards, ``pytorch_model.bin``
    and ``pytorch_model.bin.index.json`` shards, in that order of preference."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._bins: dict[Path, dict] = {}
        d = self.directory
        if (d / "model.safetensors.index.json").is_file():
            self.kind, self.files = "safetensors", self._weight_map(d / "model.safetensors.index.json")
        elif (d / "model.safetensors").is_file():
            self.kind, self.files = "safetensors", self._safetensors_keys(d / "model.safetensors")
        elif (d / "pytorch_model.bin.index.json").is_file():
            self.kind, self.files = "bin", self._weight_map(d / "pytorch_model.bin.index.json")
        elif (d / "pytorch_model.bin").is_file():
            self.kind = "bin"
            self.files = {name: d / "pytorch_model.bin" for name in self._bin(d / "pytorch_model.bin")}
        else:
            raise ModelLoadError(
                f"{d} holds no weights: expected model.safetensors, model.safetensors.index.json, "
                "pytorch_model.bin or pytorch_model.bin.index.json")

    def _weight_map(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read the weight index {index}: {exc}") from exc
        return {name: self.directory / shard for name, shard in weight_map.items()}

    @staticmethod
    def _safetensors_keys(path: Path) -> dict[str, Path]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: path for name in f.keys()}

    def _bin(self, path: Path) -> dict:
        if path not in self._bins:
            try:
                self._bins[path] = _load_bin(path)
            except (OSError, RuntimeError) as exc:
                raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        return self._bins[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def first_of(self, names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in self.files), None)

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise ModelLoadError(f"{self.directory} has no tensor {name!r}")
        if not path.is_file():
            raise ModelLoadError(f"{path}, which should hold {name!r}, does not exist")
        if self.kind == "bin":
            return self._bin(path)[name]
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent} has no config.json; it is not {what}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _head_state_dict(head_dir: Path) -> dict[str, torch.Tensor]:
    for name in HEAD_WEIGHT_FILES:
        path = head_dir / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                state = load_file(str(path), device="cpu")
            else:
                state = _load_bin(path)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the EAGLE head weights {path}: {exc}") from exc
        if not isinstance(state, dict):
            raise ModelLoadError(f"{path} does not hold a state dict")
        return {k: v for k, v in state.items() if not k.endswith(_IGNORED_HEAD_KEY_SUFFIXES)}
    raise ModelLoadError(f"{head_dir} holds no EAGLE head weights: expected {' or '.join(HEAD_WEIGHT_FILES)}")


def _target_tensors(base: Path, lm_head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, str, str | None]:
    """The target's token embedding and LM head, read by name: (embed, lm_head, their names).
    ``lm_head=False``: the embedding alone (the LM head and its name come back None)."""
    cfg = _read_json(base / "config.json", "a model directory")
    tensors = CheckpointTensors(base)
    embed_name = tensors.first_of(EMBED_TENSOR_NAMES)
    if embed_name is None:
        raise ModelLoadError(f"the target checkpoint in {base} has no token embedding; looked for "
                             f"{', '.join(EMBED_TENSOR_NAMES)}")
    embed = tensors.get(embed_name)
    if embed.dim() != 2:
        raise ModelLoadError(f"{embed_name} in {base} has shape {tuple(embed.shape)}; expected a matrix")
    if not lm_head:
        return embed, None, embed_name, None
    lm_name = tensors.first_of(LM_HEAD_TENSOR_NAMES)
    if lm_name is None:
        if cfg.get("tie_word_embeddings", True) is False:
            raise ModelLoadError(f"the target checkpoint in {base} has no LM head ({', '.join(LM_HEAD_TENSOR_NAMES)}) "
                                 "and its config says the embeddings are not tied")
        lm_name = embed_name
    lm_head = embed if lm_name == embed_name else tensors.get(lm_name)
    if lm_head.dim() != 2:
        raise ModelLoadError(f"{lm_name} in {base} has shape {tuple(lm_head.shape)}; expected a matrix")
    if lm_head.shape[1] != embed.shape[1]:
        raise ModelLoadError(f"the target's LM head width {lm_head.shape[1]} differs from its embedding width "
                             f"{embed.shape[1]} in {base}")
    return embed, lm_head, embed_name, lm_name


def load_eagle_head(head_dir: str | Path, base_model_dir: str | Path, device: str = "cpu",
                    dtype: str = "float32") -> EagleHead:
    """Load an EAGLE-1 head saved in EAGLE's layout (``config.json`` plus ``model.safetensors`` or
    ``pytorch_model.bin``) and the target tensors it needs from ``base_model_dir``."""
    # the head class comes from eagle-llm, which only EAGLE-1 heads need (EAGLE-3 heads are this project's)
    from starsd_draftd.backends.eagle_compat import build_head, head_config_from_dict, restore_rotary_precision

    head_dir = Path(head_dir)
    base = resolve_model_path(str(base_model_dir))
    raw = _read_json(head_dir / "config.json", "an EAGLE head directory")
    config = head_config_from_dict(raw)
    state = _head_state_dict(head_dir)
    embed, lm_head, embed_name, lm_name = _target_tensors(base)

    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    if hidden != embed.shape[1]:
        raise ModelLoadError(f"the EAGLE head's hidden size {hidden} differs from the target's hidden size "
                             f"{embed.shape[1]} ({embed_name} in {base})")
    if vocab != embed.shape[0]:
        raise ModelLoadError(f"the EAGLE head's vocabulary size {vocab} differs from the target's embedding rows "
                             f"{embed.shape[0]} ({embed_name} in {base})")
    if "fc.weight" not in state:
        raise ModelLoadError(f"{head_dir} does not look like an EAGLE head: its weights have no 'fc.weight'")
    has_bias = "fc.bias" in state
    declared = raw.get("bias")
    if declared is not None and bool(declared) != has_bias:
        raise ModelLoadError(f"{head_dir}/config.json says bias={declared} but the weights "
                             f"{'have' if has_bias else 'lack'} 'fc.bias'")
    own_embed = state.pop(_EMBED_KEY, None)
    if own_embed is not None and tuple(own_embed.shape) != (vocab, hidden):
        raise ModelLoadError(f"the EAGLE head's own embedding has shape {tuple(own_embed.shape)}; "
                             f"expected ({vocab}, {hidden})")

    dev = resolve_device(device)
    asked, dtype = dtype != "auto", choose_dtype(dtype, dev).name  # auto: what load_causal_lm takes for the target
    torch_dtype = resolve_dtype(dtype, dev)
    with torch.device("meta"):  # no memory and no random init: every weight is assigned below
        module = build_head(config, bias=has_bias)
    state[_EMBED_KEY] = own_embed if own_embed is not None else embed
    state = {k: v.to(device=dev, dtype=torch_dtype) for k, v in state.items()}
    try:
        result = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shapes that do not fit the config
        raise ModelLoadError(f"the EAGLE head weights in {head_dir} do not fit its config: {exc}") from exc
    if result.missing_keys or result.unexpected_keys:
        raise ModelLoadError(f"the EAGLE head weights in {head_dir} do not fit its config: missing "
                             f"{result.missing_keys or 'none'}, unexpected {result.unexpected_keys or 'none'}")
    restore_rotary_precision(module, dev)  # its buffers were built on the meta device
    module.eval().requires_grad_(False)
    tied = lm_name == embed_name and own_embed is None
    lm_weight = module.embed_tokens.weight if tied else lm_head.to(device=dev, dtype=torch_dtype)
    packed_head = None
    if dtype == FP16_WEIGHTS and fp16_range_refusal(module, head_dir, asked, extra=(lm_weight,)) is not None:
        dtype = "float32"  # the head is float32 already: fp16-weights computes in it
    if dtype == FP16_WEIGHTS:
        pack_linears(module)
        packed_head = Fp16Linear(lm_weight)
    log.info("EAGLE head %s (hidden %d, vocabulary %d, embedding from %s) on %s as %s; target tensors %s, %s from %s",
             head_dir, hidden, vocab, "the head" if own_embed is not None else "the target", dev,
             dtype if dtype == FP16_WEIGHTS else str(torch_dtype).replace("torch.", ""), embed_name, lm_name, base)
    return EagleHead(module=module, embed_weight=module.embed_tokens.weight, lm_head_weight=lm_weight,
                     hidden_size=hidden, vocab_size=vocab, config=config, device=dev, dtype=torch_dtype,
                     path=head_dir, base_path=base, lm_head_packed=packed_head)


# ---------------------------------------------------------------- the backend


@dataclass
class EagleSession:
    params: SamplingParams
    generator: torch.Generator
    past: tuple | None = None  # the head's cache: per layer (k, v), [1, kv_heads, positions, head_dim]
    pairs: list[int] = field(default_factory=list)  # t_{i+1} of each pair built from a real feature f_i
    last_hidden: torch.Tensor | None = None  # head output at the last real pair (f^_n), [1, 1, hidden]
    seed: int = 0  # the base of its draws' position seeds (base.position_seed)
    calibration: Calibration = field(default_factory=Calibration)  # greedy stopping's chances (base.Stopping)

    @property
    def features(self) -> int:
        """Target features the session holds (one per real pair in the cache)."""
        return len(self.pairs)


class EagleBackend(DraftBackend):
    name = "eagle"
    stops_drafts = True

    def __init__(self, head: EagleHead, tokenizer_dir: str | Path | None = None, q_topk: int = 32,
                 tree_topk: int = 1):
        """``tree_topk``: the most children a draft tree's node gets (1: chains only; see
        ``_greedy_trees`` and ``trees.CaterpillarDrafter``)."""
        if q_topk < 1:
            raise ValueError("q_topk must be >= 1")
        if tree_topk < 1:
            raise ValueError("tree_topk must be >= 1")
        self.head = head
        self.module = head.module
        self.device = head.device
        self.feature_size = head.feature_size  # what requests bring: the target's (fused) features
        self.feature_layers = head.feature_layers  # which target hidden states (None: the final one)
        self.target_hidden_size = head.hidden_size if head.feature_layers is None else head.target_hidden_size
        self.predicted_size = head.hidden_size  # the head's own outputs, fed back at later draft steps
        tok_dir = tokenizer_dir if tokenizer_dir is not None else head.base_path
        if tok_dir is None:
            raise ValueError("tokenizer_dir is required when the head was not loaded from a target directory")
        self.vocab_size, self.fingerprint = tokenizer_identity(tok_dir, head.logits_size)
        self.q_topk = min(q_topk, self.vocab_size)
        self.tree_topk = min(tree_topk, self.vocab_size)
        self.max_len = getattr(head.config, "max_position_embeddings", None)
        self.kv_bytes_per_token = kv_bytes_per_token(head.config, head.dtype, layers=1)  # the head's one layer

    @classmethod
    def from_dirs(cls, head_dir: str | Path, base_model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                  q_topk: int = 32, tree_topk: int = 1) -> "EagleBackend":
        head = load_eagle_head(head_dir, base_model_dir, device=device, dtype=dtype)
        return cls(head, head.base_path, q_topk=q_topk, tree_topk=tree_topk)

    def new_state(self, params: SamplingParams) -> EagleSession:
        return EagleSession(params, make_generator(params.seed), seed=session_seed(params))

    def release(self, state: object) -> None:
        st: EagleSession = state  # type: ignore[assignment]
        st.past = None
        st.last_hidden = None
        st.pairs.clear()

    # ------------------------------------------------------------ internals
    @staticmethod
    def _crop(st: EagleSession, length: int) -> None:
        """Keep the first ``length`` positions of the head's cache (drops pairs of predicted features)."""
        if st.past is None:
            return
        if length == 0:
            st.past = None
            return
        st.past = tuple((k[:, :, :length], v[:, :, :length]) for k, v in st.past)

    def _step(self, st: EagleSession, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Feed pairs (hidden[:, i], embed(tokens[i])) after the cached ones; return the head's outputs."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out, st.past = self.module(hidden, input_ids=ids, past_key_values=st.past, use_cache=True)
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits over the vocabulary for a predicted feature [1, 1, H]."""
        return self.head.lm_logits(hidden[0, -1])[: self.vocab_size].float()

    def _check_features(self, st: EagleSession, verified: list[int], new_features: torch.Tensor | None) -> int:
        m = 0 if new_features is None else int(new_features.shape[0])
        if new_features is not None and (new_features.dim() != 2 or new_features.shape[1] != self.feature_size):
            raise ValueError(f"features must have shape [m, {self.feature_size}], got {tuple(new_features.shape)}")
        if st.features + m != len(verified) - 1:
            raise ValueError(
                f"the session holds {st.features} features and got {m} more, but {len(verified)} verified tokens "
                f"need {len(verified) - 1}")
        if verified[1: 1 + st.features] != st.pairs:
            raise ValueError("the verified tokens changed under features the session already holds")
        return m

    def _prepare(self, st: EagleSession, verified: list[int], new_features: torch.Tensor | None) -> list[int]:
        """Check a request against the session and drop the pairs of the previous draft's
        predicted features; the token ids of the request's new pairs (one per new feature)."""
        if not verified:
            raise ValueError("cannot draft after an empty sequence")
        m = self._check_features(st, verified, new_features)
        held = st.features
        self._crop(st, held)
        return verified[held + 1: held + 1 + m]

    def _absorb(self, st: EagleSession, verified: list[int], new_features: torch.Tensor | None) -> torch.Tensor | None:
        """Take a request's new features into the session's cache; the head's output at the last
        real pair, or None while the session has no feature yet (a one-token prompt)."""
        ids = self._prepare(st, verified, new_features)
        if ids:
            feats = new_features.to(device=self.device, dtype=self.head.dtype).unsqueeze(0)
            out = self._step(st, feats, ids)
            st.pairs.extend(ids)
            st.last_hidden = out[:, -1:]
        return st.last_hidden

    def _chain(self, st: EagleSession, hidden: torch.Tensor, depth: int, tree_tokens: int, stop: Stopping) -> Draft:
        """A chain of ``depth`` drafts, or fewer where ``stop`` ends it (the predicted pairs it
        feeds are dropped by the next request's crop either way)."""
        # the first draft's position: after the verified tokens, one more than the pairs held
        start = len(st.pairs) + 1
        chain = chain_drafter(self, st, start, depth, tree_tokens)
        for j in range(depth):
            logits = self._logits(hidden)
            p = float(top_probs(logits)) if stop.active else None
            if chain.stops(stop, p, logits):
                break
            chain.pick(logits, p)
            if j + 1 < depth:
                hidden = self._step(st, hidden, [chain.tokens[-1]])
        return stopped_sent(stop, st.calibration, start, chain.result())

    def _greedy_trees(self, jobs: list[tuple[EagleSession, torch.Tensor, int, int]],
                      floors: list[tuple[Stopping, float]]) -> list[Draft]:
        """Greedy sessions' dynamic trees (``trees.GreedyTree``; ``jobs``: session, its head
        output at the last real pair, depth, tree tokens): one head forward per level below the
        first, for all of them, as a chain takes one per token. ``floors``, per job, its request's
        ``Stopping`` and ``min_chance``: where the stopping is active, a node must pay its row
        (``GreedyTree``'s floor, as the draft model's trees do: ``min_chance`` where sent, else
        ``min_survival``, by the session's calibration), and the chain the tree sends is what the
        calibration learns from. A node is fed as a chain token
        would be: the pair (its parent's predicted feature, its token), at its depth's position.
        Several sessions' caches are merged left-padded (as ``_batched`` does) and each level
        appends W columns, W the widest frontier: session i's nodes in its first w_i of them.
        ``tree_mask`` [B, 1, W, tree columns] lets each node see its own ancestors only; a
        padding row sees itself. The forwards' cache is dropped afterwards (the head's legacy
        cache is extended by copies): every session's own cache is as it was, holding its real
        pairs, and a session drafts the same tree alone as in a batch."""
        dev, width = self.device, self.predicted_size
        trees, predicted, cols = [], [], []
        for (st, hidden, depth, tokens), (stop, min_chance) in zip(jobs, floors):
            t = GreedyTree(self.tree_topk, frontier_width(self.tree_topk, depth, tokens),
                           *((st.calibration.chance, min_chance or stop.min_survival) if stop.active else ()))
            t.grow(ROOT, self._logits(hidden))
            trees.append(t)
            predicted.append({ROOT: hidden[0, -1]})
            cols.append([])  # the merged columns of the nodes the session has fed, in its tree's order
        lengths = [st.past[0][0].shape[2] for st, *_ in jobs]
        k = len(jobs)
        past = jobs[0][0].past if k == 1 else _merge_past([st.past for st, *_ in jobs])
        real = padded_layout(lengths, [0] * k, dev)[0]  # each row's cached slots, right-aligned
        fed = 0  # tree columns in the merged cache
        try:
            for d in range(1, max(depth for _, _, depth, _ in jobs)):
                levels = [t.frontier(d) if d < depth else [] for t, (_, _, depth, _) in zip(trees, jobs)]
                w = max(len(lv) for lv in levels)
                if not w:
                    break
                see = torch.zeros(k, 1, w, fed + w, dtype=torch.float32)
                feats = torch.zeros(k, w, width, dtype=self.head.dtype, device=dev)
                ids = torch.zeros(k, w, dtype=torch.long, device=dev)
                pos = torch.tensor([[len(st.pairs) + d - 1] * w for st, *_ in jobs], dtype=torch.long, device=dev)
                for i, (t, level) in enumerate(zip(trees, levels)):
                    own = t.feed(level)  # [len(level), its fed nodes]
                    cols[i].extend(fed + r for r in range(len(level)))
                    if level:
                        see[i, 0, : len(level)][:, cols[i]] = own.float()
                        feats[i, : len(level)] = torch.stack([predicted[i][t.parent(n)] for n in level])
                        ids[i, : len(level)] = torch.tensor([t.token(n) for n in level], dtype=torch.long)
                    for r in range(len(level), w):
                        see[i, 0, r, fed + r] = 1.0  # a padding row sees itself
                fed += w
                self.module.tree_mask = see.to(dev)
                mask = torch.cat([real, real.new_ones(k, fed)], dim=1)
                out, past = self.module(feats, input_ids=ids, attention_mask=mask, position_ids=pos,
                                        past_key_values=past, use_cache=True)
                logits = self.head.lm_logits(out.reshape(k * w, -1))[:, : self.vocab_size].float().view(k, w, -1)
                for i, (t, level) in enumerate(zip(trees, levels)):
                    for r, n in enumerate(level):
                        predicted[i][n] = out[i, r]
                        t.grow(n, logits[i, r])
        finally:
            self.module.tree_mask = None
        drafts = [t.draft(tokens) for t, (_, _, _, tokens) in zip(trees, jobs)]
        for t, (st, *_), (stop, _) in zip(trees, jobs, floors):
            stopped_sent(stop, st.calibration, len(st.pairs) + 1, t.sent_chain)  # its chain, for the calibration
        return drafts

    def _batched(self, jobs: list[tuple[EagleSession, list[int], torch.Tensor | None, int]],
                 tree_tokens: list[int], stops: list[Stopping]) -> list[Draft]:
        """Several sessions' requests in one head forward for their new features and one head
        step per draft position, for all of them. ``jobs``: (session, cropped and checked; the
        token ids of its new pairs; their features [m, H]; depth).

        The caches are merged for the forwards: each row holds its session's P cached positions
        right-aligned under a left padding, then M columns for new pairs (its own m, then
        padding), then one column per draft step. Padding is masked out, each row runs at its own
        positions, and causality keeps a row's real pairs from seeing the padding after them.
        Each session then keeps exactly the positions drafting alone would have given it.
        ``tree_tokens``: per job, the request's tree budget (sampled trees only: their extra
        nodes are leaves, drawn along with the chain). ``stops``: per job, where its greedy chain
        stops (a stopped row is carried along unread to the batch's last step; the predicted pairs
        it feeds are dropped by its next request's crop)."""
        k = len(jobs)
        lengths = [0 if st.past is None else st.past[0][0].shape[2] for st, *_ in jobs]
        news = [len(ids) for _, ids, _, _ in jobs]
        depths = [d for *_, d in jobs]
        drafting = [(m > 0 or st.last_hidden is not None) and d >= 1 for (st, *_), m, d in zip(jobs, news, depths)]
        steps = max((d - 1 for d, ok in zip(depths, drafting) if ok), default=0)
        longest, wide = max(lengths), max(news)
        dev = self.device
        past = _merge_past([st.past for st, *_ in jobs]) if longest else None
        mask, pos, step_pos = padded_layout(lengths, news, dev)  # the layout BatchedCaches batches in
        if wide:  # every session's new pairs in one forward
            feats = torch.zeros(k, wide, self.feature_size, dtype=self.head.dtype, device=dev)
            ids = torch.zeros(k, wide, dtype=torch.long, device=dev)
            for i, (_, new_ids, f, _) in enumerate(jobs):
                if news[i]:
                    feats[i, : news[i]] = f.to(device=dev, dtype=self.head.dtype)
                    ids[i, : news[i]] = torch.tensor(new_ids, dtype=torch.long)
            out, past = self.module(feats, input_ids=ids, attention_mask=mask, position_ids=pos,
                                    past_key_values=past, use_cache=True)
            for i, (st, new_ids, _, _) in enumerate(jobs):
                if news[i]:
                    st.pairs.extend(new_ids)
                    st.last_hidden = out[i:i + 1, news[i] - 1: news[i]].clone()
        chains = [chain_drafter(self, st, len(st.pairs) + 1, d, b) for (st, *_), d, b in zip(jobs, depths, tree_tokens)]
        if any(drafting):
            filler = torch.zeros(1, 1, self.predicted_size, dtype=self.head.dtype, device=dev)
            x = torch.cat([st.last_hidden if ok else filler for (st, *_), ok in zip(jobs, drafting)])  # [k, 1, H]
            toks = [0] * k
            going = list(drafting)  # rows whose chains take tokens still
            for j in range(steps + 1):
                logits = self.head.lm_logits(x[:, -1])[:, : self.vocab_size].float()
                probs = top_probs(logits).tolist() if any(s.active for s in stops) else [None] * k
                for i, chain in enumerate(chains):
                    if going[i] and j < depths[i]:
                        if chain.stops(stops[i], probs[i], logits[i]):
                            going[i] = False
                            continue
                        toks[i] = chain.pick(logits[i], probs[i])
                if not any(g and j + 1 < d for g, d in zip(going, depths)):
                    break  # every chain is done: the steps left would feed nothing read
                if j < steps:
                    mask = torch.cat([mask, mask.new_ones(k, 1)], dim=1)
                    ids = torch.tensor([[t] for t in toks], dtype=torch.long, device=dev)
                    pos = (step_pos + j).unsqueeze(1)
                    x, past = self.module(x, input_ids=ids, attention_mask=mask, position_ids=pos,
                                          past_key_values=past, use_cache=True)
        if wide or steps:  # split the merged cache back: each session keeps what drafting alone adds
            for i, (st, *_) in enumerate(jobs):
                fed = min(len(chains[i].tokens), depths[i] - 1) if drafting[i] else 0  # a stopped chain fed fewer
                own, chain = row_ranges(longest, wide, lengths[i], news[i], fed)
                if own[1] > own[0] or chain[1] > chain[0]:
                    st.past = tuple((row_slots(kk, i, own, chain), row_slots(vv, i, own, chain)) for kk, vv in past)
        return [stopped_sent(stop, st.calibration, len(st.pairs) + 1, c.result()) if ok else Draft([])
                for (st, *_), stop, c, ok in zip(jobs, stops, chains, drafting)]

    # ------------------------------------------------------------ the interface
    @torch.inference_mode()
    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None, tree_tokens: int = 0,
              min_survival: float = 0.0, min_chance: float = 0.0) -> Draft:
        """``min_survival`` > 0 (greedy sessions): a chain stops before ``depth`` where
        ``Stopping`` says; a tree keeps the nodes whose chance reaches ``min_chance`` (else
        ``min_survival``)."""
        st: EagleSession = state  # type: ignore[assignment]
        hidden = self._absorb(st, verified, None if new_features is None else as_torch(new_features))
        if hidden is None or depth < 1:
            return Draft([])  # no target feature yet (a one-token prompt): nothing to draft from
        stop = request_stopping(st.params, st.calibration, verified, min_survival)
        if st.params.greedy and self.drafts_tree(depth, tree_tokens):
            return self._greedy_trees([(st, hidden, depth, tree_tokens)], [(stop, min_chance)])[0]
        return self._chain(st, hidden, depth, tree_tokens, stop)

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """The sessions' new features in one head forward, then their chains batched: one head
        step per draft position for every session (sampled trees among them: their extra nodes
        are leaves). Greedy trees take one head forward per level for all of them
        (``_greedy_trees``). A seeded sampled session is drafted on its own: a batched forward's
        q differs from a single one's in its last bits, and a seeded output must not follow
        which sessions shared a batch."""
        out: list[Draft | None] = [None] * len(requests)
        batch, trees, floors = [], [], []
        for i, r in enumerate(requests):
            params = r.state.params  # type: ignore[attr-defined]
            if params.seeded:
                out[i] = self.draft(r.state, r.verified, r.depth, r.new_features, r.tree_tokens, r.min_survival)
            elif params.greedy and self.drafts_tree(r.depth, r.tree_tokens):
                st: EagleSession = r.state  # type: ignore[assignment]
                hidden = self._absorb(st, r.verified, None if r.new_features is None else as_torch(r.new_features))
                if hidden is None:
                    out[i] = Draft([])  # no target feature yet (a one-token prompt)
                else:
                    trees.append((i, (st, hidden, r.depth, r.tree_tokens)))
                    floors.append((request_stopping(params, st.calibration, r.verified, r.min_survival), r.min_chance))
            else:
                batch.append(i)
        if trees:
            for (i, _), d in zip(trees, self._greedy_trees([job for _, job in trees], floors)):
                out[i] = d
        if len(batch) == 1:
            r = requests[batch[0]]
            out[batch[0]] = self.draft(r.state, r.verified, r.depth, r.new_features, r.tree_tokens, r.min_survival)
        elif batch:
            jobs, stops = [], []
            for i in batch:
                r = requests[i]
                feats = None if r.new_features is None else as_torch(r.new_features)
                ids = self._prepare(r.state, r.verified, feats)  # type: ignore[arg-type]
                jobs.append((r.state, ids, feats if ids else None, r.depth))
                stops.append(request_stopping(r.state.params, r.state.calibration, r.verified, r.min_survival))
            for i, d in zip(batch, self._batched(jobs, [requests[i].tree_tokens for i in batch], stops)):
                out[i] = d
        return out  # type: ignore[return-value]


def _merge_past(pasts: list[tuple | None]) -> tuple:
    """Per layer, the sessions' cached (k, v) [1, kv_heads, n_i, head_dim] as one left-padded
    batch; a session without a cache yet is all padding."""
    some = next(p for p in pasts if p is not None)
    return tuple(tuple(left_padded([p[layer][w] if p is not None else some[layer][w][:, :, :0] for p in pasts])
                       for w in (0, 1))
                 for layer in range(len(some)))
