import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.algorithms import Context
from stocfl.algorithms.fedavg import FedAvg
from stocfl.algorithms.fedprox import FedProx
from stocfl.algorithms.stocfl.algorithm import StoCFL, StoCFLParams
from stocfl.algorithms.stocfl.clustering import ClusterSet
from stocfl.algorithms.stocfl.representation import Represent, Represented, count_sketch
from stocfl.algorithms.stocfl.tau import suggest_tau
from stocfl.client.models import make_model
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor, SequentialExecutor
from tests.helpers import REPO

FED = build("rotated", load_dataset("digits"), 24, 30, seed=0)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
CTX = Context(FED.n_clients, W0, local=LocalTraining.sgd(2, 10, 0.1), seed=0, input_shape=FED.input_shape, n_classes=10)
SAMPLES = [[0, 5, 9, 13, 20], [1, 5, 7, 14, 22], [2, 3, 9, 17, 23]]


def _run(alg, executor=None):
    ex = executor or SequentialExecutor(FED, MODEL)
    for t, s in enumerate(SAMPLES, 1):
        alg.round(t, s, ex.execute)
    return alg


def test_tau_one_never_merges():
    alg = _run(StoCFL(StoCFLParams(tau=1.0), CTX))
    seen = sorted({i for s in SAMPLES for i in s})
    assert len(alg.clusters) == len(seen) and (alg.cluster_labels()[seen] >= 0).all()


def test_tau_minus_one_lambda_zero_is_fedavg_number_for_number():
    sto = _run(StoCFL(StoCFLParams(tau=-1.0, lam=0.0), CTX))
    avg = _run(FedAvg(FedAvg.Params(), CTX))
    assert len(sto.clusters) == 1
    assert torch.equal(sto.global_model(), avg.global_model())
    (k,) = sto.clusters.ids
    assert torch.equal(sto.theta[k], avg.global_model())


def test_tau_minus_one_cluster_model_follows_fedprox_toward_w():
    """One cluster; each round theta moves exactly as FedProx (mu = lambda) would move a model
    theta whose proximal center is the round's w."""
    lam = 0.7
    sto = StoCFL(StoCFLParams(tau=-1.0, lam=lam), CTX)
    ex = SequentialExecutor(FED, MODEL)
    sto.round(1, SAMPLES[0], ex.execute)
    (k,) = sto.clusters.ids
    theta, w = sto.theta[k].clone(), sto.w.clone()
    prox = FedProx(FedProx.Params(mu=lam), CTX)
    expected = [prox.local_training(2, i, theta, prox_center=w, prox_weight=lam) for i in SAMPLES[1]]
    res = ex.execute(expected)
    n = [r.n_samples for r in res]
    want = sum(r.weights * m for r, m in zip(res, n)) / sum(n)
    sto.round(2, SAMPLES[1], ex.execute)
    assert len(sto.clusters) == 1
    assert torch.allclose(sto.theta[k], want, atol=1e-6)


def test_finds_the_rotations_and_same_on_both_executors():
    a = StoCFL(StoCFLParams(), CTX)
    b = StoCFL(StoCFLParams(), CTX)
    ex_a, ex_b = SequentialExecutor(FED, MODEL), BatchedExecutor(FED, MODEL)
    rng = np.random.default_rng(0)
    for t in range(1, 9):
        s = sorted(rng.choice(24, 6, replace=False).tolist())
        a.round(t, s, ex_a.execute)
        b.round(t, s, ex_b.execute)
    assert np.array_equal(a.cluster_labels(), b.cluster_labels())
    seen = a.cluster_labels() >= 0
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(FED.groups[seen], a.cluster_labels()[seen]) == 1.0
    for k in a.theta:
        assert torch.allclose(a.theta[k], b.theta[k], atol=1e-5)


def test_state_round_trip():
    alg = _run(StoCFL(StoCFLParams(tau=0.3), CTX))
    tensors, meta = alg.encode_state()
    fresh = StoCFL(StoCFLParams(tau=0.3), CTX)
    fresh.decode_state(tensors, meta)
    assert np.array_equal(fresh.cluster_labels(), alg.cluster_labels())
    assert fresh.clusters.members_ == {k: sorted(v) for k, v in alg.clusters.members_.items()}
    ex = SequentialExecutor(FED, MODEL)
    alg.round(4, [4, 6, 8], ex.execute)
    fresh.round(4, [4, 6, 8], ex.execute)
    assert np.array_equal(fresh.cluster_labels(), alg.cluster_labels())
    assert torch.equal(fresh.w, alg.w)


