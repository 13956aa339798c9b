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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import stocfl
from stocfl.errors import InUse, UserError
from stocfl.experiment import run_or_reuse, shed_state
from stocfl.storage import exclusive, read_jsonl, write_atomic
from stocfl_lab.records import Check, int_or_none, load_json, number, number_or_none, problem
from stocfl_lab.rerun import moved, where_run

GRID = Path("benchmark/grid.toml")
# The figures a recorded run carries; a run recorded with an older set is run again (its
# numbers must come out the same: the config is the same) so that every run has every figure.
# 2: client FLOPs per round and CPU seconds.
FIGURES_VERSION = 2
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
    tune: tuple[tuple[str, ...], ...] | None = None  # its own tuning settings (None: the grid's)
    # the knob that sets its number of clusters (a threshold, or a count it is told): the
    # settings tried besides its default, at the step tuning chose (the budget's size less one)
    knob: tuple[tuple[str, ...], ...] = ()

    def knob_on(self, scenario: Scenario) -> bool:
        """Whether the knob is tuned on ``scenario``: a count the method is told (a ``{k}``
        override) is tuned only where the scenario has no planted groups to tell (k = 1)."""
        told = {s.split("=", 1)[0] for s in self.set if "{k}" in s}
        return bool(self.knob) and not (
            scenario.k > 1 and {x.split("=", 1)[0] for setting in self.knob for x in setting} <= told
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    k: int
    target: float
    set: tuple[str, ...]
    quick_only: bool = False
    tune_on: str = ""  # the scenario whose tuning choice this one takes (a drifting one: its base)


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
    tune: dict[str, Any] = field(default_factory=dict)

    def tune_protocol(self, quick: bool = False) -> dict[str, Any]:
        """The tuning protocol: its seed, participation, validation fraction and settings."""
        return self.tune | (self.quick.get("tune", {}) if quick else {})

    def tune_settings(self, method: str, quick: bool = False) -> tuple[tuple[str, ...], ...]:
        """The settings ``method`` is tried at: its own, else the protocol's (the same budget)."""
        own = next(m.tune for m in self.methods if m.name == method)
        if own is None or (quick and "settings" in self.quick.get("tune", {})):
            return tuple(tuple(x) for x in self.tune_protocol(quick)["settings"])
        return own

    def knob_settings(self, method: str, quick: bool = False) -> tuple[tuple[str, ...], ...]:
        """The settings of ``method``'s knob tried besides its default (the quick grid: as many as
        its budget allows)."""
        knob = next(m.knob for m in self.methods if m.name == method)
        return knob[: len(self.tune_protocol(quick)["settings"]) - 1] if quick else knob

    def knob_on(self, method: str, scenario: Scenario) -> bool:
        """Whether ``method``'s knob is tuned on ``scenario`` (or the scenario it is tuned on)."""
        on = next((s for s in self.scenarios if s.name == scenario.tune_on), scenario)
        return next(m for m in self.methods if m.name == method).knob_on(on)

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

    def config(
        self, cell: Cell, seed: int, quick: bool = False, data_dir: str | None = None, extra: list[str] | None = None
    ):
        """The run's config: the base, the scenario, the method (``{k}``: the scenario's true
        groups), the participation and the seed, then the quick grid's overrides, then ``extra``
        (a tuning setting). A scenario without planted groups (k = 1) has no number to tell: a
        method's overrides with ``{k}`` are left out there, and it runs at its own default
        number of clusters, its paper's (told 1, IFCA or FedEM would be FedAvg)."""
        k = cell.scenario.k
        sets = [
            *self.base,
            *cell.scenario.set,
            f"algorithm.name={cell.method.name}",
            *(s.replace("{k}", str(k)) for s in cell.method.set if k > 1 or "{k}" not in s),
            f"run.sample_rate={cell.participation:g}",
            f"run.seed={seed}",
            *(self.quick.get("set", []) if quick else []),
            *(extra or []),
        ]
        return stocfl.load_config(None, sets, data_dir=data_dir)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: expected a list of strings (overrides KEY=VALUE)")
    return tuple(value)


def _settings(value: Any, where: str) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: expected a list of settings, each a list of overrides KEY=VALUE")
    return tuple(_strings(v, where) for v in value)


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
            Method(
                m["name"],
                _strings(m.get("set", []), f"{path}: method {m['name']}"),
                m.get("role", "clustered"),
                None if "tune" not in m else _settings(m["tune"], f"{path}: method {m['name']}: tune"),
                () if "knob" not in m else _settings(m["knob"], f"{path}: method {m['name']}: knob"),
            )
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
                str(s.get("tune_on", "")),
            )
            for s in raw["scenario"]
        )
        tune = dict(raw["tune"])
        tune = {
            "seed": int(tune["seed"]),
            "participation": float(tune["participation"]),
            "validation": float(tune["validation"]),
            "settings": _settings(tune["settings"], f"{path}: tune.settings"),
        }
        grid = Grid(
            str(raw["title"]),
            tuple(int(x) for x in raw["seeds"]),
            tuple(float(x) for x in raw["participation"]),
            _strings(raw.get("base", []), f"{path}: base"),
            methods,
            scenarios,
            dict(raw.get("quick", {})),
            tune,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"benchmark grid {path}: {type(err).__name__} {err}; see benchmark/grid.toml for the form"
        ) from None
    for what, names in (("method", [m.name for m in methods]), ("scenario", [s.name for s in scenarios])):
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise UserError(f"benchmark grid {path}: {what} {sorted(twice)[0]!r} is declared twice")
    budget = len(grid.tune["settings"])
    for m in methods:
        if m.tune is not None and len(m.tune) != budget:
            raise UserError(
                f"benchmark grid {path}: method {m.name!r} declares {len(m.tune)} tuning settings, the budget is "
                f"{budget} (tune.settings): every method gets the same"
            )
        if m.knob and len(m.knob) != budget - 1:
            raise UserError(
                f"benchmark grid {path}: method {m.name!r} declares {len(m.knob)} knob settings; the budget is its "
                f"default and {budget - 1} others (tune.settings has {budget}): every method gets the same"
            )
    names = {s.name: s for s in scenarios}
    for s in scenarios:
        if s.tune_on and (s.tune_on not in names or names[s.tune_on].tune_on):
            raise UserError(
                f"benchmark grid {path}: scenario {s.name!r}: tune_on = {s.tune_on!r} is not a scenario tuned on itself"
            )
    unknown = [m.name for m in methods if m.name not in ALGORITHMS]
    if unknown:
        raise UserError(f"benchmark grid {path}: unknown method {unknown[0]!r}; choose among {', '.join(ALGORITHMS)}")
    # every method's settings are built once here (a config is checked as it is built), so that a
    # misspelt key or a value out of range is one line now, not a run that fails hours into a stage
    # (a method's {k} overrides apply only where groups are planted: one scenario of each kind)
    kinds = list({s.k > 1: s for s in scenarios}.values())
    for s in scenarios:
        _built(grid, Cell(methods[0], s, grid.participation[0]), [], f"benchmark grid {path}: scenario {s.name!r}")
    for m in methods:
        for what, settings in (("set", [()]), ("tune", m.tune or grid.tune["settings"]), ("knob", m.knob)):
            for setting in settings:
                for s in kinds:
                    said = f"benchmark grid {path}: method {m.name!r}" + (
                        f": {what} {list(setting)}" if setting else ""
                    )
                    _built(grid, Cell(m, s, grid.participation[0]), list(setting), said)
    return grid


