"""The results of a run: its summary and, with a results directory, the files a reader opens.

The runner hands over the metrics rows and the algorithm; an algorithm adds its own summary
fields (``Algorithm.summary``) and figures (``Algorithm.plots``). Nothing here names an
algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl.algorithms import Algorithm
from stocfl.algorithms.checks import check_placements
from stocfl.client.mixture import Mixture, evaluation_task
from stocfl.client.tasks import without_dropped
from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.devices import describe, resolve_device
from stocfl.experiment import metrics, plots
from stocfl.storage import formats


def summarize(
    cfg: Config,
    fed: Federation,
    given_federation: bool,
    algorithm: Algorithm,
    rows: list[dict[str, Any]],
    rounds_done: int,
    engine: str,
    threads: int,
    elapsed: float,
) -> dict[str, Any]:
    """The run's final figures: the last evaluated accuracies, the last clustering scores, and
    the algorithm's own fields."""
    last_eval = next((x for x in reversed(rows) if x.get("accuracy") is not None), {})
    last = rows[-1] if rows else {}
    summary = {
        "algorithm": cfg.algorithm["name"],
        "scenario": fed.scenario if given_federation else cfg.scenario.name,
        "dataset": fed.dataset if given_federation else cfg.scenario.dataset,
        "seed": cfg.run.seed,
        "n_clients": fed.n_clients,
        "rounds": cfg.run.rounds,
        "rounds_done": rounds_done,
        "engine": engine,
        "threads": threads,
        "processor": describe(resolve_device(cfg.run.device)),
        "torch": torch.__version__,
        "accuracy": last_eval.get("accuracy"),
        "global_accuracy": last_eval.get("global_accuracy"),
        "n_clusters": last.get("n_clusters"),
        "ari": last.get("ari"),
        "nmi": last.get("nmi"),
        **({"mixture_tv": last["mixture_tv"]} if "mixture_tv" in last else {}),
        "placed": last.get("placed"),
        "participants": len(fed.participants),
        "label_cos_within": last.get("label_cos_within"),
        "label_cos_all": last.get("label_cos_all"),
        "seconds": round(elapsed, 3),
        "notes": fed.notes,
    }
    if last_eval.get("eval_left_out"):  # clients that failed to answer the last evaluation: not in its figures
        summary["eval_left_out"] = last_eval["eval_left_out"]
    if dropped := sum(r.get("dropped", 0) for r in rows):
        summary["dropped_in_training"] = dropped  # client-rounds whose training was left out of the round
    if fed.schedule is not None:
        summary["schedule"] = schedule_summary(fed, algorithm.cluster_labels(), rows, rounds_done)
    if fed.drift is not None:
        summary["drift"] = drift_summary(fed.drift, rows)
    summary.update(algorithm.summary(rows))
    return summary


RECOVERY_TOLERANCE = 0.01  # back within one point of the level before the change


