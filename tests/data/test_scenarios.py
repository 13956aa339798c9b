import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("name", ["rotated_mixture", "permuted_mixture", "corrupted_mixture", "corrupted"])
def test_the_new_scenarios_build_again_to_the_bit(name):
    fed = build(name, DIGITS, 12, 20, seed=3, alpha=0.7)
    again = build(name, DIGITS, 12, 20, seed=3, alpha=0.7)
    assert torch.equal(fed.x_train, again.x_train) and torch.equal(fed.x_test, again.x_test)
    assert float(fed.x_train.min()) >= 0 and float(fed.x_train.max()) <= 1
    assert (fed.mixtures is not None) == name.endswith("_mixture")


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_a_mixed_client_holds_its_recorded_shares_of_each_groups_images(alpha):
    """Client i's train set is, group by group, round(p_ig |D|) images of group g: the g
    quarter-turn rotations of distinct source images (no image twice within a group), and
    ``mixtures`` records those counts / |D|, ``groups`` the largest of them."""
    fed = build("rotated_mixture", DIGITS, 16, 30, seed=2, alpha=alpha)
    source = {im.numpy().tobytes(): k for k, im in enumerate(DIGITS.x_train)}
    m = fed.mixtures
    assert m.shape == (16, 4) and np.allclose(m.sum(1), 1) and (m >= 0).all()
    assert np.array_equal(fed.groups, m.argmax(1)) and np.allclose(m * 30, np.round(m * 30))
    used: dict[int, set] = {g: set() for g in range(4)}
    for i in range(16):
        x, y = fed.train_data(i)
        counts = np.round(m[i] * 30).astype(int)
        at = 0
        for g, n in enumerate(counts):
            for im, label in zip(x[at : at + n], y[at : at + n]):
                k = source[torch.rot90(im[None], -g, dims=(2, 3))[0].contiguous().numpy().tobytes()]
                assert int(DIGITS.y_train[k]) == int(label) and k not in used[g]
                used[g].add(k)
            at += n
    if alpha == 100.0:  # near-equal shares
        assert (m > 0.1).all()
    if alpha == 0.1:  # mostly one group each
        assert (m.max(1) > 0.6).mean() > 0.7


def test_a_mixture_larger_than_a_groups_pool_is_one_line():
    with pytest.raises(UserError, match=r"needs \d+ train samples for its clients' shares but has 1347"):
        build("rotated_mixture", DIGITS, 200, 30, seed=0, alpha=0.05)


def test_corrupted_groups_are_the_clean_images_corrupted():
    from stocfl.data.corruptions import corrupt

    fed = build("corrupted", DIGITS, 4, 20, seed=1, severity=5)
    clean = fed.train_data(0)[0]
    assert fed.notes[:4] == [
        "group 0: clean",
        "group 1: gaussian_noise (severity 5)",
        "group 2: contrast (severity 5)",
        "group 3: gaussian_blur (severity 5)",
    ]
    source = {im.numpy().tobytes() for im in DIGITS.x_train}
    assert all(im.numpy().tobytes() in source for im in clean)
    blurred = fed.train_data(3)[0]  # deterministic kinds: some source image blurred is each of them
    blurred_source = {im.numpy().tobytes() for im in corrupt(DIGITS.x_train, "gaussian_blur", 5)}
    assert all(im.numpy().tobytes() in blurred_source for im in blurred)
    assert not torch.equal(build("corrupted", DIGITS, 4, 20, seed=1, severity=1).x_train, fed.x_train)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), k=st.integers(1, 6), total=st.integers(0, 500), seed=st.integers(0, 2**16))
def test_apportioned_counts_sum_to_the_total_and_stay_within_one_of_the_shares(rows, k, total, seed):
    from stocfl.data.scenarios import apportion

    shares = np.random.default_rng(seed).dirichlet(np.ones(k), size=rows)
    counts = apportion(shares, total)
    assert (counts.sum(1) == total).all() and (counts >= 0).all()
    assert (np.abs(counts - shares * total) < 1 + 1e-9).all()


