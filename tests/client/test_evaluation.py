"""Evaluation runs in chunks sized to the model (on a CPU, a chunk's largest layer output near
the cache's size): the chunked numbers must be the numbers of the plain per-client forward."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stocfl.client.models import EVAL_CHUNK_MAX, EVAL_CHUNK_MIN, FlatModel, make_model
from stocfl.client.tasks import evaluate_pooled

CNN, CNN_W = make_model("cnn28", (1, 28, 28), 62, 200, 0)


def test_the_chunk_follows_the_largest_layer_output():
    mlp, _ = make_model("mlp", (1, 28, 28), 10, 2048, 0)
    x = torch.zeros(3, 1, 28, 28)
    # cnn28's first convolution gives 32 x 28 x 28 floats a sample (100,352 bytes): 334 a chunk
    assert CNN._largest_output((1, 28, 28), torch.float32) == 32 * 28 * 28 * 4 and CNN.eval_chunk(x) == 334
    assert mlp.eval_chunk(x) == 4096  # 2,048 hidden floats a sample
    assert CNN.eval_chunk(torch.zeros(3, 1, 28, 28, device="meta")) == EVAL_CHUNK_MAX  # not a CPU

    class NoMeta(nn.Module):  # an op with no meta kernel: a fixed guess, never an error
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) + float(x.sum())

    odd = FlatModel(NoMeta())
    assert odd.eval_chunk(torch.zeros(2, 4)) == 256 and EVAL_CHUNK_MIN <= 256


@pytest.mark.long
@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_chunked_pooled_evaluation_equals_each_client_in_one_forward(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    w = CNN_W + 0.01 * torch.randn(CNN_W.shape, generator=g)
    parts = [(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 62, (n,), generator=g)) for n in sizes]
    got = evaluate_pooled(CNN, w, parts)
    with torch.no_grad():
        for (x, y), e in zip(parts, got):
            assert e.n_samples == len(y)
            if not len(y):
                continue
            logits = CNN.forward(w, x)  # the plain version: the client's data in one pass
            loss = CNN.per_sample_loss(logits, y).double()
            assert e.correct == int((logits.argmax(1) == y).sum())
            assert abs(e.loss - float(loss.mean())) <= 1e-6 * max(1.0, float(loss.mean()))


def _dropout_module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))


def test_a_dropout_model_gives_the_same_numbers_for_the_same_seed_and_is_evaluated_without_dropout():
    import stocfl
    from stocfl.errors import UserError

    cfg = {
        "run": {"rounds": 2},
        "scenario": {"n_clients": 8, "samples_per_client": 20},
        "algorithm": {"name": "fedavg"},
    }
    first = stocfl.run(cfg, model=_dropout_module())
    torch.rand(1000)  # the global generator moves on between the runs
    again = stocfl.run(cfg, model=_dropout_module())
    # auto: only the sequential loop (alone, or in parallel's workers with more than one thread) draws as each
    # client alone
    assert first.summary["engine"] == (
        "parallel" if torch.get_num_threads() > 1 and sys.platform == "linux" else "sequential"
    )
    assert first.summary["accuracy"] == again.summary["accuracy"]
    assert all(torch.equal(a, b) for a, b in zip(first.models["global"].values(), again.models["global"].values()))
    # evaluation is the module's eval mode: dropout off, the same logits every time
    module = _dropout_module()
    flat = FlatModel(module)
    w = FlatModel.flatten(module)
    x = torch.rand(50, 1, 8, 8)
    flat.forward_train(w[: flat.n_trainable], [], x)  # a training step leaves the template in train mode
    with torch.no_grad():
        assert torch.equal(flat.forward(w, x), module.eval()(x)) and torch.equal(flat.forward(w, x), flat.forward(w, x))
    # training draws dropout masks: two steps from the same weights differ unless seeded alike
    assert not torch.equal(
        flat.forward_train(w[: flat.n_trainable], [], x), flat.forward_train(w[: flat.n_trainable], [], x)
    )
    for engine in ("batched", "lowrank"):
        with pytest.raises(UserError, match=f"run.engine = {engine}: the model has layers that draw random numbers"):
            stocfl.run({**cfg, "run": {"rounds": 1, "engine": engine}}, model=_dropout_module())


RGB, RGB_W = make_model("cifar_cnn", (3, 32, 32), 10, 200, 0)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 24), batch=st.integers(0, 8), seed=st.integers(0, 2**16), gray=st.booleans())
def test_a_conv_model_trains_and_evaluates_on_channels_last_images_to_the_numbers_of_plain_ones(n, batch, seed, gray):
    from stocfl.client.training import LocalTraining, local_sgd

    model, w0, shape = (CNN, CNN_W, (1, 28, 28)) if gray else (RGB, RGB_W, (3, 32, 32))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)
    fast_x = model.layout(x)
    assert fast_x.equal(x) and fast_x.stride()[1] == 1  # channels-last strides, one channel too
    assert fast_x[torch.arange(n).flip(0)].stride()[1] == 1  # a gathered mini-batch keeps them
    plain = FlatModel(model.module)
    plain._has_conv2d = False  # the obviously correct version: the caller's layout throughout
    assert plain.layout(x) is x
    fast, ref = (local_sgd(m, x, y, w0, LocalTraining.sgd(2, batch, 0.05), seed) for m in (model, plain))
    # float rounding of the update: 1e-7 of it after one step; a second step can amplify that where a
    # rounding moves a ReLU or max-pool input across its kink (n=18, full batch, seed 1: 3.2e-4)
    assert float((fast - ref).norm()) <= 1e-3 * float((ref - w0).norm())
    got, want = (evaluate_pooled(m, fast, [(x, y)])[0] for m in (model, plain))
    assert abs(got.loss - want.loss) <= 1e-5 * max(1.0, want.loss) and abs(got.correct - want.correct) <= 1


def test_a_model_that_views_a_convolutions_output_keeps_its_inputs_layout():
    class Viewing(nn.Module):  # as many tutorials write it: .view on the convolution's output
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 10)

        def forward(self, x):
            out = self.conv(x)
            return self.fc(out.view(out.size(0), -1))

    model = FlatModel(Viewing())
    w = FlatModel.init_weights(Viewing(), 0)
    x = torch.rand(5, 3, 8, 8)
    assert model.layout(x) is x  # channels-last would break its view: left as it is
    assert evaluate_pooled(model, w, [(x, torch.zeros(5, dtype=torch.long))])[0].n_samples == 5
