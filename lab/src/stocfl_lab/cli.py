"""The ``stocfl-lab`` command: the papers' tables (``reproduce``), the executor benchmarks (``bench``)
and the clustered-FL benchmark (``benchmark``).

The lab is stocfl's first user: it imports only stocfl's public API (``stocfl``, its folder
packages' exports, ``stocfl.config``, ``stocfl.errors``, ``stocfl.cli``'s parser helpers).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stocfl.cli import Parser, guarded, parse_seeds, path_arg
from stocfl.errors import UserError


def _parser() -> Parser:
    p = Parser(prog="stocfl-lab", description="stocfl's lab: the papers' tables and the benchmarks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    rep = sub.add_parser(
        "reproduce",
        help="a paper's table: its runs, resumable, with the paper's numbers beside ours",
        description="Run every row of a table declared in TABLES/TABLE.toml (or reuse and resume its runs in "
        "TABLES/runs/TABLE/) and write TABLES/TABLE.md and .json; TABLES is --tables, by default "
        "./reproductions.",
    )
    rep.add_argument("table", nargs="?", help="table name (stocfl-lab reproduce --list)")
    rep.add_argument("--list", action="store_true", help="list the tables")
    rep.add_argument(
        "--pending",
        action="store_true",
        help="list every declared run no record finishes yet, cheapest first, with its recorded seeds' time "
        "(with --data-dir: those the data sets there cannot run, apart, with the reason)",
    )
    rep.add_argument(
        "--coverage",
        action="store_true",
        help="check reproductions/coverage.toml against the tables and print (or --out) the coverage page",
    )
    rep.add_argument("--out", type=path_arg, help="with --coverage: write the page here, e.g. docs/coverage.md")
    rep.add_argument(
        "--tables",
        type=path_arg,
        default="reproductions",
        help="directory of the table files (default: ./reproductions)",
    )
    rep.add_argument("--seeds", help="comma-separated seeds for every row (default: the table's, or a row's own)")
    rep.add_argument("--quick", action="store_true", help="the table's reduced setting (a smoke test, not the paper's)")
    rep.add_argument("--data-dir", type=path_arg, help="directory of the data sets (default: $STOCFL_DATA_DIR)")
    rep.add_argument("--runs", type=path_arg, help="directory of the run directories (default: TABLES/runs/TABLE)")
    rep.add_argument("--report", action="store_true", help="run nothing: write the table of the runs finished so far")
    rep.add_argument(
        "--rows",
        help="the rows to run, by 1-based number, e.g. 2,4-6 (default: every row); the table "
        "still shows every row's finished runs",
    )
    rep.add_argument(
        "--rerun",
        action="store_true",
        help="run the chosen rows again where only TABLE.json records "
        "their runs (their directories gone), e.g. to draw curves a run was recorded without",
    )
    rep.add_argument("--quiet", action="store_true", help="no progress bars")

    bench = sub.add_parser("bench", help="time one round on each executor; prints JSON")
    bench.add_argument("--data-dir", type=path_arg, help="MNIST for the paper's case (default: $STOCFL_DATA_DIR)")
    bench.add_argument("--out", type=path_arg, help="also write the JSON here")
    bench.add_argument("--quick", action="store_true", help="smaller cases (a smoke test of the benchmark)")
    bench.add_argument("--device", default="cpu", help="where to time the executors: cpu (default), cuda, cuda:N, mps")
    bench.add_argument(
        "--peers",
        action="store_true",
        help="the same FedAvg work on stocfl, a naive PyTorch loop, "
        "pfl-research and Flower's simulation (peers from the [bench] extra; a missing one is skipped)",
    )
    bench.add_argument(
        "--case",
        action="append",
        help="with --peers: only this case (repeatable; default: all of "
        "a_rotated_mnist_480x50_mlp2048, b_cifar10_1000x50_cnn, c_digits_500x10)",
    )
    bench.add_argument(
        "--tables",
        action="store_true",
        help="each committed reproduction table's setting (its first row), a few rounds: seconds a round "
        "against the arithmetic bound at the matmul peak (benchmarks/tables.json; resumable)",
    )
    bench.add_argument("--table", action="append", help="with --tables: only this table (repeatable)")
    bench.add_argument("--rounds", type=int, help="with --tables: rounds timed per table, in one run (default 3)")
    bench.add_argument("--again", action="store_true", help="with --tables: time tables already in the JSON again")
    bench.add_argument(
        "--repeats",
        type=int,
        help="with --peers: repetitions of each system but Flower (default 3; the figure is their median)",
    )
    grid = sub.add_parser(
        "benchmark",
        help="the clustered-FL benchmark: every method x scenario x participation x seed, resumable; "
        "writes BENCHMARK.json and the leaderboard",
    )
    grid.add_argument("--grid", type=path_arg, help="the grid's TOML (default: benchmark/grid.toml)")
    grid.add_argument("--record", type=path_arg, help="the runs' record (default: BENCHMARK.json beside the grid)")
    grid.add_argument("--runs", type=path_arg, help="where the run directories go (default: runs/ beside the grid)")
    grid.add_argument("--quick", action="store_true", help="the grid's quick cells (a few minutes, digits)")
    grid.add_argument("--shard", help="run cells I, I + N, ... only (I/N, e.g. 0/4): for processes and machines")
    grid.add_argument("--only", help="the cells whose name matches this pattern, e.g. '* / rotated / 0.1'")
    grid.add_argument("--tune", action="store_true", help="run the tuning protocol's runs (validation split)")
    grid.add_argument("--tuned", action="store_true", help="run each method's tuned row (after --tune)")
    grid.add_argument(
        "--keep-state",
        action="store_true",
        help="keep each recorded run's checkpoint and client stores (removed by default: the record holds its results)",
    )
    grid.add_argument("--page", action="store_true", help="run nothing: write the leaderboard from the record")
    grid.add_argument("--merge", nargs="+", type=path_arg, help="fold other machines' records into this one")
    grid.add_argument("--out", type=path_arg, help="write the leaderboard (Markdown) here, e.g. docs/benchmark.md")
    grid.add_argument("--data-dir", type=path_arg, help="the data sets (default: $STOCFL_DATA_DIR)")
    grid.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _benchmark(args) -> int:
    from stocfl_lab.benchmark import main as benchmark_main

    return benchmark_main(args)


def _reproduce(args) -> int:
    from stocfl_lab.reproduce import listing, reproduce, table_files

    if args.coverage:
        from stocfl.storage import write_atomic
        from stocfl_lab.coverage import page

        text = page(Path(args.tables))
        if args.out:
            write_atomic(Path(args.out), text.encode())
            print(f"coverage: {args.out}")
        else:
            print(text, end="")
        return 0
    if args.pending:
        from stocfl.data import resolve_data_dir
        from stocfl_lab.reproduce import pending

        data_dir = resolve_data_dir(args.data_dir)  # --data-dir, else $STOCFL_DATA_DIR
        print(pending(Path(args.tables), None if data_dir is None else str(data_dir))[1])
        return 0
    if args.list:
        if args.table:
            raise UserError(f"reproduce --list lists every table; drop {args.table!r}, or drop --list to run it")
        print(listing(Path(args.tables)))
        return 0
    if not args.table:
        raise UserError("reproduce: name a table (stocfl-lab reproduce --list shows them)")
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    reproduce(
        args.table,
        seeds,
        args.quick,
        args.data_dir,
        Path(args.runs) if args.runs else None,
        progress=not args.quiet,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        report_only=args.report,
        rows=args.rows,
        rerun=args.rerun,
        root=Path(args.tables),
    )
    md, _, _ = table_files(args.table, args.quick, root=Path(args.tables))
    print(md.read_text(), end="")
    print(f"table: {md}")
    return 0


def _bench(args) -> int:
    if args.tables:
        from stocfl_lab.tablebench import main as tables_main

        return tables_main(args)
    if args.table or args.rounds is not None or args.again:
        raise UserError("stocfl-lab bench: --table, --rounds and --again choose what --tables times; add --tables")
    from stocfl_lab.bench import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    act = {"reproduce": _reproduce, "bench": _bench, "benchmark": _benchmark}[args.command]
    return guarded("stocfl-lab", args.command, lambda: act(args))


if __name__ == "__main__":
    raise SystemExit(main())
