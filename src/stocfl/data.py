"""Data set loaders. Each returns a :class:`Dataset`: float32 images (N, C, H, W) in [0, 1]
(dark background, as MNIST), int64 labels, and for FEMNIST each sample's writer.

The data directory comes from the config (``scenario.data_dir``), ``--data-dir`` or the
environment variable ``STOCFL_DATA_DIR``; ``digits`` (scikit-learn's bundled 8x8 digits) needs
none. A missing or corrupt file raises one :class:`UserError` line naming the file and the
expected layout.
"""

from __future__ import annotations

import gzip
import io
import lzma
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from stocfl.errors import UserError

LAYOUT = {
    "mnist": "mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (the official IDX files)",
    "fashion_mnist": "fashion_mnist/fashion_mnist_subset.npz with x_test_first2000, y_test_first2000, "
    "x_train_first100, y_train_first100 (uint8 28x28)",
    "cifar10": "cifar10/cifar10_train_00..49.npy.xz, cifar10_test_first1000.npy.xz (uint8 N,32,32,3) "
    "and cifar10_labels.npz (y_train, y_test_first1000)",
    "femnist": "femnist/femnist_leaf_part{0,1,2}.npz with x_train, y_train, writer_idx_train, x_test, "
    "y_test, writer_idx_test, writer_id, writer_source",
}

# Only 2,100 Fashion-MNIST images lie in ../shared/data; stocfl trains on official train 0..99
# plus test 0..1499 and tests on official test 1500..1999 (documented in README).
FASHION_TEST_FROM = 1500


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    writer_train: np.ndarray | None = None  # writer index of each train sample (FEMNIST)
    writer_test: np.ndarray | None = None
    note: str = ""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    d = str(data_dir) if data_dir else os.environ.get("STOCFL_DATA_DIR", "")
    return Path(d) if d else None


def load_dataset(name: str, data_dir: str | os.PathLike | None = None) -> Dataset:
    """Load a data set by name (digits, mnist, fashion_mnist, cifar10, femnist)."""
    if name == "digits":
        return _digits()
    root = resolve_data_dir(data_dir)
    if root is None:
        raise UserError(
            f"data set {name!r} needs a data directory: pass --data-dir DIR or set STOCFL_DATA_DIR "
            f"(expected layout: DIR/{LAYOUT[name]}); 'digits' needs none"
        )
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist; pass --data-dir DIR or set STOCFL_DATA_DIR")
    loader = {"mnist": _mnist, "fashion_mnist": _fashion, "cifar10": _cifar10, "femnist": _femnist}[name]
    return loader(root.resolve())


def _need(path: Path, name: str) -> Path:
    if not path.is_file():
        raise UserError(f"data file {path} is missing; expected layout: DATA_DIR/{LAYOUT[name]}")
    return path


def _corrupt(path: Path, name: str, why: str) -> UserError:
    return UserError(f"data file {path} is corrupt ({why}); expected layout: DATA_DIR/{LAYOUT[name]}")


