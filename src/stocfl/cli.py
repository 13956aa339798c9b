"""The ``stocfl`` command: run, resume, assign, export, compare, config, certs (the lab's reproduce and
bench: ``stocfl-lab``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stocfl.errors import UserError, first_repeated


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2, as for every other bad
    input (the lab's ``stocfl-lab`` uses it too)."""

    def error(self, message):
        prog, *command = self.prog.split()  # "stocfl", ["run"] for stocfl run
        self.exit(2, f"{prog}: error: {message} (see {' '.join([prog, *command, '--help'])})\n")


def path_arg(text: str) -> str:
    """An argparse type: a usable path."""
    if "\x00" in text or not text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable path")
    return text


def _parser() -> argparse.ArgumentParser:
    from stocfl import __version__
    from stocfl.executors import ENGINES

    p = Parser(prog="stocfl", description="Clustered federated learning: StoCFL and its baselines.")
    p.add_argument("--version", action="version", version=f"stocfl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser(
        "run",
        help="run an experiment from a TOML config",
        description="Run an experiment. Every config key, its default and meaning: 'stocfl config'.",
    )
    run.add_argument(
        "config",
        nargs="?",
        type=path_arg,
        default="default",
        help="TOML config, a path or the name of a packaged one (stocfl config --list; default: "
        "'default', StoCFL on rotated digits); sections [run] [scenario] [model] [train] [aggregation] "
        "[algorithm]",
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set run.rounds=5 (repeatable)",
    )
    run.add_argument("--out", type=path_arg, help="results directory (default: runs/<scenario>-<algorithm>-<time>)")
    run.add_argument("--data-dir", type=path_arg, help="directory of the data sets (default: $STOCFL_DATA_DIR)")
    run.add_argument(
        "--engine",
        choices=("local", *ENGINES),
        help="shortcut for --set run.engine=...; local = auto (in-process); the choices are the registered engines",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    res = sub.add_parser("resume", help="continue a run that was stopped or killed")
    res.add_argument("dir", type=path_arg, help="results directory of the run")
    res.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run.rounds=N to run a finished run further (or run.eval_every=K); no other key",
    )
    res.add_argument("--data-dir", type=path_arg, help="directory of the data sets, if it moved")
    res.add_argument("--quiet", action="store_true", help="no progress bar")

    cfg_ = sub.add_parser(
        "config",
        help="list every config key with its default and meaning",
        description="Every config key with its default and meaning; --list: the configs that ship "
        "with stocfl, each runnable by name (stocfl run NAME).",
    )
    cfg_.add_argument("--list", action="store_true", help="list the packaged configs instead")

    new = sub.add_parser(
        "assign",
        help="place new or held-out clients on a finished run (cluster, accuracy)",
        description="Place clients on a saved run: by default its held-out clients "
        "(scenario.holdout); with --set scenario.KEY=VALUE or --set run.seed=N, the clients of a "
        "new federation built from the run's scenario so changed.",
    )
    new.add_argument("dir", type=path_arg, help="results directory of the run")
    new.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="build new clients: scenario.* keys or run.seed",
    )
    new.add_argument("--clients", help="comma-separated client ids (default: all held-out / all new)")
    new.add_argument(
        "--unlabeled",
        action="store_true",
        help="the new clients hold no labels: placed from what they compute without them (flux)",
    )
    new.add_argument("--data-dir", type=path_arg, help="directory of the data sets")
    new.add_argument("--out", type=path_arg, help="CSV of the placements (default: DIR/new_clients.csv)")

    exp = sub.add_parser(
        "export",
        help="write a run's cluster and global models as state_dicts (safetensors)",
        description="Write each found cluster's model and the global model of a run, at its last "
        "checkpoint, as PyTorch state_dicts in safetensors, with models.json saying which is which. "
        "Load one with stocfl.load_model(DIR, cluster=N).",
    )
    exp.add_argument("dir", type=path_arg, help="results directory of the run")
    exp.add_argument("--out", type=path_arg, help="directory of the model files (default: DIR/export)")
    exp.add_argument("--data-dir", type=path_arg, help="directory of the data sets, if it moved")

    cmp_ = sub.add_parser("compare", help="several algorithms x seeds on one scenario: one table and one plot")
    cmp_.add_argument("config", nargs="?", type=path_arg, help="TOML config of the scenario, model and training")
    cmp_.add_argument(
        "--algo",
        action="append",
        required=True,
        metavar="'NAME [key=value ...]'",
        help="an algorithm and its parameters, e.g. --algo fedavg --algo 'ifca n_models=2' (repeatable)",
    )
    cmp_.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    cmp_.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmp_.add_argument("--out", type=path_arg, default="runs/compare", help="directory of the runs and the table")
    cmp_.add_argument("--data-dir", type=path_arg, help="directory of the data sets")
    cmp_.add_argument("--quiet", action="store_true", help="no progress bars")

    certs = sub.add_parser(
        "certs",
        help="certificates for a Flower deployment in secure mode (TLS)",
        description="Write ca.crt, ca.key, server.pem, server.key into DIR: a private CA and a "
        "SuperLink certificate it signed. SuperLink: --ssl-ca-certfile ca.crt --ssl-certfile "
        "server.pem --ssl-keyfile server.key; SuperNodes: --root-certificates ca.crt; flwr: "
        'root-certificates = "ca.crt" in $FLWR_HOME/config.toml.',
    )
    certs.add_argument("dir", type=path_arg, help="directory to write the files into")
    certs.add_argument(
        "--host",
        action="append",
        metavar="NAME_OR_IP",
        help="a name or IP address the SuperNodes use to reach the SuperLink (repeatable; "
        "default: 127.0.0.1 and localhost)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--overwrite", action="store_true", help="replace existing files (a new CA)")

    for moved, what in MOVED.items():
        sub.add_parser(moved, help=f"{what}: moved to the lab, 'stocfl-lab {moved}'", add_help=False)
    return p


