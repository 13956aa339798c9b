"""Server logic of the baselines, fed with crafted client replies (no data needed), plus
checks on real runs."""

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from stocfl.algorithms import Context
from stocfl.algorithms.cfl import CFL, CFLParams
from stocfl.algorithms.ditto import Ditto, DittoParams
from stocfl.algorithms.flhc import DEFAULT_THRESHOLD, FLHC, FLHCParams
from stocfl.algorithms.ifca import IFCA, IFCAParams
from stocfl.client.tasks import Evaluate, Evaluated, Train, Trained, out_of_bound
from stocfl.client.training import LocalTraining
from stocfl.storage.store import ClientStore

P = 6
DIRS = torch.eye(P)[:2]
GROUP_DIR = [DIRS[0], -DIRS[0], DIRS[1], -DIRS[1]]  # four groups whose updates cancel on average


def ctx(n, w0=None):
    return Context(
        n,
        torch.zeros(P) if w0 is None else w0,
        local=LocalTraining.sgd(1, 0, 0.1),
        seed=0,
        init_model=lambda s: torch.full((P,), float(s)),
        last_layer=2,
    )


def fake_run(groups, scale=1.0, noise=0.05):
    """Client i returns its start weights plus its group's direction (and a little noise)."""
    g = torch.Generator().manual_seed(0)

    def run(tasks):
        out = []
        for t in tasks:
            assert isinstance(t, Train)
            d = GROUP_DIR[groups[t.client]] * scale + noise * torch.randn(P, generator=g)
            out.append(Trained(t.weights + d, 10))
        return out

    return run


def test_cfl_splits_four_groups_at_any_depth_with_global_ids():
    rng = np.random.default_rng(1)
    groups = rng.permutation(np.repeat(np.arange(4), 5))  # shuffled: sub-matrix rows != client ids
    alg = CFL(CFLParams(eps1=0.8, eps2=0.5, warmup=0), ctx(20))
    run = fake_run(groups)
    for t in range(1, 4):
        diag = alg.round(t, list(range(20)), run)
    labels = alg.cluster_labels()
    assert len(alg.models) == 4 and adjusted_rand_score(groups, labels) == 1.0
    assert sorted(np.bincount(labels).tolist()) == [5, 5, 5, 5]  # every client in exactly one cluster
    assert {"cluster", "mean_norm", "max_norm"} <= set(diag["cfl_norms"][0])


def test_cfl_mean_norm_is_the_norm_of_the_mean_update():
    groups = np.array([0, 1, 0, 1])  # opposite updates: mean 0, every norm 1
    alg = CFL(CFLParams(eps1=0.1, eps2=10.0, warmup=0), ctx(4))
    diag = alg.round(1, [0, 1, 2, 3], fake_run(groups, noise=0.0))
    (norms,) = diag["cfl_norms"]
    assert norms["mean_norm"] == pytest.approx(0.0, abs=1e-6) and norms["max_norm"] == pytest.approx(1.0)
    assert len(alg.models) == 1, "max_norm 1 < eps2 10: no split"


def test_cfl_respects_warmup_and_needs_more_than_two_fresh_clients():
    groups = np.array([0, 1, 0, 1])
    alg = CFL(CFLParams(eps1=0.8, eps2=0.5, warmup=2), ctx(4))
    run = fake_run(groups)
    alg.round(1, [0, 1, 2, 3], run)
    alg.round(2, [0, 1, 2, 3], run)
    assert len(alg.models) == 1
    alg.round(3, [0, 1], run)  # only two fresh updates
    assert len(alg.models) == 1
    alg.round(4, [0, 1, 2, 3], run)
    assert len(alg.models) == 2 and adjusted_rand_score(groups, alg.cluster_labels()) == 1.0


def test_cfl_cluster_warmup_holds_the_halves_of_a_split_that_many_rounds():
    rng = np.random.default_rng(4)
    groups = rng.permutation(np.repeat(np.arange(4), 5))
    run = fake_run(groups)
    counts = {}
    for rest in (0, 3):
        alg = CFL(CFLParams(eps1=0.8, eps2=0.5, warmup=1, cluster_warmup=rest), ctx(20))
        counts[rest] = [len(alg.models)]
        for t in range(1, 10):
            alg.round(t, list(range(20)), run)
            counts[rest].append(len(alg.models))
        assert adjusted_rand_score(groups, alg.cluster_labels()) == 1.0
    # the first split after the warm-up (round 2) in both; without a rest the halves split at
    # once (round 3), with a rest of 3 rounds at round 2 + 3 + 1 = 6
    assert counts[0][:4] == [1, 1, 2, 4] and counts[0][-1] == 4
    assert counts[3][:6] == [1, 1, 2, 2, 2, 2] and counts[3][6:] == [4, 4, 4, 4]


