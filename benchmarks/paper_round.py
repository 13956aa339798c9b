"""The StoCFL paper's round at (N, |D|) = (4800, 50) against its arithmetic bound.

Rotated MNIST, 480 clients sampled per round, MLP 784-2048-10, 5 full-batch epochs at lr 0.1,
StoCFL's two trainings a client (its cluster's model, pulled toward the global one, and the
global model). The algorithm's rounds (clients' work, aggregation, clustering; no evaluation)
run on the low-rank engine and on the dense batched one, side by side in one process, rounds
1..R each. The bound of a round is the arithmetic of the tasks it ran at the float32 matmul
peak measured in the same run: each training as the path computes it
(:func:`stocfl.executors.lowrank.flops`: low-rank on the low-rank engine, dense on the other),
every other task (the one-off representations) as counted by FlopCounterMode. Printed per
engine and round: seconds, the bound, their ratio; the two engines' clusters and models must
agree (checked: same clusters, models within 1e-4).

    .venv/bin/python benchmarks/paper_round.py --data-dir ../shared/data
    .venv/bin/python benchmarks/paper_round.py --rounds 3 --profile lowrank   # cProfile's top lines
    .venv/bin/python benchmarks/paper_round.py --engines lowrank,lowrank-factored,lowrank,lowrank-factored

``lowrank-factored`` is the low-rank engine with ``run.factored_replies`` (replies aggregated
from their factors); every engine's clusters and models are compared with the first's. Writes
benchmarks/paper_round.json (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "paper_round.json"
CONFIG = ROOT / "src" / "stocfl" / "configs" / "rotated_mnist_4800x50.toml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="lowrank,batched")
    ap.add_argument("--profile", default="", help="an engine whose rounds run under cProfile (its top lines printed)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--device", default="cpu", help="where client work runs (run.device), e.g. cuda")
    args = ap.parse_args()

    import torch

    from stocfl.client import FlopCount, Train
    from stocfl.executors import set_threads, structure
    from stocfl.executors.pool import keep_freed_memory
    from stocfl.experiment import configure
    from stocfl.experiment.build import build_federation
    from stocfl.experiment.loop import Experiment
    from stocfl_lab.bench import matmul_peak
    from stocfl_lab.tablebench import path_flops

    set_threads(args.threads)
    sets = ["algorithm.name=stocfl", f"run.threads={args.threads}", "run.eval_every=1000", f"run.device={args.device}"]
    sets += [f"scenario.data_dir={args.data_dir}"] if args.data_dir else []
    base = configure.load(str(CONFIG), overrides=sets)
    t = time.perf_counter()
    fed = build_federation(base)
    print(f"federation built in {time.perf_counter() - t:.1f} s", flush=True)
    dev = torch.device(args.device)  # the bound at the peak of where the clients' work runs (TF32 off on CUDA)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    size = 8192 if dev.type == "cuda" else 2048  # a GPU needs a larger product to reach its peak
    peaks = [matmul_peak(size, device=dev) * 1e9]
    out: dict = {"engines": {}}
    finals = {}
    for n, engine in enumerate(args.engines.split(",")):
        factored = engine == "lowrank-factored"
        chosen = ["run.engine=lowrank", "run.factored_replies=true"] if factored else [f"run.engine={engine}"]
        cfg = configure.load(str(CONFIG), overrides=[*sets, *chosen])
        exp = Experiment.create(cfg, None, federation=fed)
        assert structure(exp.model) is not None, "the MLP's first layer is dense"
        counter = FlopCount(fed, exp.model)
        ran: list = []
        ask = exp.ask

        def recording(tasks, _ask=ask, _ran=ran):
            _ran.extend(tasks)
            return _ask(tasks)

        rows = []
        prof = cProfile.Profile() if engine == args.profile else None
        with keep_freed_memory():  # as a run's rounds do (Experiment.run)
            for r in range(1, args.rounds + 1):
                sampled = exp.sample(r)
                ran.clear()
                if prof:
                    prof.enable()
                t = time.perf_counter()
                exp.algorithm.round(r, sampled, recording)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t
                if prof:
                    prof.disable()
                trainings = sum(type(x) is Train for x in ran)
                work = path_flops(ran, fed, exp.model, counter, engine.startswith("lowrank"))
                bound = work / peaks[0]
                rows.append(
                    {
                        "round": r,
                        "seconds": round(seconds, 3),
                        "trainings": trainings,
                        "other_tasks": len(ran) - trainings,
                        "gflop": round(work / 1e9, 1),
                        "bound_s": round(bound, 3),
                        "over_bound": round(seconds / bound, 2),
                    }
                )
                print(engine, json.dumps(rows[-1]), flush=True)
            if prof:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            exp.executor.release()  # the next engine's rounds start without this one's kept memory
        models = exp.algorithm.cluster_models()
        key = f"{engine} ({n + 1})" if engine in out["engines"] else engine
        finals[key] = (exp.algorithm.cluster_labels(), {k: m.clone() for k, m in models.items()})
        out["engines"][key] = rows
        peaks.append(matmul_peak(size, device=dev) * 1e9)
        del exp
    first = next(iter(finals))
    (la, ma) = finals[first]
    out["engines_agree"] = {}
    for other in list(finals)[1:]:
        lb, mb = finals[other]
        same = bool((la == lb).all())
        close = ma.keys() == mb.keys() and all(torch.allclose(ma[k], mb[k], rtol=1e-4, atol=1e-4) for k in ma)
        out["engines_agree"][f"{other} against {first}"] = {"clusters": same, "models_1e-4": close}
    print("engines agree:", out["engines_agree"])
    out |= {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {args.threads} threads, device {args.device}",
        "matmul_peak_gflops": [round(p / 1e9, 1) for p in peaks],
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
