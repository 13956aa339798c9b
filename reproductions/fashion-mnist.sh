#!/bin/bash
# A data directory with the whole of Fashion-MNIST, for the hybrid rows of Table 3 and Fig. 3:
#
#   reproductions/fashion-mnist.sh OUT_DIR [SHARED_DATA_DIR]
#
# OUT_DIR gets links to SHARED_DATA_DIR's data sets (default ../shared/data) and, in
# OUT_DIR/fashion_mnist, the official train/t10k IDX files from Debian's dataset-fashion-mnist
# package (Zalando's files, MIT; from the Debian archive, not the web). The script checks that the
# package's labels are the official label files' (when SHARED_DATA_DIR has them) and that its first
# 100 train and 2,000 test images are those of SHARED_DATA_DIR's subset, then prints the
# `--data-dir` to use. Needs `make setup` (it reads the files with stocfl). Never put OUT_DIR inside
# the repository.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: reproductions/fashion-mnist.sh OUT_DIR [SHARED_DATA_DIR]" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
case "$out/" in "$here"/*) echo "fashion-mnist.sh: $out is inside the repository; choose a directory outside it" >&2; exit 2;; esac
shared=$(cd "${2:-$here/../shared/data}" 2>/dev/null && pwd) \
    || { echo "fashion-mnist.sh: no data directory ${2:-$here/../shared/data}; pass SHARED_DATA_DIR" >&2; exit 2; }
mkdir -p "$out"
py=${PYTHON:-$here/.venv/bin/python}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null 2>&1) \
    || { echo "fashion-mnist.sh: apt-get download dataset-fashion-mnist failed; is a Debian archive reachable?" >&2; exit 2; }
dpkg -x "$tmp"/dataset-fashion-mnist_*.deb "$tmp/x"
for d in "$shared"/*/; do
    name=$(basename "$d")
    [ "$name" = fashion_mnist ] || ln -sfn "$d" "$out/$name"
done
mkdir -p "$out/fashion_mnist"
cp "$tmp"/x/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz "$out/fashion_mnist/"

"$py" - "$out/fashion_mnist" "$shared/fashion_mnist" <<'EOF'
import sys
from pathlib import Path
import numpy as np
from stocfl.data import _read_idx

new, old = map(Path, sys.argv[1:])
idx = lambda path: _read_idx(path, "fashion_mnist", 3 if "images" in path.name else 1)
x = {s: idx(new / f"{s}-images-idx3-ubyte.gz") for s in ("train", "t10k")}
assert x["train"].shape == (60000, 28, 28) and x["t10k"].shape == (10000, 28, 28), "unexpected image counts"
for s in ("train", "t10k"):
    ref = old / f"{s}-labels-idx1-ubyte.gz"
    if ref.exists():
        assert (idx(new / f"{s}-labels-idx1-ubyte.gz") == idx(ref)).all(), f"{s} labels differ from {ref}"
sub = old / "fashion_mnist_subset.npz"
if sub.exists():
    f = np.load(sub)
    assert (x["train"][:100] == f["x_train_first100"]).all() and (x["t10k"][:2000] == f["x_test_first2000"]).all(), \
        f"images differ from {sub}"
print("Fashion-MNIST: 60,000 train and 10,000 test images, checked against", old)
EOF
echo "--data-dir $out"
