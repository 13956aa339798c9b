"""``stocfl reproduce TABLE``: a paper's table as a declared set of runs, with the paper's
numbers beside ours.

A table is a TOML file in ``reproductions/`` (``TABLE.toml``): a title, the paper it comes
from, a config in ``configs/``, notes on where our setting differs, and one ``[[run]]`` per
row (``name``, ``set`` overrides, the paper's ``[mean, std]``). Every (row, seed) is an
ordinary run directory under ``reproductions/runs/TABLE/``, so a stopped reproduction goes on
where it stopped: finished runs are read, stopped ones resumed, and a directory that holds a
run of another config is refused. ``TABLE.md`` and ``TABLE.json`` are rewritten after every
run, so what has finished is on disk while the rest runs.
"""

from __future__ import annotations

import json
import platform
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stocfl import config
from stocfl.compare import run_or_reuse
from stocfl.errors import UserError
from stocfl.files import write_atomic
from stocfl.runner import Experiment, finished_summary

ROOT = Path(__file__).resolve().parents[2] / "reproductions"  # the repository's tables
MAX_DISTINCT_MODELS = 64  # the authors' metric evaluates each distinct model on a whole pool


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    paper: tuple[float, float] | None  # the paper's mean and std, percent


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    source: str
    config: Path
    seeds: tuple[int, ...]
    quick: tuple[str, ...]
    notes: tuple[str, ...]
    rows: tuple[Row, ...]


def tables(root: Path = ROOT) -> dict[str, Path]:
    return {p.stem: p for p in sorted(root.glob("*.toml"))}


def load_table(name: str, root: Path = ROOT) -> Table:
    found = tables(root)
    if name not in found:
        raise UserError(f"reproduce: no table {name!r} in {root}; choose one of {', '.join(found) or '(none)'} "
                        f"(stocfl reproduce --list)")
    path = found[name]
    try:
        raw = tomllib.loads(path.read_text())
        rows = tuple(Row(str(r["name"]), tuple(str(s) for s in r.get("set", [])),
                         tuple(float(v) for v in r["paper"]) if r.get("paper") else None) for r in raw["run"])
        table = Table(name, str(raw["title"]), str(raw["source"]), root.parent / raw["config"],
                      tuple(int(s) for s in raw.get("seeds", [0])), tuple(raw.get("quick", [])),
                      tuple(raw.get("notes", [])), rows)
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path}: not a reproduction table ({type(err).__name__}: {err}); it needs title, source, "
                        f"config and [[run]] entries with name, set and paper") from None
    if len({r.name for r in rows}) != len(rows):
        raise UserError(f"{path}: two [[run]] entries share a name; give each row its own")
    return table


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def authors_metric(exp: Experiment) -> float | None:
    """Each participating client's model on the pooled test data of its true group (for
    rotated MNIST, the test images of its rotation that the group's clients hold), averaged
    over clients. None where there are no groups or too many distinct models (Ditto's
    personal models)."""
    fed = exp.fed
    if fed.groups is None:
        return None
    clients = [int(i) for i in fed.participants]
    models = exp.algorithm.client_models(clients, exp.run_tasks)
    if len({id(w) for w in models}) > MAX_DISTINCT_MODELS:
        return None
    pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for g in sorted({int(fed.groups[i]) for i in clients}):
        parts = [fed.test_data(i) for i in range(fed.n_clients) if int(fed.groups[i]) == g]
        pools[g] = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    cache: dict[tuple[int, int], float] = {}
    total = 0.0
    with torch.no_grad():
        for i, w in zip(clients, models):
            key = (id(w), int(fed.groups[i]))
            if key not in cache:
                x, y = pools[key[1]]
                correct = sum(int((exp.model.forward(w, x[a:a + 4096]).argmax(1) == y[a:a + 4096]).sum())
                              for a in range(0, len(y), 4096))
                cache[key] = correct / max(1, len(y))
            total += cache[key]
    return total / len(clients)


def _stats(values: list[float]) -> dict[str, Any]:
    return {"mean": round(100 * float(np.mean(values)), 2), "std": round(100 * float(np.std(values)), 2),
            "n": len(values)} if values else {}