def test_merged_models_weigh_by_trained_samples_untrained_weigh_zero():
    alg = StoCFL(StoCFLParams(tau=0.5), CTX)
    alg.theta = {0: torch.ones(3), 1: torch.full((3,), 4.0)}
    alg.trained = {0: 10.0, 1: 30.0}
    alg._merge_models(0, 1)
    assert torch.allclose(alg.theta[0], torch.full((3,), 3.25)) and alg.trained[0] == 40.0
    alg._merge_models(0, 2)  # cluster 2 never trained: theta_0 must not move
    assert torch.allclose(alg.theta[0], torch.full((3,), 3.25)) and alg.trained[0] == 40.0
    alg._merge_models(3, 0)  # an untrained keeper takes the trained model
    assert torch.allclose(alg.theta[3], torch.full((3,), 3.25))


def test_a_client_whose_psi_is_rejected_still_trains_w():
    class ZeroPsi(SequentialExecutor):
        def execute(self, tasks):
            return [
                Represented(torch.zeros_like(r.psi), r.n_samples) if isinstance(r, Represented) and t.client == 5 else r
                for t, r in zip(tasks, super().execute(tasks))
            ]

    ex = ZeroPsi(FED, MODEL)
    alg = StoCFL(StoCFLParams(), CTX)
    w = alg.w.clone()
    diag = alg.round(1, SAMPLES[0], ex.execute)
    assert diag["rejected_representations"] == 1 and alg.cluster_labels()[5] == -1
    plain = SequentialExecutor(FED, MODEL).execute([alg.local_training(1, i, w) for i in SAMPLES[0]])
    n = [r.n_samples for r in plain]
    expected = sum(r.weights * k for r, k in zip(plain, n)) / sum(n)
    assert torch.allclose(alg.w, expected, atol=1e-6), "w is the mean over every sampled client, client 5 included"


def test_auto_tau_needs_no_kept_representations_and_says_what_it_did():
    alg = StoCFL(StoCFLParams(tau="auto", keep_representations=False), CTX)
    ex = SequentialExecutor(FED, MODEL)
    diag = alg.round(1, [0, 5], ex.execute)  # two clients: too few to suggest tau, no merges yet
    assert diag["tau"] is None and diag["tau_auto"].startswith("waiting: 2 of 3") and diag["merges"] == 0
    assert len(alg.clusters) == 2 and not alg.reps
    tensors, meta = alg.encode_state()
    resumed = StoCFL(StoCFLParams(tau="auto", keep_representations=False), CTX)
    resumed.decode_state(tensors, meta)
    for a in (alg, resumed):
        diag = a.round(2, [1, 7, 9, 13, 20], ex.execute)
        assert diag["tau"] is not None and diag["tau_auto"].startswith("suggested from 7 representations: ")
        assert f": {len(a.clusters)} clusters (gap " in diag["tau_auto"], diag["tau_auto"]
    arrival = [0, 5, 1, 7, 9, 13, 20]
    assert diag["tau"] == suggest_tau(torch.stack([_psi(ex, i) for i in arrival]))
    assert np.array_equal(alg.cluster_labels(), resumed.cluster_labels())
    # every pair of clusters ends at or below the decided tau, the two early singletons included
    u = alg.clusters.units(alg.clusters.ids)
    assert float((u @ u.T - 4 * torch.eye(len(u), dtype=torch.float64)).max()) <= alg.tau + 1e-9


