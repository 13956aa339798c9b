"""``stocfl-lab reproduce TABLE``: a paper's table as a declared set of runs, with the paper's
numbers beside ours.

A table is a TOML file in ``reproductions/`` (``TABLE.toml``): a title, the paper it comes
from, a config in ``configs/``, notes on where our setting differs, and one ``[[run]]`` per
row (``name``, ``set`` overrides, the paper's ``[mean, std]``). A row compares one measure of
its runs with the paper's number (``metric``: the table's, else accuracy; at the last round,
or at ``round``: FL+HC's "post cluster" columns). The rows run the table's one protocol, the
training the paper states; a row that changes it to test an explanation says what it changes
(``diagnostic = "w in a chain (the authors' code)"``, or once for a whole table) and is written
in its own block under the headline table. A row's ``seeds`` are its own where they differ
from the table's (headline rows a reviewer reads declare three). A table that sweeps
one parameter (``sweep = "algorithm.tau"``) is drawn against it (StoCFL Fig. 8), one whose
rows count clusters is drawn per round with the clustering objective (Fig. 3). Every (row, seed) is an
ordinary run directory under ``reproductions/runs/TABLE/``, so a stopped reproduction goes on
where it stopped: finished runs are read, stopped ones resumed, and a directory that holds a
run of another config is refused. ``TABLE.md`` and ``TABLE.json`` are rewritten after every
run, so what has finished is on disk while the rest runs. ``TABLE.json`` records each finished
run (its figures, its curves and its config's digest), and a run recorded there for the config
asked is reused when its directory is gone (a fresh clone): the run directories are never
committed, the tables are. An unfinished run's progress (its rounds, its measure at the last
round that evaluated it, its curves so far) is recorded too, so a table still says how far a run
got, and what it measured there, once its directory is gone with the machine that ran it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import textwrap
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import stocfl
from stocfl import config
from stocfl.client import id_ranges
from stocfl.data import data_root
from stocfl.errors import UserError, first_repeated
from stocfl.experiment import LoadedRun, build_federation, finished_summary, integer_rounds, run_or_reuse
from stocfl.storage import exclusive, holder, read_jsonl, save_figure, write_atomic

from .benchmark import mean_ci
from .coverage import row_diagnostic
from .records import FIX, read_table_record
from .rerun import moved, moved_as_recorded, where_run

# what a run run again (--rerun) must give again: its numbers, not its time or machine
RERUN_FIGURES = ("accuracy", "global_accuracy", "n_clusters", "ari", "authors_metric")

ROOT = Path("reproductions")  # the tables of the working directory (stocfl-lab reproduce --tables DIR: others)
MAX_DISTINCT_MODELS = 64  # the authors' metric evaluates each distinct model on a whole pool
LEGEND_LINES = 24  # a figure legend's entries a column; more curves than this split a panel by row group
# measure -> (what it is, factor to the table's unit); the summary key is the measure's name
METRICS = {
    "accuracy": ("test accuracy (%), own model", 100.0),
    "global_accuracy": ("global model's accuracy (%)", 100.0),
    "macro_accuracy": ("test accuracy (%), own model, the plain mean over clients", 100.0),
    "heldout_accuracy": ("held-out clients' accuracy (%), placed after training", 100.0),
    "n_clusters": ("clusters found", 1.0),
    "ari": ("ARI against the true groups", 1.0),
    # needs run.target_accuracy in the row's config: FL+HC's "% of clients reaching the target"
    "clients_at_target": ("clients reaching the target accuracy (%)", 100.0),
}

# the authors' metric, by row: "group" (Table 1: each client's model on its true group's pooled
# test data, mean over clients) or "pooled" (StoCFL Table 3's "average performance of cluster
# models": each cluster model on every client's test data, mean over models)
AUTHORS = ("group", "pooled")


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    paper: tuple[float, float | None] | None  # the paper's mean and std (None: it gives none), in the metric's unit
    metric: str = "accuracy"
    series: str = ""  # a sweep table's line this row belongs to
    at_round: int | None = None  # read the measure at this round, not the last (FL+HC: "post cluster")
    authors: str = "group"  # the authors' metric: each client's model on its group's pool, or "pooled"
    seeds: tuple[int, ...] | None = None  # this row's seeds where they are not the table's
    # what this row changes from the paper's stated training ("w in a chain (the authors' code)"):
    # a diagnostic row tests an explanation and is shown in its own block, never in the headline
    # column; "" for the headline rows, which all run the one protocol the table declares
    diagnostic: str = ""

    @property
    def measure(self) -> str:
        return self.metric if self.at_round is None else f"{self.metric} at round {self.at_round}"


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
    sweep: str | None = None  # the config key the rows vary, drawn on the x axis

    def seeds_of(self, row: Row) -> tuple[int, ...]:
        """The row's own seeds, or the table's."""
        return row.seeds or self.seeds


def tables(root: Path = ROOT) -> dict[str, Path]:
    """The reproduction tables: every TOML file there but coverage.toml (what of the papers the
    tables cover, :mod:`stocfl_lab.coverage`)."""
    return {p.stem: p for p in sorted(root.glob("*.toml")) if p.name != "coverage.toml"}


def _paper(value) -> tuple[float, float | None]:
    """A row's ``paper``: [mean, std], or [mean] where the paper gives no spread."""
    numbers = tuple(float(v) for v in value)
    if len(numbers) not in (1, 2):
        raise ValueError(f"paper = {list(value)!r}: expected [mean, std] or [mean]")
    return numbers[0], numbers[1] if len(numbers) == 2 else None


def load_table(name: str, root: Path = ROOT) -> Table:
    found = tables(root)
    if name not in found:
        raise UserError(
            f"reproduce: no table {name!r} in {root}; choose one of {', '.join(found) or '(none)'} "
            f"(stocfl-lab reproduce --list)"
        )
    path = found[name]
    try:
        raw = tomllib.loads(path.read_text())
        metric = str(raw.get("metric", "accuracy"))
        rows = tuple(
            Row(
                str(r["name"]),
                tuple(str(s) for s in r.get("set", [])),
                _paper(r["paper"]) if r.get("paper") else None,
                str(r.get("metric", metric)),
                str(r.get("series", "")),
                int(r["round"]) if r.get("round") is not None else None,
                str(r.get("authors", "group")),
                tuple(int(s) for s in r["seeds"]) if r.get("seeds") is not None else None,
                row_diagnostic(raw, r),
            )
            for r in raw["run"]
        )
        table = Table(
            name,
            str(raw["title"]),
            str(raw["source"]),
            root.parent / raw["config"],
            tuple(int(s) for s in raw.get("seeds", [0])),
            tuple(raw.get("quick", [])),
            tuple(raw.get("notes", [])),
            rows,
            str(raw["sweep"]) if raw.get("sweep") else None,
        )
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"{path}: not a reproduction table ({type(err).__name__}: {err}); it needs title, source, "
            f"config and [[run]] entries with name, set and paper"
        ) from None
    if not table.seeds or first_repeated(table.seeds) is not None:
        raise UserError(f"{path}: seeds = {list(table.seeds)}; give distinct seeds, e.g. [0, 1, 2]")
    if len({r.name for r in rows}) != len(rows):
        raise UserError(f"{path}: two [[run]] entries share a name; give each row its own")
    for r in rows:
        if r.metric not in METRICS:
            raise UserError(f"{path}: row {r.name!r} has metric {r.metric!r}; use one of {', '.join(METRICS)}")
        if r.authors not in AUTHORS:
            raise UserError(f"{path}: row {r.name!r} has authors = {r.authors!r}; use one of {', '.join(AUTHORS)}")
        if r.seeds is not None and (not r.seeds or first_repeated(r.seeds) is not None):
            raise UserError(f"{path}: row {r.name!r} has seeds = {list(r.seeds)}; give distinct seeds, e.g. [0, 1, 2]")
        if any(o.split("=", 1)[0].strip() == "run.seed" for o in r.overrides):
            raise UserError(
                f"{path}: row {r.name!r} sets run.seed, which each seed's run sets itself; give the row "
                f"seeds = [...] instead"
            )
        if r.at_round is not None and r.at_round < 1:
            raise UserError(f"{path}: row {r.name!r} reads round {r.at_round}; rounds count from 1")
        if table.sweep and sweep_value(r, table.sweep) is None:
            raise UserError(
                f"{path}: row {r.name!r} does not set {table.sweep}, the key the table sweeps; add "
                f'"{table.sweep}=VALUE" to its set'
            )
    return table


