"""``stocfl-lab bench``: one FedAvg round of local training per executor, as JSON.

Cases
-----
mlp2048_rotated_mnist_d50
    The StoCFL paper's Rotated-MNIST setting at (N, |D|) = (4800, 50), 10% per round: MLP
    784-2048-10, 5 full-batch epochs, lr 0.1, 480 clients trained (compute-bound; the low-rank
    path's case: 50 samples against 784 inputs).
mlp2048_rotated_mnist
    The same at |D| = 200, 120 clients trained.
digits_small
    The digits model (64-32-10) on 500 clients of 10 samples, batch 10, 5 epochs
    (per-client overhead dominates).

``flower_sim`` adds the per-round overhead of the flower-sim engine against the local one
for the same StoCFL run (digits, 20 clients).

Each case times a naive loop in the style of common FL code (``deepcopy`` of an ``nn.Module``
and a ``DataLoader`` per client), the sequential, batched and (dense first layer) low-rank
executors, and
reports seconds, GFLOP/s (6 * P flops per sample per epoch), the fraction of the machine's
float32 matmul peak and the speed-up ratios. Figures, not assertions: the README carries them.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import stocfl
from stocfl.client import LocalTraining, Train, build_module, make_model, task_seed
from stocfl.data import build, resolve_data_dir
from stocfl.devices import federation_on, resolve_device
from stocfl.errors import UserError
from stocfl.executors import (
    BatchedExecutor,
    ParallelExecutor,
    SequentialExecutor,
    make_executor,
    set_threads,
    structure,
)
from stocfl_lab.naive import naive_round


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n: int = 2048, reps: int = 10, device: torch.device = torch.device("cpu")) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def _time(fn, reps: int = 1, device: torch.device = torch.device("cpu")) -> float:
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def run_case(
    name,
    fed,
    model_name,
    hidden,
    n_clients,
    epochs,
    batch_size,
    lr,
    peak,
    reps,
    device: torch.device = torch.device("cpu"),
) -> dict:
    flat, w0 = make_model(model_name, fed.input_shape, fed.n_classes, hidden, seed=0)
    module = build_module(model_name, fed.input_shape, fed.n_classes, hidden).to(device)
    clients = list(range(n_clients))
    tasks = [Train(i, w0, LocalTraining.sgd(epochs, batch_size, lr), task_seed(0, 1, i)) for i in clients]
    flops = 6.0 * flat.n_params * epochs * float(sum(fed.train_sizes[i] for i in clients))
    on_device = federation_on(fed, device)
    seconds = {
        "naive": _time(lambda: naive_round(on_device, module, w0, clients, epochs, batch_size, lr), reps, device)
    }
    engines = {
        "sequential": SequentialExecutor(fed, flat, device),
        "batched": BatchedExecutor(fed, flat, device=device),
    }
    if structure(flat) is not None:
        engines["lowrank"] = BatchedExecutor(fed, flat, lowrank=True, device=device)
    if device.type == "cpu" and torch.get_num_threads() > 1:
        engines["parallel"] = ParallelExecutor(fed, flat, workers=torch.get_num_threads())
    for engine, ex in engines.items():
        ex.execute(tasks[: min(4, len(tasks))])  # warm-up (vmap tracing, allocator)
        seconds[engine] = _time(lambda: ex.execute(tasks), reps, device)  # noqa: B023 - called before ex changes
        ex.release()  # the next engine times without this one's kept memory
    cfg = stocfl.as_config(
        {"train": {"epochs": epochs, "batch_size": batch_size, "lr": lr}, "run": {"device": str(device)}}
    )
    auto = make_executor("auto", fed, flat, cfg).name
    best = min(engines, key=seconds.get)
    return {
        "case": name,
        "model": model_name,
        "n_params": flat.n_params,
        "clients": n_clients,
        "samples_per_client": int(fed.train_sizes[0]),
        "epochs": epochs,
        "batch_size": batch_size or "full",
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gflops": {k: round(flops / v / 1e9, 2) for k, v in seconds.items()},
        "fraction_of_peak": {k: round(flops / v / 1e9 / peak, 3) for k, v in seconds.items()},
        "auto_picks": auto,
        "ratios": {
            "sequential_vs_naive": round(seconds["naive"] / seconds["sequential"], 2),
            "batched_vs_naive": round(seconds["naive"] / seconds["batched"], 2),
            "batched_vs_sequential": round(seconds["sequential"] / seconds["batched"], 2),
            **(
                {"parallel_vs_sequential": round(seconds["sequential"] / seconds["parallel"], 2)}
                if "parallel" in seconds
                else {}
            ),
            **(
                {
                    "lowrank_vs_sequential": round(seconds["sequential"] / seconds["lowrank"], 2),
                    "lowrank_vs_naive": round(seconds["naive"] / seconds["lowrank"], 2),
                }
                if "lowrank" in seconds
                else {}
            ),
            "best_vs_naive": round(seconds["naive"] / seconds[best], 2),
            "auto_vs_sequential": round(seconds["sequential"] / seconds[auto], 2),
        },
    }


def flower_overhead(rounds: int = 5, out: dict | None = None, saved=lambda: None) -> dict:
    """Seconds per round of the same StoCFL run (digits, 20 clients, half sampled per round)
    on the local sequential engine and on flower-sim, with one simulated SuperNode per client
    and with 2 SuperNodes sharing the clients; Ray's start-up is reported apart. Each case goes
    into ``out`` as it ends, and ``saved()`` is called."""
    import tempfile

    from stocfl.storage import read_jsonl

    sets = ["algorithm.name=stocfl", "scenario.n_clients=20", f"run.rounds={rounds}", "run.sample_rate=0.5"]
    cases = {
        "sequential": ["run.engine=sequential"],
        "flower-sim": ["run.engine=flower-sim"],
        "flower-sim-2-nodes": ["run.engine=flower-sim", "run.sim_nodes=2"],
    }
    out = {} if out is None else out
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in cases.items():
            cfg = stocfl.load_config(None, [*sets, *extra])
            run_dir = Path(tmp) / name
            t = time.perf_counter()
            stocfl.run_into(run_dir, cfg)
            total = time.perf_counter() - t
            per_round = [r["seconds"] for r in read_jsonl(run_dir / "metrics.jsonl")]
            out[name] = {
                "seconds_per_round": round(float(np.mean(per_round[1:])), 4),
                "total_seconds": round(total, 2),
                "rounds_seconds": round(sum(per_round), 2),
            }
            saved()
    local = out["sequential"]["seconds_per_round"]
    for name in ("flower-sim", "flower-sim-2-nodes"):
        out[name]["overhead_per_round_seconds"] = round(out[name]["seconds_per_round"] - local, 4)
        out[name]["ratio"] = round(out[name]["seconds_per_round"] / local, 1)
        out[name]["startup_seconds"] = round(out[name]["total_seconds"] - out[name]["rounds_seconds"], 2)
    return out


def main(args) -> int:
    if not getattr(args, "peers", False) and (
        getattr(args, "case", None) or getattr(args, "repeats", None) is not None
    ):
        raise UserError(
            "stocfl-lab bench: --case and --repeats choose what --peers times; add --peers, or leave them out"
        )
    _check_out(getattr(args, "out", None))  # before minutes of timing, not after
    threads = set_threads(0)
    root = resolve_data_dir(args.data_dir)
    quick = bool(getattr(args, "quick", False))
    if getattr(args, "peers", False):
        return peers_main(args, root, quick, threads)
    device = resolve_device(getattr(args, "device", None) or "cpu")
    peak = matmul_peak(1024 if quick else 2048, device=device)
    if root is not None:
        mnist = build("rotated", "mnist", 24 if quick else 120, 200, seed=0, data_dir=str(root))
        mnist50 = build("rotated", "mnist", 48 if quick else 480, 50, seed=0, data_dir=str(root))
        source = "MNIST (rotated)"
    else:
        raise UserError("stocfl-lab bench needs MNIST: pass --data-dir DIR or set STOCFL_DATA_DIR")
    digits = build("rotated", "digits", 100 if quick else 500, 10, seed=0)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {threads} torch threads",
        "device": str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        "torch": torch.__version__,
        "matmul_peak_gflops": round(peak, 1),
        "data": source,
        "finished": False,  # until every case has ended: the file is written as each one does
        "cases": [],
    }
    specs = [
        ("mlp2048_rotated_mnist_d50", mnist50, "mlp", 2048, mnist50.n_clients, 1 if quick else 5, 0, 0.1, peak, 1),
        ("mlp2048_rotated_mnist", mnist, "mlp", 2048, mnist.n_clients, 1 if quick else 5, 0, 0.1, peak, 1),
        ("digits_small", digits, "digits_mlp", 0, digits.n_clients, 5, 10, 0.1, peak, 1 if quick else 3),
    ]
    for spec in specs:
        result["cases"].append(run_case(*spec, device))
        _save(result, args.out)
    try:
        if device.type == "cpu":  # a CPU measure of per-message overhead
            result["flower_sim"] = {}
            flower_overhead(3 if quick else 6, result["flower_sim"], lambda: _save(result, args.out))
    except ImportError:
        result["flower_sim"] = "Flower not installed (pip install 'flwr[simulation]>=1.41,<1.43')"
    result["finished"] = True
    return _emit(result, args.out)


def _check_out(out: str | None) -> None:
    if not out:
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"--out {out}: cannot make its directory ({err.strerror}: {err.filename}); choose another path"
        ) from None
    if path.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"--out {out}: not a file this process can write; choose another path")


def _save(result: dict, out: str | None) -> None:
    """Write ``result`` as it stands to ``out`` (when given), atomically: a bench stopped or
    failing later keeps every case that ended."""
    if out:
        from stocfl.storage import write_atomic

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(out), (json.dumps(result, indent=2) + "\n").encode())


def _emit(result: dict, out: str | None) -> int:
    """Print the JSON, and write it to ``out`` when given."""
    print(json.dumps(result, indent=2))
    _save(result, out)
    return 0


def peers_main(args, root, quick: bool, threads: int) -> int:
    """``stocfl bench --peers``: per case, each system's seconds per round and the ratios to
    stocfl's, stocfl's fraction of the measured matmul peak, and every system's accuracy."""
    import sys

    from stocfl_lab.peers import CASES, bench_peers

    if root is None:
        raise UserError("stocfl-lab bench --peers needs MNIST and CIFAR-10: pass --data-dir DIR or set STOCFL_DATA_DIR")
    cases = getattr(args, "case", None) or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise UserError(f"stocfl-lab bench --peers: unknown case {unknown[0]!r}; choose among {', '.join(CASES)}")
    repeats = getattr(args, "repeats", None)  # argparse gives None where --repeats is not given
    repeats = 3 if repeats is None else repeats
    if not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"stocfl-lab bench --peers: --repeats must be a whole number >= 1, got {repeats!r}")
    peak = matmul_peak(1024 if quick else 2048)
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {threads} torch threads",
        "torch": torch.__version__,
        "matmul_peak_gflops": round(peak, 1),
        "finished": False,  # until every case has ended: the file is written as each one does
    }
    bench_peers(
        str(root),
        peak,
        threads,
        quick,
        repeats=1 if quick else repeats,
        cases=cases,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        out=result,
        saved=lambda: _save(result, args.out),
    )
    result["finished"] = True
    return _emit(result, args.out)