def test_tau_suggested_is_from_full_size_psi_where_all_fit_else_says_sketched(monkeypatch):
    """summary's tau_suggested is the helper's on the clients' full-size Psi (the same number
    tau = "auto" would give on them) while N x dim(Psi) fits; past that it is sketched and says so,
    and a resumed run keeps the size its kept Psi had."""
    import stocfl.algorithms.stocfl.algorithm as mod

    ex = SequentialExecutor(FED, MODEL)
    params = StoCFLParams(anchor="init")  # Psi of the MLP's weights: more than PLOT_DIM numbers
    sent = W0.numel()
    assert sent > mod.PLOT_DIM
    alg = _run(StoCFL(params, CTX), ex)
    seen = sorted(alg.reps)
    out = alg.summary([])
    assert out["tau_suggested"] == suggest_tau(torch.stack([_psi(ex, i, params) for i in seen]))
    assert out["tau_suggested_from"] == f"Psi of {len(seen)} clients"
    monkeypatch.setattr(mod, "KEEP_FULL_NUMBERS", FED.n_clients * sent - 1)
    small = StoCFL(params, CTX)
    small.round(1, SAMPLES[0], ex.execute)
    assert {len(v) for v in small.reps.values()} == {mod.PLOT_DIM}
    tensors, meta = small.encode_state()
    monkeypatch.setattr(mod, "KEEP_FULL_NUMBERS", 2**24)  # a resumed run keeps the size it began with
    resumed = StoCFL(params, CTX)
    resumed.decode_state(tensors, meta)
    for t, s in enumerate(SAMPLES[1:], 2):
        resumed.round(t, s, ex.execute)
    assert {len(v) for v in resumed.reps.values()} == {mod.PLOT_DIM}
    assert resumed.summary([])["tau_suggested_from"] == (
        f"Psi of {len(seen)} clients, sketched from {sent} to {mod.PLOT_DIM} numbers (an estimate)"
    )


def _psi(ex, client, params=None):
    alg = StoCFL(params or StoCFLParams(), CTX)
    return ex.execute([alg.represent_task(client)])[0].psi.double()


def test_bad_representations_are_rejected():
    alg = StoCFL(StoCFLParams(), CTX)
    psi = torch.zeros(5)
    accepted, _ = alg.cluster_newcomers(
        [
            Represented(psi, 10),
            Represented(torch.tensor([1.0, float("nan"), 0, 0, 0]), 10),
            Represented(torch.tensor([1.0, 0, 0, 0, 0]), 10),
        ],
        [0, 1, 2],
    )
    assert accepted == [2] and alg.cluster_labels()[:3].tolist() == [-1, -1, 0]


def test_objective_is_eq2():
    cs = ClusterSet(3)
    for i, v in enumerate(([1.0, 0.0], [0.0, 2.0], [1.0, 1.0])):
        cs.add(i, torch.tensor(v))
    assert cs.objective() == pytest.approx(0 + 2**-0.5 + 2**-0.5)


@settings(max_examples=40, deadline=None)
@given(
    vectors=st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=5, max_size=5), min_size=0, max_size=8
    ),
    merges=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=4),
)
def test_the_objective_squared_in_place_is_the_plain_formula_bit_for_bit(vectors, merges):
    cs = ClusterSet(len(vectors))
    for i, v in enumerate(vectors):
        if any(v):
            cs.add(i, torch.tensor(v))
    for a, b in merges:
        ids = cs.ids
        if len(ids) > 1 and ids[a % len(ids)] != ids[b % len(ids)]:
            cs._fold(ids[a % len(ids)], ids[b % len(ids)])
    u = cs.units(cs.ids)
    plain = 0.0 if len(u) < 2 else float((u.sum(0).pow(2).sum() - (u * u).sum()) / 2)
    assert cs.objective() == plain
    assert torch.equal(cs.units(cs.ids), u)  # the squaring took the objective's own copy


