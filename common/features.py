"""Which of the target's hidden states a feature-based draft head reads, on both sides of the wire.

An EAGLE-1 head reads the target's final hidden state (the one its LM head reads): no layer ids.
An EAGLE-3 head reads, per position, the concatenation of several hidden states taken inside the
target, named by layer ids counted as transformers counts ``hidden_states``: id i is the state
entering decoder layer i (id 0: the embeddings), so ids run 0..L-1 for a target of L layers.
The published default is the states entering layers 2, L//2 and L-3, in that order.

The draft daemon's WELCOME names the ids (``feature_layers``) and the width (``feature_size``);
the target checks them against its own model before it sends anything (``check_feature_layers``)
and fuses them from the forward it runs anyway (``fused_features``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_DEFAULT_LAYERS = 7  # below this, 2, L//2 and L-3 are not three distinct increasing layers


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The published EAGLE-3 choice for a target of ``num_layers`` layers: (2, L//2, L-3)."""
    if num_layers < MIN_DEFAULT_LAYERS:
        raise ValueError(f"the default EAGLE-3 layers (2, L//2, L-3) need a target of at least "
                         f"{MIN_DEFAULT_LAYERS} layers, this one has {num_layers}; name the layers in the head's config")
    return (2, num_layers // 2, num_layers - 3)


def check_feature_layers(layers: Sequence[int], num_layers: int) -> str | None:
    """Why ``layers`` cannot be read from a target of ``num_layers`` layers (None: they can)."""
    if not layers:
        return "no layer is named"
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        return (f"layer ids must lie in 0..{num_layers - 1} (the target has {num_layers} layers; id i is the "
                f"state entering layer i), got {bad}")
    return None


def fused_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int] | None) -> torch.Tensor:
    """What a draft head reads from a forward's ``hidden_states`` (``output_hidden_states=True``):
    the final hidden state without ``layers``, else the named states concatenated along the last
    dimension in the order given."""
    if layers is None:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)
