"""run.device: names resolved with one-line errors, tasks and results moved field by field
with shared tensors moved once. The accelerator paths themselves need a GPU (see README)."""

from __future__ import annotations

import pytest
import torch

import stocfl
from stocfl.algorithms.aggregation import weighted_mean
from stocfl.cli import main
from stocfl.client.models import make_model
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import Evaluate, FactoredTrained, Train, Trained
from stocfl.client.training import LocalTraining
from stocfl.data.scenarios import build
from stocfl.devices import federation_on, move, resolve_device
from stocfl.executors import BatchedExecutor, SequentialExecutor


def test_device_names_resolve_or_say_what_is_missing():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(stocfl.UserError, match="no CUDA device torch can use; use cpu or auto"):
            resolve_device("cuda:0")
    with pytest.raises(stocfl.UserError, match="choose auto, cpu, cuda, cuda:N or mps"):
        resolve_device("gpu")


def test_a_bad_device_is_one_line_and_exit_2(capsys):
    assert main(["run", "--set", "run.device=tpu", "--set", "run.rounds=1", "--quiet", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.device" in err[0] and "cuda:N" in err[0], err


def test_tasks_move_field_by_field_and_shared_tensors_once():
    w, v = torch.zeros(3), torch.ones(3)
    tasks = [Evaluate(0, w), Evaluate(1, w), Train(2, v, LocalTraining.sgd(1, 0, 0.1), 0, prox_center=w)]
    memo: dict[int, torch.Tensor] = {}
    meta = torch.device("meta")  # a device without storage: the moves are visible, nothing is computed
    moved = [move(t, meta, memo) for t in tasks]
    assert all(m.weights.device == meta for m in moved) and moved[2].prox_center.device == meta
    assert moved[0].weights is moved[1].weights is moved[2].prox_center  # shared before, shared after
    assert moved[0].client == 0 and moved[2].local.epochs == 1
    result = move(Trained(torch.zeros(2), 5), meta)  # results move the same way (back to the cpu)
    assert result.weights.device == meta and result.n_samples == 5
    assert move(tasks[0], torch.device("cpu")) is tasks[0]  # already there: the same object


def test_executors_on_an_explicit_cpu_device_give_the_default_numbers():
    fed = build("rotated", "digits", 6, 20, seed=0)
    flat, w0 = make_model("auto", fed.input_shape, fed.n_classes, 0, seed=0)
    tasks = [Train(i, w0, LocalTraining.sgd(2, 5, 0.1), i) for i in range(6)] + [Evaluate(i, w0) for i in range(6)]
    assert federation_on(fed, torch.device("cpu")) is fed
    for kind in (SequentialExecutor, BatchedExecutor):
        a, b = kind(fed, flat).execute(tasks), kind(fed, flat, device="cpu").execute(tasks)
        assert all(torch.equal(x.weights, y.weights) for x, y in zip(a[:6], b[:6]))
        assert [x.correct for x in a[6:]] == [y.correct for y in b[6:]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: see README)")
@pytest.mark.parametrize("dataset,model", [("digits", "mlp"), ("mnist", "cnn28")])
def test_every_executor_on_cuda_gives_the_cpu_numbers(dataset, model, request):
    """Each executor (and the low-rank path) on CUDA against the sequential CPU reference, for
    every task kind the algorithms send: plain, proximal and Adam training, evaluation and the
    data representation, in float32 with TF32 off."""
    from stocfl.algorithms.stocfl.representation import Represent

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    data_dir = request.getfixturevalue("data_dir") if dataset == "mnist" else None
    fed = build("rotated", dataset, 8, 20, seed=0, data_dir=data_dir)
    flat, w0 = make_model(model, fed.input_shape, fed.n_classes, 0, seed=0)
    center = w0 + 0.01
    tasks = (
        [Train(i, w0, LocalTraining.sgd(2, 0, 0.1), i) for i in range(3)]
        + [Train(3, w0, LocalTraining.sgd(2, 5, 0.1), 3)]
        + [Train(i, w0, LocalTraining.sgd(2, 5, 0.1), i, prox_center=center, prox_weight=0.5) for i in range(4, 6)]
        + [Train(6, w0, LocalTraining(1, 5, Optimizer("adam", 0.01)), 6)]
        + [Evaluate(i, w0) for i in range(8)]
        + [Represent(i, w0, epochs=2) for i in range(8)]
    )
    ref = SequentialExecutor(fed, flat).execute(tasks)
    executors = [
        SequentialExecutor(fed, flat, device="cuda"),
        BatchedExecutor(fed, flat, chunk_size=3, device="cuda"),
        BatchedExecutor(fed, flat, lowrank=True, device="cuda"),
        BatchedExecutor(fed, flat, lowrank=True, device="cuda", factored=True),
    ]
    # float32 on another device sums in another order. The MLP's weights agree to 1e-5; cuDNN's
    # convolutions (their algorithm picked at run time) round more, and Adam divides by sqrt(v),
    # so a coordinate whose gradient is rounding noise (a pixel that is always 0) moves up to lr
    # either way: those models are compared by their training loss, to 1e-3 relative, and the
    # CNN's representations (unit vectors) by the length of their difference, to 1e-3.

    def loss(w, client):
        x, y = fed.train_data(client)
        return float(flat.per_sample_loss(flat.forward(w, x), y).mean())

    def disagreement(f, x, y, t):
        if y.device.type != "cpu":
            return y.device
        if f == "weights" and (model != "mlp" or t.optimizer == "adam"):
            lx, ly = loss(x, t.client), loss(y, t.client)
            return None if abs(lx - ly) <= 1e-3 * lx else ("loss", lx, ly)
        if f == "psi" and model != "mlp":
            d = float((x - y).norm())
            return None if d <= 1e-3 else d
        return None if torch.allclose(x, y, rtol=1e-4, atol=1e-5) else float((x - y).abs().max())

    wrong = []
    for ex in executors:
        for i, (a, b, t) in enumerate(zip(ref, ex.execute(tasks), tasks)):
            for f in ("weights", "psi"):
                if hasattr(a, f) and (d := disagreement(f, getattr(a, f), getattr(b, f), t)) is not None:
                    wrong.append((ex.name, i, f, d))
            if hasattr(a, "correct") and (
                a.correct != b.correct or abs(a.loss - b.loss) > 1e-4 * max(1.0, abs(a.loss))
            ):
                wrong.append((ex.name, i, "evaluated", a.correct, b.correct, a.loss, b.loss))
    assert not wrong, wrong
    # factored replies stay on the device; their mean, taken there, comes to the host as the
    # CPU's mean of the same replies
    trains = [t for t in tasks if isinstance(t, Train) and t.local.optimizer.plain]
    on_device = BatchedExecutor(fed, flat, lowrank=True, device="cuda", factored=True).execute(trains)
    on_host = BatchedExecutor(fed, flat, lowrank=True, factored=True).execute(trains)
    assert all(isinstance(r, FactoredTrained) and r.A.device.type == "cuda" for r in on_device)
    mean = weighted_mean(on_device, [r.n_samples for r in on_device])
    want = weighted_mean(on_host, [r.n_samples for r in on_host])
    assert mean.device.type == "cpu" and torch.allclose(mean, want, rtol=1e-4, atol=1e-5)
