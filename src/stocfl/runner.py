"""A run: data -> scenario -> engine -> algorithm -> results on disk, resumable at any point.

Layout of a results directory::

    config.toml      the resolved config (every default filled in)
    metrics.jsonl    one line per round
    summary.json     the final figures
    checkpoint.safetensors   state after the last finished round (RNG states included)
    accuracy.png     accuracy, clusters and ARI per round
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl import checkpoint, config as config_mod, report
from stocfl.aggregation import Aggregator
from stocfl.optim import Optimizer
from stocfl.algorithms import Context, algorithm_class
from stocfl.config import Config
from stocfl.data import resolve_data_dir
from stocfl.errors import UserError
from stocfl.executors import choose_engine, make_executor, set_threads
from stocfl.files import write_atomic
from stocfl.models import FlatModel, build_module, make_model
from stocfl.scenarios import Federation, build
from stocfl.state import StateError
from stocfl.tasks import BadResult, ClientsDropped, Evaluate, check_result, without_dropped

CHECKPOINT = "checkpoint.safetensors"
log = logging.getLogger("stocfl")


def build_federation(cfg: Config) -> Federation:
    s = cfg.scenario
    return build(s.name, s.dataset, s.n_clients, s.samples_per_client, s.test_per_client,
                 seed=cfg.run.seed, alpha=s.alpha, data_dir=s.data_dir or None, holdout=s.holdout)


def build_model(cfg: Config, fed: Federation, module: Any = None, loss: Any = None
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
    """A user's loss on two train samples: one finite number per sample, differentiable."""
    x, y = fed.x_train[:2], fed.y_train[:2]
    try:
        w = w0.clone().requires_grad_(True)
        out = model.per_sample_loss(model.forward(w, x), y)
        ok = isinstance(out, torch.Tensor) and tuple(out.shape) == (len(y),) and bool(torch.isfinite(out).all())
        if ok:
            torch.autograd.grad(out.sum(), w)
    except Exception as err:  # a user's function can raise anything
        raise UserError(f"loss: calling it on the model's outputs failed ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); expected loss(logits, y) -> one value per "
                        f"sample") from None
    if not ok:
        raise UserError(f"loss: expected loss(logits, y) -> a finite tensor of shape ({len(y)},), one value per "
                        f"sample, got {getattr(out, 'shape', type(out).__name__)}")


