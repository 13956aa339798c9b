"""Flower as the transport: the message codec and the simulation engine (real Flower, Ray)."""

import json
import math

import pytest
import torch

from stocfl.cli import main
from stocfl.tasks import Evaluate, Evaluated, Gradient, Gradiented, Represent, Represented, Train, Trained

flwr = pytest.importorskip("flwr", reason="Flower is part of the test extra: pip install -e '.[test]'")
from stocfl.flower.codec import MESSAGE_TYPE, BadReply, decode_result, decode_task, encode_result, encode_task  # noqa: E402

W = torch.arange(6, dtype=torch.float32)


@pytest.mark.parametrize("task", [
    Train(3, W, 2, 10, 0.1, 77, W + 1, 0.05),
    Train(3, W, 1, 0, 0.5, 5),
    Evaluate(3, W, "train"),
    Represent(3, W, "update", "linear", 20, 50, 0.1, 9, 1024, 11),
    Gradient(3, W),
])
def test_tasks_survive_the_message_codec(task):
    back = decode_task(MESSAGE_TYPE[type(task)], encode_task(task))
    assert type(back) is type(task)
    for field in task.__dataclass_fields__:
        a, b = getattr(task, field), getattr(back, field)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field


def test_replies_are_checked_before_aggregation():
    t = Train(3, W, 1, 0, 0.1, 1)
    assert torch.equal(decode_result(t, encode_result(Trained(W + 1, 10), 3)).weights, W + 1)
    with pytest.raises(BadReply, match="shape"):
        decode_result(t, encode_result(Trained(torch.zeros(5), 10), 3))
    with pytest.raises(BadReply, match="NaN or inf"):
        decode_result(t, encode_result(Trained(torch.full((6,), math.nan), 10), 3))
    with pytest.raises(BadReply, match="from client 4"):
        decode_result(t, encode_result(Trained(W, 10), 4))
    e = decode_result(Evaluate(3, W), encode_result(Evaluated(0.5, 7, 10), 3))
    assert (e.loss, e.correct, e.n_samples) == (0.5, 7, 10)
    with pytest.raises(BadReply, match="not finite"):
        decode_result(Evaluate(3, W), encode_result(Evaluated(math.inf, 7, 10), 3))
    r = decode_result(Represent(3, W), encode_result(Represented(torch.ones(4), 10), 3))
    assert r.psi.shape == (4,)
    g = decode_result(Gradient(3, W), encode_result(Gradiented(W, 10), 3))
    assert torch.equal(g.gradient, W)


def test_flower_simulation_agrees_with_the_local_engine(tmp_path):
    """A 20-client StoCFL run through Flower's simulation engine (one SuperNode per client)
    gives the same clusters and accuracies as the in-process engine."""
    common = ["configs/default.toml", "--quiet", "--set", "scenario.n_clients=20", "--set", "run.rounds=4",
              "--set", "run.client_timeout=300.0",
              "--set", "run.sample_rate=0.3"]
    assert main(["run", *common, "--engine", "local", "--out", str(tmp_path / "local")]) == 0
    assert main(["run", *common, "--engine", "flower-sim", "--out", str(tmp_path / "flower")]) == 0
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("local", "flower")]
    assert len(rows[0]) == len(rows[1]) == 4
    for a, b in zip(*rows):
        assert a["n_clusters"] == b["n_clusters"] and a["ari"] == b["ari"]
        assert abs(a["accuracy"] - b["accuracy"]) <= 1e-4 and abs(a["global_accuracy"] - b["global_accuracy"]) <= 1e-4
    assert (tmp_path / "flower" / ".flwr").is_dir(), "FLWR_HOME must live in the run directory"