def _images(x: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W) or (N, H, W, C) -> float32 (N, C, H, W) in [0, 1]."""
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32) / 255.0)


def _labels(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(y, dtype=np.int64))


@lru_cache(maxsize=1)
def _digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]
    # A fixed stratified 75/25 split, independent of the run seed: the test split never moves.
    tr, te = train_test_split(np.arange(len(x)), test_size=0.25, random_state=0, stratify=d.target)
    return Dataset(
        "digits", torch.from_numpy(x[tr]), _labels(d.target[tr]), torch.from_numpy(x[te]),
        _labels(d.target[te]), 10, note="scikit-learn digits: 1,347 train / 450 test (fixed split)",
    )


def _read_idx(path: Path, name: str, ndim: int) -> np.ndarray:
    try:
        raw = gzip.decompress(_need(path, name).read_bytes())
    except (OSError, EOFError) as err:
        raise _corrupt(path, name, f"not gzip: {err}") from None
    if len(raw) < 4 + 4 * ndim or raw[0] != 0 or raw[1] != 0 or raw[2] != 8 or raw[3] != ndim:
        raise _corrupt(path, name, f"no IDX header for a {ndim}-d uint8 array")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise _corrupt(path, name, f"header says {dims}, file holds {body.size} bytes")
    return body.reshape(dims)


@lru_cache(maxsize=2)
def _mnist(root: Path) -> Dataset:
    d = root / "mnist"
    xs = {s: _read_idx(d / f"{s}-images-idx3-ubyte.gz", "mnist", 3) for s in ("train", "t10k")}
    ys = {s: _read_idx(d / f"{s}-labels-idx1-ubyte.gz", "mnist", 1) for s in ("train", "t10k")}
    for s in xs:
        if len(xs[s]) != len(ys[s]) or ys[s].max() > 9:
            raise _corrupt(d / f"{s}-labels-idx1-ubyte.gz", "mnist", "labels do not match the images")
    return Dataset(
        "mnist", _images(xs["train"]), _labels(ys["train"]), _images(xs["t10k"]), _labels(ys["t10k"]), 10
    )


def _npz(path: Path, name: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        with np.load(_need(path, name), allow_pickle=False) as f:
            missing = [k for k in keys if k not in f.files]
            if missing:
                raise _corrupt(path, name, f"missing arrays {missing}")
            return {k: f[k] for k in keys}
    except UserError:
        raise
    except Exception as err:  # zipfile.BadZipFile, ValueError, OSError: all mean an unreadable file
        raise _corrupt(path, name, f"{type(err).__name__}: {err}") from None


@lru_cache(maxsize=2)
def _fashion(root: Path) -> Dataset:
    keys = ("x_test_first2000", "y_test_first2000", "x_train_first100", "y_train_first100")
    f = _npz(root / "fashion_mnist" / "fashion_mnist_subset.npz", "fashion_mnist", keys)
    k = FASHION_TEST_FROM
    x_tr = np.concatenate([f["x_train_first100"], f["x_test_first2000"][:k]])
    y_tr = np.concatenate([f["y_train_first100"], f["y_test_first2000"][:k]])
    return Dataset(
        "fashion_mnist", _images(x_tr), _labels(y_tr), _images(f["x_test_first2000"][k:]),
        _labels(f["y_test_first2000"][k:]), 10,
        note="partial Fashion-MNIST: 2,100 images; train = official train 0..99 + test 0..1499 "
        "(1,600), test = official test 1500..1999 (500)",
    )


def _xz_npy(path: Path) -> np.ndarray:
    try:
        return np.load(io.BytesIO(lzma.decompress(_need(path, "cifar10").read_bytes())), allow_pickle=False)
    except UserError:
        raise
    except Exception as err:
        raise _corrupt(path, "cifar10", f"{type(err).__name__}: {err}") from None


@lru_cache(maxsize=1)
def _cifar10(root: Path) -> Dataset:
    d = root / "cifar10"
    labels = _npz(d / "cifar10_labels.npz", "cifar10", ("y_train", "y_test_first1000"))
    x_tr = np.concatenate([_xz_npy(d / f"cifar10_train_{i:02d}.npy.xz") for i in range(50)])
    x_te = _xz_npy(d / "cifar10_test_first1000.npy.xz")
    if x_tr.shape != (50000, 32, 32, 3) or x_te.shape != (1000, 32, 32, 3):
        raise _corrupt(d, "cifar10", f"image arrays have shapes {x_tr.shape} and {x_te.shape}")
    return Dataset(
        "cifar10", _images(x_tr), _labels(labels["y_train"]), _images(x_te),
        _labels(labels["y_test_first1000"]), 10,
        note="CIFAR-10: 50,000 train; only the first 1,000 official test images",
    )


@lru_cache(maxsize=1)
def _femnist(root: Path) -> Dataset:
    keys = ("x_train", "y_train", "writer_idx_train", "x_test", "y_test", "writer_idx_test",
            "writer_id", "writer_source")
    parts = [_npz(root / "femnist" / f"femnist_leaf_part{i}.npz", "femnist", keys) for i in range(3)]
    xs_tr, ys_tr, ws_tr, xs_te, ys_te, ws_te = [], [], [], [], [], []
    offset = 0
    for p in parts:
        xs_tr.append(p["x_train"]); ys_tr.append(p["y_train"]); ws_tr.append(p["writer_idx_train"] + offset)
        xs_te.append(p["x_test"]); ys_te.append(p["y_test"]); ws_te.append(p["writer_idx_test"] + offset)
        offset += len(p["writer_id"])
    # LEAF stores 255 = white background; invert to MNIST's dark background.
    x_tr = 1.0 - _images(np.concatenate(xs_tr))
    x_te = 1.0 - _images(np.concatenate(xs_te))
    return Dataset(
        "femnist", x_tr, _labels(np.concatenate(ys_tr)), x_te, _labels(np.concatenate(ys_te)), 62,
        writer_train=np.concatenate(ws_tr), writer_test=np.concatenate(ws_te),
        note=f"FEMNIST (LEAF 5% sample): {offset} writers, LEAF's own per-writer train/test split",
    )
