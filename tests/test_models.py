"""Tests for flexcomm.train.models: shapes, exact parameter counts, factory, determinism."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from flexcomm.train.models import (
    MODEL_NAMES,
    alexnet,
    build_model,
    count_parameters,
    resnet18,
    vit,
)

INPUTS = [(1, 28), (3, 32)]  # (channels, image size): Fashion-MNIST-like, CIFAR-like


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread avoids oversubscription stalls on
    shared CPUs (several times slower with 2 threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------- parameter-count formulas


def conv(cin: int, cout: int, k: int, bias: bool) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def linear(fin: int, fout: int) -> int:
    return fin * fout + fout


def resnet18_params(in_channels: int, width: int, num_classes: int) -> int:
    def bn(c: int) -> int:
        return 2 * c  # weight and bias

    total = conv(in_channels, width, 3, False) + bn(width)
    cin = width
    for stage in range(4):
        cout = width * 2**stage
        for _ in range(2):
            total += conv(cin, cout, 3, False) + bn(cout) + conv(cout, cout, 3, False) + bn(cout)
            if cin != cout:  # first block of stages 2-4: 1x1 projection shortcut
                total += conv(cin, cout, 1, False) + bn(cout)
            cin = cout
    return total + linear(8 * width, num_classes)


def alexnet_params(
    in_channels: int, width: int, fc_width: int, image_size: int, num_classes: int
) -> int:
    chans = [in_channels, width, 3 * width, 6 * width, 4 * width, 4 * width]
    total = sum(conv(a, b, 3, True) for a, b in zip(chans, chans[1:]))
    flat = 4 * width * (image_size // 8) ** 2
    return total + linear(flat, fc_width) + linear(fc_width, fc_width) + linear(
        fc_width, num_classes
    )


def vit_params(
    in_channels: int, image_size: int, patch: int, dim: int, depth: int, mlp: int, classes: int
) -> int:
    tokens = (image_size // patch) ** 2 + 1
    ln = 2 * dim
    attention = linear(dim, 3 * dim) + linear(dim, dim)  # in-projection + out-projection
    block = ln + attention + ln + linear(dim, mlp) + linear(mlp, dim)
    embed = conv(in_channels, dim, patch, True) + dim + tokens * dim  # patches, cls, pos
    return embed + depth * block + ln + linear(dim, classes)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("channels,size", INPUTS)
@pytest.mark.parametrize("width", [None, 0.25])
def test_output_shapes(name: str, channels: int, size: int, width: float | None) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, in_channels=channels, image_size=size, width=width)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(3, channels, size, size))
    assert out.shape == (3, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("channels,size", INPUTS)
def test_resnet18_exact_parameter_count(channels: int, size: int) -> None:
    for width in (8, 16):
        model = resnet18(num_classes=10, in_channels=channels, width=width, image_size=size)
        assert count_parameters(model) == resnet18_params(channels, width, 10)


def test_resnet18_standard_cifar_count() -> None:
    # The widely quoted size of CIFAR-10 ResNet-18 (3x3 stem, 10 classes).
    assert count_parameters(resnet18(10, 3, 64, 32)) == 11_173_962


@pytest.mark.parametrize("channels,size", INPUTS)
def test_alexnet_exact_parameter_count(channels: int, size: int) -> None:
    model = alexnet(num_classes=10, in_channels=channels, width=16, fc_width=256, image_size=size)
    assert count_parameters(model) == alexnet_params(channels, 16, 256, size, 10)
    assert count_parameters(model) < 1_000_000


def test_alexnet_full_width_is_communication_heavy() -> None:
    model = alexnet(num_classes=10, in_channels=1, width=64, fc_width=4096, image_size=28)
    n = count_parameters(model)
    assert n == alexnet_params(1, 64, 4096, 28, 10)
    assert n > 10_000_000
    fc = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    assert fc > 0.9 * n  # the FC layers dominate


@pytest.mark.parametrize("channels,size", INPUTS)
def test_vit_exact_parameter_count(channels: int, size: int) -> None:
    expected = vit_params(channels, size, 4, 128, 4, 256, 10)
    assert count_parameters(vit(10, channels, size)) == expected
    small = vit(10, channels, size, patch_size=4, dim=32, depth=2, heads=2, mlp_dim=64)
    assert count_parameters(small) == vit_params(channels, size, 4, 32, 2, 64, 10)


def test_build_model_width_multiplier() -> None:
    assert count_parameters(build_model("resnet18", 10, 1, 28, width=0.25)) == resnet18_params(
        1, 16, 10
    )
    assert count_parameters(build_model("alexnet", 10, 1, 28, width=0.125)) == alexnet_params(
        1, 8, 512, 28, 10
    )
    # dim 128 * 0.3 = 38.4 is rounded to a multiple of the 4 heads: 40.
    assert count_parameters(build_model("vit", 10, 1, 28, width=0.3)) == vit_params(
        1, 28, 4, 40, 4, 77, 10
    )
    default = count_parameters(build_model("ViT", 10, 1, 28))  # case-insensitive
    assert default == count_parameters(vit(10, 1, 28))


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'.*resnet18, alexnet, vit"):
        build_model("vgg", 10, 1, 28)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: build_model("resnet18", 10, 1, 28, width=0), "width"),
        (lambda: vit(image_size=30, patch_size=4), "divisible by patch_size"),
        (lambda: vit(dim=130, heads=4), "divisible by heads"),
        (lambda: alexnet(image_size=4), "image_size"),
        (lambda: resnet18(num_classes=0), "num_classes"),
    ],
)
def test_invalid_configurations(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_deterministic_given_seed(name: str) -> None:
    def params(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return list(build_model(name, 10, 1, 28, width=0.125).parameters())

    a, b, c = params(1), params(1), params(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_fit_a_small_batch(name: str) -> None:
    """Gradients flow end to end: a few Adam steps drive the loss on a fixed batch down.

    Eval mode switches dropout off so the check is deterministic and about gradient flow.
    """
    torch.manual_seed(0)
    model = build_model(name, 4, 3, 16, width=0.125).eval()
    x, y = torch.randn(16, 3, 16, 16), torch.arange(16) % 4
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_alexnet_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    model = alexnet(10, 1, width=8, fc_width=64, image_size=28)
    x = torch.randn(4, 1, 28, 28)
    assert not torch.equal(model.train()(x), model(x))
    with torch.no_grad():
        assert torch.equal(model.eval()(x), model(x))
