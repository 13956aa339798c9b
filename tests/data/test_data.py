import gzip

import numpy as np
import pytest
import torch

from stocfl.data.datasets import _fashion, _read_idx, load_dataset
from stocfl.data.scenarios import build
from stocfl.errors import UserError


def test_digits_is_embedded():
    d = load_dataset("digits")
    assert d.x_train.shape == (1347, 1, 8, 8) and d.x_test.shape == (450, 1, 8, 8)
    assert d.x_train.dtype == torch.float32 and 0 <= float(d.x_train.min()) and float(d.x_train.max()) <= 1
    assert set(d.y_train.tolist()) == set(range(10))


def test_real_data_sets(data_dir):
    m = load_dataset("mnist", data_dir)
    assert m.x_train.shape == (60000, 1, 28, 28) and m.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(m.y_train.numpy()).tolist()[:2] == [5923, 6742]  # the official class counts
    f = load_dataset("fashion_mnist", data_dir)
    if (data_dir / "fashion_mnist" / "train-images-idx3-ubyte.gz").exists():
        assert len(f.y_train) == 60000 and len(f.y_test) == 10000 and "official" in f.note
    else:
        assert len(f.y_train) == 1600 and len(f.y_test) == 500 and "partial" in f.note
    fe = load_dataset("femnist", data_dir)
    assert fe.n_classes == 62 and len(np.unique(fe.writer_train)) == 317
    assert float(fe.x_train[:100].mean()) < 0.5, "FEMNIST must be inverted to a dark background"


def test_missing_directory_and_files(tmp_path, monkeypatch):
    monkeypatch.delenv("STOCFL_DATA_DIR", raising=False)
    with pytest.raises(UserError, match="needs a data directory"):
        load_dataset("mnist")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="a_file is a file, not a directory"):  # it said "does not exist"
        load_dataset("mnist", tmp_path / "a_file")
    with pytest.raises(UserError, match="nowhere does not exist"):
        load_dataset("mnist", tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is missing; expected layout"):
        load_dataset("mnist", tmp_path)
    monkeypatch.setenv("STOCFL_DATA_DIR", str(tmp_path))
    with pytest.raises(UserError, match="fashion_mnist_subset.npz is missing"):
        load_dataset("fashion_mnist")


def test_corrupt_files_are_named(tmp_path):
    (tmp_path / "mnist").mkdir()
    for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
        (tmp_path / "mnist" / name).write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is corrupt \(not a valid gzip"):
        load_dataset("mnist", tmp_path)
    # a valid gzip whose header promises more images than it holds
    header = bytes([0, 0, 8, 3]) + (100).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    (tmp_path / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(header + bytes(784)))
    with pytest.raises(UserError, match="header says"):
        load_dataset("mnist", tmp_path)
    (tmp_path / "femnist").mkdir()
    (tmp_path / "femnist" / "femnist_leaf_part0.npz").write_bytes(b"PK garbage")
    with pytest.raises(UserError, match="femnist_leaf_part0.npz is corrupt"):
        load_dataset("femnist", tmp_path)


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def _mnist_dir(root, images=None, labels=None):
    (root / "mnist").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (20, 28, 28)) if images is None else images
    y = rng.integers(0, 10, 20) if labels is None else labels
    for s in ("train", "t10k"):
        (root / "mnist" / f"{s}-images-idx3-ubyte.gz").write_bytes(_idx(x))
        (root / "mnist" / f"{s}-labels-idx1-ubyte.gz").write_bytes(_idx(y))
    return root


@pytest.mark.parametrize(
    "case, expected",
    [
        ("bit flip in the compressed stream", "not a valid gzip"),
        ("label 12", r"labels range over 0..12, expected 0..9"),
        ("27x27 images", r"images of shape \(20, 27, 27\), expected \(N, 28, 28\)"),
        ("fewer labels than images", "19 labels"),
    ],
)
def test_corrupt_mnist_is_one_line_naming_the_file(tmp_path, case, expected):
    rng = np.random.default_rng(1)
    if case == "label 12":
        root = _mnist_dir(tmp_path, labels=np.r_[rng.integers(0, 10, 19), 12])
    elif case == "27x27 images":
        root = _mnist_dir(tmp_path, images=rng.integers(0, 256, (20, 27, 27)))
    elif case == "fewer labels than images":
        root = _mnist_dir(tmp_path, labels=rng.integers(0, 10, 19))
    else:
        root = _mnist_dir(tmp_path)
        path = root / "mnist" / "train-images-idx3-ubyte.gz"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=expected) as err:
        load_dataset("mnist", root)
    assert "mnist/t" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"x_train_first100": np.full((100, 28, 28), np.nan)}, "NaN or inf"),
        ({"x_train_first100": np.full((100, 28, 28), 300.0)}, r"pixels range over 300.0..300.0"),
        ({"y_test_first2000": np.full(2000, -1)}, r"labels range over -1..-1"),
        ({"y_test_first2000": np.zeros(2000, dtype=np.float32)}, "labels of type float32"),
    ],
)
def test_corrupt_fashion_mnist_is_one_line_naming_the_file(tmp_path, bad, expected):
    arrays = {
        "x_test_first2000": np.zeros((2000, 28, 28), np.uint8),
        "y_test_first2000": np.zeros(2000, np.int64),
        "x_train_first100": np.zeros((100, 28, 28), np.uint8),
        "y_train_first100": np.zeros(100, np.int64),
    }
    (tmp_path / "fashion_mnist").mkdir()
    np.savez(tmp_path / "fashion_mnist" / "fashion_mnist_subset.npz", **{**arrays, **bad})
    with pytest.raises(UserError, match=expected) as err:
        load_dataset("fashion_mnist", tmp_path)
    assert "fashion_mnist_subset.npz is corrupt" in str(err.value) and "\n" not in str(err.value)