def test_the_models_of_untrained_clusters_come_from_one_matrix_of_the_trained_units(monkeypatch):
    """An untrained cluster starts from its most similar trained cluster's model. The trained
    clusters' unit representations are made once for all of a round's untrained clusters (with
    a model-sized Psi, a matrix of gigabytes), with the same choice as one cluster at a time."""
    alg = StoCFL(StoCFLParams(), CTX)
    ex = SequentialExecutor(FED, MODEL)
    for t in range(1, 3):
        alg.round(t, list(range(0, 24, 2)), ex.execute)
    ids = alg.state.clusters.ids
    assert len(ids) >= 3
    for k in ids[::2]:  # every other cluster untrained
        alg.state.theta.pop(k, None)
    clusters = alg.state.clusters
    trained = [c for c in ids if c in alg.state.theta]

    def plain(cid):
        if cid in alg.state.theta:
            return alg.state.theta[cid]
        sims = clusters.units(trained) @ clusters.unit(cid)
        return alg.state.theta[trained[int(torch.argmax(sims))]]

    want = {k: plain(k) for k in ids}
    made = []
    real = ClusterSet.units
    monkeypatch.setattr(ClusterSet, "units", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    got = alg.cluster_models()
    assert list(got) == ids and all(got[k] is want[k] for k in ids)
    assert len(made) == 1
    labels = alg.cluster_labels()
    models = alg.client_models(list(range(24)), None)
    assert all(m is (want[int(labels[i])] if labels[i] >= 0 else alg.state.w) for i, m in enumerate(models))


def test_a_set_of_singletons_checkpoints_its_float32_sums_as_they_are_and_reloads_to_the_same_units():
    """A model-sized Psi with every cluster a singleton (FEMNIST with the authors' Psi at tau =
    0.55: 244 of them) wrote its sums widened to float64: twice the checkpoint for nothing."""
    g = torch.Generator().manual_seed(0)
    cs = ClusterSet(4)
    for i in range(3):
        cs.add(i, torch.randn(7, generator=g))
    tensors, meta = cs.state()
    assert tensors["cluster_sums"].dtype == torch.float32
    back = ClusterSet(4)
    back.load_state(tensors, meta)
    assert torch.equal(back.units(back.ids), cs.units(cs.ids)) and back.objective() == cs.objective()
    cs._fold(cs.ids[0], cs.ids[1])  # a sum of two: float64, and so is the whole stack
    tensors, meta = cs.state()
    assert tensors["cluster_sums"].dtype == torch.float64
    back.load_state(tensors, meta)
    assert torch.equal(back.units(back.ids), cs.units(cs.ids)) and back.objective() == cs.objective()


def test_count_sketch_preserves_cosines_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g, dtype=torch.float64)
    y = 0.6 * x + 0.8 * torch.randn(50_000, generator=g, dtype=torch.float64)
    cos = float(x @ y / x.norm() / y.norm())
    sx, sy = count_sketch(x, 1024, 7), count_sketch(y, 1024, 7)
    assert abs(float(sx @ sy / sx.norm() / sy.norm()) - cos) < 0.06
    assert torch.equal(count_sketch(x, 1024, 7), sx) and not torch.equal(count_sketch(x, 1024, 8), sx)


def test_projection_is_client_side_and_small():
    ex = SequentialExecutor(FED, MODEL)
    full = ex.execute([Represent(0, W0, kind="gradient", anchor_model="train")])[0].psi
    small = ex.execute([Represent(0, W0, kind="gradient", anchor_model="train", dim=256)])[0].psi
    assert full.numel() == MODEL.n_params and small.numel() == 256
    assert float(small.norm()) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.long
def test_server_memory_for_representations_is_flat_in_n():
    """N = 10,000 clients with 64-dim representations from 4 groups, 1% sampled per round: the
    server holds one sum per cluster, not one vector per client."""
    n, dim = 10_000, 64
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, dim, generator=g)
    cs = ClusterSet(n)
    rng = np.random.default_rng(0)
    order = rng.permutation(n)
    for r in range(0, n, 100):  # 1% of the clients arrive per round
        batch = order[r : r + 100]
        new = [cs.add(int(i), centers[i % 4] + 0.5 * torch.randn(dim, generator=g)) for i in batch]
        cs.merge_greedy(new, 0.5)
        held = sum(t.numel() for t in cs.sums_.values())
        assert len(cs) == 4 and held == 4 * dim
    assert (cs.labels_ >= 0).all()
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(np.arange(n) % 4, cs.labels_) == 1.0


def test_tau_helper_finds_the_gap():
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(4, 32, generator=g)
    reps = torch.stack([centers[i % 4] + 0.8 * torch.randn(32, generator=g) for i in range(40)])
    tau = suggest_tau(reps)
    cs = ClusterSet(40)
    cs.merge_greedy([cs.add(i, r) for i, r in enumerate(reps)], tau)
    assert len(cs) == 4, tau


def test_new_clients_join_their_group():
    alg = StoCFL(StoCFLParams(), CTX)
    ex = SequentialExecutor(FED, MODEL)
    train = [i for i in range(24) if i % 6]
    held = [i for i in range(24) if i % 6 == 0]
    for t in range(1, 6):
        alg.round(t, train, ex.execute)
    labels = alg.cluster_labels()
    placed = alg.place_new(held, ex.execute)
    for p in placed:
        same_group = [i for i in train if FED.groups[i] == FED.groups[p.client]]
        assert p.cluster == labels[same_group[0]] and not p.opened_new
        assert p.weights is alg.theta[p.cluster]
    assert (alg.cluster_labels() == labels).all(), "placing new clients after training must not change the partition"