@dataclass
class Experiment:
    cfg: Config
    out: Path | None  # the results directory; None: everything stays in memory
    executor: Any = None  # given: an executor from outside (Flower); None: an in-process one
    federation: Federation | None = None  # given: the clients' data (the API); None: from [scenario]
    module: Any = None  # given: an nn.Module whose weights are w_0 (the API); None: from [model]
    loss: Any = None  # given: a per-sample loss(logits, y) (the API); None: cross-entropy

    def __post_init__(self):
        self.threads = set_threads(self.cfg.run.threads)
        self.fed = self.federation if self.federation is not None else build_federation(self.cfg)
        self.model, w0, module = build_model(self.cfg, self.fed, self.module, self.loss)
        t = self.cfg.train
        if self.executor is not None:
            self.engine = self.cfg.run.engine
        else:
            if self.cfg.run.engine == "flower-sim":
                raise UserError("run.engine = flower-sim runs through 'stocfl run'/'stocfl resume' (Flower's simulation)")
            self.engine = choose_engine(self.cfg.run.engine, self.model.n_params, t.batch_size,
                                        float(self.fed.train_sizes.mean()))
            self.executor = make_executor(self.engine, self.fed, self.model, self.cfg.run.chunk_size)
        self.run_tasks = checked(self.executor.run, self.fed)
        ctx = Context(self.fed.n_clients, w0, t.epochs, t.batch_size, t.lr, self.cfg.run.seed,
                      self.fed.input_shape, self.fed.n_classes,
                      init_model=lambda seed: FlatModel.init_weights(copy.deepcopy(module), seed),
                      last_layer=sum(self.model.numels[self.model.n_tensors - 2: self.model.n_tensors]),
                      n_trainable=self.model.n_trainable, workdir=self.out,
                      participants=tuple(self.fed.participants), sample_size=self.sample_size(),
                      aggregator=Aggregator(**self.cfg.aggregation.model_dump()),
                      optimizer=Optimizer(t.optimizer, t.lr, t.momentum, t.weight_decay, *t.betas))
        self.algorithm = algorithm_class(self.cfg.algorithm["name"])(self.cfg.algorithm_params(), ctx)
        self.sampler = np.random.default_rng([self.cfg.run.seed, 1])
        self.round = 0
        self.elapsed = 0.0
        self.metrics_chain: str | None = metrics_chain([])
        self.config_sha256 = config_digest(self.cfg)
        self.rows: list[dict[str, Any]] = []  # metrics rows of the rounds done
        self.saved: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # state after the last round

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: Config, out: Path | None, executor: Any = None, federation: Federation | None = None,
               module: Any = None, loss: Any = None) -> "Experiment":
        if out is not None and (out / "config.toml").exists():
            raise UserError(f"{out} already holds a run; continue it with 'stocfl resume {out}' or pick another --out")
        if federation is None:
            pin_data_dir(cfg)
        exp = cls(cfg, out, executor, federation, module, loss)  # data first: a data error leaves no half-made directory
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / "config.toml", report.to_toml(cfg.to_dict()))
            write_atomic(out / "metrics.jsonl", "")
        exp.save_checkpoint()
        return exp

    @classmethod
    def open(cls, out: Path, data_dir: str | None = None, executor: Any = None, federation: Federation | None = None,
             module: Any = None, loss: Any = None) -> "Experiment":
        """A saved run, rebuilt from its config and last checkpoint (and the federation and
        module it was given in Python, if it was); nothing on disk changes."""
        path = out / "config.toml"
        if not path.is_file():
            raise UserError(f"{out} holds no run (no config.toml); start one with 'stocfl run --out {out}'")
        raw = read_config(out, data_dir)
        if not raw:
            raise UserError(f"{path} is empty; the run's configuration is lost: restore the file or start a new run")
        cfg = config_mod.validate(raw)
        has_checkpoint = (out / CHECKPOINT).exists()
        if has_checkpoint:  # before anything is built from a config that may not be the run's
            meta = checkpoint.read_meta(out / CHECKPOINT)
            stored = meta.get("config_sha256")
            if stored is not None and stored != config_digest(cfg):
                raise UserError(f"{path} does not match the run's checkpoint (edited, truncated or corrupt); "
                                f"restore it or start a new run")
            for key, given, what in (("custom_data", federation, "federation"), ("custom_model", module, "model"),
                                     ("custom_loss", loss, "loss")):
                if meta.get(key) and given is None:
                    raise UserError(f"{out} was run on a {what} given in Python; continue it from Python with "
                                    f"stocfl.resume({str(out)!r}, {what}=...)")
        exp = cls(cfg, out, executor, federation, module, loss)
        if has_checkpoint:
            exp.load_checkpoint()
        return exp

    @classmethod
    def resume(cls, out: Path, data_dir: str | None = None, executor: Any = None, federation: Federation | None = None,
               module: Any = None, loss: Any = None) -> "Experiment":
        """A saved run, ready to continue: its metrics must be the ones its checkpoint saw (rows
        after the checkpoint's round, from a kill before the checkpoint, are dropped)."""
        exp = cls.open(out, data_dir, executor, federation, module, loss)
        rows = report.read_jsonl(out / "metrics.jsonl")
        kept = rows[: exp.round]
        if [r.get("round") for r in kept] != list(range(1, exp.round + 1)) or (
                exp.metrics_chain is not None and metrics_chain(kept) != exp.metrics_chain):
            raise UserError(f"{out}/metrics.jsonl does not match the run's checkpoint at round {exp.round} (rows "
                            f"missing, edited or corrupt); restore it or start a new run")
        if exp.metrics_chain is None:
            exp.metrics_chain = metrics_chain(kept)
        if len(rows) != len(kept):
            report.write_jsonl(out / "metrics.jsonl", kept)
        exp.rows = kept
        return exp

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The state after the last finished round, as a value in memory (what a failed round
        is replayed from) and, with a results directory, in its checkpoint file."""
        tensors, meta = self.algorithm.encode_state()
        self.saved = (tensors, json.loads(json.dumps(meta)))
        if self.out is None:
            return
        checkpoint.save(self.out / CHECKPOINT, {f"algorithm/{k}": v for k, v in tensors.items()}, {
            "round": self.round,
            "elapsed": self.elapsed,
            "sampler": self.sampler.bit_generator.state,
            "algorithm": meta,
            "config_sha256": self.config_sha256,
            "metrics_sha256": self.metrics_chain,
            **({"custom_data": True} if self.federation is not None else {}),
            **({"custom_model": True} if self.module is not None else {}),
            **({"custom_loss": True} if self.loss is not None else {}),
        })

    def load_checkpoint(self) -> None:
        tensors, meta = checkpoint.load(self.out / CHECKPOINT)
        prefix = "algorithm/"
        self.saved = ({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, meta["algorithm"])
        try:
            self.restore_algorithm()
        except StateError as err:
            raise UserError(f"checkpoint {self.out / CHECKPOINT} does not fit this version of stocfl ({err}); "
                            f"start a new run") from None
        self.sampler.bit_generator.state = meta["sampler"]
        self.round = meta["round"]
        self.elapsed = meta["elapsed"]
        self.metrics_chain = meta.get("metrics_sha256")  # None: a checkpoint from before checksums

    # ---- the loop -----------------------------------------------------------------------
    def sample_size(self) -> int:
        """m = ceil(rate * N) of the participating clients."""
        pool = len(self.fed.participants)
        return min(pool, math.ceil(self.cfg.run.sample_rate * pool))

    def sample(self) -> list[int]:
        pool = self.fed.participants
        return sorted(pool[int(k)] for k in self.sampler.choice(len(pool), self.sample_size(), replace=False))

    def play_round(self, t: int, sampled: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The algorithm's round with the sampled clients. When clients fail, the round is redone
        without them from the state of the last checkpoint (the algorithms are deterministic,
        so the result is the round those clients would have had without them)."""
        dropped: list[int] = []
        while True:
            present = [i for i in sampled if i not in dropped]
            if not present:
                return {}, dropped
            try:
                return self.algorithm.round(t, present, self.run_tasks), dropped
            except ClientsDropped as err:
                if not set(err.clients) <= set(present):
                    raise UserError(f"round {t}: clients outside the round failed ({err}); "
                                    f"resume with 'stocfl resume {self.out}'") from None
                for reason in err.reasons:
                    log.warning("round %d: dropped %s", t, reason)
                dropped += err.clients
                self.restore_algorithm()

    def restore_algorithm(self) -> None:
        """The algorithm's state as of the last finished round (the value kept in memory)."""
        tensors, meta = self.saved
        self.algorithm.decode_state(tensors, json.loads(json.dumps(meta)))

    def evaluate(self) -> dict[str, float]:
        """Accuracy of the participating clients, each with the model it would use, weighted
        by test size; and of the global model on the same clients. Clients that fail to answer
        are left out of this evaluation."""
        def attempt(clients):
            models = self.algorithm.client_models(clients, self.run_tasks)
            res = self.run_tasks([Evaluate(i, w) for i, w in zip(clients, models)])
            gw = self.algorithm.global_model()
            return res, res if all(w is gw for w in models) else self.run_tasks([Evaluate(i, gw) for i in clients])

        clients, (res, gres) = without_dropped(self.fed.participants, attempt)
        self.last_eval = dict(zip(clients, res))
        return {"accuracy": _pooled(res), "global_accuracy": _pooled(gres)}

    def place_heldout(self) -> list[dict[str, Any]]:
        """Held-out clients as new clients: placement and test accuracy with the chosen model."""
        clients = self.fed.heldout_clients
        if not clients:
            return []
        def attempt(clients):
            placed = self.algorithm.place_new(clients, self.run_tasks)
            return placed, self.run_tasks([Evaluate(p.client, p.weights) for p in placed])

        _, (placed, res) = without_dropped(clients, attempt)
        return placement_rows(placed, res, self.fed.groups, cluster_majority(self.algorithm.cluster_labels(),
                                                                             self.fed.groups))

    def run(self, progress: bool = True, stop_after: int | None = None) -> dict[str, Any] | None:
        """Run to ``run.rounds`` and write the summary; with ``stop_after``, stop once that many
        rounds are done (checkpointed, no summary), as a kill would, and return None."""
        from tqdm import tqdm

        r = self.cfg.run
        bar = tqdm(total=r.rounds, initial=self.round, disable=None if progress else True,
                   desc=f"{self.cfg.algorithm['name']} on {self.cfg.scenario.name}", unit="round")
        while self.round < r.rounds:
            if stop_after is not None and self.round >= stop_after:
                bar.close()
                return None
            t0 = time.perf_counter()
            t = self.round + 1
            diag, dropped = self.play_round(t, self.sample())
            row: dict[str, Any] = {"round": t, "accuracy": None, "global_accuracy": None,
                                   "dropped": len(dropped), "dropped_clients": dropped}
            if t % r.eval_every == 0 or t == r.rounds:
                row.update(self.evaluate())
            row.update(report.clustering_scores(self.algorithm.cluster_labels(), self.fed.groups, self.fed.participants))
            row.update(diag)
            row["seconds"] = time.perf_counter() - t0
            self.elapsed += row["seconds"]
            self.rows.append(row)
            if self.out is not None:
                report.append_jsonl(self.out / "metrics.jsonl", row)
            self.metrics_chain = metrics_chain([row], self.metrics_chain)
            self.round = t
            self.save_checkpoint()
            bar.update(1)
            if row["accuracy"] is not None:
                bar.set_postfix(acc=f"{row['accuracy']:.3f}", clusters=row["n_clusters"])
        bar.close()
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """The summary of a finished run; with a results directory, every results file too."""
        if not hasattr(self, "last_eval"):
            self.evaluate()
        rows = self.rows
        last_eval = next((x for x in reversed(rows) if x.get("accuracy") is not None), {})
        last = rows[-1] if rows else {}
        s = self.cfg
        summary = {
            "algorithm": s.algorithm["name"], "scenario": self.fed.scenario if self.federation is not None else
            s.scenario.name, "dataset": self.fed.dataset if self.federation is not None else s.scenario.dataset,
            "seed": s.run.seed, "n_clients": self.fed.n_clients, "rounds": s.run.rounds,
            "rounds_done": self.round, "engine": self.engine, "threads": self.threads,
            "accuracy": last_eval.get("accuracy"), "global_accuracy": last_eval.get("global_accuracy"),
            "n_clusters": last.get("n_clusters"), "ari": last.get("ari"), "nmi": last.get("nmi"),
            "placed": last.get("placed"), "participants": len(self.fed.participants),
            "seconds": round(self.elapsed, 3), "notes": self.fed.notes,
        }
        summary.update(self.algorithm.summary(rows))  # the algorithm's own final figures
        heldout = self.place_heldout()
        if heldout:
            summary["heldout"] = summarize_placements(heldout)
        labels = self.algorithm.cluster_labels()
        reps = self.algorithm.representations()
        if self.out is not None:
            if heldout:
                report.write_csv(self.out / "heldout.csv", heldout)
            report.write_csv(self.out / "clusters.csv", report.cluster_table(labels, self.fed.groups, self.last_eval))
            if reps is not None:
                self.plot_representations(*reps, labels)
            report.write_json(self.out / "summary.json", summary)
            report.plot_accuracy(rows, self.out / "accuracy.png",
                                 f"{summary['algorithm']} on {summary['scenario']} ({summary['dataset']})")
        return summary

    def plot_representations(self, ids: list[int], reps: torch.Tensor, labels: np.ndarray) -> None:
        from stocfl import plots

        groups = self.fed.groups[ids] if self.fed.groups is not None else None
        name = f"{self.cfg.scenario.name} ({self.cfg.scenario.dataset})"
        plots.similarity_matrix(reps, groups, self.out / "similarity.png", f"cosine of Psi, {name}")
        plots.embedding(reps, labels[ids], groups, self.out / "embedding.png", name, self.cfg.run.seed)