@pytest.mark.parametrize("metric, linkage", [("l1", "complete"), ("l2", "ward"), ("cosine", "average")])
def test_flhc_clusters_updates_not_weights(metric, linkage):
    groups = np.random.default_rng(2).permutation(np.repeat(np.arange(4), 6))
    # weights far from the origin: cosines of WEIGHTS are all ~1, only the updates tell groups apart
    alg = FLHC(
        FLHCParams(warmup_rounds=1, metric=metric, linkage=linkage, n_clusters=4), ctx(24, torch.full((P,), 50.0))
    )
    run = fake_run(groups)
    alg.round(1, [0, 1, 2], run)
    diag = alg.round(2, [0, 1, 2], run)
    assert diag["clustered"] == 4 and diag["clustered_clients"] == 24 and len(diag["flhc_heights"]) == 10
    assert adjusted_rand_score(groups, alg.cluster_labels()) == 1.0
    for k in alg.models:
        assert torch.equal(alg.models[k], alg.w)


def test_flhc_clusters_can_start_from_their_members_clustering_step_models():
    groups = np.random.default_rng(3).permutation(np.repeat(np.arange(4), 5))
    sizes = np.arange(1, 21) * 7  # unequal: the start is each cluster's weighted mean, not a plain one
    step = {}

    def run(tasks):
        out = []
        for t in tasks:
            step[t.client] = t.weights + GROUP_DIR[groups[t.client]] + 0.01 * t.client
            out.append(Trained(step[t.client], int(sizes[t.client])))
        return out

    alg = FLHC(FLHCParams(warmup_rounds=1, n_clusters=4, cluster_start="updates"), ctx(20))
    alg.round(1, [0, 1], run)
    alg.round(2, [0], run)
    labels = alg.cluster_labels()
    assert adjusted_rand_score(groups, labels) == 1.0
    for k, model in alg.models.items():
        members = [i for i in range(20) if labels[i] == k]
        expected = sum(float(sizes[i]) * step[i] for i in members) / float(sum(sizes[i] for i in members))
        torch.testing.assert_close(model, expected)
        assert not torch.equal(model, alg.w)


def test_flhc_distance_threshold_and_parameter_rules():
    with pytest.raises(ValueError, match="not both"):
        FLHCParams(distance_threshold=1.0, n_clusters=4)
    # no number of clusters is handed to it: by default the tree is cut at the metric's distance
    for metric in ("l1", "l2", "cosine"):
        p = FLHCParams(metric=metric)
        assert p.n_clusters == 0 and p.distance_threshold == DEFAULT_THRESHOLD[metric] > 0
    assert FLHCParams(n_clusters=3).distance_threshold == 0
    with pytest.raises(ValueError, match="ward"):
        FLHCParams(metric="l1", linkage="ward")
    groups = np.repeat(np.arange(4), 3)
    alg = FLHC(
        FLHCParams(warmup_rounds=0, n_clusters=0, distance_threshold=0.5, metric="l2", linkage="complete"), ctx(12)
    )
    alg.round(1, [0], fake_run(groups, noise=0.01))
    assert len(alg.models) == 4


def ifca_run(best_of):
    """Train loss of model m on client i: 0 for m == best_of[i], 1 otherwise; training adds 1."""

    def run(tasks):
        out = []
        for t in tasks:
            if isinstance(t, Evaluate):
                assert t.split == "train", "IFCA must choose on train data"
                m = int(t.weights[0].item())  # models are initialised to constant seed+1+m
                out.append(Evaluated(0.0 if m - 1 == best_of[t.client] else 1.0, 1, 1))
            else:
                out.append(Trained(t.weights + torch.cat([torch.zeros(1), torch.ones(P - 1)]), 10))
        return out

    return run


