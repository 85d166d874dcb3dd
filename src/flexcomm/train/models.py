"""Image-classification models for the training app.

Four architectures sized for small images (28x28 Fashion-MNIST, 32x32 CIFAR-like):

* :func:`resnet18` -- compute-heavy, ~11M parameters at the standard width.
* :func:`alexnet` -- communication-heavy: large fully connected layers put tens of
  millions of parameters on the wire at ``fc_width=4096``.
* :func:`vit` -- a small Vision Transformer.
* :func:`mlp` -- the most communication-bound: two wide hidden layers, one
  multiply-add per parameter and sample, so the gradient exchange dominates a step
  (the demo's model).

:func:`build_model` selects one by name and applies a width multiplier so CPU runs
can use scaled-down versions. Initialisation only uses torch's global RNG, so models
are reproducible under :func:`torch.manual_seed`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "MODEL_NAMES",
    "alexnet",
    "build_model",
    "count_parameters",
    "mlp",
    "resnet18",
    "vit",
]

MODEL_NAMES: tuple[str, ...] = ("resnet18", "alexnet", "vit", "mlp")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# --------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or in_channels != out_channels:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with a 3x3 stride-1 stem and no max-pool, for small images."""

    def __init__(
        self, blocks: tuple[int, ...], num_classes: int, in_channels: int, width: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        channels = width
        for i, num_blocks in enumerate(blocks):
            out_channels = width * 2**i
            stride = 1 if i == 0 else 2
            for j in range(num_blocks):
                stages.append(BasicBlock(channels, out_channels, stride if j == 0 else 1))
                channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


def resnet18(
    num_classes: int = 10, in_channels: int = 1, width: int = 64, image_size: int = 28
) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]) for small images.

    ``width`` is the channel count of the first stage (64 standard, 16 for fast CPU
    runs); later stages double it. ``image_size`` only has to be at least 8: global
    average pooling makes the network independent of the input size.
    """
    _check_positive(num_classes=num_classes, in_channels=in_channels, width=width)
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    return ResNet((2, 2, 2, 2), num_classes, in_channels, width)


# -------------------------------------------------------------------------- AlexNet


class AlexNet(nn.Module):
    """AlexNet-style CNN: 5 conv layers (3 max-pools), then 3 FC layers with dropout."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        width: int,
        fc_width: int,
        image_size: int,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        # Channel ratios 1:3:6:4:4 follow the original AlexNet (64, 192, 384, 256, 256).
        c1, c2, c3, c4, c5 = width, 3 * width, 6 * width, 4 * width, 4 * width
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = image_size // 8  # three floor-halving max-pools
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(c5 * side * side, fc_width),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def alexnet(
    num_classes: int = 10,
    in_channels: int = 1,
    width: int = 64,
    fc_width: int = 4096,
    image_size: int = 28,
) -> AlexNet:
    """AlexNet-style CNN for small images.

    Conv channels are ``width * (1, 3, 6, 4, 4)``; the two hidden FC layers have
    ``fc_width`` units. ``image_size`` (>= 8) fixes the flattened feature size
    ``4 * width * (image_size // 8) ** 2``, so inputs must have that spatial size.
    """
    _check_positive(
        num_classes=num_classes, in_channels=in_channels, width=width, fc_width=fc_width
    )
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    return AlexNet(num_classes, in_channels, width, fc_width, image_size)


# ---------------------------------------------------------------------------- ViT


class TransformerBlock(nn.Module):
    """Pre-norm transformer encoder block: x + MHA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT: strided-conv patch embedding, class token, learned positions, LN head."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int,
    ) -> None:
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, heads, mlp_dim) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 28,
    patch_size: int = 4,
    dim: int = 128,
    depth: int = 4,
    heads: int = 4,
    mlp_dim: int = 256,
) -> VisionTransformer:
    """Small Vision Transformer; ``image_size`` must be a multiple of ``patch_size``
    and ``dim`` a multiple of ``heads``."""
    _check_positive(
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        patch_size=patch_size,
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_dim=mlp_dim,
    )
    if image_size % patch_size:
        raise ValueError(
            f"image_size ({image_size}) must be divisible by patch_size ({patch_size})"
        )
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
    return VisionTransformer(
        num_classes, in_channels, image_size, patch_size, dim, depth, heads, mlp_dim
    )


# ---------------------------------------------------------------------------- MLP


def mlp(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, hidden: int = 1024) -> nn.Sequential:
    """Flatten, two hidden ``hidden``-unit layers with ReLU, then the classifier."""
    _check_positive(num_classes=num_classes, in_channels=in_channels, image_size=image_size, hidden=hidden)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    )


# ---------------------------------------------------------------------- factory


def _scale(base: int, multiplier: float, multiple_of: int = 1) -> int:
    """``base * multiplier`` rounded to a positive multiple of ``multiple_of``."""
    return multiple_of * max(1, round(base * multiplier / multiple_of))


def build_model(
    name: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: float | None = None,
) -> nn.Module:
    """Build ``"resnet18"``, ``"alexnet"``, ``"vit"`` or ``"mlp"`` (case-insensitive).

    ``width`` multiplies every layer width of the default configuration
    (``None`` = 1.0): ResNet first-stage channels 64, AlexNet conv width 64 and FC
    width 4096, ViT ``dim`` 128 (kept a multiple of the 4 heads) and ``mlp_dim``
    256, MLP hidden width 1024. Depths are unchanged. E.g. ``width=0.25`` gives ResNet width 16, AlexNet
    16/1024 and ViT 32/64, small enough for CPU runs.
    """
    multiplier = 1.0 if width is None else float(width)
    if not multiplier > 0:
        raise ValueError(f"width must be > 0, got {width}")
    key = name.lower()
    if key == "resnet18":
        return resnet18(num_classes, in_channels, _scale(64, multiplier), image_size)
    if key == "alexnet":
        return alexnet(
            num_classes,
            in_channels,
            _scale(64, multiplier),
            _scale(4096, multiplier),
            image_size,
        )
    if key == "vit":
        heads = 4
        return vit(
            num_classes,
            in_channels,
            image_size,
            dim=_scale(128, multiplier, heads),
            heads=heads,
            mlp_dim=_scale(256, multiplier),
        )
    if key == "mlp":
        return mlp(num_classes, in_channels, image_size, _scale(1024, multiplier))
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements in ``model`` (buffers excluded)."""
    return sum(p.numel() for p in model.parameters())
