"""Scenarios: turn a data set into a federation of clients (the papers' non-IID settings).

Within a group, clients get disjoint shards of the group's (transformed) train split; across
groups the same source images are reused under each group's transformation, as in the papers.
A client's test data is a disjoint shard of the same transformation of the test split.
Everything is deterministic from the seed; asking for more samples than a group's pool holds
is a :class:`UserError`, never a silent repeat.

=====================  =======================================================  ====
scenario               groups                                                   K
=====================  =======================================================  ====
iid                    one group, random shards                                 1
pathological           labels {0,1,2}, {3,4}, {5,6}, {7,8,9}                    4
rotated                rotate 0/90/180/270 degrees (CIFAR-10: 0/180)           4 (2)
shifted                y -> (y + s) mod 10, s in {0, 3, 6, 9}                   4
label_swap             group g swaps labels (2g, 2g+1) (FL+HC)                 4
permuted_labels        y -> P_g(y), four fixed random permutations (CFL)       4
hybrid                 MNIST clients and Fashion-MNIST clients (digits: digits  2
                       and their negatives, a second feature domain)
rotated_pathological   rotations {0, 180} x the 4 label groups                  8
corrupted              clean, gaussian noise, contrast, gaussian blur at        4
                       ``severity`` (CIFAR-10-C's kinds, computed here)
rotated_mixture        every client a mixture of the rotated groups             4 (2)
permuted_mixture       every client a mixture of the permuted_labels groups     4
corrupted_mixture      every client a mixture of the corrupted groups           4
dirichlet              per-label Dirichlet(alpha) split over clients            none
shards                 two label-sorted shards a client (McMahan et al.'s       none
                       pathological non-IID; FL+HC's)
writers                one client per real writer (FEMNIST)                     none
=====================  =======================================================  ====

In a ``*_mixture`` scenario client i draws shares p_i ~ Dirichlet(alpha) over the groups, and
holds round(p_i |D|) train samples of each (largest remainders; its test data in the same
shares): ``Federation.mixtures`` records the realised shares (the true mixture that soft
assignments are scored against) and ``Federation.groups`` each client's dominant group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stocfl.data.corruptions import corrupt, corruption_seed
from stocfl.data.datasets import Dataset, load_dataset
from stocfl.data.drift import Drift
from stocfl.data.federation import Federation, gather
from stocfl.errors import UserError, refuse_builtin

LABEL_GROUPS = ((0, 1, 2), (3, 4), (5, 6), (7, 8, 9))
SHIFTS = (0, 3, 6, 9)
SWAPS = ((0, 1), (2, 3), (4, 5), (6, 7))
# CFL (Sattler et al. 2019, section 4): each of 4 groups applies its own random permutation
# to the labels; fixed here (numpy's default_rng(2019)) so that groups mean the same in every run
_perm_rng = np.random.default_rng(2019)
PERMUTATIONS = tuple(tuple(int(v) for v in _perm_rng.permutation(10)) for _ in range(4))


@dataclass
class _Group:
    source: Dataset
    labels: tuple[int, ...] | None = None  # keep only these labels
    image: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    label: Callable[[torch.Tensor], torch.Tensor] = lambda y: y
    name: str = ""
    corruption: str = ""  # a CIFAR-10-C kind applied after ``image`` (stocfl.data.corruptions)
    severity: int = 3
    seed: int = 0

    def inputs(self, x: torch.Tensor, split: str) -> torch.Tensor:
        x = self.image(x)
        if self.corruption:
            x = corrupt(x, self.corruption, self.severity, corruption_seed(self.corruption, split, self.seed))
        return x


def _rotate(quarter_turns: int):
    return lambda x: torch.rot90(x, quarter_turns, dims=(2, 3)) if quarter_turns % 4 else x


def _swap(a: int, b: int):
    def f(y):
        out = y.clone()
        out[y == a], out[y == b] = b, a
        return out

    return f


BUILTIN_SCENARIOS = (
    "iid",
    "pathological",
    "rotated",
    "shifted",
    "label_swap",
    "permuted_labels",
    "hybrid",
    "rotated_pathological",
    "corrupted",
    "rotated_mixture",
    "permuted_mixture",
    "corrupted_mixture",
    "dirichlet",
    "quantity",
    "shards",
    "writers",
)
# the scenarios whose groups transform one source the same way for every label: a client's own
# samples can be put under another group's concept
DRIFTING = ("rotated", "shifted", "label_swap", "permuted_labels", "corrupted")
ScenarioBuilder = Callable[..., "Federation"]
# name -> builder for scenarios registered from user code (the built-ins are in ``build``)
SCENARIOS: dict[str, ScenarioBuilder | None] = {name: None for name in BUILTIN_SCENARIOS}


def register_scenario(name: str, builder: ScenarioBuilder) -> None:
    """Make scenario ``name`` usable by name (``scenario.name``) in this process.

    ``builder(dataset, n_clients, samples_per_client, test_per_client, seed, alpha)`` gets the
    loaded :class:`~stocfl.data.datasets.Dataset` and the ``[scenario]`` values and returns a
    :class:`Federation` (e.g. from :meth:`Federation.from_arrays`)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise UserError(f"register_scenario: name {name!r} must be an identifier, e.g. 'my_split'")
    refuse_builtin("register_scenario", name, name in BUILTIN_SCENARIOS)
    if not callable(builder):
        raise UserError(f"register_scenario({name!r}): builder must be a function returning a Federation")
    SCENARIOS[name] = builder


