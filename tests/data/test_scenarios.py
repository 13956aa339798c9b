import numpy as np
import pytest
import torch

from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import LABEL_GROUPS, PERMUTATIONS, SHIFTS, SWAPS, build
from stocfl.errors import UserError

DIGITS = load_dataset("digits")
GROUPED = {
    "iid": 1,
    "pathological": 4,
    "rotated": 4,
    "shifted": 4,
    "label_swap": 4,
    "permuted_labels": 4,
    "hybrid": 2,
    "rotated_pathological": 8,
}


@pytest.mark.parametrize("name, k", GROUPED.items())
def test_grouped_scenarios_on_digits(name, k):
    fed = build(name, DIGITS, n_clients=4 * k, samples_per_client=20, seed=3)
    assert fed.n_clients == 4 * k and (fed.train_sizes == 20).all()
    assert (fed.test_sizes > 0).all() and (fed.test_sizes <= 20).all()
    assert sorted(np.bincount(fed.groups).tolist()) == [4] * k
    again = build(name, DIGITS, n_clients=4 * k, samples_per_client=20, seed=3)
    assert torch.equal(fed.x_train, again.x_train) and torch.equal(fed.y_test, again.y_test)
    other = build(name, DIGITS, n_clients=4 * k, samples_per_client=20, seed=4)
    assert not torch.equal(fed.x_train, other.x_train)


def test_group_transformations_are_the_papers():
    fed = build("pathological", DIGITS, 8, 20)
    for i in range(8):
        assert set(fed.train_data(i)[1].tolist()) <= set(LABEL_GROUPS[fed.groups[i]])
        assert set(fed.test_data(i)[1].tolist()) <= set(LABEL_GROUPS[fed.groups[i]])
    # shifted and label swap reuse the same images; only the labels move
    base = build("iid", DIGITS, 1, 300, seed=0)
    sh = build("shifted", DIGITS, 4, 300, seed=0)
    first = {tuple(x.flatten().tolist()): int(y) for x, y in zip(*base.train_data(0))}
    for i in range(4):
        for x, y in zip(*sh.train_data(i)):
            key = tuple(x.flatten().tolist())
            if key in first:
                assert int(y) == (first[key] + SHIFTS[sh.groups[i]]) % 10
    perm = build("permuted_labels", DIGITS, 4, 300, seed=0)
    for i in range(4):
        p = PERMUTATIONS[perm.groups[i]]
        assert sorted(p) == list(range(10))
        for x, y in zip(*perm.train_data(i)):
            key = tuple(x.flatten().tolist())
            if key in first:
                assert int(y) == p[first[key]]
    assert len(set(PERMUTATIONS)) == 4
    sw = build("label_swap", DIGITS, 4, 100)
    a, b = SWAPS[sw.groups[2]]
    assert set(sw.train_data(2)[1].tolist()) == set(range(10))
    assert a == 4 and b == 5
    rot = build("rotated", DIGITS, 4, 10, seed=0)
    x1 = rot.train_data(1)[0]  # 90 degrees: the top row becomes the left column
    assert not torch.equal(x1, torch.rot90(x1, 1, (2, 3)))


def test_shards_within_a_group_are_disjoint():
    fed = build("rotated", DIGITS, 8, 100, seed=1)
    for g in range(4):
        members = np.flatnonzero(fed.groups == g)
        rows = torch.cat([fed.train_data(i)[0] for i in members]).flatten(1)
        assert len(torch.unique(rows, dim=0)) == len(rows)  # sklearn digits hold no two equal images


def test_more_than_the_data_is_an_error():
    with pytest.raises(UserError, match=r"needs 100 clients x 30 = 3000 train samples but has 1347"):
        build("rotated", DIGITS, 400, 30)
    with pytest.raises(UserError, match="scenario.n_clients = 3 cannot fill the 4 groups"):
        build("pathological", DIGITS, 3, 10)
    with pytest.raises(UserError, match="needs a data set with writers"):
        build("writers", DIGITS, 3, 10)


def test_dirichlet_unequal_sizes():
    fed = build("dirichlet", DIGITS, 20, 30, alpha=0.3, seed=0)
    assert fed.groups is None and fed.train_sizes.sum() == 600 and fed.train_sizes.min() > 0
    assert fed.train_sizes.std() > 0
    skew = [np.bincount(fed.train_data(i)[1].numpy(), minlength=10).max() / fed.train_sizes[i] for i in range(20)]
    assert np.mean(skew) > 0.3  # alpha = 0.3 concentrates each client on few labels


def test_real_scenarios(data_dir):
    fed = build("hybrid", "mnist", 80, 40, data_dir=data_dir)
    assert fed.x_train.shape[1:] == (1, 28, 28) and np.bincount(fed.groups).tolist() == [40, 40]
    if not (data_dir / "fashion_mnist" / "train-images-idx3-ubyte.gz").exists():
        with pytest.raises(UserError, match="partial Fashion-MNIST"):
            build("hybrid", "mnist", 100, 40, data_dir=data_dir)
    w = build("writers", "femnist", 20, 1000, data_dir=data_dir)
    assert w.n_clients == 20 and w.n_classes == 62 and w.train_sizes.min() > 10
    r = build("rotated", "mnist", 1200, 50, data_dir=data_dir)
    assert r.test_sizes.tolist() == [33] * 1200  # 10,000 test images / 300 clients per rotation