def _built(grid: Grid, cell: Cell, extra: list[str], said: str) -> None:
    """``cell``'s config with ``extra`` is built (and so checked), else one line after ``said``."""
    try:
        grid.config(cell, grid.seeds[0], extra=extra)
    except UserError as err:
        raise UserError(f"{said}: {err}") from None


# ---- one run's figures ------------------------------------------------------------------------


def _cpu_seconds() -> float:
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def rounds_to(rows: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated round whose accuracy reaches ``target`` (None: none did)."""
    return next((r["round"] for r in rows if r.get("accuracy") is not None and r["accuracy"] >= target), None)


def figures(summary: dict[str, Any], rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """What the benchmark records of one finished run."""
    out = {k: summary.get(k) for k in FIGURES}
    out["rounds_to_target"] = rounds_to(rows, target)
    for key in ("bytes_down", "bytes_up", "flops"):
        values = [r.get(key) for r in rows]  # every round's, or none: a mean of some rounds misleads
        out[f"{key}_per_round"] = float(np.mean(values)) if values and None not in values else None
    out["seconds"] = round(float(sum(r.get("seconds", 0.0) for r in rows)), 2)
    return out


# ---- the record -------------------------------------------------------------------------------


def read_record(path: Path) -> dict[str, Any]:
    record = load_json(path, "restore it from git or remove it to start over")
    if record is None:
        return {"runs": {}}
    if not isinstance(record, dict) or not isinstance(record.get("runs"), dict):
        raise UserError(f"{path} is not a benchmark record (no 'runs'); restore it from git or remove it")
    for key, entry in record["runs"].items():
        problem = _entry_problem(entry)
        if problem:
            raise UserError(f"{path}: run {key!r} {problem}; restore the file from git, or remove that run")
    return record


# what every recorded run holds, and what some hold, with the test each value must pass: the
# page, the cost and the merge read them without further checks
_ENTRY_FIELDS: dict[str, Check] = {
    "cell": (True, lambda v: isinstance(v, str), "a string"),
    "method": (True, lambda v: isinstance(v, str), "a string"),
    "scenario": (True, lambda v: isinstance(v, str), "a string"),
    "family": (True, lambda v: isinstance(v, str), "a string"),
    "digest": (True, lambda v: isinstance(v, str) and len(v) == 64, "a config digest (64 hex digits)"),
    "participation": (True, lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "seed": (True, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "wall_seconds": (True, lambda v: number(v) and v >= 0, "a number of seconds"),
    "quick": (True, lambda v: isinstance(v, bool), "true or false"),
    "figures": (
        True,
        lambda v: isinstance(v, dict) and "accuracy" in v and all(number_or_none(x) for x in v.values()),
        "a table of figures, accuracy among them, each a number or null",
    ),
    "curve": (
        True,
        lambda v: (
            isinstance(v, list)
            and all(isinstance(p, list) and len(p) == 2 and number(p[0]) and number_or_none(p[1]) for p in v)
        ),
        "a list of [round, accuracy] pairs",
    ),
    "figures_version": (False, lambda v: int_or_none(v) and v is not None, "an integer"),
    "tune": (False, lambda v: int_or_none(v) and v is not None, "an integer"),
    "knob": (False, lambda v: int_or_none(v) and v is not None and v >= 1, "an integer from 1"),
    "setting": (False, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of overrides"),
    "default_setting": (False, lambda v: isinstance(v, bool), "true or false"),
    "cpu_seconds": (False, lambda v: number(v) and v >= 0, "a number of seconds"),
}


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one recorded run (None: nothing)."""
    return problem(_ENTRY_FIELDS, entry) if isinstance(entry, dict) else "is not a table of fields"


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


@dataclass(frozen=True)
class Job:
    """One run of the benchmark: its key in the record, its config, where it runs, and what
    the record says of it besides its figures."""

    key: str
    cfg: Any
    out: Path
    meta: dict[str, Any]
    target: float


def _setting_text(setting: tuple[str, ...]) -> str:
    """["train.lr=0.1"] -> "lr=0.1": how the page names a tuning setting."""
    return ", ".join(x.split(".", 1)[-1] for x in setting) or "the defaults"


def knob_key(method: str, scenario: str, j: int) -> str:
    """The record's key of a knob's tuning run (j = 1, 2, ...: the knob's settings besides its default)."""
    return f"tune / {method} / {scenario} / knob {j}"


def _best(entries: list[dict[str, Any]]) -> int:
    """The entry of best validation accuracy, the first of equals; a run that trained to nothing
    (no accuracy) is the worst."""

    def score(i: int) -> tuple[float, int]:
        acc = entries[i]["figures"]["accuracy"]
        return (-math.inf if acc is None else acc, -i)

    return max(range(len(entries)), key=score)


def step_choice(grid: Grid, record: dict[str, Any], method: str, on: str, quick: bool):
    """Tuning's first step for ``method`` on the scenario named ``on``: the best of the budget's
    settings, as (index, its entry); None while a setting's tuning run is missing."""
    entries = []
    for i in range(len(grid.tune_settings(method, quick))):
        e = record["runs"].get(f"tune / {method} / {on} / {i}")
        if e is None or bool(e.get("quick")) != quick:
            return None
        entries.append(e)
    best = _best(entries)
    return best, entries[best]


def tuning_choice(grid: Grid, record: dict[str, Any], method: str, scenario: Scenario, quick: bool):
    """The setting chosen for ``method`` on ``scenario`` (or the scenario it is tuned on), as
    ((i, j), its entry): i the first step's setting (the best validation accuracy among the
    budget's, the first of equals), j its knob's at that step (0: the knob's default, the first
    step's run itself; a knob run made at another step does not count); None while a run is
    missing."""
    on = scenario.tune_on or scenario.name
    step = step_choice(grid, record, method, on, quick)
    if step is None:
        return None
    i, first = step
    if not grid.knob_on(method, scenario):
        return (i, 0), first
    at = list(grid.tune_settings(method, quick)[i])
    entries = [first]
    for j, knob in enumerate(grid.knob_settings(method, quick), start=1):
        e = record["runs"].get(knob_key(method, on, j))
        if e is None or bool(e.get("quick")) != quick or e.get("setting") != [*at, *knob]:
            return None
        entries.append(e)
    j = _best(entries)
    return (i, j), entries[j]


def jobs(
    grid: Grid, stage: str, record: dict[str, Any], runs: Path, quick: bool, data_dir: str | None, only: str | None
) -> list[list[Job]]:
    """The runs of a stage, grouped by cell (shards split the groups): ``default``, every cell
    at every seed with the papers' defaults; ``tune``, every (method, scenario) at the tuning
    seed and participation, each setting of the method's budget, on the validation split;
    ``tuned``, every cell at every seed with its tuned setting, where tuning chose one that is
    not the default (a choice of the default is the default row itself)."""
    import fnmatch

    cells = grid.cells(quick)
    t = grid.tune_protocol(quick)
    if stage == "tune":  # one cell per (method, scenario tuned on itself), at the protocol's participation
        pairs = dict.fromkeys((c.method, c.scenario) for c in cells if not c.scenario.tune_on)
        cells = [Cell(m, sc, t["participation"]) for m, sc in pairs]
    if only is not None:
        cells = [c for c in cells if fnmatch.fnmatchcase(c.key, only)]
        if not cells:
            raise UserError(f"--only {only!r} matches no cell; cells are named 'method / scenario / participation'")
    out: list[list[Job]] = []
    for cell in cells:
        m, sc = cell.method, cell.scenario
        base = {
            "method": m.name,
            "scenario": sc.name,
            "family": sc.family,
            "participation": cell.participation,
            "quick": quick,
        }
        group = []
        if stage == "tune":
            default = stocfl.config_digest(grid.config(cell, t["seed"], quick, data_dir))
            val = f"scenario.validation={t['validation']:g}"
            for i, setting in enumerate(grid.tune_settings(m.name, quick)):
                cfg = grid.config(cell, t["seed"], quick, data_dir, extra=[*setting, val])
                plain = stocfl.config_digest(grid.config(cell, t["seed"], quick, data_dir, extra=list(setting)))
                meta = base | {"cell": cell.key, "seed": t["seed"], "tune": i, "setting": list(setting)}
                meta["default_setting"] = plain == default
                path = runs / "tune" / sc.name / m.name / f"setting{i}"
                group.append(Job(f"tune / {m.name} / {sc.name} / {i}", cfg, path, meta, sc.target))
            step = step_choice(grid, record, m.name, sc.name, quick) if grid.knob_on(m.name, sc) else None
            if step is not None:  # the knob's settings at the step chosen (known once its runs are)
                at = list(grid.tune_settings(m.name, quick)[step[0]])
                for j, knob in enumerate(grid.knob_settings(m.name, quick), start=1):
                    setting = [*at, *knob]
                    cfg = grid.config(cell, t["seed"], quick, data_dir, extra=[*setting, val])
                    plain = stocfl.config_digest(grid.config(cell, t["seed"], quick, data_dir, extra=setting))
                    meta = base | {"cell": cell.key, "seed": t["seed"], "tune": step[0], "knob": j}
                    meta |= {"setting": setting, "default_setting": plain == default}
                    path = runs / "tune" / sc.name / m.name / f"knob{j}"
                    group.append(Job(knob_key(m.name, sc.name, j), cfg, path, meta, sc.target))
        elif stage == "tuned":
            chosen = tuning_choice(grid, record, m.name, sc, quick)
            if chosen is None or chosen[1]["default_setting"]:
                continue
            setting = chosen[1]["setting"]
            name = f"{m.name} (tuned)"
            for seed in grid.seeds_for(quick):
                cfg = grid.config(cell, seed, quick, data_dir, extra=setting)
                meta = base | {"cell": f"{name} / {sc.name} / {cell.participation:g}", "seed": seed}
                meta |= {"method": name, "tuned_of": m.name, "setting": setting}
                path = runs / sc.name / f"p{cell.participation:g}" / f"{m.name}-tuned" / f"seed{seed}"
                group.append(Job(f"{meta['cell']} / seed {seed}", cfg, path, meta, sc.target))
        else:
            for seed in grid.seeds_for(quick):
                cfg = grid.config(cell, seed, quick, data_dir)
                path = runs / sc.name / f"p{cell.participation:g}" / m.name / f"seed{seed}"
                group.append(
                    Job(f"{cell.key} / seed {seed}", cfg, path, base | {"cell": cell.key, "seed": seed}, sc.target)
                )
        out.append(group)
    return out


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
    stage: str = "default",
    keep_state: bool = False,
) -> dict[str, int]:
    """Run (or reuse) every run of ``stage`` (:func:`jobs`) in this shard (``only``: the cells
    whose key, "method / scenario / participation", matches this shell pattern); returns counts
    of runs run and reused, and of runs left to another process that holds their directory
    (shards that overlap). A run once recorded keeps its results files but not its state
    (:func:`shed_state`) unless ``keep_state``."""
    counts = {"ran": 0, "reused": 0, "refigured": 0, "changed": 0, "busy": 0}
    start = read_record(record)
    seen: set[str] = set()
    # tuning's knob runs are known once the step they run at is chosen: a second pass finds them
    for again in (False, True) if stage == "tune" else (False,):
        view = read_record(record) if again else start
        for index, group in enumerate(jobs(grid, stage, view, runs, quick, data_dir, only)):
            if index % shard[1] == shard[0]:
                for job in (j for j in group if j.key not in seen):
                    seen.add(job.key)
                    _run_job(job, view, record, counts, data_dir, progress, log, keep_state)
    return counts


