"""Bottleneck adapters on the MLP of every ViT block (FedPerfix's "Adapters" design, Table 6).

Adapter-tuning (Pfeiffer et al. 2020, the paper's [30]) on the MLP output ``y`` of each block:
``y + Tanh(y W_down) W_up``, added before the block's residual. The up and down projections are
zero-initialised, so a fresh adapter leaves the ViT's output unchanged, and ``Tanh`` is the
activation, as in the authors' code. One adapter per block is our choice: the authors' code
shares a single adapter across all blocks, which the paper does not describe. Width:
``mlp-adapter-bottleneck``. Parameters: ``<block>.mlp.adapter.*``, group ``mlp-adapter``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.groups import GroupPattern
from fedfm_flower.models.tuners import TunedParts

MLP_ADAPTER_PATTERNS = (GroupPattern("mlp-adapter", r"\.mlp\.adapter\."),)


class BottleneckAdapter(nn.Module):
    """``Tanh(y W_down) W_up``, zero-initialised (a fresh adapter adds nothing)."""

    def __init__(self, width: int, bottleneck: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)
        for layer in (self.down, self.up):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution for MLP output ``y``."""
        return self.up(torch.tanh(self.down(y)))


def _add_adapter_output(mlp: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + mlp.adapter(output)


def mlp_adapter_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """One bottleneck adapter after every block's MLP (group ``mlp-adapter``)."""
    for block in backbone.blocks:
        width = block.mlp.fc2.out_features
        block.mlp.add_module("adapter", BottleneckAdapter(width, config.mlp_adapter_bottleneck))
        block.mlp.register_forward_hook(_add_adapter_output)
    return TunedParts(backbone, {}, MLP_ADAPTER_PATTERNS)