def drift_summary(drift, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A drifting federation: per change round, the clients that changed and how their accuracy
    came through it (:func:`stocfl.experiment.metrics.recovery`, within RECOVERY_TOLERANCE),
    and the clients that never changed at the end."""
    cohorts = drift.cohorts
    rounds = drift.rounds
    changes = {}
    for k, r in enumerate(rounds):  # until the same clients change again (recurrent: back)
        mine = set(cohorts[str(r)])
        until = next((q for q in rounds[k + 1 :] if mine & set(cohorts[str(q)])), None)
        changes[str(r)] = {
            "clients": len(cohorts[str(r)]),
            **metrics.recovery(rows, f"accuracy_drift_{r}", r, until, RECOVERY_TOLERANCE),
        }
    steady = [r["accuracy_steady"] for r in rows if r.get("accuracy_steady") is not None]
    return {
        "pattern": drift.pattern,
        "changes": changes,
        "steady_clients": len(cohorts["steady"]),
        "steady_accuracy_at_end": steady[-1] if steady else None,
    }


def schedule_summary(fed: Federation, labels: np.ndarray, rows: list[dict[str, Any]], rounds_done: int) -> dict:
    """A federation with a schedule: the clients that joined and left in the rounds done, the
    share of the arrivals placed, and in their true group's cluster, by the end of their
    arrival round (pooled over the arrivals), and the arrivals still present in their group's
    cluster at the end (:func:`stocfl.experiment.metrics.group_cluster_share`)."""
    joined = [i for r in rows for i in r.get("joined", [])]

    def pooled(key):
        n = [(len(r["joined"]), r[key]) for r in rows if r.get(key) is not None]
        return sum(k * v for k, v in n) / sum(k for k, _ in n) if n else None

    present = fed.present(max(1, rounds_done))
    out = {
        "joined": len(joined),
        "left": sum(len(r.get("left", [])) for r in rows),
        "present_at_end": len(present),
        "joined_placed_on_arrival": pooled("joined_placed"),
        "joined_in_group_on_arrival": pooled("joined_in_group"),
    }
    if fed.groups is not None:
        still = sorted(set(joined) & set(present))
        out["joined_in_group_at_end"] = metrics.group_cluster_share(still, labels, fed.groups, present)
    return out


def place_heldout(
    algorithm: Algorithm, fed: Federation, run, unlabeled: bool = False
) -> tuple[list[dict[str, Any]], list[int]]:
    """Held-out clients as new clients: placement and test accuracy with the chosen model; and
    the held-out clients that failed to answer (left out). ``unlabeled``: placed without their
    labels (:meth:`~stocfl.algorithms.Algorithm.place_unlabeled`, for the methods that can)."""
    if not fed.heldout_clients:
        return [], []

    def attempt(clients):
        placed = (algorithm.place_unlabeled if unlabeled else algorithm.place_new)(clients, run)
        check_placements(algorithm, clients, placed)
        return placed, run([evaluation_task(p.client, p.weights) for p in placed])

    answered, (placed, res) = without_dropped(fed.heldout_clients, attempt, "held-out clients' placement")
    return placement_rows(placed, res, fed.groups, algorithm), sorted(set(fed.heldout_clients) - set(answered))


def _own_accuracies(last_eval: dict) -> list[float]:
    """Each evaluated client's accuracy with the model it uses (clients without test data left out)."""
    return [r.accuracy for r in last_eval.values() if r.n_samples]


def client_spread(last_eval: dict) -> dict[str, float | None]:
    """The per-client view of the last evaluation: the plain mean of the clients' accuracies
    (the "macro" average of the FeSEM paper; ``accuracy`` weights by test size, its "micro"),
    their 10th percentile and the worst (each with the model it uses; clients without test
    data left out)."""
    accs = _own_accuracies(last_eval)
    if not accs:
        return {"macro_accuracy": None, "accuracy_p10": None, "worst_client_accuracy": None}
    return {
        "macro_accuracy": float(np.mean(accs)),
        "accuracy_p10": float(np.percentile(accs, 10)),
        "worst_client_accuracy": float(min(accs)),
    }


def clients_at(last_eval: dict, target: float) -> float | None:
    """The share of the evaluated clients (with test data) whose accuracy with the model each
    uses reaches ``target``: FL+HC's "percentage of clients reaching the target accuracy"."""
    accs = _own_accuracies(last_eval)
    return sum(a >= target for a in accs) / len(accs) if accs else None


def models_used(clients: list[int], models: list, algorithm: Algorithm) -> dict[int, str]:
    """Which model each client was evaluated with, as clients.csv names it: ``cluster N``
    (numbered as in clusters.csv), ``global``, ``initial`` (w_0), ``own`` (a personal model) or
    ``mixture`` (FedEM's: the client's own weights over the cluster models).
    A client not yet placed, or placed by loss at evaluation (IFCA), may use another cluster's
    model than its found cluster."""
    labels = algorithm.cluster_labels()
    found = algorithm.cluster_models()
    number = metrics.cluster_numbers(labels, found)

    def key(w):  # the same memory: the same model, also where an algorithm hands out views of one tensor
        return w.data_ptr(), w.numel()

    by_memory = {}
    for k, w in sorted(found.items(), key=lambda kw: number[kw[0]], reverse=True):
        by_memory[key(w)] = f"cluster {number[k]}"  # the lowest number wins where clusters share a model
    by_memory.setdefault(key(algorithm.ctx.init_weights), "initial")
    gw = algorithm.global_model()
    by_memory[key(gw)] = "global"
    out = {}
    for i, w in zip(clients, models):
        if isinstance(w, Mixture):  # its own weights over the clusters' models
            out[i] = "mixture"
            continue
        own = found.get(int(labels[i]))
        mine = own is not None and key(own) == key(w)
        out[i] = f"cluster {number[int(labels[i])]}" if mine else by_memory.get(key(w), "own")
    return out


def client_rows(
    labels: np.ndarray, groups: np.ndarray | None, last_eval: dict, last_global: dict, used: dict[int, str]
) -> list[dict[str, Any]]:
    """clients.csv: per evaluated client its found cluster (numbered as in clusters.csv), the
    model it was evaluated with (:func:`models_used`), true group, test samples, and the
    accuracy of that model and of the global model."""
    number = metrics.cluster_numbers(labels)
    rows = []
    for i in sorted(last_eval):
        r, g = last_eval[i], last_global.get(i)
        rows.append(
            {
                "client": int(i),
                "cluster": number.get(int(labels[i]), -1),
                "model": used.get(i, ""),
                "true_group": int(groups[i]) if groups is not None else "",
                "test_samples": r.n_samples,
                "accuracy": r.accuracy,
                "global_accuracy": g.accuracy if g is not None else "",
            }
        )
    return rows


def write_results(
    out: Path,
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    algorithm: Algorithm,
    fed: Federation,
    last_eval: dict,
    heldout: list[dict[str, Any]],
    last_global: dict,
    used: dict[int, str],
    seed: int,
) -> None:
    """summary.json, clusters.csv, clients.csv, heldout.csv (if any), accuracy.png and the
    algorithm's figures."""
    labels = algorithm.cluster_labels()
    formats.write_csv(out / "clients.csv", client_rows(labels, fed.groups, last_eval, last_global, used))
    if heldout:
        formats.write_csv(out / "heldout.csv", heldout)
    formats.write_csv(out / "clusters.csv", metrics.cluster_table(labels, fed.groups, last_eval))
    title = f"{summary['scenario']} ({summary['dataset']})"
    if (reps := algorithm.representations()) is not None:  # their cosine matrix and a t-SNE embedding
        ids, vectors = reps
        g = fed.groups[ids] if fed.groups is not None else None
        number = metrics.cluster_numbers(labels)
        plots.similarity_matrix(vectors, g, out / "similarity.png", f"cosine of client representations, {title}")
        plots.embedding(
            vectors, np.array([number.get(int(k), -1) for k in labels[ids]]), g, out / "embedding.png", title, seed
        )
    algorithm.plots(out, fed.groups, title, seed)
    formats.write_json(out / "summary.json", summary)
    plots.plot_accuracy(rows, out / "accuracy.png", f"{summary['algorithm']} on {title}", true_k(fed))


def true_k(fed: Federation) -> int | None:
    """The number of true groups among the participants, where the scenario has groups."""
    return None if fed.groups is None else int(len(np.unique(fed.groups[fed.participants])))


def cluster_majority(labels: np.ndarray, groups: np.ndarray | None) -> dict[int, int]:
    """The majority true group of each found cluster's members."""
    if groups is None:
        return {}
    return {int(k): int(np.bincount(groups[labels == k]).argmax()) for k in np.unique(labels[labels >= 0])}


def placement_rows(placed, results, groups, algorithm: Algorithm) -> list[dict[str, Any]]:
    """One row per new client: cluster (numbered as in clusters.csv), cosine, would_open_new,
    accuracy, true group, and whether the cluster is its true group's (the majority true group
    of the cluster's members)."""
    labels = algorithm.cluster_labels()
    majority = cluster_majority(labels, groups)
    number = metrics.cluster_numbers(labels, algorithm.cluster_models())
    rows = []
    for p, r in zip(placed, results):
        row = {
            "client": p.client,
            "cluster": number.get(p.cluster, p.cluster),
            "cosine": p.similarity,
            "would_open_new": p.opened_new,
            "accuracy": r.accuracy,
            "correct": r.correct,
            "test_samples": r.n_samples,
        }
        if groups is not None:
            row["true_group"] = int(groups[p.client])
            row["in_true_group_cluster"] = majority.get(p.cluster) == row["true_group"]
        rows.append(row)
    return rows


def summarize_placements(rows: list[dict[str, Any]], placement: str, left_out: list[int] = ()) -> dict[str, Any]:
    n = sum(r["test_samples"] for r in rows)
    out = {
        "clients": len(rows),
        "placement": placement,
        "accuracy": sum(r["correct"] for r in rows) / n if n else None,  # no test sample: no accuracy, not 0
        "would_open_new": sum(bool(r["would_open_new"]) for r in rows),
    }
    if left_out:
        out["left_out"] = list(left_out)
    if rows and "in_true_group_cluster" in rows[0]:
        out["in_true_group_cluster"] = sum(r["in_true_group_cluster"] for r in rows) / len(rows)
    return out
