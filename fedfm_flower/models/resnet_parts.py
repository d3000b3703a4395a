"""The parameter groups of a trainable timm ResNet: its parts named by what they do.

A ResNet trains whole (the ``resnet`` family takes no adapter tuner), its weights grouped by
role as a trainable ViT's are (``models.vit_parts``), so a method can share or keep local any of
them by name (FedBN keeps ``resnet.norm`` on each client):

``resnet.norm``   every BatchNorm: the stem's ``bn1``, the blocks' ``bn1``..``bn3`` and the
                  shortcut's (``downsample.1``); their running statistics travel with them
                  (``models.groups``)
``resnet.stem``   the stem's convolution (``conv1``)
``resnet.conv``   the stages' convolutions, the shortcut's 1x1 convolution included
``resnet.other``  anything else a timm ResNet variant has (squeeze-excitation, ...), so nothing
                  of a trainable ResNet is left frozen by omission
"""

from __future__ import annotations

from fedfm_flower.models.groups import GroupPattern

_BLOCK = r"^backbone\.layer\d+\.\d+\."

RESNET_PART_PATTERNS: tuple[GroupPattern, ...] = (
    GroupPattern("resnet.norm", r"^backbone\.bn1\.|" + _BLOCK + r"(bn\d+|downsample\.1)\."),
    GroupPattern("resnet.stem", r"^backbone\.conv1\."),
    GroupPattern("resnet.conv", _BLOCK + r"(conv\d+|downsample\.0)\."),
    GroupPattern("resnet.other", r"^backbone\."),
)

RESNET_PARTS: tuple[str, ...] = tuple(p.group for p in RESNET_PART_PATTERNS[:-1])