def test_quantity_skews_sizes_alone():
    """Sizes ~ Dirichlet over clients, every client at least one sample, N x |D| in all; the same
    test size for every client; labels drawn at random (no client far from the pooled mix)."""
    fed = build("quantity", DIGITS, 20, 30, alpha=0.5, seed=0)
    sizes = fed.train_sizes
    assert fed.groups is None and sizes.sum() == 600 and sizes.min() >= 2 and sizes.max() > 3 * sizes.min()
    assert fed.test_sizes.tolist() == [450 // 20] * 20  # the test pool shared evenly, at most |D| each
    big = [i for i in range(20) if sizes[i] >= 60]
    for i in big:  # a large client's labels are near uniform
        counts = np.bincount(fed.train_data(i)[1].numpy(), minlength=10)
        assert counts.max() / sizes[i] < 0.3
    again = build("quantity", DIGITS, 20, 30, alpha=0.5, seed=0)
    assert torch.equal(fed.x_train, again.x_train) and (again.train_sizes == sizes).all()
    # larger alpha: sizes nearer equal
    even = build("quantity", DIGITS, 20, 30, alpha=100.0, seed=0).train_sizes
    assert even.std() < sizes.std()
    with pytest.raises(UserError, match="scenario quantity on digits"):
        build("quantity", DIGITS, 100, 30)


def test_validation_holds_out_train_samples_and_never_uses_the_test_data():
    """scenario.validation: each client's test data are a held-out part of its own train data
    (round(f n), at least 1, at most n - 1), the rest its train data; nothing of the real test
    split is left."""
    from stocfl.data.federation import Federation

    fed = build("quantity", DIGITS, 20, 30, alpha=0.5, seed=0)
    tuned = fed.with_validation(0.1, seed=4)
    assert tuned.n_clients == fed.n_clients and tuned.groups is fed.groups
    for i in range(fed.n_clients):
        x, y = fed.train_data(i)
        n = len(y)
        xt, yt = tuned.train_data(i)
        xv, yv = tuned.test_data(i)
        assert len(yv) == min(n - 1, max(1, round(0.1 * n))) and len(yt) + len(yv) == n
        rows = {tuple(r) for r in x.flatten(1).tolist()}
        assert {tuple(r) for r in xv.flatten(1).tolist()} <= rows and {tuple(r) for r in xt.flatten(1).tolist()} <= rows
        assert sorted(yt.tolist() + yv.tolist()) == sorted(y.tolist())
    again = fed.with_validation(0.1, seed=4)
    assert torch.equal(again.x_test, tuned.x_test) and not torch.equal(
        fed.with_validation(0.1, seed=5).y_test, tuned.y_test
    )
    # a client of one train sample (dirichlet-0.1 at seeds 0 and 1 has one) keeps it for training
    # and holds none out; the others hold theirs out as before
    tiny = Federation.from_arrays(
        [
            (torch.arange(3.0)[:1, None], torch.zeros(1, dtype=torch.long)),
            (torch.arange(3.0)[:, None], torch.arange(3)),
        ],
        [(torch.zeros(1, 1), torch.zeros(1, dtype=torch.long))] * 2,
    )
    split = tiny.with_validation(0.1)
    assert split.train_data(0)[0].tolist() == [[0.0]] and len(split.test_data(0)[1]) == 0
    assert len(split.train_data(1)[1]) == 2 and len(split.test_data(1)[1]) == 1


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 30), half=st.integers(1, 20), seed=st.integers(0, 100))
def test_shards_give_each_client_two_label_sorted_shards(n, half, seed):
    """McMahan et al.'s split against its plain form: the N x |D| pool sorted by label and cut
    into 2N shards of |D| / 2; every client holds exactly two of them, the same ones for the
    same seed."""
    per = 2 * half
    if n * per > len(DIGITS.y_train):
        return
    fed = build("shards", DIGITS, n, per, seed=seed)
    assert fed.groups is None and (fed.train_sizes == per).all()
    pool = torch.sort(fed.y_train).values  # the pool's labels, sorted: the shards' labels in order
    shards = [pool[k * half : (k + 1) * half] for k in range(2 * n)]
    for i in range(n):
        y = torch.sort(fed.train_data(i)[1]).values
        assert any(
            torch.equal(y, torch.sort(torch.cat([shards[a], shards[b]])).values)
            for a in range(2 * n)
            for b in range(a + 1, 2 * n)
        ), "the client's labels are those of two shards"
    again = build("shards", DIGITS, n, per, seed=seed)
    assert torch.equal(fed.x_train, again.x_train) and torch.equal(fed.y_test, again.y_test)


def test_shards_test_labels_follow_the_train_labels_and_odd_sizes_are_one_line(data_dir):
    fed = build("shards", "mnist", 100, 600, data_dir=data_dir)  # FL+HC's pathological MNIST
    assert (fed.test_sizes == 100).all()
    same = 0
    for i in range(100):
        train = set(torch.unique(fed.train_data(i)[1]).tolist())
        test = set(torch.unique(fed.test_data(i)[1]).tolist())
        same += test <= train
        assert len(train) <= 4  # a shard of 300 straddles at most one label's end
    assert same >= 90, "a client's test labels are its train labels but at a few shard ends"
    with pytest.raises(UserError, match="two shards of \\|D\\| / 2; use an even number"):
        build("shards", DIGITS, 10, 21)
