import gzip

import numpy as np
import pytest
import torch

from stocfl.data import load_dataset
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
    assert len(f.y_train) == 1600 and len(f.y_test) == 500 and "partial" in f.note
    fe = load_dataset("femnist", data_dir)
    assert fe.n_classes == 62 and len(np.unique(fe.writer_train)) == 317
    assert float(fe.x_train[:100].mean()) < 0.5, "FEMNIST must be inverted to a dark background"


def test_missing_directory_and_files(tmp_path, monkeypatch):
    monkeypatch.delenv("STOCFL_DATA_DIR", raising=False)
    with pytest.raises(UserError, match="needs a data directory"):
        load_dataset("mnist")
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is missing; expected layout"):
        load_dataset("mnist", tmp_path)
    monkeypatch.setenv("STOCFL_DATA_DIR", str(tmp_path))
    with pytest.raises(UserError, match="fashion_mnist_subset.npz is missing"):
        load_dataset("fashion_mnist")


def test_corrupt_files_are_named(tmp_path):
    (tmp_path / "mnist").mkdir()
    for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
        (tmp_path / "mnist" / name).write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz is corrupt \(not gzip"):
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