def sweep_value(row: Row, key: str) -> float | None:
    for s in row.overrides:
        k, _, v = s.partition("=")
        if k.strip() == key:
            try:
                return float(v)
            except ValueError:
                return None
    return None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def authors_metric(run: LoadedRun, kind: str = "group") -> float | None:
    """Each participating client's model on the pooled test data of its true group (for
    rotated MNIST, the test images of its rotation that the group's clients hold), averaged
    over clients. None where there are no groups or too many distinct models (Ditto's
    personal models). ``kind = "pooled"``: each cluster model (the global model where the
    algorithm has no clusters) on every client's test data, averaged over models."""
    fed = run.federation
    if kind == "pooled":
        found = run.cluster_models() or {0: run.global_model()}
        parts = [fed.test_data(i) for i in range(fed.n_clients)]
        x, y = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
        return float(np.mean([run.accuracy(w, x, y) for w in found.values()]))
    if fed.groups is None:
        return None
    clients = [int(i) for i in fed.participants]
    models: list[torch.Tensor] = []
    distinct: dict[int, torch.Tensor] = {}  # held, so that an id is never reused by another model
    for _, part in run.client_models(clients):
        for w in part:
            distinct.setdefault(id(w), w)
            models.append(distinct[id(w)])
        if len(distinct) > MAX_DISTINCT_MODELS:
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
                cache[key] = run.accuracy(w, *pools[key[1]])
            total += cache[key]
    return total / len(clients)


def _stats(values: list[float], scale: float = 100.0) -> dict[str, Any]:
    """Mean, std (ddof = 0) and the half-width of the mean's 95% interval over seeds (Student's t;
    None for one seed), in the measure's unit."""
    if not values:
        return {}
    _, half = mean_ci([scale * float(v) for v in values])
    return {
        "mean": round(scale * float(np.mean(values)), 2),
        "std": round(scale * float(np.std(values)), 2),
        "ci95": None if half is None else round(half, 2),
        "n": len(values),
    }


def _seeds_text(table: Table) -> str:
    """The table's seeds, then each row's own: "0, FedAvg: 0,1,2"."""
    return ",".join(map(str, table.seeds)) + "".join(
        f", {r.name}: {','.join(map(str, r.seeds))}" for r in table.rows if r.seeds is not None
    )


def _cell(stats: dict[str, Any]) -> str:
    """Ours: the mean and its 95% interval's half-width over the n seeds (a record written before
    the interval was kept gives it from its seeds on the next write)."""
    if not stats:
        return "-"
    if stats["n"] < 2 or stats.get("ci95") is None:
        return f"{stats['mean']:.2f} (n={stats['n']})"
    return f"{stats['mean']:.2f} ± {stats['ci95']:.2f} (n={stats['n']})"


