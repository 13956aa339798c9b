"""SR-FCA against plain references: the pivot clustering against its definition on generated
graphs, the cross-entropy distances against losses computed here; and the method in a run
(INIT once, REFINE every refine_rounds rounds for refine_steps steps, merges that keep every
member)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.algorithms.srfca import pivot_clusters
from stocfl.client.tasks import Evaluate
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 14), t=st.integers(0, 3))
def test_pivot_clustering_takes_each_pivots_free_neighbours(data, n, t):
    upper = np.triu(np.array(data.draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))).reshape(n, n), 1)
    linked = upper | upper.T
    order = np.array(data.draw(st.permutations(range(n))))
    got = pivot_clusters(linked, order, t)
    # the definition, step by step
    left, want = set(range(n)), []
    for p in order:
        if p in left:
            c = {int(p)} | {j for j in left if linked[p, j]}
            left -= c
            want.append(sorted(c))
    assert got == [c for c in want if len(c) > t]
    seen = [i for c in got for i in c]
    assert len(seen) == len(set(seen)), "a client in one cluster at most"


SETTING = [
    "algorithm.name=srfca",
    "algorithm.init_epochs=2",
    "algorithm.refine_rounds=2",
    "algorithm.size_threshold=0",
    "run.sample_rate=0.5",
    "scenario.n_clients=16",
]


def test_init_once_then_refine_steps_every_refine_rounds():
    exp = Experiment.create(configure.load(overrides=[*SETTING, "run.rounds=8"]), None)
    exp.run(progress=False)
    rows = exp.rows
    assert rows[0]["clustered_clients"] <= 16 and "srfca_lambda" in rows[0]
    assert [r["round"] for r in rows if "refine_step" in r] == [3, 5], "two steps, two rounds apart"
    s = exp.algorithm.state
    labels = exp.algorithm.cluster_labels()
    assert set(labels[labels >= 0]) == set(s.models)
    assert all(i in s.local for i in range(16)), "every client trained its own model in INIT"


def test_the_cross_entropy_distances_are_the_mean_of_the_two_cross_losses():
    exp = Experiment.create(configure.load(overrides=[*SETTING, "run.rounds=1"]), None)
    exp.run(progress=False)
    alg, ask = exp.algorithm, exp.ask
    who = [0, 5, 9]
    d = alg.client_distances(who)
    for a, i in enumerate(who):
        for b, j in enumerate(who):
            (li,) = ask([Evaluate(i, alg.state.local.get(j), "train")])
            (lj,) = ask([Evaluate(j, alg.state.local.get(i), "train")])
            assert abs(d[a, b] - (li.loss + lj.loss) / 2) < 1e-5
    euclid = Experiment.create(configure.load(overrides=[*SETTING, "run.rounds=1", "algorithm.metric=euclidean"]), None)
    euclid.run(progress=False)
    w = [euclid.algorithm.state.local.get(i).double() for i in who]
    want = torch.tensor([[float((u - v).norm()) for v in w] for u in w])
    assert torch.allclose(torch.from_numpy(euclid.algorithm.client_distances(who)), want.double(), atol=1e-6)


def test_a_merge_keeps_every_member_and_weights_models_by_members():
    exp = Experiment.create(configure.load(overrides=[*SETTING, "run.rounds=1", "algorithm.metric=euclidean"]), None)
    alg = exp.algorithm
    s = alg.state
    a, b, c = (torch.full_like(s.w, v) for v in (1.0, 2.0, 50.0))
    s.models = {0: a, 3: b, 7: c}
    s.labels[:] = -1
    s.labels[[0, 1, 2]] = 0
    s.labels[[3]] = 3
    s.labels[[4, 5]] = 7
    s.threshold = float((a - b).norm()) * 1.01  # 0 and 3 are within lambda, 7 is far
    assert alg.merge(exp.ask) == 1
    assert sorted(s.models) == [0, 7]
    assert torch.allclose(s.models[0], (3 * a + 1 * b) / 4)
    assert s.labels[:6].tolist() == [0, 0, 0, 0, 7, 7] and (s.labels[6:] == -1).all()


def test_a_client_whose_data_changed_trains_its_own_model_anew():
    sets = [*SETTING, "run.rounds=6", "scenario.drift=sudden", "scenario.drift_rounds=[4]"]
    exp = Experiment.create(configure.load(overrides=sets), None)
    s = exp.algorithm.state
    exp.run(progress=False, stop_after=3)
    before = {i: s.local.get(i).clone() for i in range(16)}
    exp.run(progress=False)
    moved = exp.rows[3]["drifted"]
    assert moved and exp.rows[3]["own_models_retrained"] == len(moved)
    for i in range(16):
        assert torch.equal(s.local.get(i), before[i]) == (i not in moved)
    alg, ask = exp.algorithm, exp.ask
    i, j = moved[0], next(k for k in range(16) if k not in moved)
    (li,) = ask([Evaluate(i, s.local.get(j), "train")])  # j's model on i's new data
    (lj,) = ask([Evaluate(j, s.local.get(i), "train")])  # i's new model on j's data
    assert abs(alg.client_distances([i, j])[0, 1] - (li.loss + lj.loss) / 2) < 1e-5