def checked(run, fed: Federation):
    """``run`` (an executor's) with every result checked against its task and the client's
    sizes (:func:`stocfl.tasks.check_result`) before any algorithm sees it: the clients with a
    bad result are dropped (:class:`ClientsDropped`, counted in metrics.jsonl), whatever the
    engine."""
    train, test = fed.train_sizes, fed.test_sizes

    def run_checked(tasks):
        out, why = [], {}
        for t, r in zip(tasks, run(tasks)):
            try:
                out.append(check_result(t, r, int(train[t.client]), int(test[t.client])))
            except BadResult as err:
                why.setdefault(t.client, f"client {t.client}: bad reply ({err})")
        if why:
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        return out

    return run_checked


def check_model_fits(model: FlatModel, w0: torch.Tensor, fed: Federation, name: str) -> None:
    """One forward pass on one train sample: the model must take the data's inputs and give
    one logit per class, before a round runs."""
    x = fed.x_train[:1]
    try:
        with torch.no_grad():
            out = model.forward(w0, x)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"config: model.name = {name!r} does not fit {fed.dataset} inputs of shape "
                        f"{tuple(x.shape[1:])} ({first}); pick a model for this data") from None
    if tuple(out.shape) != (1, fed.n_classes):
        raise UserError(f"config: model.name = {name!r} gives outputs of shape {tuple(out.shape[1:])} on "
                        f"{fed.dataset}, which has {fed.n_classes} classes; pick a model for this data")


