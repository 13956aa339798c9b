"""``stocfl-lab bench --tables``: each committed reproduction table's declared setting (its first
row, the config and overrides it runs), a few rounds, against the arithmetic bound.

Per table: the seconds of each of its first rounds (what the run's rows record: the algorithm's
round, the clients' work and the server's; no evaluation, so that the rounds' cost is compared
with their own arithmetic), the client FLOPs the rounds asked as the run counts them (each task's
reference computation under FlopCounterMode), the bound those FLOPs take at the float32 matmul
peak measured just before, and seconds / bound. Where the run takes the low-rank path, the
bound of the arithmetic that path itself does is given too (its trainings by
:func:`stocfl.executors.lowrank.flops`, its other tasks as counted): the first says how far the
engine is from the dense work, the second how far the low-rank path is from its own.

The rounds run in one go, as a real run's do: a run that stops gives back what its engine keeps
from round to round (the batched engines' chunk pool, the memory freed within the run), so
rounds timed one stop at a time each paid for fresh pages that a real run pays for once. The
first round still pays for them (and places StoCFL's first newcomers); the figures from the
second round on (``steady_...``) are what the rest of a run costs.

Resumable: the JSON is written as each table ends, and a table already in it (same rounds, same
config digest) is kept unless --again; each table's peak is measured in its own turn, so a
ratio never mixes two moments of a shared machine.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from stocfl.errors import UserError
from stocfl_lab.records import load_json

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "tables.json"


def _peak() -> float:
    from stocfl_lab.bench import matmul_peak

    return matmul_peak(2048) * 1e9


def path_flops(tasks: list, fed, model, counter, lowrank: bool) -> float:
    """The FLOPs of ``tasks`` as the engine computes them: counted by ``counter`` (the dense
    reference), or with ``lowrank`` each plain-SGD training as the low-rank path computes it."""
    from stocfl.client import Train
    from stocfl.executors import lowrank_flops as flops
    from stocfl.executors import structure

    s = structure(model) if lowrank else None
    total = 0.0
    for t in tasks:
        if s is not None and type(t) is Train and t.local.optimizer.plain:
            distinct = t.prox_center is not None and t.prox_weight != 0 and t.prox_center is not t.weights
            n = int(fed.train_sizes[t.client])
            total += flops(s, n, t.local.epochs, t.local.batch_size, distinct)[1]
        else:
            total += counter(t)
    return total


def bench_table(name: str, rounds: int, data_dir: str | None) -> dict[str, Any]:
    import stocfl
    from stocfl.client import FlopCount
    from stocfl.experiment import Experiment, config_digest
    from stocfl_lab.reproduce import load_table

    table = load_table(name)
    row = table.rows[0]
    sets = [*row.overrides, "run.seed=0"]
    declared = stocfl.load_config(table.config, sets, data_dir)
    # no evaluation in the rounds timed (it comes every eval_every rounds, and at the end, which
    # these rounds do not reach)
    cfg = stocfl.load_config(
        table.config, [*sets, f"run.eval_every={declared.run.rounds}", "run.eval_rounds=[]"], data_dir
    )
    exp = Experiment.create(cfg, None)
    lowrank = exp.engine == "lowrank"
    counter = FlopCount(exp.fed, exp.model)
    asked: dict[int, list] = {}  # round -> the tasks it asked
    ask = exp.ask

    def recording(tasks, _ask=ask):
        asked.setdefault(exp.round + 1, []).extend(tasks)  # exp.round: the rounds done before this one
        return _ask(tasks)

    exp.ask = recording
    peak = _peak()
    try:
        exp.run(progress=False, stop_after=rounds)  # one run: see the module's docstring
    finally:  # the parallel engine's workers, and the memory they hold, end with their table
        close = getattr(exp.executor, "close", None)
        if close is not None:
            close()
    per_round = []
    for r, got in enumerate(exp.rows[-rounds:], start=1):
        dense = float(got.get("flops") or 0.0)
        entry = {"round": r, "seconds": round(got["seconds"], 3), "gflop": round(dense / 1e9, 2)}
        entry["over_bound"] = round(got["seconds"] / (dense / peak), 2) if dense else None
        if lowrank:
            own = path_flops(asked.get(r, []), exp.fed, exp.model, counter, True)
            entry["lowrank_gflop"] = round(own / 1e9, 2)
            entry["over_lowrank_bound"] = round(got["seconds"] / (own / peak), 2) if own else None
        per_round.append(entry)
    out = {
        "table": name,
        "row": row.name,
        "config_sha256": config_digest(cfg),
        "engine": exp.engine,
        "model": cfg.model.name,
        "clients": exp.fed.n_clients,
        "rounds": rounds,
        "matmul_peak_gflops": round(peak / 1e9, 1),
        **_summary(per_round, peak, lowrank),
        "per_round": per_round,
    }
    if len(per_round) > 1:  # from the second round on
        steady = _summary(per_round[1:], peak, lowrank)
        for key in ("seconds_per_round", "over_bound", "over_lowrank_bound"):
            if key in steady:
                out[f"steady_{key}"] = steady[key]
    return out


def _summary(entries: list[dict[str, Any]], peak: float, lowrank: bool) -> dict[str, Any]:
    """Seconds a round over ``entries`` (rounds), the bound of their FLOPs at ``peak`` and the
    ratio; on the low-rank path, the same against that path's own arithmetic."""
    n, seconds = len(entries), sum(e["seconds"] for e in entries)
    dense = sum(e["gflop"] for e in entries) * 1e9
    out = {
        "seconds_per_round": round(seconds / n, 3),
        "bound_s_per_round": round(dense / peak / n, 3),
        "over_bound": round(seconds / (dense / peak), 2) if dense else None,
    }
    if lowrank:
        own = sum(e["lowrank_gflop"] for e in entries) * 1e9
        out["lowrank_bound_s_per_round"] = round(own / peak / n, 3)
        out["over_lowrank_bound"] = round(seconds / (own / peak), 2) if own else None
    return out