@pytest.mark.parametrize("kind", ["gradient", "update"])
def test_linear_anchor_fast_path_equals_autograd(kind):
    from stocfl.client.models import linear_anchor_weights, linear_model
    from stocfl.client.training import LocalTraining, local_sgd

    lin = linear_model(FED.input_shape, 10)
    w = linear_anchor_weights(FED.input_shape, 10, 3)
    ex = SequentialExecutor(FED, MODEL)
    fast = ex.execute([Represent(4, w, kind=kind, anchor_model="linear", local=LocalTraining.sgd(3, 7, 0.1), seed=11)])[
        0
    ].psi
    x, y = FED.train_data(4)
    if kind == "gradient":
        wl = w.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(lin.forward(wl, x), y).backward()
        g = wl.grad
    else:
        g = w - local_sgd(lin, x, y, w, LocalTraining.sgd(3, 7, 0.1), 11)
    assert torch.allclose(fast, g / g.norm(), atol=1e-5)


def _plain_linear_softmax_grad(w, x, y, n_classes):
    """The closed form as written plainly: one-hot by indexing, the parts concatenated."""
    d = x.shape[1]
    weight, bias = w[: n_classes * d].view(n_classes, d), w[n_classes * d :]
    err = torch.softmax(x @ weight.T + bias, dim=1)
    err[torch.arange(len(y)), y] -= 1.0
    err /= len(y)
    return torch.cat([(err.T @ x).reshape(-1), err.sum(0)])


def _plain_linear_sgd(w, x, y, n_classes, local, seed):
    """local_sgd's plain-SGD steps with the plain closed form, one new gradient a step."""
    from stocfl.client.training import batch_plan

    w = w.clone()
    cd = n_classes * x.shape[1]
    for epoch in batch_plan(len(y), local.epochs, local.batch_size, seed):
        for idx in list(epoch) if epoch else [None]:
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])
            g = _plain_linear_softmax_grad(w, xb, yb, n_classes)
            w[:cd].add_(g[:cd], alpha=-local.optimizer.lr)
            w[cd:].add_(g[cd:], alpha=-local.optimizer.lr)
    return w


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    d=st.integers(1, 40),
    n_classes=st.integers(2, 12),
    epochs=st.integers(1, 3),
    batch=st.sampled_from([0, 1, 7, 50]),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.01, 1.0, 30.0]),
)
def test_the_linear_anchors_in_place_closed_form_equals_the_plain_one_bit_for_bit(
    n, d, n_classes, epochs, batch, seed, scale
):
    """Psi's linear anchor steps with its gradient written in place (one scatter for the
    one-hot, no concatenation): the same numbers as the plain formula, step after step."""
    from stocfl.algorithms.stocfl.representation import linear_softmax_grad
    from stocfl.client.models import linear_model
    from stocfl.client.training import local_sgd

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale
    y = torch.randint(0, n_classes, (n,), generator=g)
    w = torch.randn(n_classes * d + n_classes, generator=g) * 0.1
    assert torch.equal(linear_softmax_grad(w, x, y, n_classes), _plain_linear_softmax_grad(w, x, y, n_classes))
    local = LocalTraining.sgd(epochs, batch, 0.1)
    fast = local_sgd(linear_model((d,), n_classes), x, y, w, local, seed, grad=linear_softmax_grad)
    assert torch.equal(fast, _plain_linear_sgd(w, x, y, n_classes, local, seed))


@pytest.mark.parametrize(
    "scenario, per_client", [("rotated", 30), ("shifted", 30), ("hybrid", 30), ("pathological", 20)]
)
@pytest.mark.long
def test_groups_found_on_digits_with_defaults(tmp_path, scenario, per_client):
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    cfg = configure.load(
        REPO / "configs" / "default.toml",
        [f"scenario.name={scenario}", f"scenario.samples_per_client={per_client}", "run.eval_every=50"],
    )
    s = Experiment.create(cfg, tmp_path / scenario).run(progress=False)
    assert s["ari"] >= 0.99 and s["accuracy"] > s["global_accuracy"], s
    for name in ("accuracy.png", "similarity.png", "embedding.png", "clusters.csv"):
        assert (tmp_path / scenario / name).stat().st_size > 50


