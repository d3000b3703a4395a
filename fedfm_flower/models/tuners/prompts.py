"""Visual prompt tuning (VPT, Jia et al. 2022) on a frozen timm ``VisionTransformer``.

The input of the first block becomes ``[c, P, z]``: the class token (and any other prefix
tokens timm uses), then K learnable prompts, then the patch tokens. As in VPT and pFedPG, the
prompts enter after the position embedding has been added to the patch tokens and get no
position embedding themselves. VPT-shallow has one (K, width) prompt set at the input; VPT-deep
(``deep=True``) has one per block: before block i > 0 the K prompt outputs of block i - 1 are
replaced by block i's own prompts. After the last block the prompt tokens are dropped, so
pooling (class token or average) sees exactly the tokens of the plain ViT; with K = 0 the
forward pass is the plain ViT's.

Initialisation follows VPT: uniform in +-sqrt(6 / (3 * patch_area + width)).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.groups import GroupPattern
from fedfm_flower.models.tuners import TunedParts

PROMPT_PARAMETER = "embeddings"


class VisualPrompts(nn.Module):
    """K prompts (per block when deep) and the prompted forward pass of a timm ViT."""

    def __init__(self, backbone: nn.Module, num_prompts: int, deep: bool = False) -> None:
        super().__init__()
        width = backbone.embed_dim
        depth = len(backbone.blocks) if deep else 1
        patch = backbone.patch_embed.patch_size
        bound = math.sqrt(6.0 / (3 * patch[0] * patch[1] + width))
        self.num_prompts = num_prompts
        self.deep = deep
        self.embeddings = nn.Parameter(
            torch.empty(depth, num_prompts, width).uniform_(-bound, bound)
        )

    def _insert(self, tokens: torch.Tensor, prompts: torch.Tensor, prefix: int, replace: bool):
        batch = tokens.shape[0]
        rest = tokens[:, prefix + (self.num_prompts if replace else 0) :]
        expanded = prompts.to(tokens.dtype).unsqueeze(0).expand(batch, -1, -1)
        return torch.cat([tokens[:, :prefix], expanded, rest], dim=1)

    def features(self, backbone: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The pooled features of ``backbone`` (num_classes=0) with the prompts inserted."""
        prefix = backbone.num_prefix_tokens
        x = backbone._pos_embed(backbone.patch_embed(images))
        x = self._insert(x, self.embeddings[0], prefix, replace=False)
        x = backbone.norm_pre(backbone.patch_drop(x))
        for index, block in enumerate(backbone.blocks):
            if self.deep and index > 0:
                x = self._insert(x, self.embeddings[index], prefix, replace=True)
            x = block(x)
        x = backbone.norm(x)
        x = torch.cat([x[:, :prefix], x[:, prefix + self.num_prompts :]], dim=1)
        return backbone.forward_head(x, pre_logits=True)


PROMPT_PATTERNS = (GroupPattern("prompt", r"^prompts\."),)


def vpt_shallow_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """One set of ``vpt-num-prompts`` prompts at the input (group ``prompt``)."""
    prompts = VisualPrompts(backbone, config.vpt_num_prompts, deep=False)
    return TunedParts(backbone, {"prompts": prompts}, PROMPT_PATTERNS)


def vpt_deep_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """One set of ``vpt-num-prompts`` prompts per block (group ``prompt``)."""
    prompts = VisualPrompts(backbone, config.vpt_num_prompts, deep=True)
    return TunedParts(backbone, {"prompts": prompts}, PROMPT_PATTERNS)
