"""Client tasks and results as Flower records: named keys only, never positional lists.

One message carries all the tasks of one kind for the clients of one node in a call of the
executor (e.g. StoCFL's train of w and of theta_k): task k travels as an ArrayRecord
"k.arrays" (weights, anchor, prox_center) and a ConfigRecord "k.task" (its client and plain
numbers), with a ConfigRecord "batch" holding the count. Result k comes back as an ArrayRecord
"k.arrays" (weights or psi) and a MetricRecord "k.metrics", with a ConfigRecord "clients"
whose "ids" name the client of each result. Replies are checked before anything is aggregated.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from stocfl.tasks import (BadResult, Evaluate, Evaluated, Gradient, Gradiented, Represent, Represented, Task,
                          Train, Trained, check_vector)

MESSAGE_TYPE = {Train: "train", Evaluate: "evaluate", Represent: "query.represent", Gradient: "query.gradient"}


class BadReply(BadResult):
    """A client's reply that must not reach aggregation (wrong shape, NaN or inf, wrong client)."""


def _arrays(**tensors) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array(v.detach().numpy()) for k, v in tensors.items() if v is not None})


def encode_tasks(tasks: list[Task]) -> RecordDict:
    """One message's content: tasks of one kind."""
    if len({type(t) for t in tasks}) != 1:
        raise ValueError("one message carries tasks of one kind")
    content = RecordDict({"batch": ConfigRecord({"n": len(tasks)})})
    for k, task in enumerate(tasks):
        content[f"{k}.arrays"], content[f"{k}.task"] = _encode_task(task)
    return content


def decode_tasks(message_type: str, content: RecordDict) -> list[Task]:
    return [_decode_task(message_type, content[f"{k}.task"], content[f"{k}.arrays"])
            for k in range(int(content["batch"]["n"]))]


def encode_results(results: list, clients: list[int]) -> RecordDict:
    """The reply to one message: ``results[k]`` is client ``clients[k]``'s."""
    content = RecordDict({"clients": ConfigRecord({"ids": [int(c) for c in clients]})})
    for k, result in enumerate(results):
        content[f"{k}.arrays"], content[f"{k}.metrics"] = _encode_result(result)
    return content


def decode_results(tasks: list[Task], content: RecordDict) -> list:
    """The replies to ``tasks`` (one message's), each checked as by :func:`_decode_result`."""
    try:
        who = [int(c) for c in content["clients"]["ids"]]
        parts = [(content[f"{k}.arrays"], content[f"{k}.metrics"]) for k in range(min(len(tasks), len(who)))]
    except (KeyError, TypeError, ValueError) as err:
        raise BadReply(f"reply without the expected records ({err})") from None
    if len(who) != len(tasks) or len(content) != 1 + 2 * len(tasks):
        raise BadReply(f"reply holds {(len(content) - 1) // 2} results for {len(tasks)} tasks")
    return [_decode_result(t, c, arrays, m) for t, c, (arrays, m) in zip(tasks, who, parts)]


def _encode_task(task: Task) -> tuple[ArrayRecord, ConfigRecord]:
    if isinstance(task, Train):
        cfg = {"client": task.client, "epochs": task.epochs, "batch_size": task.batch_size, "lr": task.lr,
               "seed": task.seed, "prox_weight": task.prox_weight}
        arrays = _arrays(weights=task.weights, prox_center=task.prox_center)
    elif isinstance(task, Evaluate):
        cfg = {"client": task.client, "split": task.split}
        arrays = _arrays(weights=task.weights)
    elif isinstance(task, Represent):
        cfg = {"client": task.client, "kind": task.kind, "anchor_model": task.anchor_model, "epochs": task.epochs,
               "batch_size": task.batch_size, "lr": task.lr, "seed": task.seed, "dim": task.dim,
               "projection_seed": task.projection_seed}
        arrays = _arrays(anchor=task.anchor)
    elif isinstance(task, Gradient):
        cfg = {"client": task.client}
        arrays = _arrays(weights=task.weights)
    else:
        raise TypeError(f"no message for {type(task).__name__}")
    return arrays, ConfigRecord(cfg)