def _least_bridge(groups, leave_out, craft, limit=256, **check):
    """The least number of crafted Psi (sent together after the honest clients) that puts the
    two honest groups in one cluster (bisection; None: not within ``limit``). ``check``: the
    members' quorum (``quorum``, ``quorum_tau``)."""
    n = len(groups[0]) + len(groups[1])
    keep = leave_out > 0 or bool(check)
    honest = ClusterSet(n + limit, keep_vectors=keep)
    honest.merge_greedy(
        [honest.add(i, v) for i, v in enumerate(groups[0] + groups[1])], 0.5, leave_out=leave_out, **check
    )
    assert len(honest) == 2, "the honest clients form their two groups"

    def bridged(k):
        cs = ClusterSet(n + limit, keep_vectors=keep)
        cs.load_state(*honest.state())
        cs.merge_greedy([cs.add(n + j, craft) for j in range(k)], 0.5, leave_out=leave_out, **check)
        return len(set(cs.labels_[:n].tolist())) == 1

    if not bridged(limit):
        return None
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bridged(mid) else (mid, hi)
    assert not bridged(hi - 1)
    return hi


def test_merge_check_makes_bridging_two_groups_cost_more_crafted_representations():
    g = torch.Generator().manual_seed(0)
    e = torch.eye(40, dtype=torch.float64)
    groups = [[e[a] + 0.12 * torch.randn(40, generator=g, dtype=torch.float64) for _ in range(20)] for a in (0, 1)]
    units = [torch.stack(grp).sum(0) for grp in groups]
    units = [u / u.norm() for u in units]
    craft = (units[0] + units[1]) / (units[0] + units[1]).norm()  # an attacker who knows both centroids
    plain = _least_bridge(groups, 0.0, craft)
    checked = _least_bridge(groups, 0.2, craft)
    assert plain is not None and checked is not None and checked > plain + 4, (plain, checked)


def test_members_quorum_keeps_colluders_fewer_than_a_group_from_bridging_it():
    """Crafted Psi that join group A cannot carry A into B while they are not a majority of A's
    members: A's honest members do not point at B (issue 70, finding 8)."""
    g = torch.Generator().manual_seed(0)
    e = torch.eye(40, dtype=torch.float64)
    directions = [e[0], 0.3 * e[0] + 0.91**0.5 * e[1]]  # two groups of 20 at cosine 0.3, below tau 0.5
    groups = [[d + 0.03 * torch.randn(40, generator=g, dtype=torch.float64) for _ in range(20)] for d in directions]
    units = [torch.stack(grp).sum(0) for grp in groups]
    units = [u / u.norm() for u in units]
    craft = (units[0] + units[1]) / (units[0] + units[1]).norm()
    plain = _least_bridge(groups, 0.0, craft)
    quorum = _least_bridge(groups, 0.0, craft, quorum=0.5, quorum_tau=0.35)
    assert plain is not None and plain <= 12 and (quorum is None or quorum > 20), (plain, quorum)


@pytest.mark.parametrize("check", [{"leave_out": 0.2}, {"quorum": 0.5}], ids=["leave_out", "quorum"])
def test_merge_check_runs_in_stocfl_checkpoints_and_logs_refusals(check):
    alg = _run(StoCFL(StoCFLParams(tau=0.3, **check), CTX))
    tensors, meta = alg.encode_state()
    clusters = meta["fields"]["clusters"]["meta"]
    assert (
        tensors["clusters/member_vectors"].shape[0]
        == len(clusters["vector_clients"])
        == int((alg.cluster_labels() >= 0).sum())
    )
    fresh = StoCFL(StoCFLParams(tau=0.3, **check), CTX)
    fresh.decode_state(tensors, meta)
    ex = SequentialExecutor(FED, MODEL)
    a, b = alg.round(4, [4, 6, 8, 10], ex.execute), fresh.round(4, [4, 6, 8, 10], ex.execute)
    assert a == b and "merges_refused" in a
    assert np.array_equal(fresh.cluster_labels(), alg.cluster_labels()) and torch.equal(fresh.w, alg.w)
