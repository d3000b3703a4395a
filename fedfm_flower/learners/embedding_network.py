"""PeFLL's embedding network E(.; psi): a client descriptor from the client's own data.

A LeNet-style ConvNet (PeFLL's authors' ``CNNEmbed``; pFedSeq's Appendix B: "2 convolutional
layers (with filter size 5x5 and output channel size 32) followed by 3 fully connected layers"):
conv 5x5 to ``kernels`` channels, ReLU, 2x2 max-pool, conv 5x5 to 2 ``kernels`` (32 by default),
ReLU, 2x2 max-pool, then Linear 120, ReLU, Linear 84, ReLU, Linear to the descriptor's size.
Its input is the raw image at 32 x 32 (the authors' CIFAR size; other sizes are resized
bilinearly) with, when ``labels``, the one-hot label as ``classes`` constant extra channels (the
authors' ``embed_y``, on by default). The descriptor of a set of batches is the mean of E over
their examples: v = 1/|B| sum_{(x, y) in B} E(x, y; psi). It lives on both sides: the client
computes v and backpropagates the descriptor's gradient through it, the server holds psi and
steps it with Adam.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

SIDE = 32  # the input side the LeNet layout is built for (5x5 maps after two conv-pool stages)


class EmbeddingNetwork(nn.Module):
    """E(x, y; psi): ``forward(images, labels)`` is one descriptor per example."""

    def __init__(
        self, image_channels: int, classes: int, dim: int, kernels: int = 16, labels: bool = True
    ) -> None:
        super().__init__()
        if min(image_channels, classes, dim, kernels) < 1:
            raise ValueError("an embedding network needs channels, classes, a size and kernels")
        self.classes = classes
        self.labels = labels
        self.conv1 = nn.Conv2d(image_channels + (classes if labels else 0), kernels, 5)
        self.conv2 = nn.Conv2d(kernels, 2 * kernels, 5)
        self.fc1 = nn.Linear(2 * kernels * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, dim)

    @property
    def dim(self) -> int:
        """The descriptor's size."""
        return self.fc3.out_features

    def inputs(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The images at 32 x 32 with the one-hot labels as constant channels (when used)."""
        if images.shape[-2:] != (SIDE, SIDE):
            images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
        if not self.labels:
            return images
        onehot = F.one_hot(labels.long(), self.classes).to(images.dtype)
        planes = onehot[:, :, None, None].expand(-1, -1, SIDE, SIDE)
        return torch.cat([images, planes], dim=1)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One descriptor per example, shape ``(batch, dim)``."""
        x = F.max_pool2d(F.relu(self.conv1(self.inputs(images, labels))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))

    def describe(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device | None
    ) -> torch.Tensor:
        """v: the mean of E over every example of ``batches`` (with a graph when grad is on)."""
        total, count = None, 0
        for images, labels in batches:
            if device is not None:
                images, labels = images.to(device), labels.to(device)
            part = self(images, labels).sum(0)
            total = part if total is None else total + part
            count += len(labels)
        if total is None:
            raise ValueError("a descriptor needs at least one example")
        return total / count
