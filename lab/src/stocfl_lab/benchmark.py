"""``stocfl-lab benchmark``: the clustered-FL benchmark, every method on the shift taxonomy.

The grid is declared in a TOML file (``benchmark/grid.toml``): methods (registry names and the
overrides their papers need), scenarios (the overrides that build each federation, its family,
its number of true groups ``k`` and a target accuracy), participation rates, seeds, and the
overrides every run shares. A cell is method x scenario x participation; its runs are its seeds.

Every run is an ordinary run directory under ``benchmark/runs/`` (never committed), so a stopped
benchmark goes on where it stopped. Each finished run is recorded in ``BENCHMARK.json`` with the
digest of its config and its figures; a run recorded for the config asked is reused when its
directory is gone (a fresh clone). ``--shard I/N`` runs the cells whose index is I modulo N, so
processes and machines share a grid; shards on one machine write the one file under a lock,
and ``--merge`` folds in the files other machines wrote. The leaderboard page is written from
the JSON alone (``--page``), so it can be regenerated anywhere.

Per cell: mean and 95% confidence interval over seeds (Student's t) of accuracy (weighted by
test size, and the plain mean over clients), the 10th percentile and the worst client, ARI and
NMI where true groups exist, the mixture distance where clients are mixtures, clusters found,
the first round that reaches the scenario's target accuracy, the bytes of tensors sent to and
from clients per round (counted from the tasks and replies, whatever the engine) and wall time.
Methods are ranked per (scenario, participation) by mean accuracy; the page gives mean ranks,
Friedman's test over all methods and Nemenyi's critical difference (Demsar 2006).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import stocfl
from stocfl.errors import UserError
from stocfl.experiment import run_or_reuse
from stocfl.storage import exclusive, read_jsonl, write_atomic

GRID = Path("benchmark/grid.toml")
# what a run's summary gives each cell (summary key -> its name on the page)
FIGURES = {
    "accuracy": "accuracy",
    "macro_accuracy": "macro accuracy",
    "accuracy_p10": "10th-percentile client",
    "worst_client_accuracy": "worst client",
    "ari": "ARI",
    "nmi": "NMI",
    "mixture_tv": "mixture distance",
    "n_clusters": "clusters found",
}


@dataclass(frozen=True)
class Method:
    name: str
    set: tuple[str, ...] = ()
    role: str = "clustered"  # or "reference" (FedAvg, FedProx, Ditto)


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    k: int
    target: float
    set: tuple[str, ...]
    quick_only: bool = False


@dataclass(frozen=True)
class Cell:
    method: Method
    scenario: Scenario
    participation: float

    @property
    def key(self) -> str:
        return f"{self.method.name} / {self.scenario.name} / {self.participation:g}"


@dataclass(frozen=True)
class Grid:
    title: str
    seeds: tuple[int, ...]
    participation: tuple[float, ...]
    base: tuple[str, ...]
    methods: tuple[Method, ...]
    scenarios: tuple[Scenario, ...]
    quick: dict[str, Any] = field(default_factory=dict)

    def cells(self, quick: bool = False) -> list[Cell]:
        """Every cell, in a fixed order (scenario, participation, method): the order shards split."""
        methods, scenarios, parts = self.methods, self.scenarios, self.participation
        if quick:
            methods = tuple(m for m in methods if m.name in self.quick.get("methods", []))
            scenarios = tuple(s for s in scenarios if s.name in self.quick.get("scenarios", []))
            parts = tuple(self.quick.get("participation", parts))
        else:
            scenarios = tuple(s for s in scenarios if not s.quick_only)
        return [Cell(m, s, p) for s in scenarios for p in parts for m in methods]

    def seeds_for(self, quick: bool) -> tuple[int, ...]:
        return tuple(self.quick.get("seeds", self.seeds)) if quick else self.seeds

    def config(self, cell: Cell, seed: int, quick: bool = False, data_dir: str | None = None):
        """The run's config: the base, the scenario, the method (``{k}``: the scenario's true
        groups), the participation and the seed, then the quick grid's overrides."""
        sets = [
            *self.base,
            *cell.scenario.set,
            f"algorithm.name={cell.method.name}",
            *(s.replace("{k}", str(cell.scenario.k)) for s in cell.method.set),
            f"run.sample_rate={cell.participation:g}",
            f"run.seed={seed}",
            *(self.quick.get("set", []) if quick else []),
        ]
        return stocfl.load_config(None, sets, data_dir=data_dir)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: expected a list of strings (overrides KEY=VALUE)")
    return tuple(value)


