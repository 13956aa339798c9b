"""How each method comes through a drift (docs: living federations, measured figures).

Runs ``stocfl compare`` on the packaged ``drift_mnist`` config (200 rotated-MNIST clients, half
of each group's clients turned into the next group's rotation at round 20), its label-swap
twin and the incremental and recurrent patterns, and StoCFL with clients that do not say their
data changed (``scenario.drift_notice = false``). Every comparison is resumable (finished runs
are read, stopped ones resumed), so the script can be run again after a stop. The tables are
each directory's ``compare.md``; the figure of the main comparison is copied to
``docs/figures/drift-rotated-mnist.png``.

    python benchmarks/drift_recovery.py --data-dir ../shared/data --out runs/drift
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from stocfl.experiment.compare import compare

METHODS = ["stocfl", "ifca n_models=4", "ditto", "cfl", "fedavg", "flhc", "clove", "cflgp", "srfca", "flux", "fedccfa"]
STUDIES = {
    # name: (overrides, methods, seeds)
    "rotated-sudden": ([], METHODS, [0, 1, 2]),
    "rotated-sudden-no-notice": (["scenario.drift_notice=false"], ["stocfl", "flhc"], [0, 1, 2]),
    "label-swap-sudden": (["scenario.name=label_swap"], METHODS, [0]),
    "rotated-incremental": (
        ["scenario.drift=incremental", "scenario.drift_rounds=[15, 20, 25]"],
        ["stocfl", "ifca n_models=4", "ditto", "clove"],
        [0],
    ),
    "rotated-recurrent": (
        ["scenario.drift=recurrent", "scenario.drift_rounds=[15, 28]"],
        ["stocfl", "ifca n_models=4", "ditto", "clove"],
        [0],
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="runs/drift")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=list(STUDIES), choices=list(STUDIES))
    args = ap.parse_args()
    out = Path(args.out)
    for name in args.only:
        sets, methods, seeds = STUDIES[name]
        rows = compare(
            "drift_mnist", methods, seeds, out / name, [*sets, f"run.threads={args.threads}"], args.data_dir, False
        )
        print(f"{name}: {len(rows)} methods -> {out / name / 'compare.md'}", flush=True)
    figure = out / "rotated-sudden" / "compare_drift.png"
    if figure.exists():
        target = Path(__file__).resolve().parents[1] / "docs" / "figures" / "drift-rotated-mnist.png"
        shutil.copyfile(figure, target)
        print(f"figure -> {target}")


if __name__ == "__main__":
    main()
