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


def test_femnist_cnn_is_the_stocfl_authors_femnist_model_with_xavier_weights_and_dropout():
    module = build_module("femnist_cnn", (1, 28, 28), 62)
    shapes = [tuple(p.shape) for p in module.parameters()]
    assert shapes == [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,), (62, 128), (62,)]
    assert [m.p for m in module.modules() if isinstance(m, torch.nn.Dropout)] == [0.25, 0.5]
    model, w = make_model("femnist_cnn", (1, 28, 28), 62, 200, 0)
    weights = model.unflatten(w)
    for name, p in weights.items():
        if name.endswith("weight"):  # Xavier uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out))
            t = p.view(p.shape[0], -1)
            receptive = t.shape[1] // (p.shape[1] if p.dim() > 1 else 1)
            bound = (6 / (t.shape[1] + p.shape[0] * receptive)) ** 0.5
            assert t.abs().max() <= bound and t.abs().max() > 0.9 * bound, name
    again = make_model("femnist_cnn", (1, 28, 28), 62, 200, 0)[1]
    assert torch.equal(w, again)  # seeded: same seed, same w_0
    with pytest.raises(ValueError, match="femnist_cnn needs 28x28 images"):
        build_module("femnist_cnn", (3, 32, 32), 10)