def load_grid(path: str | Path = GRID) -> Grid:
    """The grid declared in ``path``, checked: names known, every method and scenario once."""
    from stocfl.algorithms import ALGORITHMS

    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"benchmark grid {path}: cannot be read ({err}); pass --grid FILE") from None
    try:
        methods = tuple(
            Method(m["name"], _strings(m.get("set", []), f"{path}: method {m['name']}"), m.get("role", "clustered"))
            for m in raw["method"]
        )
        scenarios = tuple(
            Scenario(
                s["name"],
                s["family"],
                int(s["k"]),
                float(s["target"]),
                _strings(s["set"], f"{path}: scenario {s['name']}"),
                bool(s.get("quick_only", False)),
            )
            for s in raw["scenario"]
        )
        grid = Grid(
            str(raw["title"]),
            tuple(int(x) for x in raw["seeds"]),
            tuple(float(x) for x in raw["participation"]),
            _strings(raw.get("base", []), f"{path}: base"),
            methods,
            scenarios,
            dict(raw.get("quick", {})),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"benchmark grid {path}: {type(err).__name__} {err}; see benchmark/grid.toml for the form"
        ) from None
    for what, names in (("method", [m.name for m in methods]), ("scenario", [s.name for s in scenarios])):
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise UserError(f"benchmark grid {path}: {what} {sorted(twice)[0]!r} is declared twice")
    unknown = [m.name for m in methods if m.name not in ALGORITHMS]
    if unknown:
        raise UserError(f"benchmark grid {path}: unknown method {unknown[0]!r}; choose among {', '.join(ALGORITHMS)}")
    return grid


# ---- one run's figures ------------------------------------------------------------------------


