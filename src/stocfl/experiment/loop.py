"""The round loop of a run: sample, play the round (replayed without the clients that failed),
evaluate, checkpoint; resumable at any point. What it needs is made by :mod:`stocfl.experiment.build`; the
results files are written by :mod:`stocfl.experiment.results`.

Layout of a results directory::

    config.toml      the resolved config (every default filled in)
    metrics.jsonl    one line per round
    summary.json     the final figures
    checkpoint.safetensors   state after the last finished round (RNG states included)
    accuracy.png     accuracy, clusters and ARI per round
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl import config as config_mod
from stocfl.algorithms import algorithm_class
from stocfl.algorithms.checks import check_client_models, check_diagnostics, check_labels, check_outputs
from stocfl.client.tasks import ClientsDropped, Evaluate, without_dropped
from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.errors import UserError
from stocfl.executors import make_executor, set_threads
from stocfl.executors.localbn import LocalBatchNorm
from stocfl.experiment import metrics
from stocfl.experiment.build import (
    build_context,
    build_federation,
    build_model,
    checked,
    pin_data_dir,
    read_config,
    sample_size,
)
from stocfl.experiment.results import (
    client_spread,
    models_used,
    place_heldout,
    summarize,
    summarize_placements,
    write_results,
)
from stocfl.storage import checkpoint, formats
from stocfl.storage.files import exclusive, write_atomic
from stocfl.storage.state import StateError
from stocfl.storage.tensorboard import Scalars

CHECKPOINT = "checkpoint.safetensors"
log = logging.getLogger("stocfl")


EVAL_MODEL_BYTES = 2**30  # the client models held at once while evaluating


def client_models_in_parts(algorithm, clients: list[int], run):
    """``algorithm.client_models`` over ``clients`` a part at a time, so that at most
    EVAL_MODEL_BYTES of distinct models are held: Ditto's 4,800 personal models of the
    1.6M-parameter MLP are 31 GB (evaluating them at once was killed for memory)."""
    step = max(1, EVAL_MODEL_BYTES // (4 * max(1, len(algorithm.ctx.init_weights))))
    for a in range(0, len(clients), step):
        part = clients[a : a + step]
        yield part, algorithm.client_models(part, run)


def _refuse_a_run_in(out: Path) -> None:
    if (out / "config.toml").exists():
        raise UserError(f"{out} already holds a run; continue it with 'stocfl resume {out}' or pick another --out")


@dataclass
class Experiment:
    cfg: Config
    out: Path | None  # the results directory; None: everything stays in memory
    executor: Any = None  # given: an executor from outside (Flower); None: an in-process one
    federation: Federation | None = None  # given: the clients' data (the API); None: from [scenario]
    module: Any = None  # given: an nn.Module whose weights are w_0 (the API); None: from [model]
    loss: Any = None  # given: a per-sample loss(logits, y) (the API); None: cross-entropy

    def __post_init__(self):
        if self.cfg.run.tensorboard:
            Scalars.check(self.out)
        self.threads = set_threads(self.cfg.run.threads)
        self.fed = self.federation if self.federation is not None else build_federation(self.cfg)
        self.label_dists = self.fed.label_distributions()
        self.model, w0, module = build_model(self.cfg, self.fed, self.module, self.loss)
        self.engine = self.cfg.run.engine  # given an executor (Flower's): the engine it serves
        if self.executor is None:
            self.executor = make_executor(self.cfg.run.engine, self.fed, self.model, self.cfg)
            self.engine = self.executor.name  # auto: the one it chose
        self.run_tasks = checked(self.executor.run, self.fed)
        self.local: LocalBatchNorm | None = None
        if self.cfg.train.local_bn:
            entries = self.model.batchnorm_entries()
            if not len(entries):
                raise UserError(
                    "config: train.local_bn = true keeps BatchNorm layers per client, but the model has "
                    "none; set it false or use a model with BatchNorm"
                )
            self.local = LocalBatchNorm(entries, self.fed.n_clients, self.out)
            self.run_tasks = self.local.wrap(self.run_tasks)
        ctx = build_context(self.cfg, self.fed, self.model, w0, module, self.out)
        self.algorithm = algorithm_class(self.cfg.algorithm["name"])(self.cfg.algorithm_params(), ctx)
        self.sampler = np.random.default_rng([self.cfg.run.seed, 1])
        self.round = 0
        self.elapsed = 0.0
        self.metrics_chain: str | None = metrics_chain([])
        self.config_sha256 = config_digest(self.cfg)
        self.rows: list[dict[str, Any]] = []  # metrics rows of the rounds done
        self.saved: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}  # state after the last round

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        cfg: Config,
        out: Path | None,
        executor: Any = None,
        federation: Federation | None = None,
        module: Any = None,
        loss: Any = None,
    ) -> Experiment:
        if out is not None:
            _refuse_a_run_in(out)
        if federation is None:
            pin_data_dir(cfg)
        exp = cls(
            cfg, out, executor, federation, module, loss
        )  # data first: a data error leaves no half-made directory
        if out is None:
            exp.save_checkpoint()
            return exp
        out.mkdir(parents=True, exist_ok=True)
        with exclusive(out):
            _refuse_a_run_in(out)  # another process may have made one meanwhile
            write_atomic(out / "config.toml", formats.to_toml(cfg.to_dict()))
            write_atomic(out / "metrics.jsonl", "")
            exp.save_checkpoint()
        return exp

    @classmethod
    def open(
        cls,
        out: Path,
        data_dir: str | None = None,
        executor: Any = None,
        federation: Federation | None = None,
        module: Any = None,
        loss: Any = None,
        overrides: list[str] = (),
    ) -> Experiment:
        """A saved run, rebuilt from its config and last checkpoint (and the federation and
        module it was given in Python, if it was). ``overrides`` (``run.rounds=N``,
        ``run.eval_every=K``: keys that change nothing computed so far) are written into its
        config.toml; otherwise nothing on disk changes."""
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
            core, stored = meta.get("config_core_sha256"), meta.get("config_sha256")
            if (core is not None and core != config_digest(cfg, core=True)) or (
                core is None and stored is not None and stored != config_digest(cfg)
            ):
                raise UserError(
                    f"{path} does not match the run's checkpoint (edited, truncated or corrupt); "
                    f"restore it or start a new run"
                )
            for key, given, what in (
                ("custom_data", federation, "federation"),
                ("custom_model", module, "model"),
                ("custom_loss", loss, "loss"),
            ):
                if meta.get(key) and given is None:
                    raise UserError(
                        f"{out} was run on a {what} given in Python; continue it from Python with "
                        f"stocfl.resume({str(out)!r}, {what}=...)"
                    )
        if overrides:
            with exclusive(out):
                cfg = extended(cfg, overrides, meta["round"] if has_checkpoint else 0, out)
        exp = cls(cfg, out, executor, federation, module, loss)
        if has_checkpoint:
            exp.check_given(meta)
            exp.load_checkpoint()
        return exp

    @classmethod
    def resume(
        cls,
        out: Path,
        data_dir: str | None = None,
        executor: Any = None,
        federation: Federation | None = None,
        module: Any = None,
        loss: Any = None,
        overrides: list[str] = (),
    ) -> Experiment:
        """A saved run, ready to continue: its metrics must be the ones its checkpoint saw (rows
        after the checkpoint's round, from a kill before the checkpoint, are dropped).
        ``overrides``: as for :meth:`open` (``run.rounds=N`` extends a finished run)."""
        if (out / "config.toml").is_file() and not (out / CHECKPOINT).exists():
            raise UserError(
                f"{out} has no checkpoint ({CHECKPOINT}), so there is nothing to continue from; start "
                f"the run again into a new directory"
            )
        with exclusive(out) if out.is_dir() else contextlib.nullcontext():  # not read while another process writes
            return cls._resumed(out, cls.open(out, data_dir, executor, federation, module, loss, overrides))

    @staticmethod
    def _resumed(out: Path, exp: Experiment) -> Experiment:
        rows = formats.read_jsonl(out / "metrics.jsonl")
        kept = rows[: exp.round]
        if [r.get("round") for r in kept] != list(range(1, exp.round + 1)) or (
            exp.metrics_chain is not None and metrics_chain(kept) != exp.metrics_chain
        ):
            raise UserError(
                f"{out}/metrics.jsonl does not match the run's checkpoint at round {exp.round} (rows "
                f"missing, edited or corrupt); restore it or start a new run"
            )
        if exp.metrics_chain is None:
            exp.metrics_chain = metrics_chain(kept)
        if len(rows) != len(kept):
            formats.write_jsonl(out / "metrics.jsonl", kept)
        exp.rows = kept
        return exp

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The state after the last finished round, as a value in memory (what a failed round
        is replayed from) and, with a results directory, in its checkpoint file: the
        algorithm's state and, with ``train.local_bn``, the clients' own BatchNorm entries."""
        parts = {"algorithm": self.algorithm.encode_state()}
        if self.local is not None:
            parts["local_bn"] = self.local.state()
        self.saved = {k: (t, json.loads(json.dumps(m))) for k, (t, m) in parts.items()}
        if self.out is None:
            return
        checkpoint.save(
            self.out / CHECKPOINT,
            {f"{p}/{k}": v for p, (t, _) in parts.items() for k, v in t.items()},
            {
                "round": self.round,
                "elapsed": self.elapsed,
                "sampler": self.sampler.bit_generator.state,
                **{p: m for p, (_, m) in parts.items()},
                "config_sha256": self.config_sha256,
                "config_core_sha256": config_digest(self.cfg, core=True),
                "metrics_sha256": self.metrics_chain,
                "data_sha256": self.digests["data_sha256"],
                **({"custom_data": True} if self.federation is not None else {}),
                **(
                    {"custom_model": True, "model_sha256": self.digests["model_sha256"]}
                    if self.module is not None
                    else {}
                ),
                **({"custom_loss": True, "loss_probe": self.digests["loss_probe"]} if self.loss is not None else {}),
            },
        )

    @functools.cached_property
    def digests(self) -> dict[str, Any]:
        """What identifies the run's data (built from its config or given in Python), and the
        model and loss given in Python: the sha256 of the data, and of the model's parameter
        names and shapes with w_0 (StoCFL's Psi and FeSEM's start use w_0 in later rounds); a
        loss, which has no digest, by its values on four train samples at w_0."""
        w0 = self.algorithm.ctx.init_weights
        model = probe = None
        if self.module is not None:
            layout = [(k, tuple(v.shape), str(v.dtype)) for k, v in self.module.state_dict().items()]
            model = hashlib.sha256(repr(layout).encode() + w0.detach().cpu().numpy().tobytes()).hexdigest()
        if self.loss is not None:
            with torch.no_grad():
                x, y = self.fed.x_train[:4], self.fed.y_train[:4]
                probe = [float(v) for v in self.model.per_sample_loss(self.model.forward(w0, x), y)]
        return {"data_sha256": self.fed.digest(), "model_sha256": model, "loss_probe": probe}

    def check_given(self, meta: dict[str, Any]) -> None:
        """A run continues only on the data it started on, and on the model and loss it was
        given in Python (checkpoints written before these digests are taken as they are)."""
        mine = self.digests
        if meta.get("data_sha256") not in (None, mine["data_sha256"]):
            if self.federation is not None:
                raise UserError(
                    f"{self.out}: the federation given is not the one the run started on (its data, clients "
                    f"or classes differ); pass the same Federation to stocfl.resume, or start a new run"
                )
            raise UserError(
                f"{self.out}: the data built from its config ({self.cfg.scenario.dataset} in "
                f"{self.cfg.scenario.data_dir or 'the package'}) differ from the data the run started on; "
                f"point --data-dir at the run's copy of the data set, or start a new run"
            )
        if meta.get("model_sha256") not in (None, mine["model_sha256"]):
            raise UserError(
                f"{self.out}: the model given is not the one the run started on (its parameters' names, "
                f"shapes or initial weights w_0 differ); pass the same nn.Module, initialised with the "
                f"same seed, to stocfl.resume, or start a new run"
            )
        probe, mine_probe = meta.get("loss_probe"), mine["loss_probe"]
        if probe is not None and mine_probe is not None and not np.allclose(probe, mine_probe, rtol=1e-4, atol=1e-6):
            raise UserError(
                f"{self.out}: the loss given is not the one the run started on (on the same samples and "
                f"w_0 it gives {mine_probe[0]:.6g}, the run's gave {probe[0]:.6g}); pass the same loss to "
                f"stocfl.resume, or start a new run"
            )

    def load_checkpoint(self) -> None:
        tensors, meta = checkpoint.load(self.out / CHECKPOINT)
        names = ["algorithm"] + (["local_bn"] if self.local is not None else [])
        self.saved = {
            p: ({k[len(p) + 1 :]: v for k, v in tensors.items() if k.startswith(p + "/")}, meta.get(p)) for p in names
        }
        try:
            self.restore_algorithm()
        except (StateError, KeyError, TypeError) as err:
            raise UserError(
                f"checkpoint {self.out / CHECKPOINT} does not fit this version of stocfl ({err}); start a new run"
            ) from None
        self.sampler.bit_generator.state = meta["sampler"]
        self.round = meta["round"]
        self.elapsed = meta["elapsed"]
        self.metrics_chain = meta.get("metrics_sha256")  # None: a checkpoint from before checksums

    # ---- the loop -----------------------------------------------------------------------
    def sample_size(self) -> int:
        return sample_size(self.cfg, self.fed)

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
                    raise UserError(
                        f"round {t}: clients outside the round failed ({err}); resume with 'stocfl resume {self.out}'"
                    ) from None
                log.warning("round %d: dropped %s", t, err.summary())
                dropped += err.clients
                self.restore_algorithm()

    def restore_algorithm(self) -> None:
        """The algorithm's state as of the last finished round (the value kept in memory)."""
        tensors, meta = self.saved["algorithm"]
        self.algorithm.decode_state(tensors, json.loads(json.dumps(meta)))
        if self.local is not None:
            self.local.load_state(*self.saved["local_bn"])

    def evaluate(self, round_: int | None = None) -> dict[str, Any]:
        """Accuracy of the participating clients, each with the model it would use, weighted
        by test size; and of the global model on the same clients, after round ``round_`` (the
        last one done by default). Clients that fail to answer are left out of this evaluation
        (and logged)."""
        check_outputs(self.algorithm)

        def attempt(clients):
            res, gres, used = [], [], {}
            gw = self.algorithm.global_model()  # once: IFCA's is the mean of its models, formed anew per call
            for part, models in client_models_in_parts(self.algorithm, clients, self.run_tasks):
                check_client_models(self.algorithm, part, models)
                tasks = [Evaluate(i, w) for i, w in zip(part, models)]
                if all(w is gw for w in models):
                    r = self.run_tasks(tasks)
                    res, gres = res + r, gres + r
                else:  # one batch of tasks, not two: over Flower, one exchange with each node, not two
                    r = self.run_tasks(tasks + [Evaluate(i, gw) for i in part])
                    res, gres = res + r[: len(part)], gres + r[len(part) :]
                used.update(models_used(part, models, self.algorithm))
            return res, gres, used

        clients, (res, gres, self.last_used) = without_dropped(
            self.fed.participants, attempt, f"round {round_ or self.round}: evaluation"
        )
        self.last_eval = dict(zip(clients, res))
        self.last_global = dict(zip(clients, gres))
        out: dict[str, Any] = {"accuracy": _pooled(res), "global_accuracy": _pooled(gres)}
        left = sorted(set(self.fed.participants) - set(clients))
        if left:  # the figures cover the others only: said in the row and the summary, not in the log alone
            out["eval_left_out"] = left
        return out

    def run(
        self, progress: bool = True, stop_after: int | None = None, label: str | None = None
    ) -> dict[str, Any] | None:
        """Run to ``run.rounds`` and write the summary; with ``stop_after``, stop once that many
        rounds are done (checkpointed, no summary), as a kill would, and return None. ``label``
        names the run in its progress lines (a comparison's algorithm label)."""
        from tqdm import tqdm

        r = self.cfg.run
        desc = f"{label or self.cfg.algorithm['name']} on {self.cfg.scenario.name}, seed {r.seed}"
        lines = progress and not sys.stderr.isatty()  # nohup, SLURM, CI: one line per round, not a bar
        scalars = Scalars(self.out, self.round + 1) if r.tensorboard else None
        bar = tqdm(
            total=r.rounds, initial=self.round, disable=True if lines or not progress else None, desc=desc, unit="round"
        )
        try:
            with exclusive(self.out) if self.out is not None else contextlib.nullcontext():
                return self._loop(bar, scalars, lines, desc, stop_after)
        finally:
            bar.close()
            if scalars is not None:
                scalars.close()

    def _loop(self, bar, scalars, lines: bool, desc: str, stop_after: int | None) -> dict[str, Any] | None:
        r = self.cfg.run
        while self.round < r.rounds:
            if stop_after is not None and self.round >= stop_after:
                return None
            t0 = time.perf_counter()
            t = self.round + 1
            diag, dropped = self.play_round(t, self.sample())
            row: dict[str, Any] = {
                "round": t,
                "accuracy": None,
                "global_accuracy": None,
                "dropped": len(dropped),
                "dropped_clients": dropped,
            }
            if t % r.eval_every == 0 or t == r.rounds:
                row.update(self.evaluate(t))
            row.update(
                metrics.clustering_scores(
                    check_labels(self.algorithm), self.fed.groups, self.fed.participants, self.label_dists
                )
            )
            check_diagnostics(self.algorithm, t, diag, row)
            row.update(diag)
            row["seconds"] = time.perf_counter() - t0
            self.elapsed += row["seconds"]
            self.rows.append(row)
            if self.out is not None:
                formats.append_jsonl(self.out / "metrics.jsonl", row)
            self.metrics_chain = metrics_chain([row], self.metrics_chain)
            self.round = t
            self.save_checkpoint()
            if scalars is not None:
                scalars.add(row)
            bar.update(1)
            bar.set_postfix_str(round_line(row), refresh=False)
            if lines:
                print(
                    f"{desc}: round {t}/{r.rounds} {round_line(row)} ({row['seconds']:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """The summary of a finished run; with a results directory, every results file too."""
        if not hasattr(self, "last_eval"):
            self.evaluate()
        summary = summarize(
            self.cfg,
            self.fed,
            self.federation is not None,
            self.algorithm,
            self.rows,
            self.round,
            self.engine,
            self.threads,
            self.elapsed,
        )
        summary.update(client_spread(self.last_eval))
        heldout, heldout_left = place_heldout(self.algorithm, self.fed, self.run_tasks)
        if heldout or heldout_left:
            summary["heldout"] = summarize_placements(heldout, self.algorithm.placement, heldout_left)
        if self.out is not None:
            write_results(
                self.out,
                summary,
                self.rows,
                self.algorithm,
                self.fed,
                self.last_eval,
                heldout,
                self.last_global,
                self.last_used,
                self.cfg.run.seed,
            )
        return summary


def round_line(row: dict[str, Any]) -> str:
    """A round's figures as the log shows them: accuracy when evaluated, clusters, and ARI with
    the share of participants it is computed over (4 clients placed of 400 can score ARI 1.0)."""
    parts = [] if row.get("accuracy") is None else [f"accuracy {row['accuracy']:.4f}"]
    parts.append(f"clusters {row['n_clusters']}")
    if row.get("ari") is not None:
        parts.append(f"ARI {row['ari']:.4f}")
    if row.get("coverage") is not None:
        parts.append(f"placed {row['placed']} ({100 * row['coverage']:.1f}%)")
    if row.get("ari") is None and row.get("label_cos_within") is not None:
        parts.append(f"label cos within {row['label_cos_within']:.3f} / all {row['label_cos_all']:.3f}")
    return " ".join(parts)


def finished_summary(out: Path) -> dict[str, Any] | None:
    """The summary of the run in ``out`` when it has done every round of its config, else None.
    A finished run whose checkpoint was left behind (to carry its results off a machine) is
    still finished: its summary, metrics and clients hold its numbers."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        rounds = read_config(out)["run"]["rounds"]
        meta = (
            checkpoint.read_meta(out / CHECKPOINT)
            if (out / CHECKPOINT).exists()
            else {"round": summary.get("rounds_done")}
        )
    except Exception:  # noqa: BLE001 - anything unreadable: not a finished run; resume says what is wrong
        return None
    if any(meta.get(k) for k in ("custom_data", "custom_model", "custom_loss")):
        return None  # run from Python: resume names what it needs
    return summary if summary.get("rounds_done") == summary.get("rounds") == rounds == meta.get("round") else None


# Keys a resumed run may change: they change nothing computed in the rounds already done (and
# leave the checkpoint's core digest as it was before they existed).
EXTENDABLE = ("run.rounds", "run.eval_every", "run.tensorboard")


# Keys added after checkpoints began to store a digest of the whole config, with the default
# that reproduces the behaviour before them.
ADDED_KEYS = {
    "run.tensorboard": False,
    "algorithm.cluster_start": "global",
    "algorithm.cluster_warmup": 0,
    "algorithm.chain": False,
}


def config_digest(cfg: Config, core: bool = False) -> str:
    """SHA-256 of the resolved config, the data directory left out (data may move); ``core``:
    the keys in :data:`EXTENDABLE` left out as well."""
    d = cfg.to_dict()
    d["scenario"] = {k: v for k, v in d["scenario"].items() if k != "data_dir"}
    for key, default in ADDED_KEYS.items():  # at its default, a newer key leaves an older run's digest as it was
        section, name = key.split(".")
        if d[section].get(name) == default:
            d[section].pop(name)
    if core:
        d["run"] = {k: v for k, v in d["run"].items() if f"run.{k}" not in EXTENDABLE}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def extended(cfg: Config, overrides: list[str], done: int, out: Path) -> Config:
    """``cfg`` with ``overrides`` of :data:`EXTENDABLE` keys applied, written to ``out``'s
    config.toml. Other keys, or fewer rounds than are done, are refused in one line."""
    raw = cfg.to_dict()
    for item in overrides:
        parts, value = config_mod.parse_override(item)
        key = ".".join(parts)
        if key not in EXTENDABLE:
            raise UserError(
                f"resume --set {item!r}: a resumed run may change only {', '.join(EXTENDABLE)}; other "
                f"keys would change what it computed: start a new run with 'stocfl run'"
            )
        raw["run"][parts[1]] = value
    new = config_mod.validate(raw)
    if new.run.rounds < done:
        raise UserError(
            f"resume --set run.rounds={new.run.rounds}: the run has done {done} rounds already; ask for {done} or more"
        )
    write_atomic(out / "config.toml", formats.to_toml(new.to_dict()))
    return new


def metrics_chain(rows: list[dict[str, Any]], start: str | None = None) -> str:
    """A hash chain over metrics rows as written (one JSON line each): the checkpoint stores
    the chain of the rows it saw, so that resume can tell an edited or cut metrics file."""
    h = start or hashlib.sha256(b"stocfl metrics").hexdigest()
    for r in rows:
        h = hashlib.sha256((h + formats.json_line(r)).encode()).hexdigest()
    return h


def _pooled(results) -> float | None:
    """Correct over samples of all results; None when no client was evaluated."""
    n = sum(r.n_samples for r in results)
    return sum(r.correct for r in results) / n if n else None
