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
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl.bounds import MAX_CLASSES
from stocfl.errors import UserError, refuse_builtin

LAYOUT = {
    "mnist": "mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (the official IDX files)",
    "fashion_mnist": "fashion_mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (the official IDX files, "
    "all 70,000 images) or fashion_mnist/fashion_mnist_subset.npz with x_test_first2000, y_test_first2000, "
    "x_train_first100, y_train_first100 (uint8 28x28)",
    "cifar10": "cifar10/cifar10_train_00..49.npy.xz, cifar10_test_first1000.npy.xz (uint8 N,32,32,3) "
    "and cifar10_labels.npz (y_train, y_test_first1000)",
    "femnist": "femnist/femnist_leaf_part{0,1,2}.npz with x_train, y_train, writer_idx_train, x_test, "
    "y_test, writer_idx_test, writer_id, writer_source",
}

# Without the official image files only 2,100 Fashion-MNIST images lie in ../shared/data; stocfl
# then trains on official train 0..99 plus test 0..1499 and tests on official test 1500..1999.
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


# name -> (loader, needs a data directory, a built-in whose loader checks its files itself)
DATASETS: dict[str, tuple[Callable[[Path | None], Any], bool, bool]] = {}


def register_dataset(name: str, loader: Callable[[Path | None], Any], needs_data_dir: bool = False) -> None:
    """Make data set ``name`` usable by name (``scenario.dataset``) in this process.

    ``loader(data_dir)`` returns a :class:`Dataset` or a tuple ``(x_train, y_train, x_test,
    y_test)`` of arrays or tensors (images as (N, C, H, W) or features as (N, D), labels
    0..classes-1); it is checked like a built-in data set. ``data_dir`` is the resolved data
    directory, or None when none is set and ``needs_data_dir`` is False."""
    if not isinstance(name, str) or not name.isidentifier():
        raise UserError(f"register_dataset: name {name!r} must be an identifier, e.g. 'my_data'")
    refuse_builtin("register_dataset", name, name in DATASETS and DATASETS[name][2])
    if not callable(loader):
        raise UserError(f"register_dataset({name!r}): loader must be a function data_dir -> Dataset or arrays")
    DATASETS[name] = (loader, needs_data_dir, False)


def load_dataset(name: str, data_dir: str | os.PathLike | None = None) -> Dataset:
    """Load a data set by name (digits, mnist, fashion_mnist, cifar10, femnist, or one
    registered with :func:`register_dataset`)."""
    root = data_root(name, data_dir)
    loader, _, builtin = DATASETS[name]
    out = loader(root)
    return out if builtin else as_dataset(name, out)