def rounds_to(rows: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated round whose accuracy reaches ``target`` (None: none did)."""
    return next((r["round"] for r in rows if r.get("accuracy") is not None and r["accuracy"] >= target), None)


def figures(summary: dict[str, Any], rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """What the benchmark records of one finished run."""
    out = {k: summary.get(k) for k in FIGURES}
    traffic = [(r.get("bytes_down"), r.get("bytes_up")) for r in rows]
    out["rounds_to_target"] = rounds_to(rows, target)
    out["bytes_down_per_round"] = (
        float(np.mean([d for d, _ in traffic])) if all(d is not None for d, _ in traffic) else None
    )
    out["bytes_up_per_round"] = (
        float(np.mean([u for _, u in traffic])) if all(u is not None for _, u in traffic) else None
    )
    out["seconds"] = round(float(sum(r.get("seconds", 0.0) for r in rows)), 2)
    return out


# ---- the record -------------------------------------------------------------------------------


def read_record(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"runs": {}}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is unreadable ({err}); restore it from git or remove it to start over") from None
    if not isinstance(record, dict) or not isinstance(record.get("runs"), dict):
        raise UserError(f"{path} is not a benchmark record (no 'runs'); restore it from git or remove it")
    return record


def _save_run(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one run to the record under a lock: shards on one machine share the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path.parent, wait=True, lock=".benchmark.lock"):
        record = read_record(path)
        record["runs"][key] = entry
        write_atomic(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())


def merge(path: Path, others: list[Path]) -> int:
    """Fold the runs recorded in ``others`` (other machines' records) into ``path``; a run
    recorded in both under different digests is refused: they ran different configs."""
    with exclusive(path.parent, wait=True, lock=".benchmark.lock"):
        record = read_record(path)
        added = 0
        for other in others:
            for key, entry in read_record(other)["runs"].items():
                held = record["runs"].get(key)
                if held is not None and held["digest"] != entry["digest"]:
                    raise UserError(f"{other}: run {key!r} has another config than in {path}; keep one of them")
                if held is None:
                    record["runs"][key] = entry
                    added += 1
        write_atomic(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return added


# ---- running the grid -------------------------------------------------------------------------


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected I/N, e.g. 0/4 (cells I, I + N, ...)") from None
    if not 0 <= i < n:
        raise UserError(f"--shard {text!r}: expected 0 <= I < N")
    return i, n


def run(
    grid: Grid,
    record: Path,
    runs: Path,
    quick: bool = False,
    shard: tuple[int, int] = (0, 1),
    data_dir: str | None = None,
    progress: bool = False,
    log=print,
    only: str | None = None,
) -> dict[str, int]:
    """Run (or reuse) every (cell, seed) of this shard (``only``: the cells whose key, "method /
    scenario / participation", matches this shell pattern); returns counts of runs run and reused."""
    import fnmatch

    counts = {"ran": 0, "reused": 0}
    cells = grid.cells(quick)
    if only is not None:
        cells = [c for c in cells if fnmatch.fnmatchcase(c.key, only)]
        if not cells:
            raise UserError(f"--only {only!r} matches no cell; cells are named 'method / scenario / participation'")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, stocfl {stocfl.__version__}"
    for index, cell in enumerate(cells):
        if index % shard[1] != shard[0]:
            continue
        for seed in grid.seeds_for(quick):
            cfg = grid.config(cell, seed, quick, data_dir)
            digest = stocfl.config_digest(cfg)
            key = f"{cell.key} / seed {seed}"
            held = read_record(record)["runs"].get(key)
            if held is not None and held["digest"] == digest:
                counts["reused"] += 1
                continue
            # the digest in the name: a grid whose settings changed runs anew beside the old run
            out = (
                runs / cell.scenario.name / f"p{cell.participation:g}" / cell.method.name / f"seed{seed}-{digest[:10]}"
            )
            t = time.perf_counter()
            summary = run_or_reuse(cfg, out, data_dir, progress, label=cell.method.name)
            rows = read_jsonl(out / "metrics.jsonl")
            entry = {
                "cell": cell.key,
                "method": cell.method.name,
                "scenario": cell.scenario.name,
                "family": cell.scenario.family,
                "participation": cell.participation,
                "seed": seed,
                "quick": quick,
                "digest": digest,
                "figures": figures(summary, rows, cell.scenario.target),
                "curve": [[r["round"], r["accuracy"]] for r in rows if r.get("accuracy") is not None],
                "wall_seconds": round(time.perf_counter() - t, 2),
                "machine": machine,
                "date": time.strftime("%Y-%m-%d"),
            }
            _save_run(record, key, entry)
            counts["ran"] += 1
            log(f"{key}: accuracy {entry['figures']['accuracy']}")
    return counts


# ---- statistics and the page ------------------------------------------------------------------


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% confidence interval (Student's t; None for one value)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), None
    return float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))


def cells_of(record: dict[str, Any], quick: bool) -> dict[str, dict[str, Any]]:
    """Per cell: its runs' figures gathered over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for entry in record["runs"].values():
        if bool(entry.get("quick")) != quick:
            continue
        cell = out.setdefault(
            entry["cell"],
            {k: entry[k] for k in ("method", "scenario", "family", "participation")} | {"runs": []},
        )
        cell["runs"].append(entry)
    return out


def ranks(cells: dict[str, dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Mean rank of each method by mean accuracy over the (scenario, participation) pairs where
    every method has a figure (rank 1 best; ties share their mean rank), Friedman's test and
    Nemenyi's critical difference at 0.05."""
    from scipy import stats

    table: dict[tuple[str, float], dict[str, float]] = {}
    for c in cells.values():
        accs = [r["figures"]["accuracy"] for r in c["runs"] if r["figures"]["accuracy"] is not None]
        if accs:
            table.setdefault((c["scenario"], c["participation"]), {})[c["method"]] = float(np.mean(accs))
    complete = [row for row in table.values() if all(m in row for m in methods)]
    if not complete or len(methods) < 2:
        return {"pairs": len(complete), "mean_rank": {}, "friedman_p": None, "cd": None}
    r = np.array([stats.rankdata([-row[m] for m in methods]) for row in complete])
    k, n = len(methods), len(complete)
    out: dict[str, Any] = {"pairs": n, "mean_rank": dict(zip(methods, r.mean(0).round(3).tolist()))}
    out["friedman_p"] = float(stats.friedmanchisquare(*r.T).pvalue) if k >= 3 and n >= 2 else None
    q = stats.studentized_range.ppf(0.95, k, np.inf) / math.sqrt(2)
    out["cd"] = float(q * math.sqrt(k * (k + 1) / (6 * n)))
    return out


def _fmt(values: list[float | None], scale: float = 100.0, digits: int = 1) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    mean, ci = mean_ci([v * scale for v in got])
    missing = "" if len(got) == len(values) else f" ({len(got)}/{len(values)})"
    return f"{mean:.{digits}f}" + ("" if ci is None else f" ± {ci:.{digits}f}") + missing


def page(grid: Grid, record: dict[str, Any], quick: bool = False) -> str:
    """The leaderboard as Markdown, from the record alone."""
    cells = cells_of(record, quick)
    expected = grid.cells(quick)
    methods = list(dict.fromkeys(c.method.name for c in expected))  # every method of the grid, run or not
    n_seeds = len(grid.seeds_for(quick))
    runs = [r for c in cells.values() for r in c["runs"]]
    spent = sum(r["wall_seconds"] for r in runs)
    lines = [
        f"# {grid.title}" + (" (quick grid)" if quick else ""),
        "",
        "<!-- written by `stocfl-lab benchmark --page` from benchmark/BENCHMARK.json: do not edit -->",
        "",
        f"{len(cells)} of {len(expected)} cells have runs; {sum(len(c['runs']) for c in cells.values())} of "
        f"{len(expected) * n_seeds} runs are recorded. Each figure is the mean ± the half-width of its 95% "
        f"confidence interval over seeds (Student's t); (m/n): only m of the cell's n runs have the figure. "
        f"A cell not yet run is *pending*.",
        "",
        f"Cost so far: {spent / 3600:.2f} hours of wall time for the {len(runs)} runs recorded"
        + (
            f" ({spent / len(runs):.0f} s a run on average, on {', '.join(sorted({r['machine'] for r in runs}))})."
            if runs
            else "."
        )
        + " Not counted yet: the client-side FLOPs of a round (they need each task kind's cost model). Not in the "
        "grid yet: quantity skew (no scenario varies only the clients' sizes) and the tuned second row of each "
        "method (the protocol is on the design page).",
        "",
    ]
    families: dict[str, list[Scenario]] = {}
    for s in grid.scenarios:
        if s.quick_only == quick or (quick and s.name in grid.quick.get("scenarios", [])):
            families.setdefault(s.family, []).append(s)
    parts = grid.quick.get("participation", grid.participation) if quick else grid.participation
    for family, scenarios in families.items():
        lines += [f"## {family}", ""]
        for p in parts:
            head = ["method"] + [f"{s.name} (k={s.k})" for s in scenarios]
            lines += [
                f"Accuracy (%), participation {p:g}:",
                "",
                "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head),
            ]
            for m in methods:
                row = [m]
                for s in scenarios:
                    c = cells.get(f"{m} / {s.name} / {p:g}")
                    row.append("*pending*" if c is None else _fmt([r["figures"]["accuracy"] for r in c["runs"]]))
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
        lines += [f"Per cell, {family}: the other figures", ""]
        head = [
            "cell",
            "macro acc. (%)",
            "p10 client (%)",
            "worst (%)",
            "ARI",
            "clusters",
            "rounds to target",
            "kB down / round",
            "kB up / round",
            "seconds",
        ]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in scenarios:
            for p in parts:
                for m in methods:
                    c = cells.get(f"{m} / {s.name} / {p:g}")
                    if c is None:
                        continue
                    f = [r["figures"] for r in c["runs"]]
                    lines.append(
                        "| "
                        + " | ".join(
                            [
                                f"{m} / {s.name} / {p:g}",
                                _fmt([x["macro_accuracy"] for x in f]),
                                _fmt([x["accuracy_p10"] for x in f]),
                                _fmt([x["worst_client_accuracy"] for x in f]),
                                _fmt([x["ari"] for x in f], 1.0, 3) if s.k > 1 else "-",
                                _fmt([x["n_clusters"] for x in f], 1.0, 1),
                                _fmt([x["rounds_to_target"] for x in f], 1.0, 1),
                                _fmt([x["bytes_down_per_round"] for x in f], 1e-3, 0),
                                _fmt([x["bytes_up_per_round"] for x in f], 1e-3, 0),
                                _fmt([x["seconds"] for x in f], 1.0, 1),
                            ]
                        )
                        + " |"
                    )
        lines.append("")
    rk = ranks(cells, methods)
    lines += ["## Ranks", ""]
    if rk["mean_rank"]:
        order = sorted(rk["mean_rank"], key=rk["mean_rank"].get)
        lines += [
            f"Mean rank by accuracy over the {rk['pairs']} (scenario, participation) pairs where every method "
            f"has runs (1 = best). Friedman's test: p = {rk['friedman_p']:.3g}"
            if rk["friedman_p"] is not None
            else f"Mean rank by accuracy over the {rk['pairs']} (scenario, participation) pairs where every "
            f"method has runs (1 = best).",
            f"Nemenyi's critical difference at 0.05: {rk['cd']:.2f}; two methods whose mean ranks differ by "
            f"less are not told apart by these runs.",
            "",
            "| method | mean rank |",
            "|---|---|",
            *(f"| {m} | {rk['mean_rank'][m]:.2f} |" for m in order),
            "",
        ]
    else:
        lines += ["No (scenario, participation) pair has runs of every method yet.", ""]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    grid = load_grid(args.grid or GRID)
    quick = bool(args.quick)
    # the quick grid's runs go to a record of their own, never into the committed one
    name = "BENCHMARK-quick.json" if quick else "BENCHMARK.json"
    record = Path(args.record or Path(args.grid or GRID).parent / name)
    if args.merge:
        added = merge(record, [Path(m) for m in args.merge])
        print(f"stocfl-lab benchmark: {added} runs added to {record}")
    elif not args.page:
        runs = Path(args.runs or Path(args.grid or GRID).parent / "runs")
        counts = run(
            grid,
            record,
            runs,
            quick,
            parse_shard(args.shard),
            args.data_dir,
            not args.quiet,
            log=(lambda m: None) if args.quiet else print,
            only=args.only,
        )
        print(f"stocfl-lab benchmark: {counts['ran']} runs run, {counts['reused']} reused ({record})")
    out = Path(args.out) if args.out else None
    text = page(grid, read_record(record), quick)
    if out is not None:
        write_atomic(out, text.encode())
        print(f"stocfl-lab benchmark: the leaderboard is in {out}")
    return 0
