"""Build what a run needs, once: its federation, its model, its executor and the checked task
runner, the algorithm with its context (:func:`build_run`). Its parts are shared by the round
loop, the Flower ClientApp, new-client placement (``stocfl assign``) and the tests."""

from __future__ import annotations

import copy
import logging
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl import config as schema
from stocfl.algorithms import Algorithm, Context, algorithm_class
from stocfl.algorithms.aggregation import Aggregator
from stocfl.client.flops import FlopCount
from stocfl.client.models import FlatModel, build_module, make_model
from stocfl.client.tasks import (
    BadResult,
    ClientsDropped,
    FactoredTrained,
    check_result,
    checking,
    field_names,
    out_of_bound,
)
from stocfl.client.training import LocalTraining
from stocfl.config import Config
from stocfl.data.datasets import resolve_data_dir
from stocfl.data.federation import Federation
from stocfl.data.scenarios import build
from stocfl.data.schedule import Schedule
from stocfl.errors import UserError
from stocfl.executors import make_executor, set_threads
from stocfl.executors.drifting import Drifting
from stocfl.executors.localbn import LocalBatchNorm
from stocfl.experiment import configure
from stocfl.storage.tensorboard import Scalars

log = logging.getLogger("stocfl")


def build_federation(cfg: Config) -> Federation:
    """``[scenario]``'s federation, with its schedule of who is present when, if it has one."""
    s = cfg.scenario
    fed = build(
        s.name,
        s.dataset,
        s.n_clients,
        s.samples_per_client,
        s.test_per_client,
        seed=cfg.run.seed,
        alpha=s.alpha,
        data_dir=s.data_dir or None,
        holdout=s.holdout,
        severity=s.severity,
        drift=s.drift,
        drift_rounds=tuple(s.drift_rounds),
        drift_share=s.drift_share,
    )
    if s.validation > 0:  # before the schedule: replace() keeps none, and it holds no data
        fed = fed.with_validation(s.validation, cfg.run.seed)
    fed.schedule = Schedule.from_shares(
        fed.participants, fed.n_clients, s.present_at_start, s.join_rounds, s.leave, s.leave_rounds, cfg.run.seed
    )
    return fed


def build_model(
    cfg: Config, fed: Federation, module: Any = None, loss: Any = None
) -> tuple[FlatModel, torch.Tensor, Any]:
    """The run's model as a flat function, its w_0 and its nn.Module: the module given (its
    current weights are w_0), else ``[model]`` initialised with the run's seed; with ``loss``
    (per-sample loss(logits, y)) instead of cross-entropy. Checked against the data by one
    forward pass. Shared by the runner and the Flower ClientApp."""
    m = cfg.model
    name = m.name if module is None else type(module).__name__
    if module is not None:
        model, w0 = FlatModel(module, loss), FlatModel.flatten(module)
    else:
        try:
            model, w0 = make_model(m.name, fed.input_shape, fed.n_classes, m.hidden, cfg.run.seed)
            model.loss = loss
            module = build_module(m.name, fed.input_shape, fed.n_classes, m.hidden)
        except ValueError as err:
            raise UserError(f"config: model.name: {err}") from None
    check_model_fits(model, w0, fed, name)
    if loss is not None:
        check_loss(model, w0, fed)
    return model, w0, module


def check_loss(model: FlatModel, w0: torch.Tensor, fed: Federation) -> None:
    """A user's loss on two train samples: one finite number per sample, differentiable. (A
    negative loss is allowed: evaluation needs it finite only.)"""
    x, y = fed.x_train[:2], fed.y_train[:2]
    try:
        w = w0.clone().requires_grad_(True)
        out = model.per_sample_loss(model.forward(w, x), y)
        ok = isinstance(out, torch.Tensor) and tuple(out.shape) == (len(y),) and bool(torch.isfinite(out).all())
        if ok:
            torch.autograd.grad(out.sum(), w)
    except Exception as err:  # a user's function can raise anything
        raise UserError(
            f"loss: calling it on the model's outputs failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); expected loss(logits, y) -> one value per "
            f"sample"
        ) from None
    if not ok:
        raise UserError(
            f"loss: expected loss(logits, y) -> a finite tensor of shape ({len(y)},), one value per "
            f"sample, got {getattr(out, 'shape', type(out).__name__)}"
        )


def check_model_fits(model: FlatModel, w0: torch.Tensor, fed: Federation, name: str) -> None:
    """The model before a round runs: trainable parameters, finite initial weights, and one
    forward pass on one train sample that gives a tensor of one logit per class. Whatever the
    forward raises, or a tuple, dict or other output it returns (as a HuggingFace model does),
    is one line."""
    if model.n_trainable == 0:
        raise UserError(f"model {name!r} has no trainable parameters; federated training needs some")
    if not bool(torch.isfinite(w0).all()):
        raise UserError(f"model {name!r} has a NaN or infinite initial weight; initialise it with finite numbers")
    x = fed.x_train[:1]
    try:
        with torch.no_grad():
            out = model.forward(w0, x)
    except Exception as err:  # noqa: BLE001 - a user's module can raise anything
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(
            f"config: model.name = {name!r} does not fit {fed.dataset} inputs of shape "
            f"{tuple(x.shape[1:])} ({type(err).__name__}: {first}); pick a model for this data"[:400]
        ) from None
    if not isinstance(out, torch.Tensor):
        raise UserError(
            f"model {name!r} returns a {type(out).__name__}, not a tensor of logits; wrap it so that its "
            f"forward returns the logits (e.g. the 'logits' entry of its output)"
        )
    if tuple(out.shape) != (1, fed.n_classes):
        raise UserError(
            f"config: model.name = {name!r} gives outputs of shape {tuple(out.shape[1:])} on "
            f"{fed.dataset}, which has {fed.n_classes} classes; pick a model for this data"
        )