def test_ifca_chooses_by_train_loss_and_unchosen_models_keep_weights():
    best_of = {0: 0, 1: 2, 2: 0, 3: 2}
    alg = IFCA(IFCAParams(n_models=4), ctx(4))
    before = [w.clone() for w in alg.models]
    diag = alg.round(1, [0, 1, 2, 3], ifca_run(best_of))
    assert diag["choices"] == [2, 0, 2, 0]
    assert diag["model_loss"] == [0.0, None, 0.0, None]  # the chosen models' loss on their clients
    assert alg.cluster_labels().tolist() == [0, 2, 0, 2]
    assert torch.equal(alg.models[1], before[1]) and torch.equal(alg.models[3], before[3])
    assert not torch.equal(alg.models[0], before[0])
    assert len({float(w[0]) for w in before}) == 4, "models are initialised independently"


def test_ifca_weight_sharing_shares_all_but_the_output_layer():
    best_of = {0: 0, 1: 1}
    alg = IFCA(IFCAParams(n_models=2, share_layers=True), ctx(2))

    def run(tasks):
        out = []
        for t in tasks:
            if isinstance(t, Evaluate):
                out.append(Evaluated(0.0 if int(t.weights[0].item()) - 1 == best_of[t.client] else 1.0, 1, 1))
            else:
                out.append(Trained(torch.full((P,), 10.0 * (t.client + 1)), 10))
        return out

    alg.round(1, [0, 1], run)
    a, b = alg.models
    assert torch.equal(a[:4], b[:4]) and torch.allclose(a[:4], torch.full((4,), 15.0))
    assert torch.equal(a[4:], torch.full((2,), 10.0)) and torch.equal(b[4:], torch.full((2,), 20.0))


def test_ditto_personal_models_start_from_w_and_are_pulled_toward_it():
    seen = []

    def run(tasks):
        seen.extend(tasks)
        return [Trained(t.weights + 1.0, 10) for t in tasks]

    alg = Ditto(DittoParams(lam=0.3), ctx(3))
    alg.round(1, [0, 1], run)
    glob, pers = seen[0], seen[1]
    assert pers.prox_weight == 0.3 and torch.equal(pers.prox_center, glob.weights)
    assert torch.equal(pers.weights, glob.weights) and pers.seed == glob.seed
    assert torch.equal(alg.personal.get(0), torch.ones(P))
    models = alg.client_models([0, 2], run)
    assert torch.equal(models[0], torch.ones(P)) and models[1] is alg.w


@pytest.mark.parametrize("ram", [0, 2**20])
def test_client_store_undo_restores_rows_the_checkpoint_did_not_see(ram, tmp_path):
    s = ClientStore(5, P, tmp_path, "x", ram)
    s.write({1: torch.ones(P), 3: torch.full((P,), 3.0)})
    tensors, seen = s.state()  # on disk, the checkpoint's part is the rows' CRCs
    s.write({1: torch.full((P,), 7.0), 4: torch.full((P,), 4.0)})  # killed before the checkpoint
    reopened = ClientStore(5, P, tmp_path, "x", ram)
    reopened.load_state(tensors, seen)
    assert torch.equal(reopened.get(1), torch.ones(P)) and 4 not in reopened and 3 in reopened
    assert reopened.version == 1


def test_fesem_assigns_trains_then_updates_centres_from_fresh_models():
    """Group g of client i = i % 2 pulls along +e0 (g = 0) or -e0 (g = 1), 10 per training."""
    from stocfl.algorithms.fesem import FeSEM, FeSEMParams
    from stocfl.errors import UserError

    step = [torch.eye(P)[0] * 10, -torch.eye(P)[0] * 10]
    seen = []

    def run(tasks):
        seen.extend(tasks)
        out = []
        for t in tasks:
            g = t.client % 2
            if isinstance(t, Evaluate):
                assert t.split == "train"
                out.append(Evaluated(float((t.weights - 10 * step[g]).norm()), 1, 1))
            else:
                out.append(Trained(t.weights + step[g], 10))
        return out

    c = Context(8, torch.zeros(P), local=LocalTraining.sgd(1, 0, 0.1), seed=0, sample_size=4)
    alg = FeSEM(FeSEMParams(n_centers=2), c)
    alg.round(1, [0, 1, 2, 3], run)
    k = {g: int(alg.labels[g]) for g in (0, 1)}
    assert k[0] != k[1] and alg.labels[:4].tolist() == [k[0], k[1], k[0], k[1]]
    # K-means of the first models (+-10 e0), one local step from the centres (+-20 e0), and the
    # centres are the mean of those FRESH models
    assert torch.allclose(alg.centers[k[0]], 2 * step[0]) and torch.allclose(alg.centers[k[1]], 2 * step[1])
    seen.clear()
    alg.round(2, [0, 5], run)  # client 0 was seen (stored +20 e0); client 5 is new, of group 1
    assert sorted(t.client for t in seen if isinstance(t, Evaluate)) == [5, 5], "a new client is placed by train loss"
    assert alg.labels[5] == k[1]
    # the centres moved to this round's fresh models only: clients 1-3's stored models do not count
    assert torch.allclose(alg.centers[k[0]], 3 * step[0]) and torch.allclose(alg.centers[k[1]], 3 * step[1])
    with pytest.raises(UserError, match="n_centers"):
        FeSEM(FeSEMParams(n_centers=5), c)


