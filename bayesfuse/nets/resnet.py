"""Residual networks for 28x28 greyscale images, given flat as every dataset here feeds them.

* :func:`resnet20`: the CIFAR-style ResNet-20 of He et al. (2016, section 4.2): a 3x3 stem, three
  stages of three basic blocks at ``16, 32, 64`` x ``width`` channels (the second and third
  halve the image with a stride-2 first block), global average pooling, a linear head.
* :func:`resnet18`: ResNet-18 (He et al. 2016, table 1): four stages of two basic blocks at
  ``64, 128, 256, 512`` x ``width`` channels, its stem adapted to 28x28 inputs (one 3x3 conv, no
  max-pool, as CIFAR versions do).

A basic block is ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``; the shortcut is the
identity where the shape is kept, a 1x1 convolution with batch norm where the block changes the
width or the stride (option B of He et al. 2016). Both are plain ``nn.Module`` classes with a
``forward``: :func:`bayesfuse.nets.tracing.spec_from_module` traces them with ``torch.fx``.
Every residual add ties the permutations of the layers that meet there (Ainsworth et al. 2023,
section 3), so the spec has one permutation per *stage's stream* (the stem or projection conv
and each block's second conv write into it) and one per block's inner layer:
ResNet-20 has 3 streams + 9 inner groups, ResNet-18 4 + 8. The projection conv of a stage's
first block reads the previous stream and writes into the next one.

The convolutions keep a bias although batch norm follows each of them: fusion folds every batch
norm into the layer before it (NAFI appendix E, eq. 47), which needs a bias to take the shift;
the fused network's batch norms are then identities in eval mode.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bayesfuse.nets.images import image_shape

__all__ = ["BasicBlock", "ResNet", "resnet20", "resnet18", "stage_widths"]

#: Channels of each stage at width 1: ResNet-20 (He et al. 2016, section 4.2) and ResNet-18 (table 1).
RESNET20_WIDTHS = (16, 32, 64)
RESNET18_WIDTHS = (64, 128, 256, 512)


def stage_widths(base: Sequence[int], width: float) -> tuple[int, ...]:
    """``base`` channels times the width multiplier ``width``, rounded, at least 1 each."""
    if not width > 0:
        raise ValueError(f"the width multiplier must be positive, got {width}")
    return tuple(max(1, round(c * width)) for c in base)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and a shortcut (He et al. 2016, figure 2): the identity, or a 1x1
    conv-BN where ``stride != 1`` or the width changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``stem (3x3 conv-BN-ReLU) -> stages of basic blocks -> global average pool -> linear``.

    Parameters
    ----------
    n_features : int
        Pixels of the flat square greyscale input (784 for 28x28); reshaped in ``forward``.
    n_classes : int
    widths : sequence of int
        Channels of each stage; every stage after the first halves the image.
    blocks : int
        Basic blocks per stage.
    """

    def __init__(self, n_features: int, n_classes: int, widths: Sequence[int], blocks: int) -> None:
        super().__init__()
        if blocks < 1 or not widths:
            raise ValueError(f"a ResNet needs at least one stage and one block per stage, got {list(widths)}, {blocks}")
        self.shape = image_shape(n_features)
        widths = [int(w) for w in widths]
        self.stem = nn.Conv2d(self.shape[0], widths[0], 3, padding=1)
        self.bn = nn.BatchNorm2d(widths[0])
        stages, c_in = [], widths[0]
        for s, c in enumerate(widths):
            layers = [BasicBlock(c_in if b == 0 else c, c, stride=2 if s > 0 and b == 0 else 1) for b in range(blocks)]
            stages.append(nn.Sequential(*layers))
            c_in = c
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, n_classes)

    def example_input(self) -> torch.Tensor:
        """Two flat zero images, for tracing (:func:`bayesfuse.nets.graph_spec.example_input_for`)."""
        return torch.zeros(2, self.shape[0] * self.shape[1] * self.shape[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x.reshape(-1, *self.shape))))
        x = self.stages(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet20(n_features: int = 784, n_classes: int = 10, width: float = 1.0) -> ResNet:
    """ResNet-20 (He et al. 2016, section 4.2): 3 stages x 3 basic blocks, ``16, 32, 64`` x ``width``
    channels; about 0.27M parameters at width 1."""
    return ResNet(n_features, n_classes, stage_widths(RESNET20_WIDTHS, width), blocks=3)


def resnet18(n_features: int = 784, n_classes: int = 10, width: float = 1.0) -> ResNet:
    """ResNet-18 (He et al. 2016, table 1): 4 stages x 2 basic blocks, ``64, 128, 256, 512`` x
    ``width`` channels, a 3x3 stem and no max-pool for 28x28 inputs; about 11.2M parameters at
    width 1."""
    return ResNet(n_features, n_classes, stage_widths(RESNET18_WIDTHS, width), blocks=2)