def _split_counts(n: int, k: int) -> list[int]:
    return [n // k + (g < n % k) for g in range(k)]


def build(
    name: str,
    dataset: str | Dataset,
    n_clients: int,
    samples_per_client: int,
    test_per_client: int = 0,
    seed: int = 0,
    alpha: float = 0.5,
    data_dir: str | None = None,
    holdout: float = 0.0,
    severity: int = 3,
    drift: str = "",
    drift_rounds: tuple[int, ...] = (),
    drift_share: float = 0.5,
) -> Federation:
    """Build scenario ``name`` on ``dataset`` (a name or a loaded :class:`Dataset`).

    Parameters
    ----------
    n_clients : int
        N, clients in total, spread evenly over the groups (writers: number of writers).
    samples_per_client : int
        |D|, train samples per client (dirichlet, quantity: the mean size; writers: a cap per writer).
    test_per_client : int, default 0
        Test samples per client; 0 = an equal share of the group's test pool, at most |D|.
    seed : int, default 0
        Seeds every shuffle and draw.
    alpha : float, default 0.5
        Dirichlet concentration: over labels (dirichlet), over groups (``*_mixture``), over the
        clients' sizes (quantity).
    holdout : float in [0, 1), default 0
        Fraction of clients kept out of training (per true group where there is one), to be
        placed as new clients afterwards (the StoCFL paper's 70/30 generalisation study).
    severity : int in 1..5, default 3
        Corruption severity (``corrupted`` and ``corrupted_mixture``).
    drift : "" | "sudden" | "incremental" | "recurrent", default ""
        Clients whose data change concept at ``drift_rounds`` (:mod:`stocfl.data.drift`):
        ``drift_share`` of each group's participants, on the scenarios of :data:`DRIFTING`.
    """
    if drift and name not in DRIFTING:  # before any data is read
        raise UserError(
            f"config: scenario.drift: scenario {name!r} cannot drift; a drifting client keeps its samples "
            f"under another group's transformation, which needs one of {', '.join(DRIFTING)}"
        )
    src = dataset if isinstance(dataset, Dataset) else load_dataset(dataset, data_dir)
    rng = np.random.default_rng(seed)
    if n_clients < 1 or samples_per_client < 1 or test_per_client < 0:
        raise UserError(
            "config: scenario.n_clients and scenario.samples_per_client must be >= 1, scenario.test_per_client >= 0"
        )
    if SCENARIOS.get(name) is not None:
        fed = SCENARIOS[name](src, n_clients, samples_per_client, test_per_client, seed, alpha)
        if not isinstance(fed, Federation):
            raise UserError(f"config: scenario.name: scenario {name!r} returned {type(fed).__name__}, not a Federation")
    elif name == "writers":
        fed = _writers(src, n_clients, samples_per_client, test_per_client, rng)
    elif name == "dirichlet":
        fed = _dirichlet(src, n_clients, samples_per_client, test_per_client, alpha, rng)
    elif name == "quantity":
        fed = _quantity(src, n_clients, samples_per_client, test_per_client, alpha, rng)
    elif name == "shards":
        fed = _shards(src, n_clients, samples_per_client, test_per_client, rng)
    elif name.endswith("_mixture") and name in BUILTIN_SCENARIOS:
        base = {"permuted_mixture": "permuted_labels"}.get(name, name.removesuffix("_mixture"))
        groups = _groups(base, src, data_dir, severity, seed)
        fed = _mixed(name, src.name, groups, n_clients, samples_per_client, test_per_client, alpha, rng)
    else:
        groups = _groups(name, src, data_dir, severity, seed)
        fed, sources = _grouped(name, src.name, groups, n_clients, samples_per_client, test_per_client, rng)
    if holdout > 0:
        fed.heldout = _holdout(fed, holdout, np.random.default_rng([seed, 2]))
    if drift:
        fed.drift = _drifting(fed, groups, sources, drift, drift_rounds, drift_share, seed)
    return fed


def _holdout(fed: Federation, fraction: float, rng: np.random.Generator) -> np.ndarray:
    groups = fed.groups if fed.groups is not None else np.zeros(fed.n_clients, dtype=np.int64)
    out = np.zeros(fed.n_clients, dtype=bool)
    for g in np.unique(groups):
        members = rng.permutation(np.flatnonzero(groups == g))
        out[members[: int(round(fraction * len(members)))]] = True
    if out.all():
        raise UserError(f"config: scenario.holdout = {fraction} leaves no client to train; lower it")
    if not out.any():
        sizes = sorted({int((groups == g).sum()) for g in np.unique(groups)})
        raise UserError(
            f"config: scenario.holdout = {fraction} holds out no client (it rounds to 0 of each group's "
            f"{'/'.join(map(str, sizes))} clients); raise it, or give each group more clients"
        )
    return out


CORRUPTED = ("gaussian_noise", "contrast", "gaussian_blur")  # one of CIFAR-10-C's noise, digital and blur families


def _groups(name: str, src: Dataset, data_dir: str | None, severity: int = 3, seed: int = 0) -> list[_Group]:
    if name == "iid":
        return [_Group(src, name="all")]
    if name == "pathological":
        return [_Group(src, labels=ls, name=f"labels {ls}") for ls in LABEL_GROUPS]
    if name == "rotated":
        turns = (0, 2) if src.name == "cifar10" else (0, 1, 2, 3)
        return [_Group(src, image=_rotate(t), name=f"rot {90 * t}") for t in turns]
    if name == "shifted":
        return [_Group(src, label=lambda y, s=s: (y + s) % 10, name=f"shift {s}") for s in SHIFTS]
    if name == "label_swap":
        return [_Group(src, label=_swap(a, b), name=f"swap {a}<->{b}") for a, b in SWAPS]
    if name == "permuted_labels":
        return [
            _Group(src, label=lambda y, p=torch.tensor(p): p[y], name=f"labels permuted {''.join(map(str, p))}")
            for p in PERMUTATIONS
        ]
    if name == "corrupted":
        return [_Group(src, name="clean")] + [
            _Group(src, name=f"{kind} (severity {severity})", corruption=kind, severity=severity, seed=seed)
            for kind in CORRUPTED
        ]
    if name == "rotated_pathological":
        return [
            _Group(src, labels=ls, image=_rotate(t), name=f"rot {90 * t}, labels {ls}")
            for t in (0, 2)
            for ls in LABEL_GROUPS
        ]
    if name == "hybrid":
        if src.name == "digits":
            return [_Group(src, name="digits"), _Group(src, image=lambda x: 1.0 - x, name="negative digits")]
        if src.name != "mnist":
            raise UserError(
                "config: scenario.dataset: scenario hybrid needs mnist (paired with fashion_mnist) or digits"
            )
        return [_Group(src, name="mnist"), _Group(load_dataset("fashion_mnist", data_dir), name="fashion_mnist")]
    raise UserError(f"config: scenario.name: unknown scenario {name!r}")


def _pool(y: torch.Tensor, labels: tuple[int, ...] | None, rng: np.random.Generator) -> np.ndarray:
    idx = np.arange(len(y)) if labels is None else np.flatnonzero(np.isin(y.numpy(), labels))
    return rng.permutation(idx)


def _grouped(scenario, dataset, groups, n_clients, per_client, test_per_client, rng) -> tuple[Federation, list]:
    """The federation, and each client's source indices (train, test): what its data are made
    of, under its group's transformation (a drifting client keeps them under another's)."""
    counts = _split_counts(n_clients, len(groups))
    if min(counts) == 0:
        raise UserError(
            f"config: scenario.n_clients = {n_clients} cannot fill the {len(groups)} groups of scenario {scenario}; "
            f"use n_clients >= {len(groups)}"
        )
    xs_tr, ys_tr, xs_te, ys_te, sizes_te, sources = [], [], [], [], [], []
    for g, (grp, n_g) in enumerate(zip(groups, counts)):
        tr, te = _pool(grp.source.y_train, grp.labels, rng), _pool(grp.source.y_test, grp.labels, rng)
        need = n_g * per_client
        if need > len(tr):
            raise UserError(
                f"config: scenario.n_clients x scenario.samples_per_client: scenario {scenario} on "
                f"{grp.source.name}: group {g} "
                f"({grp.name}) needs {n_g} clients x "
                f"{per_client} = {need} train samples but has {len(tr)}; lower n_clients or samples_per_client"
                + (f" ({grp.source.note})" if grp.source.note else "")
            )
        t = test_per_client or min(per_client, len(te) // n_g)
        if t == 0 or n_g * t > len(te):
            raise UserError(
                f"config: scenario.n_clients x scenario.test_per_client: scenario {scenario} on "
                f"{grp.source.name}: group {g} "
                f"({grp.name}) has {len(te)} test samples, "
                f"too few for {n_g} clients x {max(t, 1)}; lower n_clients or test_per_client"
                + (f" ({grp.source.note})" if grp.source.note else "")
            )
        tr_idx, te_idx = torch.from_numpy(tr[:need]), torch.from_numpy(te[: n_g * t])
        xs_tr.append(grp.inputs(grp.source.x_train[tr_idx], "train"))
        ys_tr.append(grp.label(grp.source.y_train[tr_idx]))
        xs_te.append(grp.inputs(grp.source.x_test[te_idx], "test"))
        ys_te.append(grp.label(grp.source.y_test[te_idx]))
        sizes_te += [t] * n_g
        sources += [(tr_idx[j * per_client : (j + 1) * per_client], te_idx[j * t : (j + 1) * t]) for j in range(n_g)]
    shape = {tuple(x.shape[1:]) for x in xs_tr}
    if len(shape) > 1:
        raise UserError(f"scenario {scenario}: groups have different image shapes {shape}")
    fed = Federation(
        scenario,
        dataset,
        torch.cat(xs_tr).contiguous(),
        torch.cat(ys_tr),
        np.arange(n_clients + 1) * per_client,
        torch.cat(xs_te).contiguous(),
        torch.cat(ys_te),
        np.concatenate([[0], np.cumsum(sizes_te)]),
        n_classes=max(g.source.n_classes for g in groups),
        groups=np.repeat(np.arange(len(groups)), counts),
        notes=[f"group {g}: {grp.name}" for g, grp in enumerate(groups)]
        + sorted({grp.source.note for grp in groups if grp.source.note}),
    )
    return fed, sources


def _drifting(fed: Federation, groups: list[_Group], sources: list, pattern, rounds, share, seed) -> Drift:
    """``fed``'s drift: the changes of ``pattern`` and, for every (client, concept) pair a client
    moves to, its own source samples under that concept's transformation."""
    changes = Drift.plan(pattern, list(rounds), share, fed.groups, fed.participants, seed)
    start = fed.groups.copy()
    pairs = np.unique(changes[changes[:, 2] != start[changes[:, 1]]][:, 1:], axis=0).reshape(-1, 2)
    parts: dict[str, list] = {"train": [], "test": []}
    for i, k in pairs:
        grp = groups[int(k)]
        for split, idx in zip(("train", "test"), sources[int(i)]):
            x = grp.source.x_train if split == "train" else grp.source.x_test
            y = grp.source.y_train if split == "train" else grp.source.y_test
            parts[split].append((grp.inputs(x[idx], split), grp.label(y[idx])))
    if not len(pairs):
        raise UserError(
            f"config: scenario.drift_share = {share}: no client drifts (it rounds to 0 of each group's clients); "
            f"raise it, or give each group more clients"
        )
    extra = Federation.from_arrays(parts["train"], parts["test"], pairs[:, 1], fed.n_classes, f"{fed.dataset} drifted")
    return Drift(start, changes, pairs.astype(np.int64), extra, pattern)


def apportion(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts (rows sum to ``total``) nearest to ``shares * total``: floors, then one more
    to the largest remainders (the first of equal remainders)."""
    raw = shares * total
    counts = np.floor(raw).astype(np.int64)
    short = total - counts.sum(1)
    order = np.argsort(-(raw - counts), axis=1, kind="stable")
    for i, k in enumerate(short):
        counts[i, order[i, :k]] += 1
    return counts


def _mixed(scenario, dataset, groups, n_clients, per_client, test_per_client, alpha, rng) -> Federation:
    k = len(groups)
    shares = rng.dirichlet(np.full(k, alpha), size=n_clients)
    tr_counts = apportion(shares, per_client)
    pools = [(_pool(g.source.y_train, g.labels, rng), _pool(g.source.y_test, g.labels, rng)) for g in groups]
    t = test_per_client or min(per_client, min(len(te) for _, te in pools) // n_clients)
    if t == 0:
        raise UserError(
            f"config: scenario.n_clients: scenario {scenario} on {dataset} has too few test samples for "
            f"{n_clients} clients; lower n_clients or set scenario.test_per_client"
        )
    te_counts = apportion(shares, t)
    parts_tr, parts_te = [], []
    for g, (grp, (tr, te)) in enumerate(zip(groups, pools)):
        for what, pool, counts, parts in (("train", tr, tr_counts, parts_tr), ("test", te, te_counts, parts_te)):
            need = int(counts[:, g].sum())
            if need > len(pool):
                raise UserError(
                    f"config: scenario.n_clients x scenario.samples_per_client: scenario {scenario} on {dataset}: "
                    f"group {g} ({grp.name}) needs {need} {what} samples for its clients' shares but has "
                    f"{len(pool)}; lower n_clients, samples_per_client or test_per_client"
                )
            idx = torch.from_numpy(pool[:need])
            source = grp.source.x_train if what == "train" else grp.source.x_test
            labels = grp.source.y_train if what == "train" else grp.source.y_test
            parts.append((grp.inputs(source[idx], what), grp.label(labels[idx]), np.cumsum([0, *counts[:, g]])))
    shape = {tuple(x.shape[1:]) for x, _, _ in parts_tr}
    if len(shape) > 1:
        raise UserError(f"scenario {scenario}: groups have different image shapes {shape}")

    def stack(parts):  # client by client, its part of every group in group order
        xs, ys = [], []
        for i in range(n_clients):
            for x, y, off in parts:
                xs.append(x[off[i] : off[i + 1]])
                ys.append(y[off[i] : off[i + 1]])
        return torch.cat(xs).contiguous(), torch.cat(ys)

    x_tr, y_tr = stack(parts_tr)
    x_te, y_te = stack(parts_te)
    mixtures = tr_counts / per_client
    return Federation(
        scenario,
        dataset,
        x_tr,
        y_tr,
        np.arange(n_clients + 1) * per_client,
        x_te,
        y_te,
        np.arange(n_clients + 1) * t,
        n_classes=max(g.source.n_classes for g in groups),
        groups=mixtures.argmax(1).astype(np.int64),
        notes=[f"group {g}: {grp.name}" for g, grp in enumerate(groups)]
        + [f"each client's shares of the groups ~ Dirichlet({alpha:g}); groups: its dominant one"]
        + sorted({grp.source.note for grp in groups if grp.source.note}),
        mixtures=mixtures,
    )


def _dirichlet(src, n_clients, per_client, test_per_client, alpha, rng) -> Federation:
    """Standard per-label Dirichlet split (FeSEM): label c's share of each client ~ Dir(alpha).

    A random subset of N*|D| train samples (and N*test samples) is split so client sizes vary;
    draws are repeated (up to 100 times) until every client has at least one train sample."""
    tr, te = _random_pool("dirichlet", src, n_clients, per_client, test_per_client, rng)
    for _ in range(100):
        q = rng.dirichlet(np.full(n_clients, alpha), size=src.n_classes)  # (classes, clients)
        tr_parts = _split_by_label(src.y_train.numpy()[tr], tr, q, n_clients)
        if min(len(p) for p in tr_parts) > 0:
            break
    else:
        raise UserError(
            f"config: scenario.alpha = {alpha} leaves dirichlet clients empty; raise scenario.alpha or "
            "scenario.samples_per_client"
        )
    te_parts = _split_by_label(src.y_test.numpy()[te], te, q, n_clients)
    return _from_parts("dirichlet", src, tr_parts, te_parts, None, [f"alpha = {alpha}"])


def _random_pool(scenario, src, n_clients, per_client, test_per_client, rng):
    """N x |D| train samples and N x t test samples drawn at random (t = ``test_per_client``, or
    an equal share of the test split, at most |D|); too few samples is one line."""
    total = n_clients * per_client
    if total > len(src.y_train):
        raise UserError(
            f"config: scenario.n_clients x scenario.samples_per_client: scenario {scenario} on {src.name}: "
            f"{n_clients} x {per_client} = {total} train samples, "
            f"the data set has {len(src.y_train)}; lower n_clients or samples_per_client"
        )
    t = test_per_client or min(per_client, len(src.y_test) // n_clients)
    if t == 0 or n_clients * t > len(src.y_test):
        raise UserError(
            f"config: scenario.n_clients: scenario {scenario} on {src.name}: {len(src.y_test)} test samples are too "
            f"few for {n_clients} clients"
        )
    tr = rng.choice(len(src.y_train), total, replace=False)
    te = rng.choice(len(src.y_test), n_clients * t, replace=False)
    return tr, te


def _quantity(src, n_clients, per_client, test_per_client, alpha, rng) -> Federation:
    """Quantity skew alone (NIID-Bench's, Li et al., ICDE 2022): N*|D| train samples drawn at
    random, client j's share of them ~ Dirichlet_N(alpha) (2 samples each first, so none is empty
    and each can hold one out for validation);
    labels and inputs identically distributed. Every client gets the same test size, so that
    its accuracy is measured as precisely as any other's."""
    total = n_clients * per_client
    tr, te = _random_pool("quantity", src, n_clients, per_client, test_per_client, rng)
    least = min(2, per_client)  # 2: a client can hold one out for validation (scenario.validation)
    sizes = least + apportion(rng.dirichlet(np.full(n_clients, alpha))[None], total - least * n_clients)[0]
    cuts = np.cumsum(sizes)[:-1]
    tr_parts = [np.sort(p) for p in np.split(tr, cuts)]
    te_parts = [np.sort(p) for p in np.split(te, n_clients)]
    note = f"client sizes ~ Dirichlet({alpha:g}) x {total}: {int(sizes.min())} to {int(sizes.max())} samples"
    return _from_parts("quantity", src, tr_parts, te_parts, None, [note])


def _shards(src, n_clients, per_client, test_per_client, rng) -> Federation:
    """McMahan et al.'s pathological non-IID split (AISTATS 2017), FL+HC's "pathological": N x |D|
    train samples drawn at random, sorted by label, cut into 2N shards of |D| / 2, and two shards
    at random to each client, so that most clients hold two labels (a shard at a label's end
    holds two). The test pool is drawn, sorted and cut the same way, and each client gets the
    test shards of the same ranks as its train shards, so its test labels are its train labels
    (FL+HC: "the test dataset each client has access to is drawn from the same distribution as
    the training data"), without drawing a test sample twice."""
    if per_client % 2:
        raise UserError(
            f"config: scenario.samples_per_client = {per_client}: scenario shards gives each client two shards "
            "of |D| / 2; use an even number"
        )
    tr, te = _random_pool("shards", src, n_clients, per_client, test_per_client, rng)
    t = len(te) // n_clients
    tr = tr[np.argsort(src.y_train.numpy()[tr], kind="stable")]
    te = te[np.argsort(src.y_test.numpy()[te], kind="stable")]
    order = rng.permutation(2 * n_clients)  # client i: shards order[2i] and order[2i + 1]

    def deal(idx: np.ndarray) -> list[np.ndarray]:  # 2N shards, sizes within one, two to each client
        shards = np.array_split(idx, 2 * n_clients)
        return [np.sort(np.concatenate([shards[k] for k in order[2 * i : 2 * i + 2]])) for i in range(n_clients)]

    tr_parts, te_parts = deal(tr), deal(te)
    two = sum(len(np.unique(src.y_train.numpy()[p])) <= 2 for p in tr_parts)
    note = f"2 shards of {per_client // 2} a client ({two} of {n_clients} hold 2 labels or fewer), {t} test samples"
    return _from_parts("shards", src, tr_parts, te_parts, None, [note])


def _split_by_label(y, idx, q, n_clients) -> list[np.ndarray]:
    parts = [[] for _ in range(n_clients)]
    for c in range(q.shape[0]):
        members = idx[y == c]
        cuts = (np.cumsum(q[c]) * len(members)).astype(int)[:-1]
        for i, chunk in enumerate(np.split(members, cuts)):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _from_parts(scenario, src, tr_parts, te_parts, groups, notes) -> Federation:
    x_tr, y_tr, off_tr = gather(src.x_train, src.y_train, tr_parts)
    x_te, y_te, off_te = gather(src.x_test, src.y_test, te_parts)
    return Federation(
        scenario,
        src.name,
        x_tr,
        y_tr,
        off_tr,
        x_te,
        y_te,
        off_te,
        src.n_classes,
        groups,
        notes + ([src.note] if src.note else []),
    )


def _writers(src, n_clients, cap, test_cap, rng) -> Federation:
    if src.writer_train is None:
        raise UserError(
            f"config: scenario.dataset: scenario writers needs a data set with writers (femnist); {src.name} has none"
        )
    have = np.intersect1d(np.unique(src.writer_train), np.unique(src.writer_test))
    if n_clients > len(have):
        raise UserError(
            f"config: scenario.n_clients: asked for {n_clients} writers, {src.name} has {len(have)} with train "
            f"and test "
            f"data ({src.note}); lower n_clients"
        )
    chosen = np.sort(rng.choice(have, n_clients, replace=False))
    tr = [rng.permutation(np.flatnonzero(src.writer_train == w))[:cap] for w in chosen]
    te = [np.flatnonzero(src.writer_test == w)[: test_cap or None] for w in chosen]
    return _from_parts("writers", src, tr, te, None, [f"{n_clients} writers, at most {cap} train samples each"])
