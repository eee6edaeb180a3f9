"""RevNet18/34/50 (the paper's reversible ResNets) and the ResNet baselines, as DeepSpeed layer specs.

A RevNet carries two streams of the ResNet's width (so twice its channels). Its blocks:

- reversible block: the paper's one-branch coupling ``y1 = x2``, ``y2 = x1 + F(x2)`` with F the ResNet
  block's residual branch (basic: conv-bn-relu-conv-bn; bottleneck: 1x1-3x3-1x1);
- downsampling block (where the width or the resolution changes, non-reversible): the same swap with the
  identities replaced by strided 1x1 projections, ``y1 = P1(x2)``, ``y2 = P2(x1) + F(x2)``;
- a non-reversible stem (7x7/2 conv and max-pool on ImageNet, 3x3/1 on CIFAR) whose output is split
  into the two streams, and a head that pools both streams and classifies their concatenation.

One layer per residual block plus stem and head gives the paper's partition: 10 stages for RevNet18
(non-reversible at 0, 3, 5, 7, 9), 18 for RevNet34 and RevNet50. With a 1000-class head the parameter
counts are 12.38M, 22.49M and 30.39M (paper Tab. 2: 12.2M, 22.3M, 30.4M); the ResNet baselines
match torchvision's 11.69M, 21.80M and 25.56M exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import SwapCoupling
from ..nn.draws import by_children

DEPTHS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3))}


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels)


def residual_branch(kind: str, in_channels: int, width: int, stride: int) -> nn.Sequential:
    """The residual function of a ResNet block (output channels: width, or 4 x width for bottleneck)."""
    if kind == "basic":
        return nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride, 1, bias=False), _bn(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), _bn(width))
    out = 4 * width
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 1, bias=False), _bn(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, width, 3, stride, 1, bias=False), _bn(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, out, 1, bias=False), _bn(out))


def projection(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), _bn(out_channels))


def _out_channels(kind: str, width: int) -> int:
    return width if kind == "basic" else 4 * width


class Stem(nn.Module):
    """Non-reversible input layer; with ``streams=2`` its output is split into the RevNet's pair."""

    draws_random = by_children  # its layers decide (``petra_ds.nn.draws``)

    def __init__(self, channels: int, cifar: bool, streams: int = 1) -> None:
        super().__init__()
        self.streams = streams
        out = channels * streams
        if cifar:
            layers = [nn.Conv2d(3, out, 3, 1, 1, bias=False), _bn(out), nn.ReLU(inplace=True)]
        else:
            layers = [nn.Conv2d(3, out, 7, 2, 3, bias=False), _bn(out), nn.ReLU(inplace=True),
                      nn.MaxPool2d(3, 2, 1)]
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor):
        y = self.body(x)
        return tuple(y.chunk(2, dim=1)) if self.streams == 2 else y


class RevBlock(SwapCoupling):
    """Reversible residual block: ``y1 = x2``, ``y2 = x1 + F(x2)`` (paper Fig. 2)."""

    def __init__(self, kind: str, width: int) -> None:
        channels = _out_channels(kind, width)
        super().__init__(residual_branch(kind, channels, width, 1))


class DownsampleBlock(nn.Module):
    """Non-reversible swap block where shapes change: ``y1 = P1(x2)``, ``y2 = P2(x1) + F(x2)``."""

    draws_random = by_children

    def __init__(self, kind: str, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out = _out_channels(kind, width)
        self.F = residual_branch(kind, in_channels, width, stride)
        self.P1 = projection(in_channels, out, stride)
        self.P2 = projection(in_channels, out, stride)

    def forward(self, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x1, x2 = x
        return self.P1(x2), self.P2(x1) + self.F(x2)


class RevHead(nn.Module):
    draws_random = by_children

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        return self.fc(nn.functional.adaptive_avg_pool2d(torch.cat(x, dim=1), 1).flatten(1))


class ResBlock(nn.Module):
    """Standard ResNet block (the baseline): relu(x + F(x)), projection shortcut where shapes change."""

    draws_random = by_children

    def __init__(self, kind: str, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out = _out_channels(kind, width)
        self.F = residual_branch(kind, in_channels, width, stride)
        self.shortcut = projection(in_channels, out, stride) if (stride != 1 or in_channels != out) else None

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        return nn.functional.relu(identity + self.F(x))


class ResHead(nn.Module):
    draws_random = by_children

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def _plan(depth: int, base_width: int = 64):
    """(kind, [(in_channels, width, stride), ...] per block, final channels)."""
    if depth not in DEPTHS:
        raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth}")
    kind, counts = DEPTHS[depth]
    blocks, channels = [], base_width
    widths = [base_width * 2**i for i in range(4)]
    for stage, (width, count) in enumerate(zip(widths, counts)):
        for i in range(count):
            stride = 2 if (stage > 0 and i == 0) else 1
            blocks.append((channels, width, stride))
            channels = _out_channels(kind, width)
    return kind, blocks, channels


def revnet_layers(depth: int, num_classes: int = 1000, cifar: bool = False, base_width: int = 64) -> list:
    """Layer specs of RevNet-``depth``: stem, one layer per residual block, head. ``base_width`` 64 is
    the paper's network; smaller values give the same structure at a fraction of the cost."""
    from deepspeed.runtime.pipe.module import LayerSpec

    kind, blocks, final = _plan(depth, base_width)
    layers = [LayerSpec(Stem, base_width, cifar, 2)]
    for in_channels, width, stride in blocks:
        if stride == 1 and in_channels == _out_channels(kind, width):
            layers.append(LayerSpec(RevBlock, kind, width))
        else:
            layers.append(LayerSpec(DownsampleBlock, kind, in_channels, width, stride))
    layers.append(LayerSpec(RevHead, final, num_classes))
    return layers


def resnet_layers(depth: int, num_classes: int = 1000, cifar: bool = False, base_width: int = 64) -> list:
    """Layer specs of the ResNet-``depth`` baseline, from the same residual branches."""
    from deepspeed.runtime.pipe.module import LayerSpec

    kind, blocks, final = _plan(depth, base_width)
    layers = [LayerSpec(Stem, base_width, cifar, 1)]
    layers += [LayerSpec(ResBlock, kind, c, w, s) for c, w, s in blocks]
    layers.append(LayerSpec(ResHead, final, num_classes))
    return layers


def build_sequential(layers: list) -> nn.Sequential:
    """All layers in one ``nn.Sequential`` (plain PyTorch use, parameter counts)."""
    return nn.Sequential(*[spec.build() for spec in layers])
