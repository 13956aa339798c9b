"""The built-in models: the papers' and authors' architectures, by name."""

import pytest
import torch

from stocfl.client.models import build_module, make_model


def test_cifar_lenet_is_the_stocfl_authors_cifar_model():
    # their models/cnn.py CNN_CIFAR10: conv 3->6 (5x5), conv 6->16 (5x5), FC 400-120-84-10
    module = build_module("cifar_lenet", (3, 32, 32), 10)
    shapes = [tuple(p.shape) for p in module.parameters()]
    assert shapes == [(6, 3, 5, 5), (6,), (16, 6, 5, 5), (16,), (120, 400), (120,), (84, 120), (84,), (10, 84), (10,)]
    assert sum(p.numel() for p in module.parameters()) == 62_006
    model, w = make_model("cifar_lenet", (3, 32, 32), 10, 200, 0)
    out = model.forward(w, torch.rand(4, 3, 32, 32))
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="cifar_lenet needs 32x32 images"):
        build_module("cifar_lenet", (1, 28, 28), 10)