def write_table(
    table: Table,
    results: dict[str, list[dict[str, Any]]],
    status: dict[str, str],
    seeds: list[int],
    quick: bool,
    out_md: Path,
    out_json: Path,
    per_row: bool = False,
    kept: dict[tuple[str, int], dict[str, Any]] | None = None,
    progress: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """TABLE.json and TABLE.md from the runs finished so far; ``per_row``: the rows that declare
    their own seeds ran those (no --seeds was given). ``kept``: recorded runs of seeds this table
    does not show, written on as each row's ``other_runs`` so that a later call (or a fresh
    clone) reuses them. ``progress``: how far the unfinished runs got (see :func:`run_progress`),
    written as each row's ``progress``; a seed with a finished run has none."""
    rows = []
    finished = {(name, r["seed"]) for name, runs_ in results.items() for r in runs_} | set(kept or {})
    for row in table.rows:
        runs = results.get(row.name, [])
        ours = _stats([r[row.metric] for r in runs if r.get(row.metric) is not None], METRICS[row.metric][1])
        theirs = (
            _stats([r["authors_metric"] for r in runs if r.get("authors_metric") is not None])
            if row.metric == "accuracy"
            else {}
        )
        entry = {
            "name": row.name,
            **({"diagnostic": row.diagnostic} if row.diagnostic else {}),
            "metric": row.measure,
            "paper": {"mean": row.paper[0], "std": row.paper[1]} if row.paper else None,
            "ours": ours,
            "authors_metric": theirs,
            "status": status.get(row.name, "not run"),
            "difference": round(ours["mean"] - row.paper[0], 2) if ours and row.paper else None,
            "clusters": [r["n_clusters"] for r in runs],
            "ari": [r["ari"] for r in runs],
            "seconds": [r["seconds"] for r in runs],
            "seeds": [r["seed"] for r in runs],
            "set": list(row.overrides),
            "runs": runs,
        }
        other = sorted((rec for (name, _), rec in (kept or {}).items() if name == row.name), key=lambda r: r["seed"])
        if other:
            entry["other_runs"] = other
        going = sorted(
            (p for (name, s), p in (progress or {}).items() if name == row.name and (name, s) not in finished),
            key=lambda p: p["seed"],
        )
        if going:
            entry["progress"] = going
        rows.append(entry)
    own = [r for r in table.rows if r.seeds is not None] if per_row else []
    command = (
        f"stocfl-lab reproduce {table.name}"
        + ("" if own else f" --seeds {','.join(map(str, seeds))}")
        + (" --quick" if quick else "")
    )
    seeds_line = f"; seeds {_seeds_text(table)}" if own else ""
    doc = {
        "table": table.name,
        "title": table.title,
        "source": table.source,
        "config": str(table.config.relative_to(table.config.parents[1])),
        "command": command,
        "seeds": seeds,
        **({"row_seeds": {r.name: list(r.seeds) for r in own}} if own else {}),
        "quick": quick,
        "machine": f"{_processors(results)}, {_threads(results)}, {_torch(results)}",
        "date": _dates(results),
        "notes": list(table.notes),
        "rows": rows,
    }
    if quick:
        doc["notes"] = [f"--quick: {' '.join(table.quick)}; not the paper's setting", *doc["notes"]]
    write_atomic(out_json, json.dumps(doc, indent=2) + "\n")
    lines = [
        f"# {table.title}",
        "",
        f"Source: {table.source}.",
        "",
        f"Command: `{command}` (config `{doc['config']}`{seeds_line}), {doc['machine']}, {doc['date']}.",
        "",
    ]
    headline = [e for e in rows if not e.get("diagnostic")]
    blocks: dict[str, list[dict[str, Any]]] = {}
    for e in rows:
        if e.get("diagnostic"):
            blocks.setdefault(e["diagnostic"], []).append(e)
    if headline:
        lines += _md_rows(headline)
    for label, block in blocks.items():
        lines += [
            "",
            f"Diagnostic rows, {label} (another setting than the table's protocol, to test an explanation):",
            "",
        ]
        lines += _md_rows(block)
    lines += _collapse_lines(rows)
    lines += [
        "",
        "Accuracies in percent. The paper's figure is its mean +- its std; ours is the mean ± the half-width of "
        "its 95% confidence interval over the n seeds finished (Student's t; one seed has none); the JSON "
        "record keeps the std too. Rows above the diagnostic blocks run the table's one protocol, the training "
        "the paper states.",
        "",
        "Notes:",
        "",
    ]
    lines += [f"- {n}" for n in doc["notes"]]
    write_atomic(out_md, "\n".join(lines) + "\n")
    return doc


def _md_rows(entries: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of written rows."""
    lines = [
        "| method | measure | paper | ours | difference | ours: authors' metric | clusters | ARI | "
        "wall time (s) | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        paper = "-"
        if e["paper"]:
            std = e["paper"]["std"]
            paper = f"{e['paper']['mean']:.2f}" + ("" if std is None else f" +- {std:.2f}")
        diff = f"{e['difference']:+.2f}" if e["difference"] is not None else "-"
        lines.append(
            f"| {e['name']} | {e['metric']} | {paper} | {_cell(e['ours'])} | {diff} | "
            f"{_cell(e['authors_metric'])} | "
            f"{', '.join(map(str, e['clusters'])) or '-'} | "
            f"{', '.join(f'{a:.3f}' for a in e['ari'] if a is not None) or '-'} | "
            f"{', '.join(f'{s:.0f}' for s in e['seconds']) or '-'} | {e['status'].replace('|', '/')} |"
        )
    return lines


def _processors(results: dict[str, list[dict[str, Any]]]) -> str:
    """The processors the finished runs ran on (each run's summary records its own; runs
    recorded before that are counted as not recorded)."""
    runs = [r for runs in results.values() for r in runs]
    named = sorted({r["processor"] for r in runs if r.get("processor")})
    unknown = sum(1 for r in runs if not r.get("processor"))
    if not named:
        return f"{platform.machine()}{' (processor not recorded)' if runs else ''}"
    return "; ".join(named) + (f"; {platform.machine()} ({unknown} run(s) recorded no processor)" if unknown else "")


def _dates(results: dict[str, list[dict[str, Any]]]) -> str:
    """The days the shown runs finished, first to last (today where none has): the table's date
    does not move when it is written again from the same runs."""
    days = sorted({r["date"] for runs in results.values() for r in runs if r.get("date")})
    if not days:
        return time.strftime("%Y-%m-%d")
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _torch(results: dict[str, list[dict[str, Any]]]) -> str:
    """The torch versions the finished runs ran (each run's summary records its own; a run
    recorded before that is taken to have run this process's)."""
    runs = [r for runs in results.values() for r in runs]
    used = {r["torch"] for r in runs if r.get("torch")}
    if not runs or any(not r.get("torch") for r in runs):
        used.add(torch.__version__)
    return f"torch {'; '.join(sorted(used))}"


def _threads(results: dict[str, list[dict[str, Any]]]) -> str:
    """The torch threads the finished runs used (each run's summary records its own)."""
    used = sorted({r["threads"] for runs in results.values() for r in runs if r.get("threads")})
    if not used:
        return "no run finished"
    return f"{'/'.join(map(str, used))} torch thread{'s' if used != [1] else ''} per run"


def _finished(run_dir: Path) -> str:
    """The day a finished run wrote its summary (UTC)."""
    return time.strftime("%Y-%m-%d", time.gmtime((run_dir / "summary.json").stat().st_mtime))


def run_progress(
    table: Table, row: Row, run_dir: Path, cfg: config.Config, seed: int, data_dir: str | None
) -> dict[str, Any] | None:
    """How far the unfinished run of ``row`` at ``seed`` in ``run_dir`` got: its rounds done of
    its config's, the row's measure at the last round that evaluated it (``measured_at``), its
    curves so far, the day of its last round and its config's digest. None when it has done no
    round, or the directory holds a run of another config."""

    done = read_jsonl(run_dir / "metrics.jsonl")
    if not done:
        return None
    digest = stocfl.config_digest(cfg)
    try:
        if stocfl.open_run(run_dir, data_dir).digest != digest:
            return None
    except UserError:
        return None
    evaluated = [r for r in done if r.get(row.metric) is not None]
    day = time.strftime("%Y-%m-%d", time.gmtime((run_dir / "metrics.jsonl").stat().st_mtime))
    return {
        "seed": seed,
        "rounds_done": len(done),
        "rounds": cfg.run.rounds,
        "measured_at": evaluated[-1]["round"] if evaluated else None,
        row.metric: float(evaluated[-1][row.metric]) if evaluated else None,
        "date": day,
        "digest": digest,
        "curves": run_curves(table, run_dir, done),
    }


def progress_text(row: Row, p: dict[str, Any], here: bool) -> str:
    """An unfinished run's progress in words: "stopped at round 160 of 200; accuracy 58.55 at
    round 160", and where its directory is gone, that it runs again from round 1."""
    text = f"round {p['rounds_done']} of {p['rounds']}"
    if p.get("measured_at") is not None and p.get(row.metric) is not None:
        text += f"; {row.metric} {p[row.metric] * METRICS[row.metric][1]:.2f} at round {p['measured_at']}"
    if not here:
        text += f" ({p['date']}; its run directory is not here: it runs again from round 1)"
    return text


def _written(table: Table, path: Path, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table's JSON at ``path`` and its rows by name; nothing where there is none. A file
    that cannot be read, is of another table (or of the other of --quick and the paper's
    setting) or records a run with a field missing or of the wrong kind is refused in one line
    (:func:`stocfl_lab.records.read_table_record`): read as nothing, its runs would be run again
    and the file written over, its records lost."""
    doc = read_table_record(path)
    if doc is None:
        return {}, {}
    if doc.get("table") != table.name or bool(doc.get("quick")) != quick:
        which = "the --quick setting's" if doc.get("quick") else "the paper's setting's"
        raise UserError(f"{path} records table {doc.get('table')!r} ({which}), not this one; {FIX}")
    return doc, {e["name"]: e for e in doc["rows"]}


def _config_at(config_of: Callable[[Row, int], config.Config], row: Row, seed: Any) -> config.Config | None:
    """The row's config at a recorded seed; None for a value no config takes."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        return None
    try:
        return config_of(row, seed)
    except UserError:
        return None


def recorded_progress(
    table: Table, written: tuple[dict[str, Any], dict[str, Any]], config_of: Callable[[Row, int], config.Config]
) -> dict[tuple[str, int], dict[str, Any]]:
    """The unfinished runs' progress the table's JSON (``written``, from :func:`_written`)
    records, by (row, seed), where it is of the row's config at that seed."""
    _, entries = written
    found = {}
    for row in table.rows:
        entry = entries.get(row.name)
        if not isinstance(entry, dict) or entry.get("set") != list(row.overrides):
            continue
        for p in entry.get("progress") or []:
            cfg = _config_at(config_of, row, p.get("seed")) if isinstance(p, dict) else None
            if (
                cfg is not None
                and isinstance(p.get("rounds_done"), int)
                and p.get("digest") == stocfl.config_digest(cfg)
            ):
                found[(row.name, p["seed"])] = p
    return found


def table_files(name: str, quick: bool = False, root: Path = ROOT) -> tuple[Path, Path, Path]:
    """Where table ``name`` is written: ``TABLE.md``, ``TABLE.json`` and the accuracy curves
    ``TABLE.png`` (``TABLE-quick.*``)."""
    stem = f"{name}-quick" if quick else name
    return root / f"{stem}.md", root / f"{stem}.json", root / f"{stem}.png"


def _panel(metric: str) -> str:
    """The panel a measure is drawn in: every percentage shares the accuracy panel."""
    return "accuracy" if METRICS[metric][1] == 100.0 else metric


def _group(row: Row) -> str:
    """A row's group: its name before the first comma (Table 3: "Rotated", "Hybrid", ...)."""
    return row.name.split(",", 1)[0].strip()


def _panel_rows(table: Table, kind: str) -> list[Row]:
    """The rows a panel of this measure draws (the objective panel: those counting clusters)."""
    want = "n_clusters" if kind == "objective" else kind
    return [r for r in table.rows if _panel(r.metric) == want]


def _run_key(row: Row) -> tuple[str, ...]:
    """The run a row's curve is drawn from: rows of one measure and config read one run."""
    return (row.metric, *sorted(row.overrides))


def _kinds(table: Table) -> list[str]:
    """The measures drawn: accuracies share one; a table that counts clusters adds the
    clustering objective (StoCFL Fig. 3 b)."""
    kinds: list[str] = []
    for row in table.rows:
        if _panel(row.metric) not in kinds:
            kinds.append(_panel(row.metric))
    if "n_clusters" in kinds and not table.sweep:
        kinds.append("objective")
    return kinds


def _panels(table: Table) -> list[tuple[str, str | None]]:
    """The panels drawn, (measure, group): one a measure, split by row group where more curves
    than a legend column holds would crowd one panel and the groups are few (Table 3's scenarios)."""
    panels: list[tuple[str, str | None]] = []
    for kind in _kinds(table):
        rows = _panel_rows(table, kind)
        groups = list(dict.fromkeys(_group(r) for r in rows))
        runs = {_run_key(r) for r in rows}
        if not table.sweep and len(runs) > LEGEND_LINES and 2 <= len(groups) <= 6:
            panels += [(kind, g) for g in groups]
        else:
            panels.append((kind, None))
    return panels


def _curve_keys(table: Table) -> list[str]:
    # the clusters found every round too: when an IFCA-like method's models die out, over seeds
    keys = sorted({r.metric for r in table.rows} | {"n_clusters"})
    return [*keys, "objective"] if "objective" in _kinds(table) else keys


def models_in_use(record: dict[str, Any]) -> tuple[int, int] | None:
    """A run's clusters (models in use) at its last round and the first round from which it
    held that count to the end, from its recorded curve; None without one."""
    rounds, counts = _series(record, "n_clusters")
    if not counts:
        return None
    since = len(counts) - 1
    while since > 0 and counts[since - 1] == counts[-1]:
        since -= 1
    return int(counts[-1]), int(rounds[since])


def _collapse_lines(entries: list[dict[str, Any]]) -> list[str]:
    """Per IFCA row, its runs' models in use at the end and since when: how often and at which
    round its models collapse, over seeds."""
    lines = []
    for e in entries:
        if not e["name"].startswith("IFCA"):
            continue
        seen = [(r["seed"], models_in_use(r)) for r in e["runs"]]
        told = [f"seed {s}: {m[0]} from round {m[1]}" for s, m in seen if m is not None]
        if told:
            lines.append(f"- {e['name']}: " + "; ".join(told) + ".")
    if not lines:
        return []
    return ["", "Models in use at the last round, and the round from which each run kept that many:", "", *lines]


def run_curves(table: Table, run_dir: Path, rows: list[dict[str, Any]] | None = None) -> dict[str, list[list[float]]]:
    """The measures the table draws, per round of one run: ``{key: [rounds, values]}``, from
    its ``metrics.jsonl`` (or its ``rows``, read already)."""

    rows = read_jsonl(run_dir / "metrics.jsonl") if rows is None else rows
    curves = {}
    for key in _curve_keys(table):
        kept = [r for r in rows if r.get(key) is not None]
        if kept:
            curves[key] = [[r["round"] for r in kept], [float(r[key]) for r in kept]]
    return curves


def _series(record: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    rounds, values = (record.get("curves") or {}).get(key, ([], []))
    return list(rounds), list(values)


def _run_label(names: list[str], seeds: int) -> str:
    """The legend entry of a run that several rows read: FL+HC's "FL+HC, cf = 0.1, n = 1, post
    cluster" and "..., round 50" draw one curve, "FL+HC, cf = 0.1, n = 1 (post cluster, round 50;
    1 seed)"."""
    count = f"{seeds} seed{'s' if seeds > 1 else ''}"
    common = os.path.commonprefix(names) if len(names) > 1 else ""
    base = common[: common.rfind(",")] if "," in common else ""
    if len(names) == 1 or not base:
        return f"{' / '.join(names)} ({count})"
    return f"{base} ({', '.join(name[len(base) :].lstrip(', ') for name in names)}; {count})"


def _style(n: int) -> tuple[str, str]:
    """Row ``n``'s colour and marker: no two of the first 100 rows share both."""
    return f"C{n % 10}", "os^Dv<>pPX"[(n + n // 10) % 10]


def plot_curves(
    table: Table,
    finished: dict[str, list[dict[str, Any]]],
    path: Path,
    unfinished: dict[str, list[dict[str, Any]]] | None = None,
) -> None:
    """Draw the table's figure (``draw_curves``) into ``path``, grown to hold its legend."""
    import matplotlib.pyplot as plt

    fig = draw_curves(table, finished, unfinished)
    save_figure(fig, path, tight=True)
    plt.close(fig)


def draw_curves(
    table: Table, finished: dict[str, list[dict[str, Any]]], unfinished: dict[str, list[dict[str, Any]]] | None = None
):
    """Each row's measure per round, mean over its finished seeds, with the paper's number
    starred in the same colour at the last round (StoCFL Fig. 5; clusters and the clustering
    objective per round, Fig. 3 b); a sweep table draws the final measure against the swept
    value instead (Fig. 8: tau against the clusters found). A run that several rows read (FL+HC's
    post cluster and round 50) is drawn once, with each row's star. A run recorded before tables
    kept curves is drawn as its final value alone. A row with no finished run draws the furthest
    of its ``unfinished`` runs' curves so far (their progress records), dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(table)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 1.0 + 3.8 * len(panels)), squeeze=False)
    ylabels = {
        **{k: v[0] for k, v in METRICS.items()},
        "accuracy": "test accuracy (%)",
        "objective": "clustering objective (Eq. 2)",
    }
    legend_lines: list[int] = []  # the lines of each panel's legend beside it
    for ax, (panel, group) in zip(axes[:, 0], panels):
        points: dict[str, list[tuple[float, float, float | None]]] = {}
        drawn: dict[tuple[str, ...], str] = {}  # a run's curve is drawn once; the other rows reading it add a star
        members = {r.name for r in _panel_rows(table, panel) if group is None or _group(r) == group}

        def shown(name: str, group: str | None = group) -> str:
            """A row's legend name: a group's panel, titled with the group, drops it from each."""
            return name[len(group) + 2 :] if group is not None and name.startswith(f"{group}, ") else name

        for n, row in enumerate(table.rows):
            if row.name not in members:
                continue
            key = row.metric if panel != "objective" else "objective"
            scale = METRICS[row.metric][1] if panel != "objective" else 1.0
            records = finished.get(row.name, [])
            paper = row.paper[0] if row.paper and panel != "objective" else None
            finals = [r[row.metric] for r in records if r.get(row.metric) is not None]
            if table.sweep:
                if finals:
                    series = row.series or ", ".join(
                        o for o in row.overrides if o.partition("=")[0].strip() != table.sweep
                    )
                    points.setdefault(series or "ours", []).append(
                        (sweep_value(row, table.sweep), scale * float(np.mean(finals)), paper)
                    )
                continue
            curves = [_series(r, key) for r in records]
            curves = [c for c in curves if c[0] and c[0] == curves[0][0]]
            going = [(p, _series(p, key)) for p in (unfinished or {}).get(row.name, []) if _series(p, key)[0]]
            if not records and going:
                p, (rounds, values) = max(going, key=lambda g: g[1][0][-1])
                colour, marker = _style(n)
                ax.plot(
                    rounds,
                    scale * np.asarray(values),
                    color=colour,
                    marker=marker,
                    ms=4,
                    mfc="none",
                    ls="--",
                    markevery=max(1, len(rounds) // 25),
                    label=f"{shown(row.name)} (unfinished: seed {p['seed']}, "
                    f"round {p['rounds_done']} of {p['rounds']})",
                )
                if paper is not None:
                    ax.plot([p["rounds"]], [paper], color=colour, marker="*", ms=11, ls="", mec="k", mew=0.5)
                continue
            if not curves:
                if finals and panel != "objective" and row.at_round is None:
                    colour, marker = _style(n)
                    why = (
                        "measured at the last round only"
                        if any(r.get("curves") for r in records)
                        else "curve not recorded"
                    )  # macro accuracy is not logged per round
                    ax.plot(
                        [records[0]["rounds"]],
                        [scale * float(np.mean(finals))],
                        color=colour,
                        marker=marker,
                        ms=6,
                        mfc="none",
                        ls="",
                        label=f"{shown(row.name)}: final value ({why})",
                    )
                    if paper is not None:
                        ax.plot(
                            [records[0]["rounds"]], [paper], color=colour, marker="*", ms=11, ls="", mec="k", mew=0.5
                        )
                continue
            rounds, values = curves[0][0], scale * np.mean([c[1] for c in curves], axis=0)
            run_key = _run_key(row)
            if run_key in drawn:
                if paper is not None:
                    ax.plot(
                        [row.at_round or rounds[-1]],
                        [paper],
                        color=drawn[run_key],
                        marker="*",
                        ms=11,
                        ls="",
                        mec="k",
                        mew=0.5,
                    )
                continue
            colour, marker = _style(n)
            drawn[run_key] = colour
            ax.plot(
                rounds,
                values,
                color=colour,
                marker=marker,
                ms=4,
                mfc="none",
                markevery=max(1, len(rounds) // 25),
                label=_run_label([shown(r.name) for r in table.rows if _run_key(r) == run_key], len(curves)),
            )
            if paper is not None:
                ax.plot([row.at_round or rounds[-1]], [paper], color=colour, marker="*", ms=11, ls="", mec="k", mew=0.5)
        for n, (series, pts) in enumerate(points.items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "os^Dv"[n % 5] + "-",
                color=f"C{n % 10}",
                mfc="none",
                label=f"ours, final round: {series}",
            )
        paper_pts = sorted({(p[0], p[2]) for pts in points.values() for p in pts if p[2] is not None})
        if paper_pts:
            ax.plot(
                [p[0] for p in paper_pts], [p[1] for p in paper_pts], "k*", ms=11, ls="", label="the paper's number"
            )
        if not table.sweep and panel != "objective" and any(line.get_marker() == "*" for line in ax.lines):
            ax.plot([], [], "k*", ms=9, ls="", label="the paper's number")
        ax.set(xlabel=table.sweep if table.sweep else "round", ylabel=ylabels[panel])
        if panel == "accuracy":
            ax.set_ylim(0, 100)
        if panel == "n_clusters":
            ax.yaxis.get_major_locator().set_params(integer=True)
        if not table.sweep:
            integer_rounds(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and table.sweep:
            ax.legend(fontsize=8, loc="best")
        elif ax.get_legend_handles_labels()[0]:
            entries = len(ax.get_legend_handles_labels()[0])
            ncol = -(-entries // LEGEND_LINES)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=ncol)
            legend_lines.append(-(-entries // ncol))
    if legend_lines:  # a long legend widens and heightens the figure rather than squeezing the axes
        renderer = fig.canvas.get_renderer()
        widest = (
            max(ax.get_legend().get_window_extent(renderer).width for ax in axes[:, 0] if ax.get_legend() is not None)
            / fig.dpi
        )
        fig.set_size_inches(max(8.5, 5.5 + widest), max(fig.get_size_inches()[1], 1.0 + 0.17 * max(legend_lines)))
    for ax, (_, group) in zip(axes[1:, 0], panels[1:]):
        if group is not None:
            ax.set_title(group, fontsize=9, loc="left", fontweight="bold")
    title, first = textwrap.fill(table.title, 90), panels[0][1]  # the legend takes the right side
    axes[0, 0].set_title(title if first is None else f"{title}\n{first}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def reproduce(
    name: str,
    seeds: list[int] | None = None,
    quick: bool = False,
    data_dir: str | None = None,
    runs: Path | None = None,
    root: Path = ROOT,
    progress: bool = True,
    log: Callable[[str], None] = print,
    report_only: bool = False,
    rows: str | None = None,
    rerun: bool = False,
) -> dict[str, Any]:
    """Run (or reuse, or resume) every row of table ``name`` for every seed; write
    ``root/name.md`` and ``root/name.json`` after each run and return the JSON. With
    ``report_only``, run nothing: the table of the runs finished so far. ``rows`` ("2,4-6": 1-based
    row numbers) runs those rows only; the table still shows every row's finished runs. ``rerun``
    runs the chosen rows' runs again where only the table records them (their directories gone,
    e.g. to draw the curves of a run recorded without them); a run directory is still reused."""
    if rerun and report_only:
        raise UserError("reproduce: --rerun runs rows again and --report runs nothing; pass one of them")
    if seeds is not None and (not seeds or first_repeated(seeds) is not None):
        raise UserError(
            f"reproduce: seeds {list(seeds)}: give distinct seeds, e.g. [0, 1, 2] (each is one run a row; "
            f"a seed given twice would count its run twice)"
        )
    table = load_table(name, root)
    chosen = select_rows(table, rows)
    asked = seeds

    def seeds_of(row: Row) -> list[int]:
        """--seeds for every row; else the row's own seeds, or the table's."""
        return list(asked) if asked is not None else list(table.seeds_of(row))

    def partly(row: Row, n_done: int, word: str) -> str:
        """A row's status from its finished seeds and the word on the rest ("not run", ...)."""
        total = len(seeds_of(row))
        if n_done >= total:
            return "done"
        rest = "the rest not run" if word == "not run" else word
        return f"{n_done} of {total} seeds done; {rest}" if n_done else word

    seeds = list(table.seeds) if asked is None else list(asked)
    runs = (root / "runs" / name) if runs is None else runs
    extra = list(table.quick) if quick else []
    configs: dict[tuple[str, int], config.Config] = {}

    def config_of(row: Row, s: int) -> config.Config:
        if (row.name, s) not in configs:
            configs[(row.name, s)] = stocfl.load_config(
                table.config, [*row.overrides, f"run.seed={s}", *extra], data_dir
            )
        return configs[(row.name, s)]

    for row in table.rows:  # every config asked is checked before the first long run
        for s in seeds_of(row):
            run = config_of(row, s).run
            if row.at_round is not None and not run.evaluates(row.at_round):  # found before the run, not after it
                raise UserError(
                    f"reproduce: row {row.name!r} reads round {row.at_round}, which its runs do not evaluate "
                    f'(run.eval_every = {run.eval_every}); add "run.eval_rounds=[{row.at_round}]" to its set'
                )
            if row.metric == "clients_at_target" and run.target_accuracy == 0:
                raise UserError(
                    f"reproduce: row {row.name!r} reads clients_at_target, which its runs record only with a "
                    f'target; add "run.target_accuracy=0.99" (the target) to its set'
                )
    suffix = "-quick" if quick else ""
    out_md, out_json, out_png = table_files(name, quick, root)
    results: dict[str, list[dict[str, Any]]] = {}
    status: dict[str, str] = {}
    doc: dict[str, Any] = {}
    shared: dict[tuple[str, ...], str] = {}  # rows of one config share its runs (a table's Global column)
    written = _written(table, out_json, quick)
    recorded = recorded_runs(table, written, config_of)  # every seed's, not only those asked
    partial = recorded_progress(table, written, config_of)  # unfinished runs', their directories here or not
    for row in table.rows:  # the tables written while the first rows run keep what the later rows recorded
        done = [recorded[(row.name, s)] for s in seeds_of(row) if (row.name, s) in recorded]
        if done:
            results[row.name] = done
            status[row.name] = partly(row, len(done), "not run")

    stems = {row.name: shared.setdefault(tuple(sorted(row.overrides)), slug(row.name)) for row in table.rows}

    def run_dir_of(row_name: str, s: int) -> Path:
        return runs / f"{stems[row_name]}-seed{s}{suffix}"

    if not report_only:  # a run that would fail for want of its data fails before any other runs
        _check_data(
            table,
            chosen,
            seeds_of,
            config_of,
            data_dir,
            lambda row, s: (
                finished_summary(run_dir_of(row.name, s)) is None and (rerun or (row.name, s) not in recorded)
            ),
        )

    def unfinished(row: Row, s: int, pid: int | None = None) -> str:
        """A seed's unfinished run in words, its progress read again from its directory (the
        table's record of it kept where the directory is gone): run by ``pid``, stopped part-way,
        or not run."""
        here = run_progress(table, row, run_dir_of(row.name, s), config_of(row, s), s, data_dir)
        if here is not None:
            partial[(row.name, s)] = here
        p = partial.get((row.name, s))
        if pid is not None:
            return f"running seed {s} (pid {pid})" + (f": {progress_text(row, here, True)}" if here else "")
        return f"stopped at {progress_text(row, p, here is not None)}" if p else "not run"

    def idle(row: Row) -> str:
        """A row no process runs: stopped part-way, or not run."""
        for s in seeds_of(row):
            if (row.name, s) not in recorded and (word := unfinished(row, s)) != "not run":
                return word
        return "not run"

    def write(current: str | None) -> dict[str, Any]:
        """The table, with what other processes running other rows recorded meanwhile: read,
        merged and written under the table's lock, so no process writes back a stale view. A
        row another process is running says so (its run directory's lock names the pid)."""
        with exclusive(root, wait=True, lock=f".{out_json.stem}.lock"):
            written = _written(table, out_json, quick)
            recorded.update(recorded_runs(table, written, config_of))
            for other in table.rows:
                if other.name == current or status.get(other.name, "").startswith(("done", "failed")):
                    continue
                done = [recorded[(other.name, s)] for s in seeds_of(other) if (other.name, s) in recorded]
                if len(done) > len(results.get(other.name, [])):
                    results[other.name] = done
                held = [(s, pid) for s in seeds_of(other) if (pid := holder(run_dir_of(other.name, s)))]
                status[other.name] = partly(other, len(done), unfinished(other, *held[0]) if held else idle(other))
            for key, p in recorded_progress(table, written, config_of).items():
                partial.setdefault(key, p)  # recorded by another process, from a directory not here
            # a recorded run this view does not show (another seed, or one run again that failed
            # or has not finished) stays recorded until a finished run of its seed replaces it
            shown = {(row_name, r["seed"]) for row_name, runs_ in results.items() for r in runs_}
            kept = {key: rec for key, rec in recorded.items() if key not in shown}
            return write_table(
                table,
                results,
                status,
                seeds,
                quick,
                out_md,
                out_json,
                per_row=asked is None,
                kept=kept,
                progress=partial,
            )

    failed: list[str] = []
    for row in table.rows:
        row_failed = row_idle = ""  # this pass's word on the row: an earlier view of it may be stale
        runs_here = row.name in chosen and not report_only
        results.pop(row.name, None)
        for s in seeds_of(row):
            if runs_here:
                status[row.name] = unfinished(row, s, os.getpid())
                doc = write(row.name)
            run_dir = run_dir_of(row.name, s)
            summary = finished_summary(run_dir)
            # finished in another checkout, its directory gone: read from the table unless run again
            if summary is None and (row.name, s) in recorded and not (rerun and runs_here):
                results.setdefault(row.name, []).append(recorded[(row.name, s)])
                continue
            if summary is None and not runs_here:
                row_idle = row_idle if row_idle not in ("", "not run") else unfinished(row, s)
                continue
            if runs_here and (pid := holder(run_dir)) not in (None, os.getpid()):
                row_idle = unfinished(row, s, pid)
                log(f"reproduce {name}: {row.name}, seed {s}: another process (pid {pid}) is running it; left to it")
                continue
            if runs_here:  # a finished run is reused, a stopped one resumed
                log(f"reproduce {name}: {row.name}, seed {s} -> {run_dir}")
                try:
                    summary = run_or_reuse(configs[(row.name, s)], run_dir, data_dir, progress, row.name)
                except UserError as err:  # this row cannot run here (data we lack): the others still can
                    unfinished(row, s)  # how far it got stays recorded
                    row_failed = f"failed: {err}"
                    failed.append(f"{row.name}, seed {s}: {err}")
                    log(f"reproduce {name}: {row.name}, seed {s} failed: {err}")
                    continue
            held = run_dir / ("authors_metric.json" if row.authors == "group" else f"authors_metric_{row.authors}.json")
            if held.exists():
                theirs = json.loads(held.read_text())["authors_metric"]
            else:
                theirs = authors_metric(stocfl.open_run(run_dir, data_dir).load(), row.authors)
                write_atomic(held, json.dumps({"authors_metric": theirs}) + "\n")
            result = {
                **{k: summary[k] for k in ("accuracy", "global_accuracy", "n_clusters", "ari", "seconds", "seed")},
                "threads": summary.get("threads"),
                "processor": summary.get("processor"),
                "torch": summary.get("torch"),
                "authors_metric": theirs,
                "heldout_accuracy": summary.get("heldout", {}).get("accuracy"),
                "macro_accuracy": summary.get("macro_accuracy", _macro_from_clients(run_dir)),
                "clients_at_target": summary.get("clients_at_target"),
            }
            if summary.get("eval_left_out"):  # its figures cover fewer clients than the row's setting
                result["eval_left_out"] = len(summary["eval_left_out"])
            if row.at_round is not None:
                result.update(authors_metric=None, **{row.metric: _at_round(run_dir, row)})
            result.update(
                rounds=summary["rounds"],
                authors=row.authors,
                date=_finished(run_dir),
                digest=stocfl.open_run(run_dir, data_dir).digest,
                curves=run_curves(table, run_dir),
            )
            held_run = recorded.get((row.name, s)) if rerun and runs_here else None
            # run again: its numbers must come back (a record with its curves is a run's own, to
            # the bit; one migrated from an older table, without curves, holds rounded figures:
            # compared at the decimals it holds)
            if held_run is not None:
                check = moved if held_run.get("curves") else moved_as_recorded
                said = check(held_run, result, RERUN_FIGURES)
                if said:  # said even when quiet: the same config gave other numbers
                    print(
                        f"reproduce {name}: {row.name}, seed {s}: WARNING run again under the same config, "
                        f"{', '.join(said)}; {where_run(held_run, result)}"
                    )
            results.setdefault(row.name, []).append(result)
            partial.pop((row.name, s), None)
        status[row.name] = row_failed or partly(row, len(results.get(row.name, [])), row_idle or "done")
        if left := sum(r.get("eval_left_out", 0) for r in results.get(row.name, [])):
            status[row.name] += f" ({left} client(s) failed to answer the final evaluation: left out of its figures)"
        doc = write(row.name if runs_here else None)
        going = {e["name"]: e["progress"] for e in doc["rows"] if e.get("progress")}
        if any(r.get("curves") for runs_ in [*results.values(), *going.values()] for r in runs_):
            plot_curves(table, results, out_png, going)  # else the PNG drawn with them stays
    if failed:
        raise UserError(
            f"reproduce {name}: {len(failed)} run(s) failed, the table holds the rest ({out_md}); first: {failed[0]}"
        )
    return doc


def recorded_runs(
    table: Table, written: tuple[dict[str, Any], dict[str, Any]], config_of: Callable[[Row, int], config.Config]
) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs the table's JSON (``written``, from :func:`_written`) records as finished, by
    (row, seed), whichever seeds the call that wrote it showed (``other_runs`` keeps the rest). A
    run is reused only when its digest is that of the row's config at its seed (``config_of``). Tables
    written before runs were recorded hold each row's mean over seeds; a row finished with one
    seed and the same overrides is read from it, its config file trusted unchanged, and kept
    with that config's digest from then on."""
    doc, entries = written
    found: dict[tuple[str, int], dict[str, Any]] = {}
    config_at = functools.partial(_config_at, config_of)

    threads = re.search(r"(\d+) torch thread", str(doc.get("machine", "")))
    written_on = str(doc.get("date") or "").split(" to ")[-1] or None  # the (last) day the table was written
    for row in table.rows:
        entry = entries.get(row.name)
        if not isinstance(entry, dict) or entry.get("set") != list(row.overrides):
            continue
        if "runs" in entry:
            for rec in [*entry["runs"], *(entry.get("other_runs") or [])]:
                cfg = config_at(row, rec.get("seed")) if isinstance(rec, dict) else None
                if (
                    cfg is not None
                    and rec.get("digest") == stocfl.config_digest(cfg)
                    and rec.get("authors", "group") == row.authors
                ):
                    # recorded before runs had dates: the table was written that day or after
                    found[(row.name, rec["seed"])] = rec if rec.get("date") else {**rec, "date": written_on}
            continue
        ours, seeds = entry.get("ours") or {}, entry.get("seeds") or []
        if ours.get("n") != 1 or len(seeds) != 1 or (cfg := config_at(row, seeds[0])) is None:
            continue
        theirs = entry.get("authors_metric") or {}
        rec = {k: None for k in ("accuracy", "global_accuracy", "heldout_accuracy", "macro_accuracy", "ari")}
        rec.update(
            {
                row.metric: ours["mean"] / METRICS[row.metric][1],
                "authors_metric": theirs["mean"] / 100.0 if theirs else None,
                "n_clusters": (entry.get("clusters") or [None])[0],
                "seconds": (entry.get("seconds") or [0.0])[0],
                "seed": seeds[0],
                "threads": int(threads.group(1)) if threads else None,
                "rounds": cfg.run.rounds,
                "digest": stocfl.config_digest(cfg),
                "curves": None,
                "date": written_on,
            }
        )
        if row.metric != "ari" and entry.get("ari"):
            rec["ari"] = entry["ari"][0]
        found[(row.name, seeds[0])] = rec
    return found


def _check_data(
    table: Table,
    chosen: set[str],
    seeds_of: Callable[[Row], list[int]],
    config_of: Callable[[Row, int], config.Config],
    data_dir: str | None,
    to_run: Callable[[Row, int], bool],
) -> None:
    """One line for the chosen rows whose runs need a data directory this call lacks (none
    given, or not a directory), naming them by number, before anything runs."""

    lacking: dict[str, list[int]] = {}
    for n, row in enumerate(table.rows, 1):
        for s in [s for s in seeds_of(row) if to_run(row, s)] if row.name in chosen else []:
            cfg = config_of(row, s)
            try:
                data_root(cfg.scenario.dataset, cfg.scenario.data_dir or data_dir)
            except UserError as err:
                lacking.setdefault(str(err), []).append(n)
                break
    for why, numbers in lacking.items():
        raise UserError(f"reproduce {table.name}: row(s) {id_ranges(numbers)} cannot run: {why}; nothing was run")


def select_rows(table: Table, rows: str | None) -> set[str]:
    """The names of the rows ``rows`` picks: 1-based numbers and ranges, e.g. "2,4-6"."""
    names = [row.name for row in table.rows]
    if rows is None:
        return set(names)
    listed = "; ".join(f"{i}: {n}" for i, n in enumerate(names, 1))
    chosen = set()
    for item in rows.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not (lo.isdigit() and (hi.isdigit() or not dash) and 1 <= int(lo) <= int(hi or lo) <= len(names)):
            raise UserError(
                f"reproduce --rows {rows!r}: {item.strip()!r} is not a row number or range of "
                f"{table.name}'s rows 1 to {len(names)} ({listed})"
            )
        chosen.update(names[int(lo) - 1 : int(hi or lo)])
    return chosen


def _macro_from_clients(run_dir: Path) -> float | None:
    """The plain mean of clients.csv's accuracies, for runs finished before summary.json
    carried ``macro_accuracy``."""
    import csv

    try:
        with open(run_dir / "clients.csv", newline="") as f:
            accs = [float(r["accuracy"]) for r in csv.DictReader(f) if int(r["test_samples"]) > 0]
    except (OSError, KeyError, ValueError):
        return None
    return float(np.mean(accs)) if accs else None


def _at_round(run_dir: Path, row: Row) -> float | None:

    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if r["round"] == row.at_round:
            if r.get(row.metric) is None:
                raise UserError(
                    f"reproduce: row {row.name!r} reads {row.metric} at round {row.at_round}, where "
                    f'{run_dir} did not evaluate; add "run.eval_rounds=[{row.at_round}]" to the row\'s set'
                )
            return r[row.metric]
    raise UserError(f"reproduce: row {row.name!r} reads round {row.at_round}; {run_dir} has no such round")


def _recorded(table: Table, path: Path) -> str:
    """How far the table's written ``TABLE.json`` got: its rows done, and those stopped or running."""
    try:
        doc = read_table_record(path)
    except UserError:
        return "its record is damaged (stocfl-lab reproduce TABLE --report says how)"
    if doc is None:
        return "not run yet"
    if doc.get("table") != table.name:
        return f"its record is table {doc.get('table')!r}'s (stocfl-lab reproduce TABLE --report says how)"
    status = {r["name"]: r.get("status", "not run") for r in doc["rows"]}
    states = [status.get(r.name, "not run") for r in table.rows]
    done = sum(s == "done" for s in states)
    others = [f"{n} {kind}" for kind in ("stopped", "running") if (n := sum(s.startswith(kind) for s in states))]
    return ", ".join([f"{done} of {len(states)} rows done", *others])


def listing(root: Path = ROOT) -> str:
    lines = []
    for name in tables(root):
        t = load_table(name, root)
        runs = len({tuple(sorted(r.overrides)) for r in t.rows})  # rows of one config share its runs
        rows = f"{len(t.rows)} rows, {runs} runs" if runs != len(t.rows) else f"{runs} runs"
        lines.append(
            f"{name}: {t.title} ({rows} per seed; seeds {_seeds_text(t)}; "
            f"{_recorded(t, table_files(name, root=root)[1])})"
        )
    if not lines:
        raise UserError(
            f"reproduce --list: no tables in {root}; run from a clone's root (its reproductions/) or pass --tables DIR"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def _data_problems(
    items: list[dict[str, Any]], configs: dict[tuple[str, str], tuple[Path, tuple[str, ...]]], data_dir: str
):
    """Set each pending item's ``cannot`` to why its federation cannot be built from ``data_dir``
    (the data set absent, or too small for the scenario: a partial Fashion-MNIST), or None.
    ``configs``: (table, row) -> the table's config and the row's overrides. Each distinct
    scenario and seed is built once; nothing is trained."""
    built: dict[tuple[str, int], str | None] = {}
    for i in items:
        path, overrides = configs[(i["table"], i["row"])]
        try:
            cfg = stocfl.load_config(path, [*overrides, f"run.seed={i['seed']}"], data_dir)
        except UserError as err:
            i["cannot"] = str(err)
            continue
        key = (cfg.scenario.model_dump_json(), cfg.run.seed)
        if key not in built:
            try:
                build_federation(cfg)
                built[key] = None
            except UserError as err:
                built[key] = str(err)
        i["cannot"] = built[key]


def pending(root: Path = ROOT, data_dir: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """Every declared (table, run, seed) no record finishes, rows of one config sharing a run,
    cheapest first: each with the median seconds of its config's recorded runs (other seeds; None
    where none ran) and the processors those ran on (a GPU's seconds say little of this CPU's).
    With ``data_dir``, each is checked against it (its federation built, nothing trained): those
    that cannot run with it are listed apart, with the reason, and not counted as runnable.
    Then every finished run recorded without its curve (migrated from an older table): to run
    again with ``--rerun``, each with the seconds it took."""
    items: list[dict[str, Any]] = []
    legacy: list[dict[str, Any]] = []
    configs: dict[tuple[str, str], tuple[Path, tuple[str, ...]]] = {}  # (table, row) -> its config, overrides
    for name in tables(root):
        t = load_table(name, root)
        configs.update({(name, row.name): (t.config, row.overrides) for row in t.rows})
        recorded = _written(t, table_files(name, root=root)[1], False)[1]
        runs_of: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for row in t.rows:  # a config's runs, whichever of its rows records them
            entry = recorded.get(row.name) or {}
            runs_of.setdefault(tuple(sorted(row.overrides)), []).extend(
                [*entry.get("runs", []), *entry.get("other_runs", [])]
            )
        seen: set[tuple[tuple[str, ...], int]] = set()
        seen_legacy: set[tuple[tuple[str, ...], int]] = set()  # a run once, whichever row records it
        for number, row in enumerate(t.rows, 1):
            config = tuple(sorted(row.overrides))
            done = runs_of[config]
            timed = [r for r in done if r.get("seconds")]
            for r in done:
                if not r.get("curves") and (config, r["seed"]) not in seen_legacy:
                    seen_legacy.add((config, r["seed"]))
                    legacy.append(
                        {
                            "table": name,
                            "row": row.name,
                            "number": number,
                            "seed": r["seed"],
                            "seconds": r.get("seconds"),
                        }
                    )
            for s in t.seeds_of(row):
                if any(r["seed"] == s for r in done) or (config, s) in seen:
                    continue
                seen.add((config, s))
                items.append(
                    {
                        "table": name,
                        "row": row.name,
                        "seed": s,
                        "seconds": float(np.median([r["seconds"] for r in timed])) if timed else None,
                        "measured_on": sorted({str(r.get("processor") or "unknown") for r in timed}),
                    }
                )
    items.sort(key=lambda i: (i["seconds"] is None, i["seconds"] or 0.0))
    if data_dir is not None:
        _data_problems(items, configs, data_dir)
    runnable = [i for i in items if not i.get("cannot")]
    known = [i["seconds"] for i in runnable if i["seconds"] is not None]
    gpu = sum(1 for i in runnable if any("NVIDIA" in p for p in i["measured_on"]))
    lines = [
        f"{i['table']}: {i['row']}, seed {i['seed']}: "
        + (
            f"about {_duration(i['seconds'])} as its recorded seeds took ({', '.join(i['measured_on'])})"
            if i["seconds"] is not None
            else "no run of its config recorded yet"
        )
        for i in runnable
    ]
    lines.append(
        f"{len(runnable)} runs pending: {len(known)} with a recorded time, about {sum(known) / 3600:.0f} hours in "
        f"all as their recorded seeds took ({gpu} of them measured on a GPU), {len(runnable) - len(known)} never run"
        + ("" if data_dir is not None else "; the data they need not checked (pass --data-dir to check it)")
    )
    cannot: dict[str, list[str]] = {}
    for i in items:
        if i.get("cannot"):
            cannot.setdefault(i["cannot"], []).append(f"{i['table']}: {i['row']}, seed {i['seed']}")
    for why, runs in cannot.items():
        lines += [f"{r}: cannot run with {data_dir}" for r in runs]
        lines.append(f"{len(runs)} runs above cannot run with {data_dir}: {why}")
    for i in legacy:
        took = f"it took {_duration(i['seconds'])}" if i["seconds"] else "its time not recorded"
        lines.append(
            f"{i['table']}: {i['row']}, seed {i['seed']}: recorded without its curve ({took}); "
            f"stocfl-lab reproduce {i['table']} --rerun --rows {i['number']} --seeds {i['seed']}"
        )
    if legacy:
        hours = sum(i["seconds"] or 0.0 for i in legacy) / 3600
        lines.append(f"{len(legacy)} finished runs recorded without their curves, about {hours:.0f} hours to run again")
    return items, "\n".join(lines)


__all__ = ["authors_metric", "listing", "load_table", "pending", "reproduce", "tables"]
