"""The ``stocfl`` command: run, resume, assign, export, compare, reproduce, config, certs, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stocfl.errors import UserError, first_repeated


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as for every other bad input
        command = " ".join(self.prog.split()[1:])  # "" for stocfl itself, "run" for stocfl run
        self.exit(2, f"stocfl: error: {message} (see stocfl {command + ' ' if command else ''}--help)\n")


def _path(text: str) -> str:
    if "\x00" in text or not text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable path")
    return text


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stocfl", description="Clustered federated learning: StoCFL and its baselines.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run an experiment from a TOML config",
                         description="Run an experiment. Every config key, its default and meaning: 'stocfl config'.")
    run.add_argument("config", nargs="?", type=_path, help="TOML config (sections [run] [scenario] [model] [train] [algorithm])")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set run.rounds=5 (repeatable)")
    run.add_argument("--out", type=_path, help="results directory (default: runs/<scenario>-<algorithm>-<time>)")
    run.add_argument("--data-dir", type=_path, help="directory of the data sets (default: $STOCFL_DATA_DIR)")
    run.add_argument("--engine", choices=("local", "auto", "sequential", "parallel", "batched", "lowrank", "flower-sim"),
                     help="shortcut for --set run.engine=...; local = auto (in-process)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    res = sub.add_parser("resume", help="continue a run that was stopped or killed")
    res.add_argument("dir", type=_path, help="results directory of the run")
    res.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="run.rounds=N to run a finished run further (or run.eval_every=K); no other key")
    res.add_argument("--data-dir", type=_path, help="directory of the data sets, if it moved")
    res.add_argument("--quiet", action="store_true", help="no progress bar")

    sub.add_parser("config", help="list every config key with its default and meaning")

    new = sub.add_parser("assign", help="place new or held-out clients on a finished run (cluster, accuracy)",
                         description="Place clients on a saved run: by default its held-out clients "
                         "(scenario.holdout); with --set scenario.KEY=VALUE or --set run.seed=N, the clients of a "
                         "new federation built from the run's scenario so changed.")
    new.add_argument("dir", type=_path, help="results directory of the run")
    new.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="build new clients: scenario.* keys or run.seed")
    new.add_argument("--clients", help="comma-separated client ids (default: all held-out / all new)")
    new.add_argument("--data-dir", type=_path, help="directory of the data sets")
    new.add_argument("--out", type=_path, help="CSV of the placements (default: DIR/new_clients.csv)")

    exp = sub.add_parser("export", help="write a run's cluster and global models as state_dicts (safetensors)",
                         description="Write each found cluster's model and the global model of a run, at its last "
                         "checkpoint, as PyTorch state_dicts in safetensors, with models.json saying which is which. "
                         "Load one with stocfl.load_model(DIR, cluster=N).")
    exp.add_argument("dir", type=_path, help="results directory of the run")
    exp.add_argument("--out", type=_path, help="directory of the model files (default: DIR/export)")
    exp.add_argument("--data-dir", type=_path, help="directory of the data sets, if it moved")

    cmp_ = sub.add_parser("compare", help="several algorithms x seeds on one scenario: one table and one plot")
    cmp_.add_argument("config", nargs="?", type=_path, help="TOML config of the scenario, model and training")
    cmp_.add_argument("--algo", action="append", required=True, metavar="'NAME [key=value ...]'",
                      help="an algorithm and its parameters, e.g. --algo fedavg --algo 'ifca n_models=2' (repeatable)")
    cmp_.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    cmp_.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmp_.add_argument("--out", type=_path, default="runs/compare", help="directory of the runs and the table")
    cmp_.add_argument("--data-dir", type=_path, help="directory of the data sets")
    cmp_.add_argument("--quiet", action="store_true", help="no progress bars")

    rep = sub.add_parser("reproduce", help="a paper's table: its runs, resumable, with the paper's numbers beside ours",
                         description="Run every row of a table declared in reproductions/TABLE.toml (or reuse and "
                         "resume its runs in reproductions/runs/TABLE/) and write reproductions/TABLE.md and .json.")
    rep.add_argument("table", nargs="?", help="table name (stocfl reproduce --list)")
    rep.add_argument("--list", action="store_true", help="list the tables")
    rep.add_argument("--seeds", help="comma-separated seeds for every row (default: the table's, or a row's own)")
    rep.add_argument("--quick", action="store_true", help="the table's reduced setting (a smoke test, not the paper's)")
    rep.add_argument("--data-dir", type=_path, help="directory of the data sets (default: $STOCFL_DATA_DIR)")
    rep.add_argument("--runs", type=_path, help="directory of the run directories (default: reproductions/runs/TABLE)")
    rep.add_argument("--report", action="store_true", help="run nothing: write the table of the runs finished so far")
    rep.add_argument("--rows", help="the rows to run, by 1-based number, e.g. 2,4-6 (default: every row); the table "
                     "still shows every row's finished runs")
    rep.add_argument("--rerun", action="store_true", help="run the chosen rows again where only TABLE.json records "
                     "their runs (their directories gone), e.g. to draw curves a run was recorded without")
    rep.add_argument("--quiet", action="store_true", help="no progress bars")

    certs = sub.add_parser("certs", help="certificates for a Flower deployment in secure mode (TLS)",
                           description="Write ca.crt, ca.key, server.pem, server.key into DIR: a private CA and a "
                           "SuperLink certificate it signed. SuperLink: --ssl-ca-certfile ca.crt --ssl-certfile "
                           "server.pem --ssl-keyfile server.key; SuperNodes: --root-certificates ca.crt; flwr: "
                           "root-certificates = \"ca.crt\" in $FLWR_HOME/config.toml.")
    certs.add_argument("dir", type=_path, help="directory to write the files into")
    certs.add_argument("--host", action="append", metavar="NAME_OR_IP",
                       help="a name or IP address the SuperNodes use to reach the SuperLink (repeatable; "
                       "default: 127.0.0.1 and localhost)")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--overwrite", action="store_true", help="replace existing files (a new CA)")

    bench = sub.add_parser("bench", help="time one round on each executor; prints JSON")
    bench.add_argument("--data-dir", type=_path, help="MNIST for the paper's case (default: $STOCFL_DATA_DIR, else ../shared/data)")
    bench.add_argument("--out", type=_path, help="also write the JSON here")
    bench.add_argument("--quick", action="store_true", help="smaller cases (a smoke test of the benchmark)")
    bench.add_argument("--device", default="cpu", help="where to time the executors: cpu (default), cuda, cuda:N, mps")
    bench.add_argument("--peers", action="store_true", help="the same FedAvg work on stocfl, a naive PyTorch loop, "
                       "pfl-research and Flower's simulation (peers from the [bench] extra; a missing one is skipped)")
    bench.add_argument("--case", action="append", help="with --peers: only this case (repeatable; default: all of "
                       "a_rotated_mnist_480x50_mlp2048, b_cifar10_1000x50_cnn, c_digits_500x10)")
    bench.add_argument("--repeats", type=int, help="with --peers: repetitions of each system but Flower "
                       "(default 3; the figure is their median)")
    return p


def _run(args) -> int:
    from stocfl import api, config
    from stocfl.build import pin_data_dir
    from stocfl.executors import engine_of
    from stocfl.runner import Experiment

    engine = [] if args.engine is None else [f"run.engine={'auto' if args.engine == 'local' else args.engine}"]
    cfg = config.load(args.config, [*args.overrides, *engine], args.data_dir)
    out = Path(args.out) if args.out else Path("runs") / (
        f"{cfg.scenario.name}-{cfg.scenario.dataset}-{cfg.algorithm['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    args.run_dir = out  # for the message on Ctrl-C
    launch = engine_of(cfg.run.engine).launch
    if launch is not None:
        pin_data_dir(cfg)  # the engine's clients must find the same data
        summary = launch(cfg.to_dict(), out, lambda ex: Experiment.create(cfg, out, ex), cfg.scenario.n_clients,
                         not args.quiet)
    else:
        summary = api.run(cfg, out=out, progress=not args.quiet).summary
    _print_summary(summary, out)
    return 0


def _resume(args) -> int:
    from stocfl import api
    from stocfl.build import read_config
    from stocfl.executors import engine_of
    from stocfl.runner import Experiment, finished_summary

    out = args.run_dir = Path(args.dir)
    raw = read_config(out, args.data_dir)
    finished = finished_summary(out)
    if finished is not None and not args.overrides:
        print(f"stocfl: {out} has finished all {finished['rounds']} rounds; to run it further: stocfl resume {out} "
              f"--set run.rounds=N", file=sys.stderr)
        _print_summary(finished, out)
        return 0
    engine = raw.get("run", {}).get("engine", "auto")
    launch = engine_of(engine).launch if isinstance(engine, str) else None
    if launch is not None:
        summary = launch(raw, out, lambda ex: Experiment.resume(out, args.data_dir, ex, overrides=args.overrides),
                         raw["scenario"]["n_clients"], not args.quiet)
    else:
        summary = api.resume(out, data_dir=args.data_dir, progress=not args.quiet, overrides=args.overrides).summary
    _print_summary(summary, out)
    return 0


def _assign(args) -> int:
    from stocfl import report
    from stocfl.newclients import place_clients

    clients = None
    if args.clients:
        try:
            clients = [int(c) for c in args.clients.split(",")]
        except ValueError:
            raise UserError(f"--clients {args.clients!r}: expected comma-separated integers, e.g. 0,5,7") from None
    rows, summary = place_clients(args.dir, args.overrides, clients, args.data_dir)
    out = Path(args.out) if args.out else Path(args.dir) / "new_clients.csv"
    report.write_csv(out, rows)
    print(json.dumps(summary))
    print(f"placements: {out.resolve()}")
    return 0


def _export(args) -> int:
    from stocfl.modelfiles import INDEX, export_models

    out = export_models(args.dir, args.out, args.data_dir)
    index = json.loads((out / INDEX).read_text())
    for m in index["models"]:
        who = "global model" if m["model"] == "global" else f"cluster {m['cluster']} ({m['members']} clients)"
        print(f"{who}: {(out / m['file']).resolve()}")
    print(f"index: {(out / INDEX).resolve()}")
    return 0


def _compare(args) -> int:
    from stocfl.compare import compare

    seeds = _seeds(args.seeds)
    out = Path(args.out)
    compare(args.config, args.algo, seeds, out, args.overrides, args.data_dir, progress=not args.quiet)
    print((out / "compare.md").read_text(), end="")
    print(f"table: {(out / 'compare.md').resolve()}")
    return 0


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if (k := first_repeated(seeds)) is not None:
        raise UserError(f"--seeds {text!r}: seed {seeds[k]} is given twice; give distinct seeds, e.g. 0,1,2")
    return seeds


def _reproduce(args) -> int:
    from stocfl.reproduce import listing, reproduce, table_files

    if args.list:
        if args.table:
            raise UserError(f"reproduce --list lists every table; drop {args.table!r}, or drop --list to run it")
        print(listing())
        return 0
    if not args.table:
        raise UserError("reproduce: name a table (stocfl reproduce --list shows them)")
    seeds = _seeds(args.seeds) if args.seeds is not None else None
    reproduce(args.table, seeds, args.quick, args.data_dir, Path(args.runs) if args.runs else None,
              progress=not args.quiet, log=lambda m: print(m, file=sys.stderr, flush=True), report_only=args.report,
              rows=args.rows, rerun=args.rerun)
    md, _, _ = table_files(args.table, args.quick)
    print(md.read_text(), end="")
    print(f"table: {md}")
    return 0


def _print_summary(summary: dict, out: Path) -> None:
    keys = ("algorithm", "scenario", "dataset", "rounds_done", "accuracy", "global_accuracy", "n_clusters", "ari",
            "seconds")
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"results: {out.resolve()}")
    if left := summary.get("eval_left_out"):
        from stocfl.tasks import id_ranges

        print(f"stocfl: note: the accuracies leave out {len(left)} client(s) that failed to answer the last evaluation "
              f"(clients {id_ranges(left)}; eval_left_out in summary.json)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "resume":
            return _resume(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "reproduce":
            return _reproduce(args)
        if args.command == "assign":
            return _assign(args)
        if args.command == "export":
            return _export(args)
        if args.command == "config":
            from stocfl.config import describe

            print(describe())
            return 0
        if args.command == "certs":
            from stocfl.flower.certs import make_certificates

            paths = make_certificates(args.dir, args.host or ("127.0.0.1", "localhost"), args.days, args.overwrite)
            print("\n".join(str(p.resolve()) for p in paths.values()))
            return 0
        if args.command == "bench":
            from stocfl.bench import main as bench_main

            return bench_main(args)
    except UserError as err:
        print(f"stocfl: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. head: the run itself is complete on disk
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:  # a path that cannot be made, read or written (the run's finished rounds stay on disk)
        where = f"{err.filename}: " if err.filename else ""
        print(f"stocfl: error: {where}{err.strerror or err}; check the path and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command in ("compare", "reproduce"):
            how = f"run the same 'stocfl {args.command}' command again: finished runs are reused, this one resumed"
        else:
            how = f"continue with 'stocfl resume {getattr(args, 'run_dir', None) or 'DIR'}'"
        print(f"stocfl: interrupted; the last finished round is checkpointed: {how}", file=sys.stderr)
        return 130
    return 0
