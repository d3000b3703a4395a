"""The parameter groups of a trainable timm ViT: its parts named by what they do.

With ``train-backbone = true`` (or a method that always trains the ViT, such as FedPerfix) the
ViT's own weights are no longer backbone: they are grouped by the role FedPerfix's sensitivity
study (its Table 1) gives them, so a method can share or keep local any of them by name:

``vit.patch-embed``  the patch embedding (its projection, or the convolutional stem)
``vit.pos-embed``    the position embedding
``vit.cls-token``    the class (and register) tokens
``vit.norm``         every LayerNorm: the blocks' ``norm1``/``norm2`` and the final ``norm``
``vit.attn``         the self-attention layers (``qkv`` and ``proj``)
``vit.mlp``          the blocks' MLPs
``vit.other``        anything else a timm ViT variant has (layer scale, ...), so nothing of a
                     trainable ViT is left frozen by omission

Tuners' patterns come first (a prefix adapter inside ``attn`` is ``prefix``, not ``vit.attn``).
"""

from __future__ import annotations

from fedfm_flower.models.groups import GroupPattern

_BLOCK = r"^backbone\.blocks\.\d+\."

VIT_PART_PATTERNS: tuple[GroupPattern, ...] = (
    GroupPattern("vit.patch-embed", r"^backbone\.patch_embed\."),
    GroupPattern("vit.pos-embed", r"^backbone\.pos_embed$"),
    GroupPattern("vit.cls-token", r"^backbone\.(cls_token|reg_token)$"),
    GroupPattern("vit.norm", _BLOCK + r"norm[12]\.|^backbone\.(norm|fc_norm|norm_pre)\."),
    GroupPattern("vit.attn", _BLOCK + r"attn\."),
    GroupPattern("vit.mlp", _BLOCK + r"mlp\."),
    GroupPattern("vit.other", r"^backbone\."),
)

# The parts of FedPerfix's Table 1, by the names its configs use.
VIT_PARTS: tuple[str, ...] = tuple(p.group for p in VIT_PART_PATTERNS[:-1])
