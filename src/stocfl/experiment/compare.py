"""``stocfl compare``: several algorithms on one scenario and several seeds, one table.

Each (algorithm, seed) is an ordinary run in its own sub-directory, so an interrupted
comparison picks up where it stopped (finished runs are read, unfinished ones resumed).
Writes ``compare.md``, ``compare.csv`` (mean +- std over seeds of final accuracy, global
accuracy, ARI, clusters, seconds) and ``compare.png`` (mean accuracy per round). On a drifting
scenario also, per change round r, the drifted clients' recovery (``drift_r_*`` columns: their
accuracy before the change, at it, the lowest after it, the rounds until they are back) and
``compare_drift.png`` (their accuracy per round, one panel per change round).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from stocfl import config
from stocfl.errors import UserError, first_repeated
from stocfl.experiment import configure, plots
from stocfl.experiment.build import read_config
from stocfl.experiment.loop import Experiment
from stocfl.experiment.provenance import config_digest, finished_summary
from stocfl.storage import formats
from stocfl.storage.files import save_figure, write_atomic

COLUMNS = ("accuracy", "global_accuracy", "ari", "n_clusters", "seconds")


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``"ifca n_models=2 share_layers=true"`` -> ("ifca-n_models=2-share_layers=true", overrides)."""
    parts = spec.split()
    if not parts:
        raise UserError("--algo '': give an algorithm name and optional key=value parameters")
    name, params = parts[0], parts[1:]
    for p in params:
        if "=" not in p:
            raise UserError(f"--algo {spec!r}: parameter {p!r} must be key=value")
    label = re.sub(r"[^A-Za-z0-9_.=+-]", "_", "-".join(parts))
    return label, [f"algorithm.name={name}", *(f"algorithm.{p}" for p in params)]


def run_or_reuse(
    cfg: config.Config, out: Path, data_dir: str | None, progress: bool, label: str | None = None
) -> dict[str, Any]:
    """The summary of the run ``cfg`` in ``out``: read when it has finished, resumed when it
    stopped, started when ``out`` holds no run. A run of another resolved config there is
    refused: its numbers are not the ones asked for."""
    if (out / "config.toml").exists():
        held = configure.validate(read_config(out, data_dir))
        if config_digest(held, core=True) != config_digest(cfg, core=True):
            changed = _differences(held.to_dict(), cfg.to_dict())
            raise UserError(
                f"{out} holds a run of another config ({changed}); remove it or choose another output directory"
            )
        same = config_digest(held) == config_digest(cfg)
        finished = finished_summary(out)
        if finished is not None and same:
            return finished
        extend = [] if same else [f"run.rounds={cfg.run.rounds}", f"run.eval_every={cfg.run.eval_every}"]
        return Experiment.resume(out, data_dir, overrides=extend).run(progress=progress, label=label)
    return Experiment.create(cfg, out).run(progress=progress, label=label)


def check_directory(out: Path, asked: dict[str, config.Config], seeds: list[int], data_dir: str | None) -> None:
    """The table lists every finished run in ``out``, so every run there must be of this
    comparison's setting: an asked algorithm's runs of other seeds its config at their seed, any
    other algorithm's runs this config but for the algorithm. Else mean +- std would mix settings
    (another lr, fewer rounds) under one label; refused in one line. The runs this call makes or
    resumes are checked by ``run_or_reuse``."""
    if not asked:
        return
    first = next(iter(asked.values()))
    for d in sorted(out.glob("*-seed*")) if out.is_dir() else []:
        m = re.fullmatch(r"(.+)-seed(\d+)", d.name)
        if not m or not (d / "config.toml").exists() or (m.group(1) in asked and int(m.group(2)) in seeds):
            continue
        label = m.group(1)
        held = _setting(configure.validate(read_config(d, data_dir)).to_dict(), label in asked)
        want = _setting((asked.get(label) or first).to_dict(), label in asked)
        if held != want:
            raise UserError(
                f"{d} holds a run of another setting ({_differences(held, want)}) and the table lists "
                f"every run in {out}: remove it or choose another output directory"
            )


def _setting(cfg: dict[str, Any], with_algorithm: bool) -> dict[str, Any]:
    """A resolved config less what runs of one comparison may differ in: the seed, the data
    directory, the evaluation schedule and, between algorithms, the algorithm."""
    free = ("run.seed", "run.eval_every", "run.tensorboard", "scenario.data_dir")
    return {
        s: {k: v for k, v in sec.items() if f"{s}.{k}" not in free}
        for s, sec in cfg.items()
        if with_algorithm or s != "algorithm"
    }


def _differences(held: dict[str, Any], asked: dict[str, Any]) -> str:
    keys = [
        f"{s}.{k}: {held.get(s, {}).get(k)!r} there, {v!r} asked"
        for s, sec in asked.items()
        for k, v in sec.items()
        if k != "data_dir" and held.get(s, {}).get(k) != v
    ]
    return "; ".join(keys[:3]) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")