def checked(execute, fed: Federation, model: FlatModel | None = None):
    """``execute`` (an executor's) with every result checked against its task and the client's
    sizes (:func:`stocfl.client.tasks.check_result`) before any algorithm sees it: the clients with a
    bad result are dropped (:class:`ClientsDropped`, counted in metrics.jsonl), whatever the
    engine. Its ``traffic`` counts what the task lists cost: the bytes of the tensors in the tasks
    sent ("down") and in the replies received ("up") and, given the ``model``, the FLOPs of the
    tasks sent (:mod:`stocfl.client.flops`; "flops" None once a count failed, "flop_seconds" the
    time counting took)."""
    train, test = fed.train_sizes, fed.test_sizes
    traffic: dict[str, Any] = {"down": 0, "up": 0, "flops": None, "flop_seconds": 0.0}
    count = None
    if model is not None:
        count, traffic["flops"] = FlopCount(fed, model), 0

    def run_checked(tasks):
        out, why = [], {}
        traffic["down"] += sum(tensor_bytes(t) for t in tasks)
        # the work asked, as the bytes sent: a client that does not answer was asked it too
        if count is not None and traffic["flops"] is not None:
            try:
                traffic["flops"] += sum(count(t) for t in tasks)
            except Exception as err:  # noqa: BLE001 - a user's kind or model may refuse to be counted
                log.warning(
                    "client FLOPs are not counted in this run: counting a %s task failed (%s: %s)",
                    type(tasks[0]).__name__,
                    type(err).__name__,
                    err,
                )
                traffic["flops"] = None
            traffic["flop_seconds"] = count.seconds
        results = execute(tasks)
        if not isinstance(results, (list, tuple)) or len(results) != len(tasks):  # a user's engine or batched path
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else f"a {type(results).__name__}"
            raise UserError(
                f"the executor returned {got} for {len(tasks)} tasks; an executor (and a task kind's "
                f"batched function) returns a list of one result per task, in order"
            )
        results = list(results)
        passed = []  # positions of the replies that passed their own checks
        traffic["up"] += sum(tensor_bytes(r) for r in results)
        with checking():
            for k, t in enumerate(tasks):
                r, results[k] = results[k], None  # a raw result goes once checked: replies can be large (Psi)
                try:
                    out.append(check_result(t, r, int(train[t.client]), int(test[t.client])))
                    passed.append(k)
                except BadResult as err:
                    why.setdefault(t.client, f"client {t.client}: bad reply ({err})")
            # the replies in the model's space, each against what was sent and the others
            for j, reason in out_of_bound([tasks[k] for k in passed], out).items():
                c = tasks[passed[j]].client
                why.setdefault(c, f"client {c}: bad reply ({reason})")
        if why:
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        return out

    run_checked.traffic = traffic  # type: ignore[attr-defined]
    return run_checked


