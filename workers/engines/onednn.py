"""Linear layers with their weights prepacked for oneDNN, for bfloat16 / float16 on CPUs.

torch runs a reduced-precision matmul on a CPU through oneDNN, which reorders the weight
into its blocked layout on every call unless it was reordered once beforehand (as
torch.compile's freezing does): about half the time of a pass over a few tokens
(bench/results/bfloat16.md#the-bfloat16-trial-on-cpus). Results are the same to the bit.
"""

from __future__ import annotations

import torch
from torch import nn


def uses_onednn(weight: torch.Tensor) -> bool:
    """Whether a linear layer of `weight` runs through oneDNN: reduced precision on a CPU."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def prepack(linear: nn.Linear) -> None:
    """Make `linear` compute with a prepacked copy of its weight. The module stays what it
    was (its weight too, which some models read), so references to it keep working. Where
    oneDNN cannot pack it (a CPU without the instructions it needs), it is left as it is."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
    except RuntimeError:
        return
    bias = None if linear.bias is None else linear.bias.detach()
    out_features = linear.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "").view(*x.shape[:-1], out_features)

    linear.forward = forward  # type: ignore[method-assign]


def prepack_all(model: nn.Module) -> None:
    """Prepack every plain `nn.Linear` of `model` (subclasses, such as the output projection
    that `nn.MultiheadAttention` multiplies by hand, are left alone)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            prepack(module)