def finished_runs(out: Path) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """The finished runs of a comparison directory and their summaries, by label (``LABEL-seedN``
    directories)."""
    found: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for d in sorted(out.glob("*-seed*"), key=lambda p: p.name):
        m = re.fullmatch(r"(.+)-seed(\d+)", d.name)
        summary = finished_summary(d) if m and d.is_dir() else None
        if summary is not None:
            found.setdefault(m.group(1), []).append((d, summary))
    return found


def compare(
    cfg_path,
    specs: list[str],
    seeds: list[int],
    out: Path,
    overrides: list[str] = (),
    data_dir: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    seeded = [o for o in overrides if o.split("=", 1)[0].strip() == "run.seed"]
    if seeded:  # every run's seed is one of --seeds: this one would be overridden without a word
        raise UserError(
            f"--set {seeded[0]!r}: a comparison's seeds are given with --seeds (e.g. --seeds 0,1,2), not run.seed"
        )
    parsed = [parse_spec(s) for s in specs]
    labels = [label for label, _ in parsed]
    if (k := first_repeated(labels)) is not None:
        raise UserError(f"--algo {specs[k]!r} is given twice (one row, {labels[k]}); give each algorithm once")
    checked = [configure.load(cfg_path, [*overrides, *algo], data_dir) for _, algo in parsed]  # before any long run
    check_directory(out, dict(zip(labels, checked)), seeds, data_dir)
    for label, algo in parsed:
        for seed in seeds:
            cfg = configure.load(cfg_path, [*overrides, *algo, f"run.seed={seed}"], data_dir)
            run_or_reuse(cfg, out / f"{label}-seed{seed}", data_dir, progress, label)
    found = finished_runs(out)  # the table lists every finished run here, of this call or an earlier one
    order = [label for label, _ in parsed] + [label for label in found if label not in dict(parsed)]
    rows, curves = table(
        {
            label: [
                (summary, formats.read_jsonl(run_dir / "metrics.jsonl")) for run_dir, summary in found.get(label, [])
            ]
            for label in order
        }
    )
    write_table(out, rows, curves, setting(checked[0]) if checked else "")
    return rows


DRIFT_FIGURES = ("before", "at_change", "lowest", "recovered_in")  # of each change (summary.json's drift)


def write_table(out: Path, rows: list[dict[str, Any]], curves: dict, title: str) -> None:
    """A comparison's files: compare.csv, compare.md and compare.png in ``out`` (and
    compare_drift.png on a drifting scenario)."""
    out.mkdir(parents=True, exist_ok=True)
    formats.write_csv(out / "compare.csv", rows)
    write_atomic(out / "compare.md", markdown(rows))
    plot({k: v for k, v in curves.items() if not k.startswith("drift ")}, out / "compare.png", title)
    drifting = {k: v for k, v in curves.items() if k.startswith("drift ")}
    if drifting:
        plot_drift(drifting, out / "compare_drift.png", title)


def _mean_row(row: dict[str, Any], col: str, vals: list[float]) -> None:
    row[f"{col}_mean"] = float(np.mean(vals)) if vals else None
    row[f"{col}_std"] = float(np.std(vals)) if vals else None
    row[f"{col}_n"] = len(vals)


def table(runs: dict[str, list[tuple[dict[str, Any], list[dict[str, Any]]]]]) -> tuple[list[dict[str, Any]], dict]:
    """Per label, from its runs' (summary, metrics rows): one row of mean, std and count of each
    column over the runs, and the accuracy curves (rounds, accuracies) of each run."""
    rows, curves = [], {}
    for label, found in runs.items():
        summaries, acc = [], []
        for summary, per_round in found:
            summaries.append(summary)
            evaluated = [r for r in per_round if r.get("accuracy") is not None]
            acc.append(([r["round"] for r in evaluated], [r["accuracy"] for r in evaluated]))
        curves[label] = acc
        row: dict[str, Any] = {
            "algorithm": label,
            "seeds": len(summaries),
            "runs_with_clients_left_out": sum(bool(s.get("eval_left_out")) for s in summaries),
        }
        for col in COLUMNS:
            _mean_row(row, col, [s[col] for s in summaries if s.get(col) is not None])
        changes = sorted({int(r) for s in summaries for r in s.get("drift", {}).get("changes", {})})
        for r in changes:  # each change round of a drifting scenario: its cohort's recovery and curve
            for fig in DRIFT_FIGURES:
                got = [s["drift"]["changes"].get(str(r), {}).get(fig) for s in summaries if "drift" in s]
                _mean_row(row, f"drift_{r}_{fig}", [v for v in got if v is not None])
            key = f"accuracy_drift_{r}"
            curves.setdefault(f"drift {r}", {})[label] = [
                (
                    [x["round"] for x in per_round if x.get(key) is not None],
                    [x[key] for x in per_round if x.get(key) is not None],
                )
                for _, per_round in found
            ]
        rows.append(row)
    return rows, curves


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(r, col, pct):
        m, s, n = r[f"{col}_mean"], r[f"{col}_std"], r[f"{col}_n"]
        if m is None:
            return "n/a"
        fewer = f" (n={n})" if n < r["seeds"] else ""  # a seed without this figure is not in its mean
        return (f"{100 * m:.2f} +- {100 * s:.2f}" if pct else f"{m:.2f} +- {s:.2f}") + fewer

    head = (
        "| algorithm | seeds | accuracy (%) | global accuracy (%) | ARI | clusters | seconds |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    notes = "".join(
        f"\n{r['algorithm']}: in {r['runs_with_clients_left_out']} of its runs, clients that failed to "
        f"answer the last evaluation are left out of its figures (eval_left_out in their summary.json).\n"
        for r in rows
        if r.get("runs_with_clients_left_out")
    )
    changes = sorted({int(k.split("_")[1]) for r in rows for k in r if k.startswith("drift_") and k.endswith("_n")})
    drift = ""
    for c in changes:
        drift += (
            f"\nClients whose data changed at round {c}: their accuracy (%) on the data they hold, and the rounds "
            f"until they were back within one point of it\n\n"
            "| algorithm | before | at the change | lowest after | rounds to recover |\n|---|---|---|---|---|\n"
            + "".join(
                f"| {r['algorithm']} | {cell(r, f'drift_{c}_before', True)} | "
                f"{cell(r, f'drift_{c}_at_change', True)} | {cell(r, f'drift_{c}_lowest', True)} | "
                f"{recovered(r, c)} |\n"
                for r in rows
                if f"drift_{c}_before_n" in r
            )
        )
    return (
        head
        + "".join(
            f"| {r['algorithm']} | {r['seeds']} | {cell(r, 'accuracy', True)} | {cell(r, 'global_accuracy', True)} | "
            f"{cell(r, 'ari', False)} | {cell(r, 'n_clusters', False)} | {cell(r, 'seconds', False)} |\n"
            for r in rows
        )
        + notes
        + drift
    )


def recovered(row: dict[str, Any], change: int) -> str:
    """Rounds to recover, mean +- std over the seeds that recovered, and how many did not."""
    col = f"drift_{change}_recovered_in"
    n, seeds = row.get(f"{col}_n", 0), row["seeds"]
    if not n:
        return f"not recovered ({seeds} of {seeds})"
    said = f"{row[f'{col}_mean']:.1f} +- {row[f'{col}_std']:.1f}"
    return said + (f"; not recovered in {seeds - n} of {seeds}" if n < seeds else "")


def setting(cfg: config.Config) -> str:
    """The comparison's scenario and setting, for the plot's title."""
    s, r = cfg.scenario, cfg.run
    return (
        f"{s.name} ({s.dataset}): {s.n_clients} clients, {100 * r.sample_rate:g}% per round, "
        f"{cfg.train.epochs} local epochs, lr {cfg.train.lr:g}"
    )


def plot_drift(panels: dict[str, dict[str, list]], path: Path, title: str = "") -> None:
    """One panel per change round: the accuracy per round of the clients that changed then,
    each algorithm's mean over seeds, the change marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(8 * min(len(panels), 2), 4.6), squeeze=False)
    for ax, (name, curves) in zip(axes[0], sorted(panels.items(), key=lambda kv: int(kv[0].split()[1]))):
        change = int(name.split()[1])
        _curves(ax, curves)
        ax.axvline(change, color="grey", ls="--", lw=1)
        ax.set(
            xlabel="round",
            ylabel="test accuracy of the drifted clients",
            ylim=(0, 1),
            title=f"clients whose data change at round {change}",
        )
        plots.integer_rounds(ax)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right", frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _curves(ax, curves: dict[str, list]) -> None:
    for n, (label, runs) in enumerate(curves.items()):
        if not runs:
            continue
        rounds = runs[0][0]
        acc = np.array([r[1] for r in runs if r[0] == rounds])
        seeds = f" ({len(acc)} seeds)" if len(acc) > 1 else ""
        ax.plot(
            rounds, acc.mean(0), marker="os^Dv<>pP*X"[n % 11], ms=4 if len(rounds) <= 40 else 0, label=label + seeds
        )
        if len(acc) > 1:
            ax.fill_between(rounds, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2)


def plot(curves: dict[str, list], path: Path, title: str = "") -> None:
    """Mean accuracy per evaluated round of each algorithm (band: +- one std over seeds);
    every evaluated round is marked, so that a curve of one or two points still shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    _curves(ax, curves)
    ax.set(xlabel="round", ylabel="test accuracy (own model)", ylim=(0, 1), title=title)
    plots.integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend(
        fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(4, max(1, len(curves))), frameon=False
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
