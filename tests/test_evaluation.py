"""Evaluation runs in chunks sized to the model (on a CPU, a chunk's largest layer output near
the cache's size): the chunked numbers must be the numbers of the plain per-client forward."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from stocfl.models import EVAL_CHUNK_MAX, EVAL_CHUNK_MIN, FlatModel, make_model
from stocfl.tasks import evaluate_pooled

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