def _run(args) -> int:
    from stocfl import api
    from stocfl.experiment import configure

    engine = [] if args.engine is None else [f"run.engine={'auto' if args.engine == 'local' else args.engine}"]
    cfg = configure.load(args.config, [*args.overrides, *engine], args.data_dir)
    out = (
        Path(args.out)
        if args.out
        else Path("runs")
        / (f"{cfg.scenario.name}-{cfg.scenario.dataset}-{cfg.algorithm['name']}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    args.run_dir = out  # for the message on Ctrl-C
    _print_summary(api.run_into(out, cfg, progress=not args.quiet), out)
    return 0


def _resume(args) -> int:
    import copy

    from stocfl import api
    from stocfl import config as schema
    from stocfl.executors import engine_of
    from stocfl.experiment import provenance
    from stocfl.experiment.build import read_config
    from stocfl.experiment.loop import Experiment
    from stocfl.experiment.provenance import finished_summary

    out = args.run_dir = Path(args.dir)
    raw = read_config(out, args.data_dir)
    _refuse_names_registered_in_python(raw, out)
    finished = finished_summary(out)
    if finished is not None and not args.overrides:
        print(
            f"stocfl: {out} has finished all {finished['rounds']} rounds; to run it further: stocfl resume {out} "
            f"--set run.rounds=N",
            file=sys.stderr,
        )
        _print_summary(finished, out)
        return 0
    engine = raw.get("run", {}).get("engine", "auto")
    launch = engine_of(engine).launch if isinstance(engine, str) else None
    if launch is not None:
        # what the engine needs before the run is opened (run.node_wait), the extensions applied
        launched = schema.validate(provenance.with_extensions(copy.deepcopy(raw), args.overrides)).to_dict()
        summary = launch(
            launched,
            out,
            lambda ex: Experiment.resume(out, args.data_dir, ex, overrides=args.overrides),
            schema.validate(copy.deepcopy(raw)).scenario.n_clients,  # read_config checked it validates
            not args.quiet,
        )
    else:
        summary = api.resume(out, data_dir=args.data_dir, progress=not args.quiet, overrides=args.overrides).summary
    _print_summary(summary, out)
    return 0


def _refuse_names_registered_in_python(raw: dict, out: Path) -> None:
    """A run of an algorithm, model, data set, scenario or engine registered in Python names
    something this process does not know: say to resume it from Python, in one line."""
    from stocfl.algorithms import ALGORITHMS
    from stocfl.client.models import MODELS
    from stocfl.data.datasets import DATASETS
    from stocfl.data.scenarios import SCENARIOS
    from stocfl.executors import ENGINES

    for section, key, known in (
        ("algorithm", "name", ALGORITHMS),
        ("model", "name", {"auto": 0, **MODELS}),
        ("scenario", "dataset", DATASETS),
        ("scenario", "name", SCENARIOS),
        ("run", "engine", ENGINES),
    ):
        name = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(name, str) and name not in known:
            raise UserError(
                f"{out} was run with {section}.{key} = {name!r}, which is not built in (registered in Python "
                f"when it ran); resume it from Python: register it again, then stocfl.resume({str(out)!r})"
            )


def _assign(args) -> int:
    from stocfl.experiment.newclients import place_clients
    from stocfl.storage import formats

    clients = None
    if args.clients:
        try:
            clients = [int(c) for c in args.clients.split(",")]
        except ValueError:
            raise UserError(f"--clients {args.clients!r}: expected comma-separated integers, e.g. 0,5,7") from None
    rows, summary = place_clients(args.dir, args.overrides, clients, args.data_dir, args.unlabeled)
    out = Path(args.out) if args.out else Path(args.dir) / "new_clients.csv"
    formats.write_csv(out, rows)
    print(json.dumps(summary))
    print(f"placements: {out.resolve()}")
    return 0


def _export(args) -> int:
    from stocfl.experiment.modelfiles import INDEX, export_models

    out = export_models(args.dir, args.out, args.data_dir)
    index = json.loads((out / INDEX).read_text())
    for m in index["models"]:
        who = "global model" if m["model"] == "global" else f"cluster {m['cluster']} ({m['members']} clients)"
        print(f"{who}: {(out / m['file']).resolve()}")
    print(f"index: {(out / INDEX).resolve()}")
    return 0


def _compare(args) -> int:
    from stocfl.experiment.compare import compare

    seeds = parse_seeds(args.seeds)
    out = Path(args.out)
    compare(args.config, args.algo, seeds, out, args.overrides, args.data_dir, progress=not args.quiet)
    print((out / "compare.md").read_text(), end="")
    print(f"table: {(out / 'compare.md').resolve()}")
    return 0


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``: distinct integers, or one UserError line."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if (k := first_repeated(seeds)) is not None:
        raise UserError(f"--seeds {text!r}: seed {seeds[k]} is given twice; give distinct seeds, e.g. 0,1,2")
    return seeds


def _print_summary(summary: dict, out: Path) -> None:
    keys = (
        "algorithm",
        "scenario",
        "dataset",
        "rounds_done",
        "accuracy",
        "global_accuracy",
        "n_clusters",
        "ari",
        "seconds",
    )
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"results: {out.resolve()}")
    if left := summary.get("eval_left_out"):
        from stocfl.client.tasks import id_ranges

        print(
            f"stocfl: note: the accuracies leave out {len(left)} client(s) that failed to answer the last evaluation "
            f"(clients {id_ranges(left)}; eval_left_out in summary.json)",
            file=sys.stderr,
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout``, SLURM and systemd send), raised where the run is, so that it
    stops as at Ctrl-C: the last finished round is checkpointed and the command says so."""


def _on_sigterm(signum, frame):
    raise Terminated


def guarded(prog: str, command: str, act, resume_hint: str = "DIR") -> int:
    """``act()`` with every input error as one line naming it, and exit code 2 (the lab's
    ``stocfl-lab`` uses it too): a UserError, an unusable path, a full disk, a closed pipe,
    Ctrl-C and SIGTERM (exit codes 130 and 143)."""
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _guarded(prog, command, act, resume_hint)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def _guarded(prog: str, command: str, act, resume_hint) -> int:
    import errno

    try:
        return act()
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. head: the run itself is complete on disk
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:  # a path that cannot be made, read or written (the run's finished rounds stay on disk)
        where = f"{err.filename}: " if err.filename else ""
        if err.errno == errno.ENOSPC:
            print(
                f"{prog}: error: {where}no space left on the device holding {resume_hint}; free some and "
                f"{_again(prog, command, resume_hint)} (the last finished round is checkpointed)",
                file=sys.stderr,
            )
        else:
            print(f"{prog}: error: {where}{err.strerror or err}; check the path and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        print(
            f"{prog}: {what}; the last finished round is checkpointed: {_again(prog, command, resume_hint)}",
            file=sys.stderr,
        )
        return 143 if isinstance(err, Terminated) else 130


def _again(prog: str, command: str, resume_hint) -> str:
    if command in ("compare", "reproduce"):
        return f"run the same '{prog} {command}' command again: finished runs are reused, this one resumed"
    return f"continue with 'stocfl resume {resume_hint}'"


MOVED = {"reproduce": "a paper's table", "bench": "executor timings"}  # commands now in stocfl-lab


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MOVED:
        print(
            f"stocfl: error: 'stocfl {argv[0]}' moved to the lab: run 'stocfl-lab {' '.join(argv)}' (installed by "
            f"'make setup', or 'pip install ./lab' in a clone)",
            file=sys.stderr,
        )
        return 2
    args = _parser().parse_args(argv)
    return guarded("stocfl", args.command, lambda: _dispatch(args), resume_hint=_RunDir(args))


class _RunDir:
    """The run directory for the Ctrl-C message, known once the command has chosen it."""

    def __init__(self, args):
        self.args = args

    def __str__(self) -> str:
        return str(getattr(self.args, "run_dir", None) or "DIR")


def _dispatch(args) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "resume":
        return _resume(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "assign":
        return _assign(args)
    if args.command == "export":
        return _export(args)
    if args.command == "config":
        from stocfl.config import describe_packaged
        from stocfl.experiment.configure import describe

        print(describe_packaged() if args.list else describe())
        return 0
    if args.command == "certs":
        from stocfl.flower.certs import make_certificates

        paths = make_certificates(args.dir, args.host or ("127.0.0.1", "localhost"), args.days, args.overwrite)
        print("\n".join(str(p.resolve()) for p in paths.values()))
        return 0
    return 0