def config_digest(cfg: Config) -> str:
    """SHA-256 of the resolved config, the data directory left out (data may move)."""
    d = cfg.to_dict()
    d["scenario"] = {k: v for k, v in d["scenario"].items() if k != "data_dir"}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def metrics_chain(rows: list[dict[str, Any]], start: str | None = None) -> str:
    """A hash chain over metrics rows as written (one JSON line each): the checkpoint stores
    the chain of the rows it saw, so that resume can tell an edited or cut metrics file."""
    h = start or hashlib.sha256(b"stocfl metrics").hexdigest()
    for r in rows:
        h = hashlib.sha256((h + report.json_line(r)).encode()).hexdigest()
    return h


def pin_data_dir(cfg: Config) -> None:
    """Write the data directory in use ($STOCFL_DATA_DIR included) into the config as an
    absolute path, so that a resume, a new-client query or a Flower client finds the same data."""
    if cfg.scenario.data_dir or resolve_data_dir(None):
        cfg.scenario.data_dir = str(resolve_data_dir(cfg.scenario.data_dir).resolve())


def read_config(out: Path, data_dir: str | None = None) -> dict[str, Any]:
    try:
        raw = tomllib.loads((out / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"{out}/config.toml is unreadable ({err}); it is not a stocfl results directory") from None
    if data_dir is not None:
        raw.setdefault("scenario", {})["data_dir"] = str(Path(data_dir).resolve())
    return raw


def _pooled(results) -> float | None:
    """Correct over samples of all results; None when no client was evaluated."""
    n = sum(r.n_samples for r in results)
    return sum(r.correct for r in results) / n if n else None


def cluster_majority(labels: np.ndarray, groups: np.ndarray | None) -> dict[int, int]:
    """The majority true group of each found cluster's members."""
    if groups is None:
        return {}
    return {int(k): int(np.bincount(groups[labels == k]).argmax()) for k in np.unique(labels[labels >= 0])}


def placement_rows(placed, results, groups, majority: dict[int, int]) -> list[dict[str, Any]]:
    """One row per new client: cluster, cosine, opened_new, accuracy, true group, and whether
    the cluster is its true group's (``majority``: the majority true group of each cluster)."""
    rows = []
    for p, r in zip(placed, results):
        row = {"client": p.client, "cluster": p.cluster, "similarity": p.similarity, "opened_new": p.opened_new,
               "accuracy": r.accuracy, "correct": r.correct, "test_samples": r.n_samples}
        if groups is not None:
            row["true_group"] = int(groups[p.client])
            row["in_true_group_cluster"] = majority.get(p.cluster) == row["true_group"]
        rows.append(row)
    return rows


def summarize_placements(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(r["test_samples"] for r in rows)
    out = {"clients": len(rows), "accuracy": sum(r["correct"] for r in rows) / n if n else 0.0,
           "opened_new": sum(bool(r["opened_new"]) for r in rows)}
    if rows and "in_true_group_cluster" in rows[0]:
        out["in_true_group_cluster"] = sum(r["in_true_group_cluster"] for r in rows) / len(rows)
    return out