def _cell(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:.2f} +- {stats['std']:.2f} (n={stats['n']})" if stats else "-"


def write_table(table: Table, results: dict[str, list[dict[str, Any]]], status: dict[str, str], seeds: list[int],
                quick: bool, out_md: Path, out_json: Path) -> dict[str, Any]:
    """TABLE.json and TABLE.md from the runs finished so far."""
    rows = []
    for row in table.rows:
        runs = results.get(row.name, [])
        ours = _stats([r["accuracy"] for r in runs])
        theirs = _stats([r["authors_metric"] for r in runs if r.get("authors_metric") is not None])
        entry = {"name": row.name, "paper": {"mean": row.paper[0], "std": row.paper[1]} if row.paper else None,
                 "ours": ours, "authors_metric": theirs, "status": status.get(row.name, "not run"),
                 "difference": round(ours["mean"] - row.paper[0], 2) if ours and row.paper else None,
                 "clusters": [r["n_clusters"] for r in runs], "ari": [r["ari"] for r in runs],
                 "seconds": [r["seconds"] for r in runs], "seeds": [r["seed"] for r in runs], "set": list(row.overrides)}
        rows.append(entry)
    command = f"stocfl reproduce {table.name} --seeds {','.join(map(str, seeds))}" + (" --quick" if quick else "")
    doc = {"table": table.name, "title": table.title, "source": table.source,
           "config": str(table.config.relative_to(table.config.parents[1])), "command": command, "seeds": seeds,
           "quick": quick, "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch "
           f"{torch.__version__}", "date": time.strftime("%Y-%m-%d"), "notes": list(table.notes), "rows": rows}
    if quick:
        doc["notes"] = [f"--quick: {' '.join(table.quick)}; not the paper's setting", *doc["notes"]]
    write_atomic(out_json, json.dumps(doc, indent=2) + "\n")
    lines = [f"# {table.title}", "", f"Source: {table.source}.", "",
             f"Command: `{command}` (config `{doc['config']}`), {doc['machine']}, {doc['date']}.", "",
             "| method | paper | ours: accuracy | difference | ours: authors' metric | clusters | ARI | "
             "wall time (s) | status |", "|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        paper = f"{e['paper']['mean']:.2f} +- {e['paper']['std']:.2f}" if e["paper"] else "-"
        diff = f"{e['difference']:+.2f}" if e["difference"] is not None else "-"
        lines.append(f"| {e['name']} | {paper} | {_cell(e['ours'])} | {diff} | {_cell(e['authors_metric'])} | "
                     f"{', '.join(map(str, e['clusters'])) or '-'} | "
                     f"{', '.join(f'{a:.3f}' for a in e['ari'] if a is not None) or '-'} | "
                     f"{', '.join(f'{s:.0f}' for s in e['seconds']) or '-'} | {e['status']} |")
    lines += ["", "Accuracies in percent, mean +- std over seeds (n = seeds finished).", "", "Notes:", ""]
    lines += [f"- {n}" for n in doc["notes"]]
    write_atomic(out_md, "\n".join(lines) + "\n")
    return doc


def _done_rounds(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def table_files(name: str, quick: bool = False, root: Path = ROOT) -> tuple[Path, Path, Path]:
    """Where table ``name`` is written: ``TABLE.md``, ``TABLE.json`` and the accuracy curves
    ``TABLE.png`` (``TABLE-quick.*``)."""
    stem = f"{name}-quick" if quick else name
    return root / f"{stem}.md", root / f"{stem}.json", root / f"{stem}.png"


def plot_curves(table: Table, finished: dict[str, list[Path]], path: Path) -> None:
    """Accuracy per evaluated round of every row's finished runs (mean over seeds), each with
    the paper's number marked at its last round in the same colour (StoCFL paper, Fig. 5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stocfl import report
    from stocfl.files import save_figure

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for n, row in enumerate(table.rows):
        curves = []
        for run_dir in finished.get(row.name, []):
            ev = [r for r in report.read_jsonl(run_dir / "metrics.jsonl") if r.get("accuracy") is not None]
            curves.append(([r["round"] for r in ev], [100 * r["accuracy"] for r in ev]))
        curves = [c for c in curves if c[0] == curves[0][0]] if curves else []
        if not curves:
            continue
        rounds, acc = curves[0][0], np.mean([c[1] for c in curves], axis=0)
        colour = f"C{n % 10}"
        ax.plot(rounds, acc, color=colour, marker="os^Dv<>pPX"[n % 10], ms=4, mfc="none", label=f"{row.name} ({len(curves)} seed"
                f"{'s' if len(curves) > 1 else ''})")
        if row.paper:
            ax.plot([rounds[-1]], [row.paper[0]], color=colour, marker="*", ms=11, ls="", mec="k", mew=0.5)
    ax.plot([], [], "k*", ms=9, ls="", label="the paper's number")
    ax.set(xlabel="round", ylabel="test accuracy (%), own model", title=table.title, ylim=(0, 100))
    ax.title.set_fontsize(9)
    report.integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def reproduce(name: str, seeds: list[int] | None = None, quick: bool = False, data_dir: str | None = None,
              runs: Path | None = None, root: Path = ROOT, progress: bool = True,
              log: Callable[[str], None] = print, report_only: bool = False) -> dict[str, Any]:
    """Run (or reuse, or resume) every row of table ``name`` for every seed; write
    ``root/name.md`` and ``root/name.json`` after each run and return the JSON. With
    ``report_only``, run nothing: the table of the runs finished so far."""
    table = load_table(name, root)
    seeds = list(table.seeds) if seeds is None else seeds
    runs = (root / "runs" / name) if runs is None else runs
    extra = list(table.quick) if quick else []
    configs = {(row.name, s): config.load(table.config, [*row.overrides, f"run.seed={s}", *extra], data_dir)
               for row in table.rows for s in seeds}  # every config checked before the first long run
    suffix = "-quick" if quick else ""
    out_md, out_json, out_png = table_files(name, quick, root)
    finished: dict[str, list[Path]] = {}
    results: dict[str, list[dict[str, Any]]] = {}
    status: dict[str, str] = {}
    doc: dict[str, Any] = {}
    for row in table.rows:
        for s in seeds:
            status[row.name] = f"running seed {s}"
            doc = write_table(table, results, status, seeds, quick, out_md, out_json)
            run_dir = runs / f"{slug(row.name)}-seed{s}{suffix}"
            if report_only:
                summary = finished_summary(run_dir)
                if summary is None:
                    done = _done_rounds(run_dir)
                    status[row.name] = f"stopped at round {done}" if done else "not run"
                    continue
            else:
                log(f"reproduce {name}: {row.name}, seed {s} -> {run_dir}")
                summary = run_or_reuse(configs[(row.name, s)], run_dir, data_dir, progress)
            held = run_dir / "authors_metric.json"
            if held.exists():
                theirs = json.loads(held.read_text())["authors_metric"]
            else:
                theirs = authors_metric(Experiment.open(run_dir, data_dir))
                write_atomic(held, json.dumps({"authors_metric": theirs}) + "\n")
            results.setdefault(row.name, []).append({**{k: summary[k] for k in (
                "accuracy", "global_accuracy", "n_clusters", "ari", "seconds", "seed")}, "authors_metric": theirs})
            finished.setdefault(row.name, []).append(run_dir)
            plot_curves(table, finished, out_png)
        if not status[row.name].startswith(("stopped", "not run")):
            status[row.name] = "done"
        doc = write_table(table, results, status, seeds, quick, out_md, out_json)
    return doc


def listing(root: Path = ROOT) -> str:
    lines = []
    for name in tables(root):
        t = load_table(name, root)
        lines.append(f"{name}: {t.title} ({len(t.rows)} runs per seed; seeds {','.join(map(str, t.seeds))})")
    return "\n".join(lines) or f"no tables in {root}"


__all__ = ["authors_metric", "listing", "load_table", "reproduce", "tables"]