def fake_gradients(groups, updates_agree=True):
    """Trained: everyone's update is the same direction (updates cannot tell groups apart);
    Gradient: client i's gradient at w is its group's direction, 2x its size (the paper's
    signal), checked to be asked at the cluster's updated model."""
    from stocfl.client.gradient import Gradient, Gradiented

    asked = []

    def run(tasks):
        out = []
        for t in tasks:
            if isinstance(t, Gradient):
                asked.append(t)
                out.append(Gradiented(2.0 * GROUP_DIR[groups[t.client]], 10))
            else:
                out.append(Trained(t.weights + DIRS[0], 10))
        return out

    return run, asked


def test_cfl_gradient_variant_splits_on_gradients_at_the_updated_model():
    groups = np.array([0, 1, 0, 1, 0, 1])
    run, asked = fake_gradients(groups)
    upd = CFL(CFLParams(eps1=100.0, eps2=0.5, warmup=0), ctx(6))
    upd.round(1, list(range(6)), run)  # identical updates: split arbitrarily, not by group
    grad = CFL(CFLParams(eps1=0.1, eps2=1.5, warmup=0, similarity="gradients"), ctx(6))
    diag = grad.round(1, list(range(6)), run)
    (norms,) = diag["cfl_norms"]
    assert norms["mean_norm"] == pytest.approx(0.0, abs=1e-6) and norms["max_norm"] == pytest.approx(2.0)
    assert adjusted_rand_score(groups, grad.cluster_labels()) == 1.0
    assert all(torch.equal(t.weights, DIRS[0]) for t in asked), "asked at w_0 + the mean update"


def test_the_gradient_query_equals_autograd_on_the_module_and_refuses_a_crafted_reply():
    import dataclasses

    from torch import nn

    from stocfl.client.gradient import Gradient, check_gradiented
    from stocfl.client.models import build_module, make_model
    from stocfl.client.tasks import BadResult
    from stocfl.data.datasets import load_dataset
    from stocfl.data.scenarios import build
    from stocfl.executors import SequentialExecutor

    fed = build("rotated", load_dataset("digits"), 8, 30, seed=0)
    model, w0 = make_model("auto", fed.input_shape, 10, 0, seed=0)
    (r,) = SequentialExecutor(fed, model).execute([Gradient(2, w0)])
    module = build_module("auto", fed.input_shape, 10, 0)
    torch.nn.utils.vector_to_parameters(w0.clone(), module.parameters())
    module.eval()
    x, y = fed.train_data(2)
    nn.functional.cross_entropy(module(x), y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    assert r.n_samples == 30 and torch.allclose(r.gradient, want, atol=1e-6)
    task = Gradient(2, w0)
    for bad, says in [
        (r.gradient[:-1], "gradient has shape"),
        (r.gradient * float("nan"), "NaN"),
    ]:
        with pytest.raises(BadResult, match=says):
            check_gradiented(task, dataclasses.replace(r, gradient=bad), 30, 0)
    # a gradient's size is bounded against the model and the round's others
    huge = dataclasses.replace(r, gradient=torch.full_like(r.gradient, 1e9))
    assert out_of_bound([task, task, task], [r, huge, r]).keys() == {1}
    assert "beyond 1e+06 x max(1" in out_of_bound([task], [huge])[0]
    with pytest.raises(BadResult, match="n_samples"):
        check_gradiented(task, dataclasses.replace(r, n_samples=31), 30, 0)