def _tensor(record: ArrayRecord, key: str) -> torch.Tensor | None:
    return torch.from_numpy(np.array(record[key].numpy(), dtype=np.float32)) if key in record else None


def _decode_task(message_type: str, cfg: ConfigRecord, arrays: ArrayRecord) -> Task:
    if message_type == "train":
        return Train(int(cfg["client"]), _tensor(arrays, "weights"), int(cfg["epochs"]), int(cfg["batch_size"]),
                     float(cfg["lr"]), int(cfg["seed"]), _tensor(arrays, "prox_center"), float(cfg["prox_weight"]))
    if message_type == "evaluate":
        return Evaluate(int(cfg["client"]), _tensor(arrays, "weights"), str(cfg["split"]))
    if message_type == "query.represent":
        return Represent(int(cfg["client"]), _tensor(arrays, "anchor"), str(cfg["kind"]), str(cfg["anchor_model"]),
                         int(cfg["epochs"]), int(cfg["batch_size"]), float(cfg["lr"]), int(cfg["seed"]),
                         int(cfg["dim"]), int(cfg["projection_seed"]))
    if message_type == "query.gradient":
        return Gradient(int(cfg["client"]), _tensor(arrays, "weights"))
    raise ValueError(f"unknown message type {message_type!r}")


def _encode_result(result) -> tuple[ArrayRecord, MetricRecord]:
    if isinstance(result, Trained):
        arrays, metrics = _arrays(weights=result.weights), {"n_samples": result.n_samples}
    elif isinstance(result, Evaluated):
        arrays, metrics = ArrayRecord(), {"loss": result.loss, "correct": result.correct,
                                          "n_samples": result.n_samples}
    elif isinstance(result, Represented):
        arrays, metrics = _arrays(psi=result.psi), {"n_samples": result.n_samples}
    elif isinstance(result, Gradiented):
        arrays, metrics = _arrays(gradient=result.gradient), {"n_samples": result.n_samples}
    else:
        raise TypeError(f"no reply for {type(result).__name__}")
    return arrays, MetricRecord(metrics)


def _finite(t: torch.Tensor | None, what: str, n: int) -> torch.Tensor:
    try:
        return check_vector(t, what, n)
    except BadResult as err:
        raise BadReply(str(err)) from None


def _integer(m: MetricRecord, key: str) -> int:
    """An integer metric, or BadReply: a float must be finite and whole (MetricRecord carries
    numbers as int or float)."""
    try:
        v = m[key]
    except (KeyError, TypeError) as err:
        raise BadReply(f"reply without {key} ({err})") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not
                                                                  (math.isfinite(v) and v.is_integer())):
        raise BadReply(f"{key} = {v!r} is not an integer")
    return int(v)


def _decode_result(task: Task, who: int, arrays: ArrayRecord, m: MetricRecord):
    """Client ``who``'s result for ``task``, checked: the right client, the right shapes,
    finite numbers."""
    n = _integer(m, "n_samples")
    if who != task.client:
        raise BadReply(f"reply from client {who} to a task for client {task.client}")
    if isinstance(task, Train):
        return Trained(_finite(_tensor(arrays, "weights"), "weights", task.weights.numel()), n)
    if isinstance(task, Evaluate):
        try:
            loss = float(m["loss"])
        except (KeyError, TypeError, ValueError) as err:
            raise BadReply(f"reply without a loss ({err})") from None
        if not math.isfinite(loss):
            raise BadReply("evaluation loss is not finite")
        return Evaluated(loss, _integer(m, "correct"), n)
    if isinstance(task, Represent):
        psi = _tensor(arrays, "psi")
        if psi is None or psi.dim() != 1:
            raise BadReply("representation missing or not a vector")
        return Represented(psi, n)  # zero or non-finite Psi is rejected by StoCFL itself
    return Gradiented(_finite(_tensor(arrays, "gradient"), "gradient", task.weights.numel()), n)
