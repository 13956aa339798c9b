"""The round loop of a run: sample, play the round (replayed without the clients that failed),
evaluate, checkpoint; resumable at any point. What it needs is built by
:mod:`stocfl.experiment.build`, a results directory is made or reopened by
:mod:`stocfl.experiment.start` against :mod:`stocfl.experiment.provenance`, and the results
files are written by :mod:`stocfl.experiment.results`.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl.algorithms.checks import (
    check_assignments,
    check_client_models,
    check_diagnostics,
    check_labels,
    check_outputs,
)
from stocfl.client.mixture import evaluation_task
from stocfl.client.tasks import ClientsDropped, Evaluate, grouped_reasons, without_dropped
from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.errors import UserError
from stocfl.executors.pool import give_back_when_short, keep_freed_memory
from stocfl.experiment import metrics, provenance
from stocfl.experiment.build import build_run, sample_size
from stocfl.experiment.provenance import CHECKPOINT, metrics_chain
from stocfl.experiment.results import (
    client_spread,
    clients_at,
    models_used,
    place_heldout,
    summarize,
    summarize_placements,
    write_results,
)
from stocfl.storage import checkpoint, formats
from stocfl.storage.files import exclusive
from stocfl.storage.state import StateError
from stocfl.storage.tensorboard import Scalars

log = logging.getLogger("stocfl")


EVAL_MODEL_BYTES = 2**30  # the client models held at once while evaluating


def client_models_in_parts(algorithm, clients: list[int], ask):
    """``algorithm.client_models`` over ``clients`` a part at a time, so that at most
    EVAL_MODEL_BYTES of distinct models are held: Ditto's 4,800 personal models of the
    1.6M-parameter MLP are 31 GB (evaluating them at once was killed for memory)."""
    step = max(1, EVAL_MODEL_BYTES // (4 * max(1, len(algorithm.ctx.init_weights))))
    for a in range(0, len(clients), step):
        part = clients[a : a + step]
        yield part, algorithm.client_models(part, ask)


@dataclass
class Experiment:
    """A run in progress: what :func:`~stocfl.experiment.build.build_run` made, the rounds done,
    and the state after the last of them."""

    cfg: Config
    out: Path | None  # the results directory; None: everything stays in memory
    executor: Any = None  # given: an executor from outside (Flower); None: an in-process one
    federation: Federation | None = None  # given: the clients' data (the API); None: from [scenario]
    module: Any = None  # given: an nn.Module whose weights are w_0 (the API); None: from [model]
    loss: Any = None  # given: a per-sample loss(logits, y) (the API); None: cross-entropy

    def __post_init__(self):
        b = build_run(self.cfg, self.out, self.executor, self.federation, self.module, self.loss)
        self.fed, self.label_dists, self.model = b.fed, b.label_dists, b.model
        self.executor, self.engine, self.ask, self.local = b.executor, b.engine, b.ask, b.local
        self.traffic = b.traffic
        self.algorithm, self.threads, self.drifting = b.algorithm, b.threads, b.drifting
        self.sampler = np.random.default_rng([self.cfg.run.seed, 1])
        self.round = 0
        self.elapsed = 0.0
        self.metrics_chain: str | None = metrics_chain([])
        self.rows: list[dict[str, Any]] = []  # metrics rows of the rounds done
        self.saved: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}  # state after the last round
        self._digested: tuple[Config, dict[str, str]] | None = None
        self.summary_sha256: str | None = None  # of summary.json, once a finished run has written it

    # a results directory made or reopened (stocfl.experiment.start)
    @classmethod
    def create(cls, cfg: Config, out: Path | None, *args: Any, **kwargs: Any) -> Experiment:
        """A new run (:func:`stocfl.experiment.start.create`)."""
        from stocfl.experiment import start

        return start.create(cfg, out, *args, **kwargs)

    @classmethod
    def open(cls, out: Path, *args: Any, **kwargs: Any) -> Experiment:
        """A saved run, rebuilt to be read (:func:`stocfl.experiment.start.open_saved` with
        ``read_only``: nothing on its disk changes)."""
        from stocfl.experiment import start

        return start.open_saved(out, *args, read_only=True, **kwargs)

    @classmethod
    def resume(cls, out: Path, *args: Any, **kwargs: Any) -> Experiment:
        """A saved run, ready to continue (:func:`stocfl.experiment.start.resume`)."""
        from stocfl.experiment import start

        return start.resume(out, *args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The state after the last finished round, as a value in memory (what a failed round
        is replayed from) and, with a results directory, in its checkpoint file: the
        algorithm's state and, with ``train.local_bn``, the clients' own BatchNorm entries."""
        # the last state's copy goes before the new one is made: a state of gigabytes (StoCFL's
        # model-sized Psi sums) is not held three times over at the end of a round
        self.saved = {}
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
                **provenance.stamp(self.config_digests, self.metrics_chain, self.digests, self.given),
                **({"summary_sha256": self.summary_sha256} if self.summary_sha256 else {}),
            },
        )

    @property
    def given(self) -> dict[str, bool]:
        """What was given in Python instead of built from the config."""
        return {
            "federation": self.federation is not None,
            "model": self.module is not None,
            "loss": self.loss is not None,
        }

    @property
    def config_digests(self) -> dict[str, str]:
        """The config's digests, computed once per config (a resume may extend it)."""
        if self._digested is None or self._digested[0] is not self.cfg:
            self._digested = (self.cfg, provenance.config_digests(self.cfg))
        return self._digested[1]

    @functools.cached_property
    def digests(self) -> dict[str, Any]:
        """The data's digest, and the model's and loss's given in Python (:func:`provenance.digests`)."""
        return provenance.digests(self.fed, self.model, self.algorithm.ctx.init_weights, self.module, self.loss)

    def load_checkpoint(self) -> None:
        tensors, meta = checkpoint.load(self.out / CHECKPOINT)
        provenance.check_format(meta, self.out / CHECKPOINT)
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
    def sample_size(self, t: int = 1) -> int:
        return sample_size(self.cfg, self.fed, t)

    def sample(self, t: int = 1) -> list[int]:
        """m of the clients present in round ``t``, at random."""
        pool = self.fed.present(t)
        return sorted(pool[int(k)] for k in self.sampler.choice(len(pool), self.sample_size(t), replace=False))

    def play_round(
        self, t: int, sampled: list[int], arriving: list[int] = (), changed: list[int] = ()
    ) -> tuple[dict[str, Any], list[int]]:
        """The algorithm's round with the sampled clients, after it has met the clients whose
        data changed (:meth:`~stocfl.algorithms.Algorithm.drifted`) and those ``arriving`` in
        this round (:meth:`~stocfl.algorithms.Algorithm.arrive`). When clients fail, the round
        is redone without them from the state of the last checkpoint (the algorithms are
        deterministic, so the result is the round those clients would have had without them)."""
        dropped: list[int] = []
        reasons: list[str] = []
        while True:
            present = [i for i in sampled if i not in dropped]
            joining = [i for i in arriving if i not in dropped]
            moved = [i for i in changed if i not in dropped]
            if not present and not joining and not moved:
                if dropped:  # nothing was learned: never a round counted as done with no client
                    raise UserError(
                        f"round {t}: every client of the round was dropped ({grouped_reasons(reasons)}); "
                        f"{self.stopped_at()}"
                    )
                return {}, dropped
            try:
                before = {}
                if moved:
                    before.update(self.algorithm.drifted(t, moved, self.ask))
                if joining:
                    before.update(self.algorithm.arrive(t, joining, self.ask))
                diag = self.algorithm.round(t, present, self.ask) if present else {}
                if before:  # checked as the round's own are, then logged beside them
                    check_diagnostics(self.algorithm, t, before, {})
                    diag = {**before, **diag} if isinstance(diag, dict) else diag
                return diag, dropped
            except ClientsDropped as err:
                if not set(err.clients) <= set(present) | set(joining) | set(moved):
                    raise UserError(
                        f"round {t}: clients outside the round failed ({err}); resume with 'stocfl resume {self.out}'"
                    ) from None
                log.warning("round %d: dropped %s", t, err.summary())
                dropped += err.clients
                reasons += err.reasons
                self.restore_algorithm()

    def engine_counts(self) -> dict[str, int]:
        """What an executor with ``counters()`` (Flower's: node takeovers, refused claims) counted
        since the last call, for this round's row."""
        counters = getattr(self.executor, "counters", None)
        if not callable(counters):
            return {}
        now = dict(counters())
        before, self._counted = getattr(self, "_counted", {}), now
        return {k: v - before.get(k, 0) for k, v in now.items()}

    def stopped_at(self) -> str:
        """What a run stopped now keeps (the rounds done, checkpointed), and how to go on."""
        if self.out is None:
            return f"the run stops after round {self.round}"
        return (
            f"the run stops at its checkpoint of round {self.round}: remove the cause, then 'stocfl resume {self.out}'"
        )

    def restore_algorithm(self) -> None:
        """The algorithm's state as of the last finished round (the value kept in memory)."""
        tensors, meta = self.saved["algorithm"]
        self.algorithm.decode_state(tensors, json.loads(json.dumps(meta)))
        if self.local is not None:
            self.local.load_state(*self.saved["local_bn"])

    def evaluate(self, round_: int | None = None) -> dict[str, Any]:
        """Accuracy of the participating clients (those present in round ``round_``, where the
        federation has a schedule), each with the model it would use, weighted
        by test size; and of the global model on the same clients, after round ``round_`` (the
        last one done by default). Clients that fail to answer are left out of this evaluation
        (and logged)."""
        check_outputs(self.algorithm)

        def attempt(clients):
            res, gres, used = [], [], {}
            gw = self.algorithm.global_model()  # once: IFCA's is the mean of its models, formed anew per call
            for part, models in client_models_in_parts(self.algorithm, clients, self.ask):
                check_client_models(self.algorithm, part, models)
                tasks = [evaluation_task(i, w) for i, w in zip(part, models)]
                if all(w is gw for w in models):
                    r = self.ask(tasks)
                    res, gres = res + r, gres + r
                else:  # one batch of tasks, not two: over Flower, one exchange with each node, not two
                    r = self.ask(tasks + [Evaluate(i, gw) for i in part])
                    res, gres = res + r[: len(part)], gres + r[len(part) :]
                used.update(models_used(part, models, self.algorithm))
            return res, gres, used

        t = round_ or self.round
        if self.drifting is not None:  # each client on the data it holds after round t
            self.drifting.at(max(1, t))
        asked = self.fed.present(max(1, t))
        clients, (res, gres, self.last_used) = without_dropped(
            asked, attempt, f"round {t}: evaluation", none_left=f"no accuracy can be reported; {self.stopped_at()}"
        )
        self.last_eval = dict(zip(clients, res))
        self.last_global = dict(zip(clients, gres))
        out: dict[str, Any] = {"accuracy": _pooled(res), "global_accuracy": _pooled(gres)}
        if self.cfg.run.target_accuracy > 0:
            out["clients_at_target"] = clients_at(self.last_eval, self.cfg.run.target_accuracy)
        left = sorted(set(asked) - set(clients))
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
            with exclusive(self.out) if self.out is not None else contextlib.nullcontext(), keep_freed_memory():
                return self._loop(bar, scalars, lines, desc, stop_after)
        finally:
            bar.close()
            if scalars is not None:
                scalars.close()
            release = getattr(self.executor, "release", None)  # an executor from outside may have none
            if release is not None:
                release()

    def _loop(self, bar, scalars, lines: bool, desc: str, stop_after: int | None) -> dict[str, Any] | None:
        r = self.cfg.run
        while self.round < r.rounds:
            if stop_after is not None and self.round >= stop_after:
                return None
            t0 = time.perf_counter()
            t = self.round + 1
            schedule, pool, drift = self.fed.schedule, self.fed.participants, self.fed.drift
            arriving = [] if schedule is None else schedule.joining(t, pool)
            present = self.fed.present(t)
            changed = [] if drift is None else drift.changing(t, present)
            if self.drifting is not None:
                self.drifting.at(t)
            told = [i for i in changed if i not in arriving] if self.algorithm.ctx.drift_notice else []
            sent = dict(self.traffic or {})
            diag, dropped = self.play_round(t, self.sample(t), arriving, told)
            row: dict[str, Any] = {
                "round": t,
                "accuracy": None,
                "global_accuracy": None,
                "dropped": len(dropped),
                "dropped_clients": dropped,
                **self.engine_counts(),
            }
            if self.traffic is not None:  # the round's own traffic and client FLOPs, its evaluation left out
                row["bytes_down"] = self.traffic["down"] - sent["down"]
                row["bytes_up"] = self.traffic["up"] - sent["up"]
                if self.traffic.get("flops") is not None and sent.get("flops") is not None:
                    row["flops"] = self.traffic["flops"] - sent["flops"]
            if r.evaluates(t):
                row.update(self.evaluate(t))
                if drift is not None:  # each drift cohort's accuracy on the data it holds now
                    row.update(metrics.cohort_accuracy(self.last_eval, drift))
            labels = check_labels(self.algorithm)
            groups = self.fed.groups_at(t)
            row.update(metrics.clustering_scores(labels, groups, present, self.label_dists))
            if self.fed.mixtures is not None:  # a scenario of mixed clients: how far the found shares are
                weights = check_assignments(self.algorithm, labels)
                row["mixture_tv"] = metrics.mixture_distance(labels, weights, self.fed.mixtures, present)
            if schedule is not None:  # who came and went, and where this round's arrivals landed
                row.update(metrics.arrivals(labels, groups, present, arriving, schedule.leaving(t, pool)))
            if drift is not None:
                row["drifted"] = changed
            check_diagnostics(self.algorithm, t, diag, row)
            row.update(diag)
            counting = 0.0  # counting FLOPs is not the method's time
            if self.traffic is not None:
                counting = self.traffic.get("flop_seconds", 0.0) - sent.get("flop_seconds", 0.0)
            row["seconds"] = time.perf_counter() - t0 - counting
            self.elapsed += row["seconds"]
            self.rows.append(row)
            if self.out is not None:
                formats.append_jsonl(self.out / "metrics.jsonl", row)
            self.metrics_chain = metrics_chain([row], self.metrics_chain)
            self.round = t
            self.save_checkpoint()
            give_back_when_short()  # the memory kept for the next round, where the system needs it more
            if scalars is not None:
                scalars.add(row)
            bar.set_postfix_str(round_line(row), refresh=False)  # before the count moves: update() draws
            bar.update(1)
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
        # the true groups the results are scored against: with drift, the concepts at the end
        fed = self.fed if self.fed.drift is None else replace(self.fed, groups=self.fed.groups_at(self.round))
        summary = summarize(
            self.cfg,
            fed,
            self.federation is not None,
            self.algorithm,
            self.rows,
            self.round,
            self.engine,
            self.threads,
            self.elapsed,
        )
        summary.update(client_spread(self.last_eval))
        if self.cfg.run.target_accuracy > 0:
            summary["clients_at_target"] = clients_at(self.last_eval, self.cfg.run.target_accuracy)
        heldout, heldout_left = place_heldout(self.algorithm, fed, self.ask)
        if heldout or heldout_left:
            summary["heldout"] = summarize_placements(heldout, self.algorithm.placement, heldout_left)
        if self.algorithm.places_unlabeled and (heldout or heldout_left):  # test time: no labels (FLUX)
            rows, left = place_heldout(self.algorithm, fed, self.ask, unlabeled=True)
            summary["heldout_unlabeled"] = summarize_placements(rows, self.algorithm.placement_unlabeled, left)
        if self.out is not None:
            write_results(
                self.out,
                summary,
                self.rows,
                self.algorithm,
                fed,
                self.last_eval,
                heldout,
                self.last_global,
                self.last_used,
                self.cfg.run.seed,
            )
            # the summary under the checkpoint's digests: an edited summary.json is not a finished run's
            self.summary_sha256 = hashlib.sha256((self.out / "summary.json").read_bytes()).hexdigest()
            self.save_checkpoint()
        return summary


def round_line(row: dict[str, Any]) -> str:
    """A round's figures as the log shows them: accuracy when evaluated, clusters, and ARI with
    the share of participants it is computed over (4 clients placed of 400 can score ARI 1.0)."""
    parts = [] if row.get("accuracy") is None else [f"accuracy {row['accuracy']:.4f}"]
    parts.append(f"clusters {row['n_clusters']}")
    if row.get("ari") is not None:
        parts.append(f"ARI {row['ari']:.4f}")
    if row.get("mixture_tv") is not None:
        parts.append(f"mixture TV {row['mixture_tv']:.3f}")
    if row.get("coverage") is not None:
        parts.append(f"placed {row['placed']} ({100 * row['coverage']:.1f}%)")
    if row.get("ari") is None and row.get("label_cos_within") is not None:
        parts.append(f"label cos within {row['label_cos_within']:.3f} / all {row['label_cos_all']:.3f}")
    return " ".join(parts)


def _pooled(results) -> float | None:
    """Correct over samples of all results; None when no client was evaluated."""
    n = sum(r.n_samples for r in results)
    return sum(r.correct for r in results) / n if n else None