def _run_job(job: Job, start: dict[str, Any], record: Path, counts, data_dir, progress, log, keep_state) -> None:
    """Run ``job`` (or reuse its recorded run: ``start``'s, else the record's read again, since
    another shard may have recorded it), record it and count which in ``counts``."""
    digest = stocfl.config_digest(job.cfg)
    held = start["runs"].get(job.key)
    if not _reusable(held, digest):  # read again: another shard may have recorded it since
        held = read_record(record)["runs"].get(job.key)
    same = held is not None and held["digest"] == digest
    if _reusable(held, digest):
        counts["reused"] += 1
        return
    # the digest in the name: a grid whose settings changed runs anew beside the old run;
    # the figures' version: a run of older code (without the newer figures) is not reused
    out = job.out.with_name(f"{job.out.name}-{digest[:10]}-f{FIGURES_VERSION}")
    t, cpu = time.perf_counter(), _cpu_seconds()
    try:
        summary = run_or_reuse(job.cfg, out, data_dir, progress, label=job.meta["method"])
    except InUse as err:  # another process runs it (shards that overlap): its holder records it
        counts["busy"] += 1
        print(f"{job.key}: left to the process that holds it ({err})")
        return
    rows = read_jsonl(out / "metrics.jsonl")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, stocfl {stocfl.__version__}"
    entry = job.meta | {
        "digest": digest,
        "figures": figures(summary, rows, job.target),
        "curve": [[r["round"], r["accuracy"]] for r in rows if r.get("accuracy") is not None],
        "wall_seconds": round(time.perf_counter() - t, 2),
        # CPU seconds of this process: less sensitive than wall time to what else runs
        "cpu_seconds": round(_cpu_seconds() - cpu, 2),
        # the machine's load over the last minute as the run ended: above its cores, the
        # times were measured beside other work
        "load_average": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
        "figures_version": FIGURES_VERSION,
        "machine": machine,
        # numbers repeat to the bit only on the same kind of processor at the same torch
        # threads: a re-run's warning needs both to say whether the machine explains it
        "processor": summary.get("processor"),
        "threads": summary.get("threads"),
        "date": time.strftime("%Y-%m-%d"),
    }
    if same:  # run again for newer figures: its numbers must be the ones recorded
        if moved(held["figures"], entry["figures"], FIGURES) or held.get("curve") != entry["curve"]:
            counts["changed"] += 1
            # said even when quiet: the same config gave other numbers, and which
            print(f"{job.key}: WARNING run again under the same config, {_what_changed(held, entry)}")
        counts["refigured"] += 1
    _save_run(record, job.key, entry)
    if not keep_state:
        shed_state(out)
    counts["ran"] += 1
    log(f"{job.key}: accuracy {entry['figures']['accuracy']}")


