"""The built-in models: the papers' and authors' architectures, by name."""

import math

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


# The plain steps (a Sequential's layers called as their own forwards call them) against
# torch.func.functional_call, to the bit, on generated models, inputs and modes.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call  # noqa: E402

from stocfl.client.models import FlatModel, hooked, plain_steps  # noqa: E402
from stocfl.client.models import channels_last as to_channels_last  # noqa: E402
from stocfl.client.training import rows  # noqa: E402


@st.composite
def sequentials(draw):
    layers: list[nn.Module] = []
    shape: tuple[int, ...]
    if draw(st.booleans()):  # images: convolutions, pooling
        c = draw(st.integers(1, 3))
        shape = (c, draw(st.integers(6, 12)), draw(st.integers(6, 12)))
        for _ in range(draw(st.integers(1, 2))):
            out = draw(st.integers(1, 5))
            side = min(nn.Sequential(*layers)(torch.zeros(1, *shape)).shape[2:]) if layers else min(shape[1:])
            padding = draw(st.integers(0, 1))
            layers.append(
                nn.Conv2d(
                    c,
                    out,
                    draw(st.integers(1, min(3, side + 2 * padding))),  # a kernel no larger than its padded input
                    stride=draw(st.integers(1, 2)),
                    padding=padding,
                    bias=draw(st.booleans()),
                )
            )
            c = out
            layers.append(nn.ReLU(inplace=draw(st.booleans())))
            if draw(st.booleans()):
                layers.append(nn.MaxPool2d(2, ceil_mode=draw(st.booleans())))
            if draw(st.booleans()):
                layers.append(nn.Dropout(draw(st.sampled_from([0.1, 0.5]))))
        layers.append(nn.Flatten())
    else:
        shape = (draw(st.integers(2, 30)),)
    width = nn.Sequential(*layers)(torch.zeros(1, *shape)).shape[1] if layers else shape[0]
    for _ in range(draw(st.integers(1, 3))):
        out = draw(st.integers(1, 40))
        layers += [nn.Linear(width, out, bias=draw(st.booleans())), nn.ReLU()]
        if draw(st.booleans()):
            layers.append(nn.Dropout(0.3))
        width = out
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers), shape


@settings(max_examples=60, deadline=None)
@given(sequentials(), st.integers(1, 9), st.integers(0, 2**31 - 1), st.booleans())
def test_the_plain_steps_give_functional_calls_outputs_and_gradients_to_the_bit(built, n, seed, train):
    module, shape = built
    model = FlatModel(module)
    assert model._steps is not None  # every layer generated has its plain step
    w = FlatModel.init_weights(module, seed)
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))
    r = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed + 1))

    def run(plain: bool):
        leaves = [v.detach().clone().requires_grad_(True) for v in model.param_views(w)]
        torch.manual_seed(seed)  # dropout's draws
        if plain:
            out = model.forward_tensors(leaves, [] if train else None, x)
        else:
            model._mode(train)
            out = functional_call(model.module, dict(zip(model.names, leaves)), (x,))
        grads = torch.autograd.grad((out * r).sum(), leaves, allow_unused=True)
        return out.detach(), grads

    (a, ga), (b, gb) = run(True), run(False)
    assert torch.equal(a, b)
    assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(ga, gb))
    if not train:  # evaluation's forward too (no gradient taken: other kernels than above)
        plain = model.forward(w, x)
        model._steps = None
        assert torch.equal(plain, model.forward(w, x))


def test_modules_the_plain_steps_do_not_cover_and_hooks_take_the_modules_own_call():
    norm = FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)))
    assert norm._steps is None  # buffers
    assert plain_steps(nn.Sequential(nn.Linear(4, 3), nn.GELU()), ["0.weight", "0.bias"]) is None
    assert plain_steps(nn.Linear(4, 3), ["weight", "bias"]) is None  # not a Sequential
    reflect = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten())
    assert FlatModel(reflect)._steps is None
    model, w = make_model("mlp", (1, 4, 4), 3, 8, 0)
    seen = []
    handle = model.module[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    try:
        assert hooked(model._hookable)
        model.forward(w, torch.rand(5, 1, 4, 4))
    finally:
        handle.remove()
    assert seen == [(5, 16)] and not hooked(model._hookable)


@given(st.integers(1, 30), st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([1, 3]), st.integers(1, 5))
def test_rows_equal_advanced_indexing_values_and_strides(n, seed, channels_last, c, h):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, 5, generator=g)
    if channels_last:  # as the models lay images out (explicit strides, also for one channel)
        x = to_channels_last(x)
    idx = torch.randint(0, n, (max(1, n // 2),), generator=g)
    for t in (x, x.flatten(1), x[:, 0, 0, 0]):
        got, want = rows(t, idx), t[idx]
        assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.parametrize(
    "name,shape", [("cnn28", (1, 28, 28)), ("femnist_cnn", (1, 28, 28)), ("cifar_cnn", (3, 32, 32))]
)
def test_the_built_in_convolutional_models_plain_steps_equal_functional_call_on_their_layout(name, shape):
    model, w = make_model(name, shape, 10, 200, 0)
    assert model._steps is not None
    x = model.layout(torch.rand(6, *shape, generator=torch.Generator().manual_seed(1)))
    got = []
    for plain in (True, False):
        leaves = [v.detach().clone().requires_grad_(True) for v in model.param_views(w)]
        steps, model._steps = model._steps, (model._steps if plain else None)
        torch.manual_seed(3)
        out = model.forward_tensors(leaves, [], x)
        got.append((out.detach(), torch.autograd.grad(out.square().sum(), leaves)))
        model._steps = steps
    (a, ga), (b, gb) = got
    assert torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(ga, gb))


from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(sequentials())
def test_step_params_are_the_forward_flops_of_the_weights_plus_the_biases_at_each_output(built):
    """auto's count of a step's work, against torch's FlopCounterMode on a real forward pass:
    FLOPs / 2 is the weights each sample meets (a convolution's at every output pixel), and
    the count adds each bias once per output it is added to."""
    module, shape = built
    model = FlatModel(module)
    seen: dict[int, int] = {}

    def hook(m, _inputs, out):
        seen[id(m)] = math.prod(out.shape[2:]) if out.dim() > 2 else 1

    layers = [m for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    handles = [m.register_forward_hook(hook) for m in layers]
    with FlopCounterMode(display=False) as flops, torch.no_grad():
        module.eval()(torch.zeros(1, *shape))
    for h in handles:
        h.remove()
    biases = sum(m.bias.numel() * seen[id(m)] for m in layers if m.bias is not None)
    assert model.step_params(shape) == flops.get_total_flops() // 2 + biases
