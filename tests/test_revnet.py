"""RevNet18/34/50 as the paper defines them, and the ResNet baselines from the same code."""

import pytest
import torch

from petra_ds.models.revnet import RevBlock, _plan, build_sequential, resnet_layers, revnet_layers
from petra_ds.pipeline.module import spec_is_reversible
from petra_ds.nn import check_reversible

PAPER_PARAMS = {18: 12.2e6, 34: 22.3e6, 50: 30.4e6}  # Tab. 2, 1000-class head


def count(layers):
    return sum(p.numel() for p in build_sequential(layers).parameters())


@pytest.mark.parametrize("depth", [18, 34, 50])
def test_parameter_counts_match_the_paper_and_torchvision(depth):
    import torchvision  # here, not at collection: 3 s of imports for every test process

    assert abs(count(revnet_layers(depth)) / PAPER_PARAMS[depth] - 1) < 0.02
    torchvision_count = sum(p.numel() for p in getattr(torchvision.models, f"resnet{depth}")().parameters())
    assert count(resnet_layers(depth)) == torchvision_count


def test_one_stage_per_residual_block():
    layers = {d: revnet_layers(d) for d in (18, 34, 50)}
    assert [len(layers[d]) for d in (18, 34, 50)] == [10, 18, 18]
    not_reversible = [i for i, spec in enumerate(layers[18]) if not spec_is_reversible(spec)]
    assert not_reversible == [0, 3, 5, 7, 9]  # stem, three downsampling blocks, head (paper App. B)
    assert [i for i, spec in enumerate(layers[50]) if not spec_is_reversible(spec)] == [0, 1, 4, 8, 14, 17]


@pytest.mark.parametrize("depth", [18, 34, 50])
def test_every_reversible_block_inverts_in_float64(depth):
    torch.manual_seed(depth)
    kind, blocks, _ = _plan(depth)
    checked = 0
    for i, spec in enumerate(revnet_layers(depth)[1:-1]):
        if spec.typename is not RevBlock:
            continue
        block = spec.build().double().train()
        channels = blocks[i][1] if kind == "basic" else 4 * blocks[i][1]
        x = tuple(torch.randn(2, channels, 4, 4, dtype=torch.float64) for _ in range(2))
        assert check_reversible(block, x, tol=1e-10, name=f"revnet{depth}.{i + 1}") < 1e-10
        checked += 1
    assert checked == {18: 5, 34: 13, 50: 12}[depth]


@pytest.mark.parametrize("cifar,size", [(True, 32), (False, 64)])
def test_forward_shapes(cifar, size):
    model = build_sequential(revnet_layers(18, num_classes=10, cifar=cifar)).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 10)
        assert build_sequential(resnet_layers(18, 10, cifar)).eval()(torch.randn(2, 3, size, size)).shape == (2, 10)