def _reusable(held: dict[str, Any] | None, digest: str) -> bool:
    """A recorded run serves a job of this config digest at the current figures' version."""
    return held is not None and held["digest"] == digest and held.get("figures_version", 1) == FIGURES_VERSION


def _what_changed(held: dict, entry: dict) -> str:
    """The figures and curve points a run gave again otherwise than recorded: old -> new."""
    was_fig, now_fig = held["figures"], entry["figures"]
    changed = moved(was_fig, now_fig, FIGURES)
    was, now = dict(map(tuple, held.get("curve") or [])), dict(map(tuple, entry["curve"]))
    points = [f"{t}: {was.get(t)} -> {now.get(t)}" for t in sorted(set(was) | set(now)) if was.get(t) != now.get(t)]
    said = []
    if changed:
        said.append("its figures changed: " + ", ".join(changed))
    if points:
        said.append(f"its accuracy curve changed at {len(points)} of {len(now)} rounds ({'; '.join(points[:4])})")
    return "; ".join(said) + "; " + where_run(held, entry)


# ---- statistics and the page ------------------------------------------------------------------


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% confidence interval (Student's t; None for one value)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), None
    return float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))


def asked(grid: Grid, record: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    """The record as the grid asks it now: its runs (of this grid, quick or full) whose config
    digest is the one the grid gives their key today. A run recorded under another config (the
    grid's base, a scenario's or a method's settings changed since) or for a cell the grid no
    longer has is left out, its key listed under ``stale``: its numbers answer another question,
    and the page must not show them as this grid's. A tuned row's config follows the tuning
    choice of the runs kept. A record that already has ``stale`` is returned as it is."""
    if "stale" in record:
        return record
    runs = record["runs"]
    keep = {k: r for k, r in runs.items() if bool(r.get("quick")) != quick}
    want: dict[str, str] = {}
    # a knob's tuning runs follow the first step's runs kept, a tuned row's setting all tuning runs kept
    stages = (("default", "tune"), ("tune",), ("tuned",))
    for names in stages:
        view = record | {"runs": keep | {k: r for k, r in runs.items() if want.get(k) == r["digest"]}}
        for stage in names:
            for group in jobs(grid, stage, view, Path("."), quick, None, None):
                want.update((job.key, stocfl.config_digest(job.cfg)) for job in group)
    kept = {k: r for k, r in runs.items() if bool(r.get("quick")) == quick and want.get(k) == r["digest"]}
    stale = sorted(k for k, r in runs.items() if bool(r.get("quick")) == quick and k not in kept)
    return record | {"runs": keep | kept, "stale": stale}


def cells_of(record: dict[str, Any], quick: bool) -> dict[str, dict[str, Any]]:
    """Per cell: its runs' figures gathered over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for entry in record["runs"].values():
        if bool(entry.get("quick")) != quick or "tune" in entry:  # a tuning run is no cell's
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
    table: dict[tuple[str, float], dict[str, float]] = {}
    for c in cells.values():
        accs = [r["figures"]["accuracy"] for r in c["runs"] if r["figures"]["accuracy"] is not None]
        if accs:
            table.setdefault((c["scenario"], c["participation"]), {})[c["method"]] = float(np.mean(accs))
    return ranks_of(table, methods)


def ranks_of(table: dict[tuple[str, float], dict[str, float]], methods: list[str]) -> dict[str, Any]:
    """:func:`ranks` from a table of mean accuracies per (scenario, participation) and method."""
    from scipy import stats

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


def _processors(runs: list[dict[str, Any]]) -> str:
    """The processors the runs were recorded on (numbers repeat to the bit only on the same kind)."""
    count = Counter(r.get("processor") or "processor not recorded" for r in runs)
    return ", ".join(f"{n} runs on {name}" for name, n in count.most_common())


def _loaded(runs: list[dict[str, Any]]) -> str:
    """How many runs ended with the machine's load above its cores (recorded since the load was)."""
    known = [r for r in runs if r.get("load_average") is not None and r.get("cores")]
    busy = sum(r["load_average"] > r["cores"] for r in known)
    return (
        f"{busy} of the {len(known)} runs that recorded it ended with the load average above their machine's "
        f"cores ({len(runs) - len(known)} runs recorded no load)."
    )


def _in_grid(grid: Grid, s: Scenario, quick: bool) -> bool:
    """Whether scenario ``s`` is in the full grid (or the quick one)."""
    return s.name in grid.quick.get("scenarios", []) if quick else not s.quick_only


def _cell_rows(cells, scenarios, parts, methods):
    """(scenario, participation, method, its runs' figures) for every cell with runs, in page order."""
    for s in scenarios:
        for p in parts:
            for m in methods:
                c = cells.get(f"{m} / {s.name} / {p:g}")
                if c is not None:
                    yield s, p, m, [r["figures"] for r in c["runs"]]


def _geomean(values: list[float]) -> float | None:
    good = [v for v in values if v > 0]
    return float(np.exp(np.mean(np.log(good)))) if good else None


def projected_cost(grid: Grid, record: dict[str, Any], quick: bool = False) -> dict[str, Any]:
    """What the runs the grid still needs would cost, at the wall times of the runs recorded.

    Needed: every (cell, seed) with the papers' defaults not recorded at the current figures'
    version (a run recorded under older figures is run again), every tuning run not recorded,
    and every tuned row's runs not recorded where tuning chose another setting than the default
    or has not chosen yet (then counted as needed: an upper bound). A run's seconds come from,
    in order: its cell's recorded runs (their mean); the same method and scenario at another
    participation, times the ratio of the two participations' times measured over the pairs
    that have both (the clients' work scales with participation, the evaluation does not);
    its scenario's other methods at that participation, times the method's own ratio to the
    other methods measured on the scenarios where it has runs. ``record`` as the page reads it
    (:func:`asked`): a run recorded under another config counts as needed again."""
    again = set(record.get("stale", [])) | set(record["runs"])  # recorded under another config or older figures
    runs = [r for r in record["runs"].values() if bool(r.get("quick")) == quick]
    current = [r for r in runs if r.get("figures_version", 1) == FIGURES_VERSION]
    done = {k for k, r in record["runs"].items() if r.get("figures_version", 1) == FIGURES_VERSION}
    per_cell: dict[tuple[str, str, float], list[float]] = {}
    for r in runs:
        if "tune" not in r and "tuned_of" not in r:
            per_cell.setdefault((r["method"], r["scenario"], r["participation"]), []).append(r["wall_seconds"])
    mean = {k: float(np.mean(v)) for k, v in per_cell.items()}
    parts = sorted({k[2] for k in mean})
    ratio: dict[tuple[float, float], float] = {}  # (to, from) -> the measured ratio of times
    pairs: dict[tuple[float, float], int] = {}
    for p in parts:
        for q in parts:
            both = [mean[(m, s, p)] / mean[(m, s, q)] for (m, s, x) in mean if x == q and (m, s, p) in mean]
            if p != q and both:
                ratio[(p, q)], pairs[(p, q)] = _geomean(both) or p / q, len(both)
    by_scenario: dict[tuple[str, float], list[float]] = {}
    for (_, s, p), v in mean.items():
        by_scenario.setdefault((s, p), []).append(v)
    scen = {k: float(np.mean(v)) for k, v in by_scenario.items()}
    method_factor: dict[str, float] = {}
    for m in {k[0] for k in mean}:
        method_factor[m] = _geomean([v / scen[(s, p)] for (mm, s, p), v in mean.items() if mm == m]) or 1.0
    how = {"own": 0, "other participation": 0, "other methods": 0, "none": 0}

    def seconds(method: str, scenario: str, p: float) -> float | None:
        if (method, scenario, p) in mean:
            how["own"] += 1
            return mean[(method, scenario, p)]
        for q in parts:
            if (method, scenario, q) in mean:
                how["other participation"] += 1
                return mean[(method, scenario, q)] * ratio.get((p, q), p / q)
        for q in [p, *parts]:
            if (scenario, q) in scen:
                how["other methods"] += 1
                factor = ratio.get((p, q), p / q) if q != p else 1.0
                return scen[(scenario, q)] * method_factor.get(method, 1.0) * factor
        how["none"] += 1
        return None

    stages: dict[str, list[float | None]] = {"default": [], "tune": [], "tuned": []}
    rerun = 0
    tune = grid.tune_protocol(quick)
    cells = grid.cells(quick)
    for c in cells:
        m, s, p = c.method.name, c.scenario, c.participation
        chosen = tuning_choice(grid, record, m, s, quick)  # once a cell: every seed's tuned row follows it
        tuned_row = chosen is None or not chosen[1]["default_setting"]
        for seed in grid.seeds_for(quick):
            key = f"{c.key} / seed {seed}"
            if key not in done:
                rerun += key in again
                stages["default"].append(seconds(m, s.name, p))
            if tuned_row and f"{m} (tuned) / {s.name} / {p:g} / seed {seed}" not in done:
                stages["tuned"].append(seconds(m, s.name, p))
    for m, s in dict.fromkeys((c.method.name, c.scenario) for c in cells if not c.scenario.tune_on):
        keys = [f"tune / {m} / {s.name} / {i}" for i in range(len(grid.tune_settings(m, quick)))]
        if grid.knob_on(m, s):
            keys += [knob_key(m, s.name, j) for j in range(1, len(grid.knob_settings(m, quick)) + 1)]
        stages["tune"] += [seconds(m, s.name, tune["participation"]) for k in keys if k not in done]
    known = [v for v in (x for xs in stages.values() for x in xs) if v is not None]
    return {
        "runs": {k: len(v) for k, v in stages.items()},
        "rerun": rerun,
        "hours": sum(known) / 3600,
        "spent_hours": sum(r["wall_seconds"] for r in current) / 3600,
        "how": how,
        "ratio": [(p, q, round(v, 2), pairs[(p, q)]) for (p, q), v in ratio.items() if p > q],
    }


def _projection_text(pc: dict[str, Any]) -> str:
    n, how = pc["runs"], pc["how"]
    if not sum(n.values()):
        return "The grid is complete: every run it declares is recorded."
    said = [f"{how['own']} from their cell's recorded runs"]
    if how["other participation"]:
        ratios = "; ".join(
            f"a run at participation {p:g} takes {v:g}x one at {q:g} over the {n} (method, scenario) pairs recorded "
            f"at both"
            for p, q, v, n in pc["ratio"]
        )
        ratios = ratios or "scaled by the participations"
        said.append(f"{how['other participation']} from the cell at the other participation ({ratios})")
    if how["other methods"]:
        said.append(f"{how['other methods']} from their scenario's other methods")
    if how["none"]:
        said.append(f"{how['none']} with no estimate (nothing of their scenario recorded)")
    return (
        f"The rest of the grid: {n['default']} runs with the papers' defaults ({pc['rerun']} of them recorded "
        f"under older figures or another config, to run again), {n['tune']} tuning runs and at most {n['tuned']} "
        f"runs of tuned rows (as many as tuning chooses a setting other than the default): about {pc['hours']:.0f} "
        f"hours of wall time at the recorded runs' times (most of them one run a core), which makes the whole grid "
        f"about {pc['hours'] + pc['spent_hours']:.0f} hours on this machine. Estimated: " + "; ".join(said) + "."
    )


def _stale_text(stale: list[str]) -> str:
    if not stale:
        return ""
    cells = sorted({k.rsplit(" / seed ", 1)[0] for k in stale})
    return (
        f" Not shown: {len(stale)} recorded runs made under a config the grid no longer asks (its settings changed "
        f"since), to run again: {', '.join(cells[:6])}{', ...' if len(cells) > 6 else ''}."
    )


def page(grid: Grid, record: dict[str, Any], quick: bool = False) -> str:
    """The leaderboard as Markdown, from the record alone (the runs the grid asks now: :func:`asked`)."""
    record = asked(grid, record, quick)
    cells = cells_of(record, quick)
    expected = grid.cells(quick)
    methods = list(dict.fromkeys(c.method.name for c in expected))  # every method of the grid, run or not
    n_seeds = len(grid.seeds_for(quick))
    runs = [r for r in record["runs"].values() if bool(r.get("quick")) == quick]  # tuning runs too
    spent = sum(r["wall_seconds"] for r in runs)
    default = [r for c in cells.values() if " (tuned)" not in c["method"] for r in c["runs"]]
    tuned = [r for c in cells.values() if " (tuned)" in c["method"] for r in c["runs"]]
    n_tune = sum("tune" in r for r in runs)
    tuned_on = [s for s in grid.scenarios if not s.tune_on and _in_grid(grid, s, quick)]
    n_asked = sum(
        len(grid.tune_settings(m, quick)) + (len(grid.knob_settings(m, quick)) if grid.knob_on(m, s) else 0)
        for m in methods
        for s in tuned_on
    )
    lines = [
        f"# {grid.title}" + (" (quick grid)" if quick else ""),
        "",
        "<!-- written by `stocfl-lab benchmark --page` from benchmark/BENCHMARK.json: do not edit -->",
        "",
        f"{len({r['cell'] for r in default})} of {len(expected)} cells have runs; {len(default)} of "
        f"{len(expected) * n_seeds} runs with the papers' defaults are recorded, {n_tune} of the tuning protocol's "
        f"{n_asked} runs and {len(tuned)} runs of tuned rows (a tuned setting that is the default needs none). Each "
        f"figure is the mean ± the half-width of its 95% confidence interval over seeds (Student's t); (m/n): only "
        f"m of the cell's n runs have the figure. A cell not yet run is *pending*." + _stale_text(record["stale"]),
        "",
        "How the grid is built, and what to know when reading it (which methods are told the number of clusters, "
        "why CFL's and FL+HC's rows read as FedAvg's at their papers' thresholds, the tuning protocol), is on "
        "[the design page](benchmark-design.md).",
        "",
        f"Cost so far: {spent / 3600:.2f} hours of wall time for the {len(runs)} runs recorded"
        + (
            f" ({spent / len(runs):.0f} s a run on average, on {', '.join(sorted({r['machine'] for r in runs}))}; "
            f"{_processors(runs)})."
            if runs
            else "."
        )
        + " Client FLOPs are counted by torch's FlopCounterMode on each task's reference computation (the design "
        "page says how). Times depend on what else ran: "
        + _loaded(runs)
        + " CPU seconds are the run's process's (its threads' waits included).",
        "",
        _projection_text(projected_cost(grid, record, quick)),
        "",
    ]
    families: dict[str, list[Scenario]] = {}
    for s in grid.scenarios:
        if _in_grid(grid, s, quick):
            families.setdefault(s.family, []).append(s)
    parts = grid.quick.get("participation", grid.participation) if quick else grid.participation
    drawn = {(c["scenario"], c["participation"]) for c in cells.values()}
    tuning = any("tune" in e and bool(e.get("quick")) == quick for e in record["runs"].values())
    every = [x for m in methods for x in (m, f"{m} (tuned)")]  # the per-cell tables' rows
    for family, scenarios in families.items():
        lines += [f"## {family}", ""]
        for s in scenarios:
            for p in parts:
                if (s.name, p) in drawn:
                    name = f"{figure_folder(quick)}/{figure_name(s.name, p)}"
                    lines += [f"![{s.name}, participation {p:g}: accuracy per round and against traffic]({name})", ""]
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
                if tuning:
                    texts = [tuned_cell(grid, record, cells, m, s, p, quick)[0] for s in scenarios]
                    lines.append("| " + " | ".join([f"{m}, tuned", *texts]) + " |")
            lines.append("")
        mixtures = any(s.family == "mixtures" for s in scenarios)
        lines += [f"Per cell, {family}: clients and clusters", ""]
        head = ["cell", "macro acc. (%)", "p10 client (%)", "worst (%)", "ARI", "NMI"]
        head += ["mixture distance"] if mixtures else []
        head += ["clusters", "rounds to target"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s, p, m, f in _cell_rows(cells, scenarios, parts, every):
            grouped = s.k > 1
            row = [
                f"{m} / {s.name} / {p:g}",
                _fmt([x["macro_accuracy"] for x in f]),
                _fmt([x["accuracy_p10"] for x in f]),
                _fmt([x["worst_client_accuracy"] for x in f]),
                _fmt([x["ari"] for x in f], 1.0, 3) if grouped else "-",
                _fmt([x["nmi"] for x in f], 1.0, 3) if grouped else "-",
            ]
            row += [_fmt([x.get("mixture_tv") for x in f], 1.0, 3)] if mixtures else []
            row += [_fmt([x["n_clusters"] for x in f], 1.0, 1), _fmt([x["rounds_to_target"] for x in f], 1.0, 1)]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"Per cell, {family}: costs (per round, summed over the round's clients)", ""]
        head = ["cell", "client GFLOP / round", "kB down / round", "kB up / round", "rounds, wall s", "run, CPU s"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s, p, m, f in _cell_rows(cells, scenarios, parts, every):
            runs_ = cells[f"{m} / {s.name} / {p:g}"]["runs"]
            row = [
                f"{m} / {s.name} / {p:g}",
                _fmt([x.get("flops_per_round") for x in f], 1e-9, 3),
                _fmt([x["bytes_down_per_round"] for x in f], 1e-3, 0),
                _fmt([x["bytes_up_per_round"] for x in f], 1e-3, 0),
                _fmt([x["seconds"] for x in f], 1.0, 1),
                _fmt([r.get("cpu_seconds") for r in runs_], 1.0, 1),
            ]
            lines.append("| " + " | ".join(row) + " |")
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
    lines += tuning_section(grid, record, cells, methods, quick, parts)
    return "\n".join(lines) + "\n"


def tuned_cell(grid, record, cells, method: str, scenario: Scenario, p: float, quick: bool):
    """(the accuracy table's text, the tuned row's runs or None) for one tuned cell."""
    choice = tuning_choice(grid, record, method, scenario, quick)
    if choice is None:
        return "tuning pending", None
    entry = choice[1]
    said = _setting_text(tuple(entry["setting"]))
    if entry["default_setting"]:
        c = cells.get(f"{method} / {scenario.name} / {p:g}")
        return f"= default ({said})", None if c is None else c["runs"]
    c = cells.get(f"{method} (tuned) / {scenario.name} / {p:g}")
    if c is None:
        return f"*pending* ({said})", None
    return f"{_fmt([r['figures']['accuracy'] for r in c['runs']])} ({said})", c["runs"]


def tuning_section(grid, record, cells, methods, quick, parts) -> list[str]:
    """The tuning runs' validation accuracies, each method's choice, and the tuned rows' ranks."""
    protocol = grid.tune_protocol(quick)
    budget = len(protocol["settings"])
    lines = [
        "## Tuning",
        "",
        f"Each method tried {budget} settings (its declared budget, the same for all) once, at seed "
        f"{protocol['seed']} and participation {protocol['participation']:g}, on a validation split: "
        f"{protocol['validation']:g} of each client's train samples held out as its test data, the test data "
        f"never seen. The best validation accuracy (the first of equals) is its tuned setting; a drifting "
        f"scenario takes its base scenario's. Then, at that setting, the knob that sets a method's number of "
        f"clusters (a threshold; or the count it is told, where the scenario has no planted groups to tell) "
        f"tried at {budget - 1} settings besides its default, chosen the same way (the default first of "
        f"equals). Validation accuracy (%) per setting, the chosen one in bold, marked (edge) where it is the "
        f"budget's first or last step (the best may lie beyond):",
        "",
    ]
    tuned_on = [
        s
        for s in grid.scenarios
        if not s.tune_on and (s.quick_only == quick or (quick and s.name in grid.quick.get("scenarios", [])))
    ]
    head = ["method", *(s.name for s in tuned_on)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def text(setting, e, chosen: bool, edge: bool = False) -> str:
        if e is None or bool(e.get("quick")) != quick:
            return f"{_setting_text(setting)}: -"
        acc = e["figures"]["accuracy"]
        said = f"{_setting_text(setting)}: {'-' if acc is None else f'{100 * acc:.1f}'}"
        return f"**{said}**" + (" (edge)" if edge else "") if chosen else said

    for m in methods:
        row = [m]
        for s in tuned_on:
            choice = tuning_choice(grid, record, m, s, quick)
            i, j = (None, None) if choice is None else choice[0]
            steps = grid.tune_settings(m, quick)
            said = [
                text(setting, record["runs"].get(f"tune / {m} / {s.name} / {k}"), k == i, k in (0, len(steps) - 1))
                for k, setting in enumerate(steps)
            ]
            if grid.knob_on(m, s):
                said.append("knob: " + ("default" + (" (chosen)" if j == 0 else "")))
                said += [
                    text(knob, record["runs"].get(knob_key(m, s.name, k)), k == j)
                    for k, knob in enumerate(grid.knob_settings(m, quick), start=1)
                ]
            row.append("<br>".join(said))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    table: dict[tuple[str, float], dict[str, float]] = {}
    for s in grid.scenarios:
        for p in parts:
            for m in methods:
                _, got = tuned_cell(grid, record, cells, m, s, p, quick)
                accs = [r["figures"]["accuracy"] for r in got or [] if r["figures"]["accuracy"] is not None]
                if accs:
                    table.setdefault((s.name, p), {})[m] = float(np.mean(accs))
    rk = ranks_of(table, methods)
    if rk["mean_rank"]:
        order = sorted(rk["mean_rank"], key=rk["mean_rank"].get)
        lines += [
            f"Mean rank of the tuned rows over the {rk['pairs']} (scenario, participation) pairs where every "
            f"method's tuned row has runs; Nemenyi's critical difference at 0.05: {rk['cd']:.2f}.",
            "",
            "| method | mean rank, tuned |",
            "|---|---|",
            *(f"| {m} | {rk['mean_rank'][m]:.2f} |" for m in order),
            "",
        ]
    else:
        lines += ["No (scenario, participation) pair has a tuned row of every method yet.", ""]
    return lines


# ---- figures ------------------------------------------------------------------------------


def figure_name(scenario: str, participation: float) -> str:
    return f"{scenario}-p{participation:g}.png"


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, mean accuracy over the runs) on the rounds every run evaluated."""
    common = set.intersection(*({r for r, _ in run["curve"]} for run in runs))
    rounds = np.array(sorted(common))
    acc = [np.mean([dict(map(tuple, run["curve"]))[r] for run in runs]) for r in rounds]
    return rounds, np.asarray(acc)


def write_figures(grid: Grid, record: dict[str, Any], folder: Path, quick: bool = False) -> list[Path]:
    """Per (scenario, participation) with runs: each method's mean test accuracy (over seeds)
    against the round, and against the traffic so far (MB down and up: the round times the
    method's mean bytes a round). The references dashed. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stocfl.storage import save_figure

    cells = cells_of(asked(grid, record, quick), quick)
    methods = list(dict.fromkeys(c.method.name for c in grid.cells(quick)))
    roles = {m.name: m.role for m in grid.methods}
    colours = plt.get_cmap("tab20")
    written = []
    pairs = sorted({(c["scenario"], c["participation"]) for c in cells.values()})
    for scenario, p in pairs:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8), sharey=True)
        for j, m in enumerate(methods):
            c = cells.get(f"{m} / {scenario} / {p:g}")
            if c is None or not all(r["curve"] for r in c["runs"]):
                continue
            rounds, acc = _mean_curve(c["runs"])
            style = {"color": colours(j % 20), "lw": 1.3, "ls": "--" if roles.get(m) == "reference" else "-"}
            left.plot(rounds, 100 * acc, label=m, **style)
            f = [r["figures"] for r in c["runs"]]
            per_round = [x["bytes_down_per_round"] + x["bytes_up_per_round"] for x in f if x["bytes_up_per_round"]]
            if len(per_round) == len(f):
                right.plot(rounds * float(np.mean(per_round)) / 1e6, 100 * acc, **style)
        left.set(xlabel="round", ylabel="test accuracy (%)", title=f"{scenario}, participation {p:g}")
        right.set(xlabel="traffic so far (MB, down + up)", xscale="log", title="accuracy against communication")
        for ax in (left, right):
            ax.grid(alpha=0.3)
        handles, labels = left.get_legend_handles_labels()
        right.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
        fig.tight_layout()
        path = folder / figure_name(scenario, p)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=80, tight=True)
        plt.close(fig)
        written.append(path)
    if folder.is_dir():  # a figure of a cell no longer in the record goes too: the page is the record's
        for old in folder.glob("*.png"):
            if old not in written:
                old.unlink()
    return written


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
        if args.tune and args.tuned:
            raise UserError("--tune and --tuned: run the tuning first (--tune), then the tuned rows (--tuned)")
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
            stage="tune" if args.tune else "tuned" if args.tuned else "default",
            keep_state=args.keep_state,
        )
        again = (
            f" ({counts['refigured']} of them run again for newer figures, {counts['changed']} with other numbers)"
            if counts["refigured"]
            else ""
        )
        busy = f", {counts['busy']} left to other processes that hold them" if counts["busy"] else ""
        print(f"stocfl-lab benchmark: {counts['ran']} runs run{again}, {counts['reused']} reused{busy} ({record})")
    out = Path(args.out) if args.out else None
    held = asked(grid, read_record(record), quick)  # once, for the page and its figures
    text = page(grid, held, quick)
    if out is not None:
        write_atomic(out, text.encode())
        drawn = write_figures(grid, held, out.parent / figure_folder(quick), quick)
        print(f"stocfl-lab benchmark: the leaderboard is in {out}, its {len(drawn)} figures beside it")
    return 0


def figure_folder(quick: bool) -> str:
    """Where the figures go, relative to the page."""
    return "figures/benchmark-quick" if quick else "figures/benchmark"
