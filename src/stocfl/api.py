"""stocfl from Python: ``run`` and ``resume`` return a :class:`Result`; the command line is a
thin layer over the same :class:`~stocfl.experiment.loop.Experiment`.

    import stocfl
    fed = stocfl.Federation.from_arrays(train=[(x0, y0), ...], test=[(xt0, yt0), ...], groups=[0, ...])
    result = stocfl.run({"algorithm": {"name": "stocfl"}, "run": {"rounds": 20}}, federation=fed)
    result.summary["accuracy"], result.metrics, result.labels, result.models

Every problem with the input is one :class:`~stocfl.errors.UserError` whose message is the line
the command line prints.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl import config as config_mod
from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.errors import UserError
from stocfl.executors import ENGINES, engine_of
from stocfl.experiment import configure


@dataclass
class Result:
    """What a run gives back.

    Attributes
    ----------
    summary : dict
        The final figures (as ``summary.json``).
    metrics : list of dict
        One dict per round (as ``metrics.jsonl``).
    labels : np.ndarray of shape (N,)
        The found cluster of every client, numbered 0..K-1 as in clusters.csv (-1: never
        placed: held out, or never seen).
    models : dict of str to state_dict
        ``"global"`` and ``"cluster K"`` for every found cluster K (numbered as ``labels``),
        each a ``state_dict`` loadable into the run's ``nn.Module``.
    out : Path or None
        The results directory (None: the run kept everything in memory).
    """

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    labels: np.ndarray
    models: dict[str, dict[str, torch.Tensor]]
    out: Path | None

    def __repr__(self) -> str:
        s = self.summary

        def num(key, pct=False):
            v = s.get(key)
            return "n/a" if v is None else (f"{100 * v:.2f}%" if pct else f"{v:.3g}")

        where = f", out={str(self.out)!r}" if self.out is not None else ""
        return (
            f"Result({s.get('algorithm')} on {s.get('scenario')} ({s.get('dataset')}), seed {s.get('seed')}, "
            f"{s.get('rounds_done')} rounds: accuracy {num('accuracy', True)}, global {num('global_accuracy', True)}, "
            f"{s.get('n_clusters')} clusters, ARI {num('ari')}; {len(self.models)} models{where})"
        )


@dataclass
class Comparison:
    """What :func:`compare` gives back: per algorithm label, mean +- std over seeds.

    Attributes
    ----------
    rows : list of dict
        One per label: ``accuracy_mean``, ``accuracy_std``, ``accuracy_n`` and the same for
        ``global_accuracy``, ``ari``, ``n_clusters``, ``seconds`` (as ``stocfl compare``'s
        compare.csv).
    results : dict of str to list of Result
        Every run, by label, one per seed.
    """

    rows: list[dict[str, Any]]
    results: dict[str, list[Result]]

    def markdown(self) -> str:
        """The table as ``stocfl compare`` prints it."""
        from stocfl.experiment.compare import markdown

        return markdown(self.rows)

    def __str__(self) -> str:
        return self.markdown()

    def __repr__(self) -> str:
        return (
            f"Comparison of {', '.join(self.results)} over {max(map(len, self.results.values()), default=0)} seed(s):\n"
            + self.markdown()
        )

    def plot(self, path: str | Path, title: str = "") -> None:
        """Mean accuracy per evaluated round of each label (band: +- one std over seeds) as a PNG."""
        from stocfl.experiment.compare import plot, table

        _, curves = table({k: [(r.summary, r.metrics) for r in v] for k, v in self.results.items()})
        plot(curves, Path(path), title)


def as_config(config: Any = None) -> Config:
    """A validated :class:`Config` from a TOML path, a nested dict, a Config or None (defaults)."""
    if config is None or isinstance(config, (str, Path)):
        return configure.load(config)
    if isinstance(config, Config):
        return configure.settle(config)
    if isinstance(config, dict):
        return configure.validate(copy.deepcopy(config))
    raise UserError(f"config: expected a TOML path, a dict or a stocfl Config, got {type(config).__name__}")


def run(
    config: Any = None,
    *,
    federation: Federation | None = None,
    model: torch.nn.Module | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    label: str | None = None,
) -> Result:
    """Run an experiment and return its :class:`Result`.

    The run sets torch's thread count to ``run.threads`` while it runs and puts the caller's
    back when it ends.

    Parameters
    ----------
    config : path, dict, Config or None
        The run's configuration (``stocfl config`` lists every key); None = the defaults.
    federation : Federation, optional
        The clients' data (:meth:`Federation.from_arrays`); default: built from ``[scenario]``.
    model : nn.Module, optional
        The model, its current weights being w_0; default: built from ``[model]``.
    loss : callable, optional
        ``loss(logits, y)`` -> one value per sample, for local training and evaluation;
        default: cross-entropy. (StoCFL's linear anchor keeps cross-entropy.)
    out : path, optional
        A results directory to write (resumable with :func:`resume`); None = nothing is written.
    progress : bool, default True
        A progress bar in a terminal, one line a round on stderr elsewhere (a notebook, a log);
        False: silent.
    label : str, optional
        The run's name in its progress lines (default: the algorithm's).
    """
    from stocfl.experiment.loop import Experiment

    cfg = as_config(config)
    if federation is not None and not isinstance(federation, Federation):
        raise UserError(f"federation: expected a stocfl.Federation, got {type(federation).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise UserError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    # a federation replaces [scenario] and a model [model]: a key set there would be ignored without a word
    replaced = [
        (what, section, default)
        for given, what, section, default in (
            (federation, "a federation", "scenario", config_mod.ScenarioConfig()),
            (model, "a model", "model", config_mod.ModelConfig()),
        )
        if given is not None
    ]
    for what, section, default in replaced:
        for key, value in getattr(cfg, section).model_dump().items():
            if key != "data_dir" and value != getattr(default, key):
                how = {
                    "holdout": " (hold clients out with Federation.from_arrays(..., holdout=...))",
                    **dict.fromkeys(
                        ("present_at_start", "join_rounds", "leave", "leave_rounds"),
                        " (say who is present when with Federation.with_schedule(joins, leaves))",
                    ),
                    **dict.fromkeys(
                        ("drift", "drift_rounds", "drift_share", "drift_notice"),
                        " (a federation given in Python does not drift; build a drifting one from [scenario])",
                    ),
                }.get(key, "")
                raise UserError(
                    f"config: {section}.{key} = {value!r} has no effect with {what} given in Python, "
                    f"which replaces [{section}]; remove it from the config{how}"
                )
    if loss is not None and not callable(loss):
        raise UserError(f"loss: expected a function loss(logits, y) -> per-sample values, got {type(loss).__name__}")
    if engine_of(cfg.run.engine).launch is not None:
        raise UserError(
            f"run.engine = {cfg.run.engine} runs from the command line ('stocfl run'); use one of "
            f"{', '.join(n for n, e in ENGINES.items() if e.executor is not None)} from Python"
        )
    if out is not None and not str(out).strip():
        raise UserError("out = '' names no directory; give a results directory, or None to write nothing")
    with _threads_kept():
        exp = Experiment.create(cfg, None if out is None else Path(out), federation=federation, module=model, loss=loss)
        return _result(exp, exp.run(progress=progress, label=label))


def run_into(out: str | Path, config: Any = None, *, progress: bool = False) -> dict[str, Any]:
    """Run ``config`` into the results directory ``out`` on any engine, Flower's simulation
    included (what ``stocfl run`` does), and return its summary (as ``summary.json``)."""
    from stocfl.experiment.build import pin_data_dir
    from stocfl.experiment.loop import Experiment

    if not str(out).strip():
        raise UserError("out = '' names no directory; give a results directory")
    cfg, out = as_config(config), Path(out)
    launch = engine_of(cfg.run.engine).launch
    if launch is None:
        return Experiment.create(cfg, out).run(progress=progress)
    pin_data_dir(cfg)  # the engine's clients must find the same data
    return launch(cfg.to_dict(), out, lambda ex: Experiment.create(cfg, out, ex), cfg.scenario.n_clients, progress)


def resume(
    out: str | Path,
    *,
    federation: Federation | None = None,
    model: torch.nn.Module | None = None,
    loss: Callable | None = None,
    data_dir: str | None = None,
    progress: bool = True,
    overrides: list[str] = (),
) -> Result:
    """Continue the run in ``out`` (stopped or killed) to its end; ``federation``, ``model`` and
    ``loss`` as given to :func:`run` when it was started with them: the same data, the same
    module with the same initial weights, the same loss (the checkpoint's digests of them are
    checked). ``overrides``: ``["run.rounds=N"]`` runs a finished run further
    (``run.eval_every`` may change too)."""
    from stocfl.experiment.loop import Experiment

    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise UserError(
            f"overrides: expected a list of 'key=value' strings, e.g. ['run.rounds=10'], got {overrides!r:.80}"
        )
    with _threads_kept():
        exp = Experiment.resume(
            Path(out), data_dir, federation=federation, module=model, loss=loss, overrides=list(overrides)
        )
        return _result(exp, exp.run(progress=progress))


def compare(
    algorithms: list[str],
    config: Any = None,
    *,
    seeds: list[int] = (0,),
    federation: Federation | None = None,
    model: torch.nn.Module | None = None,
    loss: Callable | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> Comparison:
    """Several algorithms x seeds on one federation: what ``stocfl compare`` does, from Python.

    Parameters
    ----------
    algorithms : list of str
        Each ``"NAME [key=value ...]"``, e.g. ``["fedavg", "ifca n_models=2", "stocfl tau=0.4"]``;
        its label in the table is the spec.
    config : path, dict, Config or None
        The shared setting (scenario, model, training, rounds); its ``[algorithm]`` is replaced
        by each spec's, and ``run.seed`` by each seed.
    seeds : list of int
        The seeds, one run each per algorithm.
    federation, model, loss
        As for :func:`run`, shared by every run.
    out : path, optional
        A directory for every run (``LABEL-seedN``) and the table (compare.md, compare.csv,
        compare.png); None = nothing is written.
    """
    from stocfl.errors import first_repeated
    from stocfl.experiment.compare import parse_spec, setting, table, write_table

    base = as_config(config).to_dict()
    seeds = list(seeds)
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise UserError(f"compare: seeds {seeds!r}: give a list of distinct integers, e.g. [0, 1, 2]")
    if (k := first_repeated(seeds)) is not None:
        raise UserError(f"compare: seed {seeds[k]} is given twice; give distinct seeds, e.g. [0, 1, 2]")
    if isinstance(algorithms, str) or not algorithms:
        raise UserError("compare: algorithms: give a list of specs, e.g. ['fedavg', 'ifca n_models=2']")
    parsed = [parse_spec(s) for s in algorithms]
    labels = [label for label, _ in parsed]
    if (k := first_repeated(labels)) is not None:
        raise UserError(f"compare: {algorithms[k]!r} is given twice; give each algorithm once")
    configs = {
        label: [configure.apply({**copy.deepcopy(base), "algorithm": {}}, [*algo, f"run.seed={s}"]) for s in seeds]
        for label, algo in parsed
    }  # every spec checked before any run
    where = None if out is None else Path(out)
    results: dict[str, list[Result]] = {}
    for label, cfgs in configs.items():
        results[label] = [
            run(
                cfg,
                federation=federation,
                model=model,
                loss=loss,
                progress=progress,
                label=label,
                out=None if where is None else where / f"{label}-seed{cfg.run.seed}",
            )
            for cfg in cfgs
        ]
    rows, curves = table({k: [(r.summary, r.metrics) for r in v] for k, v in results.items()})
    if where is not None:
        write_table(where, rows, curves, setting(next(iter(configs.values()))[0]))
    return Comparison(rows, results)


class _threads_kept:
    """torch's thread count as the caller had it, put back when a run ends (a run sets its own)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def _result(exp, summary: dict[str, Any]) -> Result:
    alg, flat = exp.algorithm, exp.model
    from stocfl.experiment.metrics import cluster_numbers

    labels, found = alg.cluster_labels(), alg.cluster_models()
    number = cluster_numbers(labels, found)  # as clusters.csv and stocfl export number them
    models = {"global": flat.state_dict(alg.global_model())}
    models.update({f"cluster {number[k]}": flat.state_dict(found[k]) for k in sorted(found, key=number.get)})
    labels = np.array([number.get(int(k), -1) for k in labels], dtype=np.int64)
    return Result(summary, [dict(r) for r in exp.rows], labels, models, exp.out)
