"""FLUX against plain references: the descriptor against moments computed here from the
latents, the latent against the model's own layers, the scaler against scikit-learn's
MinMaxScaler block by block, the knee against hand-made curves; the method on rotated digits
(clusters once, places every other client, places clients without labels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score
from sklearn.preprocessing import MinMaxScaler

from stocfl.algorithms.flux import cluster, fit_scaler, knee, scale
from stocfl.client.descriptor import MISSING, Describe, Described, check_described, describe, latent, projection
from stocfl.client.models import make_model
from stocfl.client.tasks import BadResult, ClientData
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


@pytest.mark.parametrize(
    "name, shape",
    [("mlp", (1, 28, 28)), ("cnn28", (1, 28, 28)), ("cifar_cnn", (3, 32, 32)), ("cifar_lenet", (3, 32, 32))],
)
def test_the_latent_is_the_input_of_the_first_fully_connected_layer(name, shape):
    model, w = make_model(name, shape, 10, 32, 0)
    x = torch.rand((5, *shape), generator=torch.Generator().manual_seed(1))
    module = model.module.to_empty(device="cpu")
    module.load_state_dict(model.state_dict(w))
    layers = list(module.children())
    first = next(k for k, m in enumerate(layers) if isinstance(m, torch.nn.Linear))
    want = torch.nn.Sequential(*layers[:first])(x).reshape(5, -1)
    assert torch.allclose(latent(model, w, x), want, atol=1e-6)


def test_the_projection_is_the_principal_axes_of_uniform_points_signed_alike():
    axes, center = projection(30, 4, 1)
    g = torch.Generator().manual_seed(1)
    pts = torch.rand((200, 30), generator=g, dtype=torch.float64)
    cov = (pts - pts.mean(0)).T @ (pts - pts.mean(0))
    top = torch.linalg.eigh(cov).eigenvectors[:, -4:].flip(1).T  # the 4 largest, first first
    assert torch.allclose((axes @ top.T).abs(), torch.eye(4, dtype=torch.float64), atol=1e-8)
    assert torch.allclose(center, pts.mean(0))
    assert (axes.gather(1, axes.abs().argmax(1, keepdim=True)) > 0).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 6), labelled=st.booleans(), seed=st.integers(0, 999))
def test_the_descriptor_is_the_moments_of_the_projected_latents(n, k, labelled, seed):
    model, w = make_model("mlp", (1, 4, 4), 3, 8, 0)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand((n, 1, 4, 4), generator=g), torch.randint(0, 3, (n,), generator=g)
    c = ClientData(0, x, y, x[:0], y[:0], model, 3)
    r = describe(c, Describe(0, w, k, 1, 3, labelled))
    z = x.reshape(n, -1).double().numpy()  # an MLP's latent: its flattened input
    axes, center = (t.numpy() for t in projection(16, k, 1))
    p = (z - center) @ axes.T
    want = [p.mean(0), p.std(0)]
    if labelled:
        per = [(p[y.numpy() == c].mean(0), p[y.numpy() == c].std(0)) if (y == c).sum() > 1 else None for c in range(3)]
        want += [m[0] if m else np.full(k, MISSING) for m in per] + [m[1] if m else np.full(k, MISSING) for m in per]
    assert np.allclose(r.descriptor.numpy(), np.concatenate(want), atol=1e-5)
    assert r.n_samples == n
    check_described(Describe(0, w, k, 1, 3, labelled), r, n, 0)


def test_a_bad_descriptor_is_refused():
    t = Describe(0, torch.zeros(3), 2, 1, 2, True)
    good = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, -1.0, -1.0, 0.1, 0.1, -1.0, -1.0])
    assert check_described(t, Described(good, 7), 7, 0).n_samples == 7
    bad = {
        "shape": Described(good[:-1], 7),
        "NaN": Described(good * float("nan"), 7),
        "negative deviation": Described(torch.cat([good[:2], -good[2:4], good[4:]]), 7),
        "missing in one half": Described(torch.cat([good[:10], torch.tensor([0.5, 0.5])]), 7),
        "count": Described(good, 8),
    }
    for why, r in bad.items():
        with pytest.raises(BadResult):
            check_described(t, r, 7, 0)
        assert why


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    blocks=st.integers(1, 5),
    k=st.integers(1, 4),
    seed=st.integers(0, 999),
    flat=st.booleans(),
)
def test_the_scaler_is_minmax_over_each_block_flattened(n, blocks, k, seed, flat):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, blocks * k)) * rng.uniform(0.1, 10, size=blocks * k)
    if flat:
        x[:, :k] = 3.0  # a block of one value: scaled by 1
    lo, span = fit_scaler(x, k)
    mine = scale(x, lo, span, k)
    for b in range(blocks):  # the authors' scaler: one MinMaxScaler per block, its entries as one feature
        part = x[:, b * k : (b + 1) * k]
        want = MinMaxScaler().fit(part.reshape(-1, 1)).transform(part.reshape(-1, 1)).reshape(part.shape)
        assert np.allclose(mine[:, b * k : (b + 1) * k], want, atol=1e-12)
    assert np.allclose(scale(x[:, : 2 * k], lo, span, k), mine[:, : 2 * k])  # the first blocks alone


@pytest.mark.parametrize("flat, rise", [(10, 5), (30, 3), (6, 12)])
def test_the_knee_of_a_flat_then_rising_curve_is_where_it_bends(flat, rise):
    y = np.concatenate([np.linspace(0, 0.1, flat), 0.1 + np.cumsum(np.full(rise, 1.0))])
    assert abs(knee(y) - (flat - 1)) <= 1
    assert knee(np.linspace(0, 1, 20)) is None  # a straight line has no knee
    assert knee(np.ones(5)) is None and knee(np.array([0.0, 1.0])) is None


def test_dbscan_at_the_knee_finds_separated_groups_and_keeps_an_outlier_alone():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [5, 0], [0, 5]], dtype=float)
    x = np.concatenate([c + rng.normal(scale=0.1, size=(8, 2)) for c in centres] + [np.array([[20.0, 20.0]])])
    labels, eps, noise = cluster(x, 1.0, 2)
    truth = np.repeat([0, 1, 2, 3], [8, 8, 8, 1])
    assert adjusted_rand_score(truth, labels) == 1.0 and noise == 1 and 0 < eps < 5
    assert labels[0] == 0 and cluster(x[:1], 1.0, 2)[0].tolist() == [0]


SETTING = ["algorithm.name=flux", "algorithm.warmup_rounds=1", "run.sample_rate=0.5", "scenario.samples_per_client=60"]


def test_flux_clusters_once_and_places_every_other_client_from_its_descriptor():
    exp = Experiment.create(configure.load(overrides=[*SETTING, "run.rounds=4", "scenario.n_clients=24"]), None)
    exp.run(progress=False)
    row = exp.rows[1]
    assert row["clustered_clients"] == 12 and row["placed_by_descriptor"] == 12
    assert row["placed"] == 24 and row["coverage"] == 1.0
    assert all("clustered" not in r for r in exp.rows[2:])  # once
    labels = exp.algorithm.cluster_labels()
    assert set(labels) == set(exp.algorithm.state.models)


def test_a_new_client_without_labels_is_placed_from_the_moments_of_its_latents_only(tmp_path):
    sets = [*SETTING, "run.rounds=3", "scenario.n_clients=24", "scenario.holdout=0.25"]
    exp = Experiment.create(configure.load(overrides=sets), None)
    exp.run(progress=False)
    seen = []
    ask = exp.ask

    def spy(tasks):
        seen.extend(t for t in tasks if isinstance(t, Describe))
        return ask(tasks)

    placed = exp.algorithm.place_unlabeled(exp.fed.heldout_clients, spy)
    assert [p.client for p in placed] == exp.fed.heldout_clients
    assert all(not t.labelled for t in seen) and len(seen) == 8
    assert all(p.cluster in exp.algorithm.state.models for p in placed)
    # nearest centroid over the first 2k scaled entries, computed here
    alg = exp.algorithm
    x = scale(torch.stack([r.descriptor.double() for r in ask(seen)]).numpy(), alg.state.lo, alg.state.span, alg.k)
    ids = sorted(alg.state.centroids)
    cents = np.stack([alg.state.centroids[c][: 2 * alg.k].numpy() for c in ids])
    want = [ids[int(np.argmin(((cents - row) ** 2).sum(1)))] for row in x]
    assert [p.cluster for p in placed] == want


def test_held_out_clients_are_placed_with_and_without_labels_and_assign_can_do_either(tmp_path, capsys):
    import json

    from stocfl.cli import main

    out = tmp_path / "r"
    sets = [*SETTING, "run.rounds=3", "scenario.n_clients=24", "scenario.holdout=0.25"]
    assert main(["run", "--quiet", "--out", str(out), *[a for s in sets for a in ("--set", s)]]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout"]["clients"] == summary["heldout_unlabeled"]["clients"] == 8
    assert "label-free" in summary["heldout_unlabeled"]["placement"]
    capsys.readouterr()
    assert main(["assign", str(out), "--unlabeled"]) == 0
    said = json.loads(capsys.readouterr().out.splitlines()[0])
    assert said == summary["heldout_unlabeled"]
    other = tmp_path / "s"
    assert main(["run", "--quiet", "--out", str(other), "--set", "run.rounds=2", "--set", "scenario.holdout=0.25"]) == 0
    capsys.readouterr()
    assert main(["assign", str(other), "--unlabeled"]) == 2
    err = capsys.readouterr().err.strip()
    assert "without labels only flux can place one" in err and len(err.splitlines()) == 1
