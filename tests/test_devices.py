"""run.device: names resolved with one-line errors, tasks and results moved field by field
with shared tensors moved once. The accelerator paths themselves need a GPU (see README)."""

from __future__ import annotations

import pytest
import torch

import stocfl
from stocfl.cli import main
from stocfl.devices import federation_on, move, resolve_device
from stocfl.executors import BatchedExecutor, SequentialExecutor
from stocfl.models import make_model
from stocfl.scenarios import build
from stocfl.tasks import Evaluate, Train, Trained


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
    tasks = [Evaluate(0, w), Evaluate(1, w), Train(2, v, 1, 0, 0.1, 0, prox_center=w)]
    memo: dict[int, torch.Tensor] = {}
    meta = torch.device("meta")  # a device without storage: the moves are visible, nothing is computed
    moved = [move(t, meta, memo) for t in tasks]
    assert all(m.weights.device == meta for m in moved) and moved[2].prox_center.device == meta
    assert moved[0].weights is moved[1].weights is moved[2].prox_center  # shared before, shared after
    assert moved[0].client == 0 and moved[2].epochs == 1
    result = move(Trained(torch.zeros(2), 5), meta)  # results move the same way (back to the cpu)
    assert result.weights.device == meta and result.n_samples == 5
    assert move(tasks[0], torch.device("cpu")) is tasks[0]  # already there: the same object


def test_executors_on_an_explicit_cpu_device_give_the_default_numbers():
    fed = build("rotated", "digits", 6, 20, seed=0)
    flat, w0 = make_model("auto", fed.input_shape, fed.n_classes, 0, seed=0)
    tasks = [Train(i, w0, 2, 5, 0.1, i) for i in range(6)] + [Evaluate(i, w0) for i in range(6)]
    assert federation_on(fed, torch.device("cpu")) is fed
    for kind in (SequentialExecutor, BatchedExecutor):
        a, b = kind(fed, flat).run(tasks), kind(fed, flat, device="cpu").run(tasks)
        assert all(torch.equal(x.weights, y.weights) for x, y in zip(a[:6], b[:6]))
        assert [x.correct for x in a[6:]] == [y.correct for y in b[6:]]
