"""The model's repeated blocks (decoder layers): the units FSDP2 shards one by one and torch.compile compiles."""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the classes the model lists as unsplittable, else *DecoderLayer/*Block."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]
    return layers