def _write_idx(path, arr):
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes()))


def test_official_fashion_mnist_files_give_the_whole_set(tmp_path, data_dir):
    """With the official IDX files in fashion_mnist/ the hybrid rows the 2,100-image subset
    cannot fill can run (here files of 2,400 / 400 images in the official format)."""
    rng = np.random.default_rng(0)
    d = tmp_path / "fashion_mnist"
    d.mkdir()
    (tmp_path / "mnist").symlink_to(data_dir / "mnist")
    images = {s: rng.integers(1, 256, (n, 28, 28)) for s, n in (("train", 2400), ("t10k", 400))}
    for s, x in images.items():
        _write_idx(d / f"{s}-images-idx3-ubyte.gz", x)
        _write_idx(d / f"{s}-labels-idx1-ubyte.gz", rng.integers(0, 10, len(x)))
    f = load_dataset("fashion_mnist", tmp_path)
    assert f.x_train.shape == (2400, 1, 28, 28) and len(f.y_test) == 400 and "partial" not in f.note
    assert torch.equal(
        (f.x_train[:, 0] * 255).round().to(torch.uint8), torch.from_numpy(images["train"].astype(np.uint8))
    )
    fed = build("hybrid", "mnist", 20, 200, data_dir=tmp_path)  # 2,000 Fashion-MNIST train images
    assert np.bincount(fed.groups).tolist() == [10, 10]
    fashion = [i for i in range(20) if fed.groups[i] == 1]
    assert all(float((fed.train_data(i)[0] == 0).float().mean()) == 0 for i in fashion)  # our images: no 0 pixel
    if not (data_dir / "fashion_mnist" / "train-images-idx3-ubyte.gz").exists():
        with pytest.raises(UserError, match="official train- and t10k-images-idx3-ubyte.gz"):
            build("hybrid", "mnist", 20, 200, data_dir=data_dir)
    (d / "t10k-images-idx3-ubyte.gz").unlink()
    _fashion.cache_clear()
    with pytest.raises(UserError, match="t10k-images-idx3-ubyte.gz is missing"):
        load_dataset("fashion_mnist", tmp_path)


def test_fashion_subset_is_the_official_images_it_says(data_dir):
    """The subset's labels are the official label files' at the documented indices."""
    d = data_dir / "fashion_mnist"
    if (d / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("the official Fashion-MNIST images are present: the subset is not used")
    train = _read_idx(d / "train-labels-idx1-ubyte.gz", "fashion_mnist", 1)
    test = _read_idx(d / "t10k-labels-idx1-ubyte.gz", "fashion_mnist", 1)
    assert len(train) == 60000 and len(test) == 10000
    f = load_dataset("fashion_mnist", data_dir)
    assert f.y_train.tolist() == train[:100].tolist() + test[:1500].tolist()
    assert f.y_test.tolist() == test[1500:2000].tolist()
