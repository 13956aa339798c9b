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

"$py" - "$out" "$shared" <<'EOF'
import sys

import torch

from stocfl.data import load_dataset

new, old = sys.argv[1:]
full = load_dataset("fashion_mnist", new)  # the official IDX files
assert len(full.x_train) == 60000 and len(full.x_test) == 10000, "unexpected image counts"
try:
    held = load_dataset("fashion_mnist", old)  # the shared directory's: the official files, or its subset
except Exception:  # noqa: BLE001 - nothing to compare with
    held = None
if held is not None and len(held.x_train) == 60000:
    same = torch.equal(full.x_train, held.x_train) and torch.equal(full.y_test, held.y_test)
elif held is not None:  # the subset: official train 0..99 + test 0..1499 as train, test 1500..1999 as test
    k = len(held.x_train) - 100
    same = (
        torch.equal(full.x_train[:100], held.x_train[:100])
        and torch.equal(full.y_train[:100], held.y_train[:100])
        and torch.equal(full.x_test[:k], held.x_train[100:])
        and torch.equal(full.x_test[k : k + len(held.x_test)], held.x_test)
        and torch.equal(full.y_test[k : k + len(held.y_test)], held.y_test)
    )
else:
    same = True
assert same, f"the package's images or labels differ from those in {old}"
print("Fashion-MNIST: 60,000 train and 10,000 test images, checked against", old)
EOF
echo "--data-dir $out"
