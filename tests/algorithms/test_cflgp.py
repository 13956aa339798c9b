"""CFL-GP against plain references: the renaming of a partition against a search over every
permutation, the running mean of a profile against the mean of the updates, the spectral
step and the estimate of K on planted clusters; and the method in a run (profiles, partitions
every P rounds up to the termination round, the warm-up that settles K)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score

from stocfl.algorithms.cflgp import estimate_k, match, spectral_partition
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


@settings(max_examples=80, deadline=None)
@given(data=st.data(), k=st.integers(1, 5), n=st.integers(1, 30))
def test_the_renaming_agrees_with_the_old_partition_as_much_as_any_permutation(data, k, n):
    new = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n)))
    old = np.array(data.draw(st.lists(st.integers(-1, k - 1), min_size=n, max_size=n)))
    mine = match(new, old, k)
    best = max(int(((np.array(p)[new]) == old).sum()) for p in itertools.permutations(range(k)))
    assert int((mine == old).sum()) == best
    assert adjusted_rand_score(new, mine) == 1.0  # only renamed


def planted(n_per=10, k=4, d=30, noise=0.05, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d))
    cols = np.concatenate([c + noise * rng.normal(size=(n_per, d)) for c in centres]).T
    return cols, np.repeat(np.arange(k), n_per)


def test_the_spectral_step_and_the_estimate_of_k_find_planted_clusters():
    for k in (2, 3, 5):
        g, truth = planted(k=k)
        labels, basis, centres = spectral_partition(g, k, 0)
        assert adjusted_rand_score(truth, labels) == 1.0
        assert basis.shape == (g.shape[0], k) and centres.shape == (k, k)
        assert estimate_k(g, 8, 0) == k


def test_a_run_profiles_clients_partitions_every_period_and_stops():
    sets = ["algorithm.name=cflgp", "algorithm.n_models=2", "algorithm.period=2", "algorithm.stop_after=5"]
    exp = Experiment.create(configure.load(overrides=[*sets, "run.rounds=8", "run.sample_rate=0.25"]), None)
    seen, fresh = {}, {}
    ask, play = exp.ask, exp.algorithm.round

    def round_(t, sampled, _ask):
        fresh[t] = sum(int(exp.algorithm.state.seen[i] == 0) for i in sampled)

        def spy(tasks):
            seen.setdefault(t, []).extend(tasks)
            return ask(tasks)

        return play(t, sampled, spy)

    exp.algorithm.round = round_
    exp.run(progress=False)
    parts = [r["round"] for r in exp.rows if "partitioned" in r]
    assert parts == [1, 3, 5], "every P = 2 rounds, none after stop_after = 5"
    s = exp.algorithm.state
    assert (s.seen >= 1).sum() == (exp.algorithm.cluster_labels() >= 0).sum()
    for t in range(1, 9):  # at a partition every sampled client trains both models; else its own,
        assert len(seen[t]) == (2 * 10 if t in parts else 10 + fresh[t])  # and both if it has no profile


def test_a_profile_is_the_running_mean_of_a_clients_updates():
    exp = Experiment.create(configure.load(overrides=["algorithm.name=cflgp", "algorithm.n_models=2"]), None)
    alg = exp.algorithm
    g = torch.Generator().manual_seed(0)
    ups = [[torch.randn(alg.d, generator=g) for _ in range(2)] for _ in range(4)]
    for u in ups:
        alg.update_profile(3, u)
    want = torch.stack([torch.cat(u) for u in ups]).mean(0)
    assert torch.allclose(alg.state.profiles[3], want, atol=1e-6) and alg.state.seen[3] == 4


def test_the_warm_up_settles_k_and_starts_the_profiles_anew():
    sets = ["algorithm.name=cflgp", "algorithm.warmup_rounds=2", "algorithm.n_models=4", "run.rounds=4"]
    exp = Experiment.create(configure.load(overrides=[*sets, "run.sample_rate=0.5"]), None)
    exp.run(progress=False)
    row = exp.rows[2]
    k = row["cflgp_k"]
    assert 1 <= k <= 4 and len(exp.algorithm.state.models) == k
    assert exp.algorithm.state.profiles.shape[1] == k * exp.algorithm.d
    assert "partitioned" in row and all("partitioned" not in r for r in exp.rows[:2])