def _line(entry: dict[str, Any]) -> str:
    """A table's figures as the bench prints them."""
    if "not_timed" in entry:
        return f"not timed: {entry['not_timed']}"
    parts = [
        f"{entry['seconds_per_round']:.2f} s a round, bound {entry['bound_s_per_round']:.3f} s, x{entry['over_bound']}"
    ]
    if "over_lowrank_bound" in entry:
        parts.append(f"low-rank bound x{entry['over_lowrank_bound']}")
    if "steady_seconds_per_round" in entry:
        steady = f"from round 2: {entry['steady_seconds_per_round']:.2f} s, x{entry['steady_over_bound']}"
        if "steady_over_lowrank_bound" in entry:
            steady += f", low-rank x{entry['steady_over_lowrank_bound']}"
        parts.append(steady)
    return "; ".join(parts)


def _read_result(out: Path) -> dict[str, Any]:
    """The results measured so far (each table's kept until --again), or nothing; a file that
    cannot be read or whose entries lack their rounds and date is refused in one line."""
    fix = "restore it from git, or remove it to time every table again"
    result = load_json(out, fix)
    if result is None:
        return {}
    kept = result.get("tables", {}) if isinstance(result, dict) else None
    if not isinstance(kept, dict):
        raise UserError(f"{out} is not a table bench's results (no table of 'tables'); {fix}")
    for name, entry in kept.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("rounds"), int)
            and not isinstance(entry.get("rounds"), bool)
            and isinstance(entry.get("date"), str)
        ):
            raise UserError(f"{out}: table {name!r} has no whole entry (its rounds and date); {fix}")
    return result


def main(args) -> int:
    import sys

    from stocfl.executors import set_threads, trim_freed_memory
    from stocfl.storage import write_atomic
    from stocfl_lab.reproduce import tables

    rounds = 3 if getattr(args, "rounds", None) is None else args.rounds
    if rounds < 1:
        raise UserError(f"stocfl-lab bench --tables: --rounds must be >= 1, got {rounds}")
    names = sorted(n for n in tables() if n != "coverage")
    only = getattr(args, "table", None)
    if only:
        unknown = [t for t in only if t not in names]
        if unknown:
            raise UserError(f"stocfl-lab bench --tables: no table {unknown[0]!r}; choose among {', '.join(names)}")
        names = [n for n in names if n in only]
    out = Path(args.out) if getattr(args, "out", None) else DEFAULT_OUT
    threads = set_threads(0)
    result = _read_result(out)
    result.setdefault("tables", {})
    result |= {"machine": f"{platform.machine()}, {threads} torch threads", "torch": torch.__version__}
    for name in names:
        kept = result["tables"].get(name)
        if kept and kept.get("rounds") == rounds and not getattr(args, "again", False):
            print(f"{name}: kept ({kept['date']})", file=sys.stderr, flush=True)
            continue
        try:
            entry = bench_table(name, rounds, getattr(args, "data_dir", None))
        except UserError as e:  # the table cannot run here (its round does not fit in memory): said, and the rest timed
            entry = {"table": name, "rounds": rounds, "not_timed": str(e)}
        gc.collect()  # the table's run, its state and its engine's memory, before the next is built
        trim_freed_memory()
        entry["date"] = time.strftime("%Y-%m-%d")
        result["tables"][name] = entry
        print(f"{name}: {_line(entry)}", file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