def data_root(name: str, data_dir: str | os.PathLike | None = None) -> Path | None:
    """The resolved directory data set ``name`` is read from: None for one that needs none; a
    :class:`UserError` when it needs one and none is given, or the one given is no directory."""
    if name not in DATASETS:
        raise UserError(f"config: scenario.dataset: unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    root = resolve_data_dir(data_dir)
    if not DATASETS[name][1]:
        return root
    if root is None:
        where = f" (expected layout: DIR/{LAYOUT[name]})" if name in LAYOUT else ""
        raise UserError(
            f"data set {name!r} needs a data directory: pass --data-dir DIR or set "
            f"STOCFL_DATA_DIR{where}; 'digits' needs none"
        )
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise UserError(f"data directory {root} {what}; pass --data-dir DIR or set STOCFL_DATA_DIR")
    return root.resolve()


def as_dataset(name: str, data: Any) -> Dataset:
    """A user's data set (a :class:`Dataset` or ``(x_train, y_train, x_test, y_test)``), checked:
    float inputs of one shape with finite values, integer labels 0..classes-1 of matching
    length. One :class:`UserError` line names what is wrong."""
    if isinstance(data, Dataset):
        parts, n_classes = (data.x_train, data.y_train, data.x_test, data.y_test), data.n_classes
    else:
        try:
            parts = tuple(data)
        except TypeError:
            parts = ()
        if len(parts) != 4:
            raise UserError(
                f"data set {name!r}: the loader must return a Dataset or (x_train, y_train, x_test, y_test)"
            )
        n_classes = None
    x_tr, y_tr = check_arrays(f"data set {name!r} train", *parts[:2])
    x_te, y_te = check_arrays(f"data set {name!r} test", *parts[2:])
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise UserError(
            f"data set {name!r}: train inputs have shape {tuple(x_tr.shape[1:])}, test inputs "
            f"{tuple(x_te.shape[1:])}; they must match"
        )
    top = int(max(y_tr.max(), y_te.max() if len(y_te) else 0)) + 1
    n_classes = n_classes or top
    if top > n_classes:
        raise UserError(f"data set {name!r}: label {top - 1} is outside 0..{n_classes - 1}")
    note = data.note if isinstance(data, Dataset) else ""
    return Dataset(
        name,
        x_tr,
        y_tr,
        x_te,
        y_te,
        int(n_classes),
        getattr(data, "writer_train", None),
        getattr(data, "writer_test", None),
        note,
    )


def check_arrays(what: str, x: Any, y: Any, allow_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` as float32 inputs (N, ...) and int64 labels (N,), or one UserError line: dense
    tensors in memory (not sparse, not on the meta device), inputs of numbers but not uint8
    (images of 0..255 are given as floats, divided by 255 as stocfl's own data sets are),
    finite; labels whole numbers in 0..MAX_CLASSES-1."""
    try:
        x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
        y = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
    except (TypeError, ValueError, OverflowError) as err:
        raise UserError(f"{what}: not arrays of numbers ({err})") from None
    for name, t in (("inputs", x), ("labels", y)):
        if t.layout != torch.strided or t.device.type == "meta":
            raise UserError(f"{what}: {name} are a {t.layout} tensor on {t.device}; give dense tensors with data")
    if x.dtype == torch.uint8:
        raise UserError(f"{what}: inputs of type uint8 (0..255 images?); give floats, e.g. x / 255")
    if x.dim() < 2:
        raise UserError(f"{what}: inputs have shape {tuple(x.shape)}; expected (samples, features...) ")
    if not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        raise UserError(f"{what}: inputs of type {x.dtype}; expected numbers")
    x = x.float()
    if y.dim() != 1 or len(y) != len(x):
        raise UserError(f"{what}: {len(x)} inputs but labels of shape {tuple(y.shape)}; expected ({len(x)},)")
    if y.is_floating_point():
        if not bool(torch.all(y == y.round())) or not bool(torch.isfinite(y).all()):
            raise UserError(f"{what}: labels must be whole numbers")
        if len(y) and float(y.abs().max()) >= MAX_CLASSES:  # before .long(): 2**62 as a float overflows it
            raise UserError(f"{what}: label {float(y.abs().max()):.0f} is beyond {MAX_CLASSES - 1}")
    elif y.dtype == torch.bool or y.is_complex():
        raise UserError(f"{what}: labels of type {y.dtype}; expected integers")
    y = y.long()
    if not len(x) and not allow_empty:
        raise UserError(f"{what}: no samples")
    if len(x) and not bool(torch.isfinite(x).all()):
        raise UserError(f"{what}: inputs hold NaN or inf")
    if len(y) and int(y.min()) < 0:
        raise UserError(f"{what}: label {int(y.min())} is negative; labels are 0..classes-1")
    if len(y) and int(y.max()) >= MAX_CLASSES:
        raise UserError(f"{what}: label {int(y.max())} is beyond {MAX_CLASSES - 1}; labels are 0..classes-1")
    return x, y


def _need(path: Path, name: str) -> Path:
    if not path.is_file():
        raise UserError(f"data file {path} is missing; expected layout: DATA_DIR/{LAYOUT[name]}")
    return path


def _corrupt(path: Path, name: str, why: str) -> UserError:
    return UserError(f"data file {path} is corrupt ({why}); expected layout: DATA_DIR/{LAYOUT[name]}")


def _images(x: np.ndarray, path: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Images of one file, checked: (N, *shape) with pixel values 0..255 (uint8, or finite
    numbers in that range) -> float32 (N, C, H, W) in [0, 1]."""
    if x.ndim != 1 + len(shape) or tuple(x.shape[1:]) != shape:
        raise _corrupt(path, name, f"images of shape {tuple(x.shape)}, expected (N, {', '.join(map(str, shape))})")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
            raise _corrupt(path, name, f"pixels of type {x.dtype}, expected uint8")
        if not np.isfinite(x).all():
            raise _corrupt(path, name, "pixels hold NaN or inf")
        if x.size and (x.min() < 0 or x.max() > 255):
            raise _corrupt(path, name, f"pixels range over {x.min()}..{x.max()}, expected 0..255")
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32) / 255.0)


def _labels(y: np.ndarray, path: Path, name: str, n_classes: int, n: int) -> torch.Tensor:
    """Labels of one file, checked: n integers in 0..n_classes - 1."""
    if y.ndim != 1 or len(y) != n:
        raise _corrupt(path, name, f"{y.size} labels in shape {tuple(y.shape)} for {n} images")
    if not np.issubdtype(y.dtype, np.integer):
        raise _corrupt(path, name, f"labels of type {y.dtype}, expected integers")
    if n and (y.min() < 0 or y.max() >= n_classes):
        raise _corrupt(path, name, f"labels range over {y.min()}..{y.max()}, expected 0..{n_classes - 1}")
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
        "digits",
        torch.from_numpy(x[tr]),
        torch.from_numpy(d.target[tr].astype(np.int64)),
        torch.from_numpy(x[te]),
        torch.from_numpy(d.target[te].astype(np.int64)),
        10,
        note="scikit-learn digits: 1,347 train / 450 test (fixed split)",
    )


def _read_idx(path: Path, name: str, ndim: int) -> np.ndarray:
    try:
        raw = gzip.decompress(_need(path, name).read_bytes())
    except (OSError, EOFError, zlib.error) as err:
        raise _corrupt(path, name, f"not a valid gzip file: {err}") from None
    if len(raw) < 4 + 4 * ndim or raw[0] != 0 or raw[1] != 0 or raw[2] != 8 or raw[3] != ndim:
        raise _corrupt(path, name, f"no IDX header for a {ndim}-d uint8 array")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise _corrupt(path, name, f"header says {dims}, file holds {body.size} bytes")
    return body.reshape(dims)


def _idx_dataset(root: Path, name: str, note: str = "") -> Dataset:
    d = root / name
    x, y = {}, {}
    for s in ("train", "t10k"):
        xp, yp = d / f"{s}-images-idx3-ubyte.gz", d / f"{s}-labels-idx1-ubyte.gz"
        x[s] = _images(_read_idx(xp, name, 3), xp, name, (28, 28))
        y[s] = _labels(_read_idx(yp, name, 1), yp, name, 10, len(x[s]))
    return Dataset(name, x["train"], y["train"], x["t10k"], y["t10k"], 10, note=note)


@lru_cache(maxsize=2)
def _mnist(root: Path) -> Dataset:
    return _idx_dataset(root, "mnist")


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
    if (root / "fashion_mnist" / "train-images-idx3-ubyte.gz").exists():
        return _idx_dataset(root, "fashion_mnist", note="Fashion-MNIST, the official IDX files")
    keys = ("x_test_first2000", "y_test_first2000", "x_train_first100", "y_train_first100")
    path = root / "fashion_mnist" / "fashion_mnist_subset.npz"
    f = _npz(path, "fashion_mnist", keys)
    x = {k: _images(f[f"x_{k}"], path, "fashion_mnist", (28, 28)) for k in ("train_first100", "test_first2000")}
    y = {k: _labels(f[f"y_{k}"], path, "fashion_mnist", 10, len(x[k])) for k in x}
    k = FASHION_TEST_FROM
    if len(x["test_first2000"]) <= k:
        raise _corrupt(path, "fashion_mnist", f"{len(x['test_first2000'])} test images, expected 2,000")
    return Dataset(
        "fashion_mnist",
        torch.cat([x["train_first100"], x["test_first2000"][:k]]),
        torch.cat([y["train_first100"], y["test_first2000"][:k]]),
        x["test_first2000"][k:],
        y["test_first2000"][k:],
        10,
        note="partial Fashion-MNIST: 2,100 images; train = official train 0..99 + test 0..1499 "
        "(1,600), test = official test 1500..1999 (500); the official train- and t10k-images-idx3-ubyte.gz "
        "and -labels-idx1-ubyte.gz in DATA_DIR/fashion_mnist give all 70,000",
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
    lp = d / "cifar10_labels.npz"
    labels = _npz(lp, "cifar10", ("y_train", "y_test_first1000"))
    parts = [d / f"cifar10_train_{i:02d}.npy.xz" for i in range(50)]
    x_tr = torch.cat([_images(_xz_npy(p), p, "cifar10", (32, 32, 3)) for p in parts])
    tp = d / "cifar10_test_first1000.npy.xz"
    x_te = _images(_xz_npy(tp), tp, "cifar10", (32, 32, 3))
    if len(x_tr) != 50000 or len(x_te) != 1000:
        raise _corrupt(d, "cifar10", f"{len(x_tr)} train and {len(x_te)} test images, expected 50,000 and 1,000")
    return Dataset(
        "cifar10",
        x_tr,
        _labels(labels["y_train"], lp, "cifar10", 10, len(x_tr)),
        x_te,
        _labels(labels["y_test_first1000"], lp, "cifar10", 10, len(x_te)),
        10,
        note="CIFAR-10: 50,000 train; only the first 1,000 official test images",
    )


@lru_cache(maxsize=1)
def _femnist(root: Path) -> Dataset:
    keys = (
        "x_train",
        "y_train",
        "writer_idx_train",
        "x_test",
        "y_test",
        "writer_idx_test",
        "writer_id",
        "writer_source",
    )
    xs_tr, ys_tr, ws_tr, xs_te, ys_te, ws_te = [], [], [], [], [], []
    offset = 0
    for i in range(3):
        path = root / "femnist" / f"femnist_leaf_part{i}.npz"
        p = _npz(path, "femnist", keys)
        for split, xs, ys, ws in (("train", xs_tr, ys_tr, ws_tr), ("test", xs_te, ys_te, ws_te)):
            x = _images(p[f"x_{split}"], path, "femnist", (28, 28))
            w = _labels(p[f"writer_idx_{split}"], path, "femnist", len(p["writer_id"]), len(x)).numpy()
            xs.append(x)
            ys.append(_labels(p[f"y_{split}"], path, "femnist", 62, len(x)))
            ws.append(w + offset)
        offset += len(p["writer_id"])
    # LEAF stores 255 = white background; invert to MNIST's dark background.
    x_tr = 1.0 - torch.cat(xs_tr)
    x_te = 1.0 - torch.cat(xs_te)
    return Dataset(
        "femnist",
        x_tr,
        torch.cat(ys_tr),
        x_te,
        torch.cat(ys_te),
        62,
        writer_train=np.concatenate(ws_tr),
        writer_test=np.concatenate(ws_te),
        note=f"FEMNIST (LEAF 5% sample): {offset} writers, LEAF's own per-writer train/test split",
    )


DATASETS.update(
    {
        "digits": (lambda root: _digits(), False, True),
        "mnist": (_mnist, True, True),
        "fashion_mnist": (_fashion, True, True),
        "cifar10": (_cifar10, True, True),
        "femnist": (_femnist, True, True),
    }
)