def tensor_bytes(item: Any) -> int:
    """The bytes of the tensors a task or a result carries (its dataclass fields and the tensors
    inside them, e.g. a Mixture's models): what crosses the network in either direction, but for
    a few numbers of bookkeeping (counts, losses, seeds) that no method's cost depends on.

    Counted for every task and reply of every round (a round of 500 clients walks some 10,000
    fields), so each dataclass type's field names are found once, and a number or a string is
    passed over before anything else is asked of it."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if item is None or isinstance(item, _SCALARS):
        return 0
    if isinstance(item, FactoredTrained):  # in-process factors; a client would send the dense model
        return item.nbytes
    if isinstance(item, (list, tuple)):
        return sum(tensor_bytes(x) for x in item)
    return sum(tensor_bytes(getattr(item, name)) for name in field_names(item))


_SCALARS = (int, float, str, bool, bytes, np.generic)


def pin_data_dir(cfg: Config) -> None:
    """Write the data directory in use ($STOCFL_DATA_DIR included) into the config as an
    absolute path, so that a resume, a new-client query or a Flower client finds the same data."""
    if cfg.scenario.data_dir or resolve_data_dir(None):
        cfg.scenario.data_dir = str(resolve_data_dir(cfg.scenario.data_dir).resolve())


def read_config(out: Path, data_dir: str | None = None) -> dict[str, Any]:
    try:
        text = (out / "config.toml").read_text(encoding="utf-8")
        schema.check_nesting(text, f"{out}/config.toml")
        raw = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"{out}/config.toml is unreadable ({err}); it is not a stocfl results directory") from None
    try:  # its structure before any key is read: an edited file is one line, never a KeyError
        schema.validate(copy.deepcopy(raw))
    except UserError as err:
        raise UserError(f"{out}/config.toml is not a stocfl config ({err}); restore it or start a new run") from None
    if data_dir is not None:
        raw.setdefault("scenario", {})["data_dir"] = str(Path(data_dir).resolve())
    return raw


def sample_size(cfg: Config, fed: Federation, t: int = 1) -> int:
    """m = ceil(rate * N) of the participating clients present in round ``t``."""
    pool = len(fed.present(t))
    return min(pool, math.ceil(cfg.run.sample_rate * pool))


def build_context(
    cfg: Config, fed: Federation, model: FlatModel, w0: torch.Tensor, module: Any, workdir: Path | None = None
) -> Context:
    """What the algorithm's server knows when it starts (:class:`~stocfl.algorithms.Context`)."""
    return Context(
        fed.n_clients,
        w0,
        LocalTraining.from_config(cfg.train),
        cfg.run.seed,
        fed.input_shape,
        fed.n_classes,
        init_model=lambda seed: FlatModel.init_weights(copy.deepcopy(module), seed),
        last_layer=sum(model.numels[model.n_tensors - 2 : model.n_tensors]),
        n_trainable=model.n_trainable,
        workdir=workdir,
        store_ram=cfg.run.store_ram * 2**20,
        participants=tuple(fed.participants),
        sample_size=sample_size(cfg, fed),
        aggregator=Aggregator(**cfg.aggregation.model_dump()),
        drift_notice=fed.drift is not None and cfg.scenario.drift_notice,
        present=None if fed.schedule is None else fed.present,
    )


@dataclass
class Built:
    """What a run is made of, built from its config (and what was given in Python)."""

    fed: Federation
    label_dists: Any  # every client's label distribution (the label-cosine scores of unlabelled groups)
    model: FlatModel
    module: Any  # the nn.Module whose weights are w_0
    executor: Any
    engine: str  # the engine that runs the client tasks (auto: the one it chose)
    ask: Any  # the checked task runner the algorithm asks its clients through
    local: LocalBatchNorm | None  # the clients' own BatchNorm entries (train.local_bn)
    algorithm: Algorithm
    threads: int  # the torch threads in use
    drifting: Drifting | None = None  # with drift: sets the round whose data the tasks run on
    traffic: dict[str, Any] | None = None  # what the task lists cost so far (:func:`checked`)


def build_run(
    cfg: Config,
    out: Path | None,
    executor: Any = None,
    federation: Federation | None = None,
    module: Any = None,
    loss: Any = None,
) -> Built:
    """Everything a run needs: ``executor`` given (Flower's) or an in-process one for
    ``run.engine``; ``federation``, ``module`` and ``loss`` given in Python or None (from the
    config). Names and parameters are checked before any data is read."""
    configure.settle(cfg)
    if cfg.run.tensorboard:
        Scalars.check(out)
    threads = set_threads(cfg.run.threads)
    fed = federation if federation is not None else build_federation(cfg)
    label_dists = fed.label_distributions()
    model, w0, module = build_model(cfg, fed, module, loss)
    engine = cfg.run.engine  # given an executor (Flower's): the engine it serves
    if executor is None:
        engine_fed = fed.engine_federation()
        if engine_fed is not fed:  # its first slots are the clients' own data: hold them once, as views
            fed.x_train, fed.y_train = engine_fed.x_train[: len(fed.y_train)], engine_fed.y_train[: len(fed.y_train)]
            fed.x_test, fed.y_test = engine_fed.x_test[: len(fed.y_test)], engine_fed.y_test[: len(fed.y_test)]
        executor = make_executor(cfg.run.engine, engine_fed, model, cfg)
        engine = executor.name  # auto: the one it chose
    elif fed.drift is not None:
        raise UserError(
            f"config: scenario.drift = {cfg.scenario.drift!r} runs on the in-process engines; run.engine = "
            f"{engine!r} does not carry a client's data changing yet; choose auto, sequential, batched or parallel"
        )
    execute, drifting = executor.execute, None
    if fed.drift is not None:
        drifting = execute = Drifting(executor.execute, fed.drift, cfg.run.rounds)
    ask = checked(execute, fed, model)
    traffic = ask.traffic
    local = None
    if cfg.train.local_bn:
        entries = model.batchnorm_entries()
        if not len(entries):
            raise UserError(
                "config: train.local_bn = true keeps BatchNorm layers per client, but the model has "
                "none; set it false or use a model with BatchNorm"
            )
        local = LocalBatchNorm(entries, fed.n_clients, out, cfg.run.store_ram * 2**20)
        ask = local.wrap(ask)
    ctx = build_context(cfg, fed, model, w0, module, out)
    algorithm = algorithm_class(cfg.algorithm["name"])(cfg.params, ctx)
    return Built(fed, label_dists, model, module, executor, engine, ask, local, algorithm, threads, drifting, traffic)
