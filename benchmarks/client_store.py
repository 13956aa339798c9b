"""What a per-client store costs a round: Ditto on the StoCFL paper's round shape.

Ditto keeps every sampled client's personal model in a per-client store (N x P float32). The
store's work each round is the write of the sampled rows (with, on disk, the undo log of the
rows they replace and a flush of the map; in memory, an append to the journal), their CRC-32,
and the checkpoint's part (on disk nothing more; in memory, one fsync of the journal), and in
memory, once every N / m rounds, the fold of the journal into a snapshot. Every client holds a
model before the timed rounds (the steady state, where rows are overwritten). This
runs the same rounds with the store in memory (``run.store_ram`` above the store's size) and
on disk (``run.store_ram = 0``), alternating forms in one process, and prints per round the
round's seconds, the seconds inside the store (write, state, get) and their ratio. The
numbers of both forms must be equal (the store does not change them): checked.

    .venv/bin/python benchmarks/client_store.py                 # N = 600, 3 rounds, 2 repeats
    .venv/bin/python benchmarks/client_store.py --clients 1200 --rounds 2

Needs MNIST in $STOCFL_DATA_DIR (or --data-dir). Writes benchmarks/client_store.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "client_store.json"


def timed(cls, names, clock):
    """Wrap ``cls``'s methods ``names`` so that the seconds spent inside add up in ``clock``."""
    for name in names:
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapper(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                clock[0] += time.perf_counter() - t

        setattr(cls, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment
    from stocfl.storage.store import ClientStore

    torch.set_num_threads(args.threads)
    clock = [0.0]
    timed(ClientStore, ["write", "state", "load_state", "get"], clock)
    base = [
        "algorithm.name=ditto",
        "scenario.name=rotated",
        "scenario.dataset=mnist",
        f"scenario.n_clients={args.clients}",
        "scenario.samples_per_client=50",
        "model.name=mlp",
        "model.hidden=2048",
        "train.epochs=5",
        "train.batch_size=0",
        "train.lr=0.1",
        "run.sample_rate=0.1",
        f"run.rounds={args.rounds + 1}",
        "run.eval_every=1000",
        f"run.threads={args.threads}",
        *([f"scenario.data_dir={args.data_dir}"] if args.data_dir else []),
    ]
    p = 784 * 2048 + 2048 + 2048 * 10 + 10
    store_mib = args.clients * p * 4 / 2**20
    forms = {"memory": int(store_mib) + 1, "disk": 0}
    results: dict[str, list[dict[str, float]]] = {f: [] for f in forms}
    personal = {}
    with tempfile.TemporaryDirectory() as d:  # a first run's one-off costs (workers, caches) in no figure
        Experiment.create(configure.load(overrides=[*base, "run.rounds=1"]), Path(d) / "warm").run(progress=False)
    for rep in range(args.repeats):
        for form, ram in forms.items() if rep % 2 == 0 else reversed(list(forms.items())):
            with tempfile.TemporaryDirectory() as d:
                cfg = configure.load(overrides=[*base, f"run.store_ram={ram}"])
                exp = Experiment.create(cfg, Path(d) / "run")
                assert exp.algorithm.state.personal.in_ram == (form == "memory")
                # steady state: every client has a personal model (the rounds overwrite rows), and
                # the journal has been folded once (the fold's cost, every N / m rounds, apart)
                s = exp.algorithm.state.personal
                s.write({i: exp.algorithm.ctx.init_weights for i in range(s.n)})
                exp.save_checkpoint()
                clock[0] = 0.0
                s.write({})
                fold = clock[0]
                exp.save_checkpoint()
                os.sync()  # the prefill's gigabytes written back first: no round waits on them
                clock[0] = 0.0
                t = time.perf_counter()
                exp.run(progress=False, stop_after=args.rounds)
                total = time.perf_counter() - t
                store = clock[0]
                s = exp.algorithm.state.personal
                seen = [i for i in range(s.n) if i in s]
                personal[form] = {i: s.get(i) for i in seen[:20]}
                results[form].append({"round_s": total / args.rounds, "store_s": store / args.rounds, "fold_s": fold})
                print(
                    f"{form:6s} repeat {rep}: {total / args.rounds:6.2f} s a round, store {store / args.rounds:5.2f} s "
                    f"({store / total:.1%}); a fold of the journal {fold:.2f} s",
                    flush=True,
                )
                del exp
    a, b = personal["memory"], personal["disk"]
    assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a), "the forms gave other models"
    summary = {
        form: {
            "round_s": min(r["round_s"] for r in rs),
            "store_s": min(r["store_s"] for r in rs),
            "fold_s": min(r["fold_s"] for r in rs),
        }
        for form, rs in results.items()
    }
    m = -(-args.clients // 10)
    for v in summary.values():  # the fold comes once every N / m rounds
        v["store_share"] = round((v["store_s"] + v["fold_s"] * m / args.clients) / v["round_s"], 4)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "clients": args.clients,
        "sampled_per_round": m,
        "params": p,
        "store_mib": round(store_mib, 1),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "best_of_repeats": summary,
        "disk_over_memory_round": round(summary["disk"]["round_s"] / summary["memory"]["round_s"], 3),
    }
    print(json.dumps(record, indent=1))
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
