"""Living federations: clients whose data drift (``[scenario]``'s drift keys,
:mod:`stocfl.data.drift`). Checked against the plain definitions (the latest change at or
before a round; a drifted client's data are its own samples under the new concept), through
real runs of every algorithm on every in-process engine, and across a stop and resume."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stocfl
from stocfl.algorithms import ALGORITHMS
from stocfl.algorithms.stocfl.clustering import ClusterSet
from stocfl.cli import main
from stocfl.data.drift import Drift
from stocfl.data.scenarios import SWAPS, build
from stocfl.errors import UserError
from stocfl.experiment import configure, metrics
from stocfl.experiment.build import build_federation
from stocfl.experiment.loop import Experiment
from stocfl.experiment.provenance import config_digest
from tests.helpers import watch
from tests.test_common import small_settings

SMALL = ["run.rounds=8", "run.sample_rate=0.25", "scenario.n_clients=24", "scenario.samples_per_client=20"]
SUDDEN = ["scenario.drift=sudden", "scenario.drift_rounds=[4]"]


def latest_concepts(start, changes, t):
    """The plain reading: each client's concept is that of its last change at or before t."""
    out = list(start)
    for i in range(len(start)):
        mine = [(r, k) for r, c, k in changes.tolist() if c == i and r <= t]
        if mine:
            out[i] = max(mine)[1]
    return out


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=2, max_size=5),
    pattern=st.sampled_from(["sudden", "incremental", "recurrent"]),
    rounds=st.lists(st.integers(2, 30), min_size=1, max_size=4, unique=True),
    share=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_a_drift_plan_is_the_latest_change_of_each_client(sizes, pattern, rounds, share, seed):
    rounds = sorted(rounds)[:1] if pattern == "sudden" else sorted(rounds)
    if pattern != "sudden" and len(rounds) < 2:
        return  # refused (test_bad_drift_keys_are_one_line_each)
    groups = np.repeat(np.arange(len(sizes)), sizes)
    n, n_groups = len(groups), len(sizes)
    changes = Drift.plan(pattern, rounds, share, groups, list(range(n)), seed)
    movers = sorted({int(i) for i in changes[:, 1]})
    for g, size in enumerate(sizes):  # share of every group, drawn per group
        assert sum(groups[i] == g for i in movers) == int(round(share * size))
    assert (np.diff(changes[:, 0]) >= 0).all()
    pairs = np.unique(changes[changes[:, 2] != groups[changes[:, 1]]][:, 1:], axis=0).reshape(-1, 2)
    d = Drift(groups, changes, pairs, None, pattern)
    for t in range(1, 33):
        now = d.concepts(t)
        assert now.tolist() == latest_concepts(groups, changes, t)
        assert d.changing(t, list(range(n))) == ([] if t == 1 else np.flatnonzero(now != d.concepts(t - 1)).tolist())
        moved = now != groups
        assert (now[moved] == (groups[moved] + 1) % n_groups).all(), "a drifting client moves to the next concept"
        slots = d.slots(t)
        assert (slots[~moved] == np.flatnonzero(~moved)).all()
        for i in np.flatnonzero(moved):
            assert pairs[slots[i] - n].tolist() == [i, now[i]]
    if pattern == "recurrent" and len(rounds) % 2 == 0:
        assert (d.concepts(31) == groups).all(), "back where they started after an even number of changes"
    if pattern == "incremental":
        per_round = [int((changes[:, 0] == r).sum()) for r in rounds]
        assert sum(per_round) == len(movers), "each drifting client moves once"


@pytest.mark.parametrize("scenario", ["rotated", "label_swap"])
def test_a_drifted_client_holds_its_own_samples_under_the_new_concept(scenario):
    fed = build(scenario, "digits", 16, 12, seed=3, drift="sudden", drift_rounds=(2,), drift_share=0.5)
    engine = fed.engine_federation()
    d = fed.drift
    slots = d.slots(2)
    moved = np.flatnonzero(d.concepts(2) != fed.groups)
    assert len(moved) == 8 and engine.n_clients == 16 + 8
    for i in moved:
        g, k = int(fed.groups[i]), int(d.concepts(2)[i])
        for split in ("train", "test"):
            x0, y0 = getattr(fed, f"{split}_data")(i)
            x1, y1 = getattr(engine, f"{split}_data")(int(slots[i]))
            assert len(y1) == len(y0), "a client's sizes never change"
            if scenario == "rotated":  # group g turns its images g quarter turns: k - g more
                assert torch.equal(x1, torch.rot90(x0, k - g, dims=(2, 3)))
                assert torch.equal(y1, y0)
            else:  # the same images, the other group's swap of the source labels
                assert torch.equal(x1, x0)
                src = y0.clone()
                a, b = SWAPS[g]
                src[y0 == a], src[y0 == b] = b, a
                want = src.clone()
                a, b = SWAPS[k]
                want[src == a], want[src == b] = b, a
                assert torch.equal(y1, want)
    for i in range(16):  # before the change every client runs on its own slot
        assert torch.equal(engine.train_data(i)[0], fed.train_data(i)[0])


@pytest.mark.parametrize(
    "sets, says",
    [
        (["scenario.drift=sideways", "scenario.drift_rounds=[3]"], "choose one of sudden, incremental, recurrent"),
        (["scenario.drift=sudden"], "needs exactly one round"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[3, 4]"], "needs exactly one round"),
        (["scenario.drift=recurrent", "scenario.drift_rounds=[3]"], "two rounds or more"),
        (["scenario.drift=incremental", "scenario.drift_rounds=[4, 3]"], "increasing rounds"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[1]"], "every round must be in 2..run.rounds"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[500]"], "every round must be in 2..run.rounds"),
        (["scenario.drift_rounds=[3]"], "rounds given but no drift"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[3]", "scenario.drift_share=0"], "drift_share"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[3]", "scenario.name=dirichlet"], "cannot drift"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[3]", "scenario.name=iid"], "cannot drift"),
        (["scenario.drift=sudden", "scenario.drift_rounds=[3]", "scenario.drift_share=0.01"], "no client drifts"),
    ],
)
def test_bad_drift_keys_are_one_line_each(sets, says, capsys):
    sets = ["run.rounds=6", *sets]
    assert main(["run", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_drift_changes_the_configs_digest_and_is_refused_beside_a_given_federation():
    base = configure.load(overrides=SMALL)
    assert config_digest(base) != config_digest(configure.load(overrides=SMALL + SUDDEN))
    fed = build_federation(base)
    with pytest.raises(UserError, match="does not drift"):
        stocfl.run(configure.load(overrides=["run.rounds=8", *SUDDEN]).to_dict(), federation=fed, progress=False)
    assert build_federation(configure.load(overrides=SMALL + SUDDEN)).digest() != fed.digest()


def test_cluster_removal_keeps_every_sum_the_sum_of_its_members():
    """Reference: each cluster's sum recomputed from its members' vectors, after adds, merges
    and removals in any order."""

    @settings(max_examples=60, deadline=None)
    @given(data=st.data(), n=st.integers(2, 14), dim=st.integers(1, 5), seed=st.integers(0, 999))
    def check(data, n, dim, seed):
        g = torch.Generator().manual_seed(seed)
        vecs = {i: torch.randn(dim, generator=g, dtype=torch.float64) + 0.1 for i in range(n)}
        cs = ClusterSet(n, keep_vectors=True)
        for i in range(n):
            cs.add(i, vecs[i])
        cs.merge_greedy(cs.ids, data.draw(st.floats(-1.0, 1.0)))
        gone = data.draw(st.lists(st.integers(0, n - 1), unique=True))
        for i in gone:
            k = int(cs.labels_[i])
            kept = cs.remove(i)
            assert cs.labels_[i] == -1 and i not in cs.vectors_
            assert (kept is None) == (k not in cs.sums_)
        for c in cs.ids:
            members = np.flatnonzero(cs.labels_ == c).tolist()
            assert sorted(cs.members_[c]) == members and cs.counts_[c] == len(members)
            assert torch.allclose(cs.sums_[c], sum(vecs[i] for i in members), atol=1e-9)
        assert sum(cs.counts_.values()) == n - len(gone)

    check()


def watched(exp):
    return watch(exp, "drifted", "drifted")


def evaluated_directly(exp, t):
    """Every participant's accuracy with the model the algorithm gives it, on the data the
    federation says it holds in round t, computed here without the engine's drift mapping."""
    engine_fed = exp.fed.engine_federation()
    slots = exp.fed.drift.slots(t)
    clients = exp.fed.participants
    models = exp.algorithm.client_models(clients, exp.ask)
    out = {}
    for i, w in zip(clients, models):
        x, y = engine_fed.test_data(int(slots[i]))
        if hasattr(w, "models"):  # a mixture: not checked here
            continue
        with torch.no_grad():
            out[i] = int((exp.model.forward(w, x).argmax(1) == y).sum())
    return out


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_runs_on_the_data_each_client_holds_in_the_round(name):
    sets = [*SMALL, *SUDDEN, *small_settings(name), "run.eval_every=1"]
    exp = Experiment.create(configure.load(overrides=sets), None)
    seen = watched(exp)
    summary = exp.run(progress=False)
    d = exp.fed.drift
    moved = d.changing(4, exp.fed.participants)
    assert len(moved) == 12
    for row in exp.rows:
        t = row["round"]
        assert row["drifted"] == (moved if t == 4 else [])
        assert seen.get(t, {}).get("drifted", []) == (moved if t == 4 else [])
    direct = evaluated_directly(exp, 8)
    for i, correct in direct.items():
        assert exp.last_eval[i].correct == correct, f"client {i} was not evaluated on the data it holds"
    cohort = summary["drift"]["changes"]["4"]
    assert cohort["clients"] == 12 and summary["drift"]["steady_clients"] == 12
    assert exp.rows[-1]["accuracy_drift_4"] is not None


@pytest.mark.parametrize("engine", ["batched", "parallel"])
def test_every_in_process_engine_runs_a_drifting_federation_as_the_sequential_one(engine):
    sets = [*SMALL, *SUDDEN, "algorithm.name=ifca", "run.eval_every=2", "algorithm.n_models=4"]
    rows = {}
    for e in ("sequential", engine):
        exp = Experiment.create(configure.load(overrides=[*sets, f"run.engine={e}"]), None)
        exp.run(progress=False)
        rows[e] = [(r["round"], r["accuracy"], r["n_clusters"]) for r in exp.rows]
    for (t, a, k), (t2, b, k2) in zip(rows["sequential"], rows[engine]):
        assert t == t2 and k == k2 and (a is None) == (b is None)
        assert a is None or abs(a - b) < 1e-6


def test_stocfl_reclusters_each_drifted_client_with_its_new_concept():
    """A client whose data changed sends a new Psi and leaves its old cluster: at the end the
    partition matches the concepts the clients then hold."""
    sets = ["run.rounds=12", "run.sample_rate=0.25", *SUDDEN, "algorithm.name=stocfl"]  # 40 clients x 30
    exp = Experiment.create(configure.load(overrides=sets), None)
    summary = exp.run(progress=False)
    row = exp.rows[3]
    assert row["drift_reclustered"] >= 1
    labels = exp.algorithm.cluster_labels()
    now = exp.fed.groups_at(12)
    placed = labels >= 0
    assert metrics.clustering_scores(labels, now, exp.fed.participants)["ari"] == summary["ari"]
    assert summary["ari"] >= 0.95 and placed.sum() >= 36
    old = exp.fed.groups
    moved = np.flatnonzero(now != old)
    # the drifted clients sit with the clients that held their new concept from the start
    for i in moved[placed[moved]]:
        peers = np.flatnonzero((old == now[i]) & (now == old) & placed)
        assert labels[i] == np.bincount(labels[peers]).argmax()


def test_without_the_notice_stocfl_keeps_a_drifted_client_where_it_was():
    sets = [*SMALL, *SUDDEN, "run.rounds=10", "algorithm.name=stocfl", "scenario.drift_notice=false"]
    exp = Experiment.create(configure.load(overrides=sets), None)
    seen = watched(exp)
    exp.run(progress=False)
    assert all("drifted" not in s for s in seen.values())
    before = exp.rows[2]
    assert "drift_reclustered" not in exp.rows[3] and exp.rows[-1]["ari"] < before["ari"]


@pytest.mark.parametrize("name", ["stocfl", "flhc", "fedccfa"])
def test_a_stopped_drifting_run_resumes_to_the_numbers_of_one_in_one_go(tmp_path, name):
    cfg = [*SMALL, "scenario.drift=recurrent", "scenario.drift_rounds=[3, 6]", *small_settings(name)]
    one = Experiment.create(configure.load(overrides=cfg), tmp_path / "one")
    one.run(progress=False)
    cut = Experiment.create(configure.load(overrides=cfg), tmp_path / "cut")
    assert cut.run(progress=False, stop_after=4) is None  # between the two changes
    Experiment.resume(tmp_path / "cut").run(progress=False)

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in (d / "metrics.jsonl").open()]

    assert rows(tmp_path / "one") == rows(tmp_path / "cut")
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["drift"]["pattern"] == "recurrent"


def test_recovery_counts_rounds_until_the_level_before_the_change():
    rows = [{"round": t, "a": v} for t, v in enumerate([0.8, 0.9, 0.5, 0.7, 0.895, 0.92, None, 0.3], start=1)]
    r = metrics.recovery(rows, "a", 3, None, 0.01)
    assert r == {"before": 0.9, "at_change": 0.5, "lowest": 0.3, "recovered_in": 2}
    assert metrics.recovery(rows, "a", 3, 5, 0.01)["recovered_in"] is None  # not before the next change
    assert metrics.recovery(rows, "a", 2, None, 0.2)["recovered_in"] == 0  # never fell below the level
    assert metrics.recovery(rows[:1], "a", 3, None, 0.01)["at_change"] is None


def test_drift_over_a_flower_engine_is_refused_in_one_line():
    cfg = configure.load(overrides=[*SMALL, *SUDDEN])

    class Remote:  # an executor from outside, as Flower's is
        def execute(self, tasks):
            raise AssertionError("never reached")

    with pytest.raises(UserError, match="in-process engines"):
        Experiment(cfg, None, executor=Remote())


def test_a_comparison_on_a_drifting_scenario_reports_each_methods_recovery(tmp_path):
    sets = [*SMALL, *SUDDEN, "run.eval_every=1"]
    args = ["compare", "--quiet", "--out", str(tmp_path), "--seeds", "0,1", "--algo", "fedavg", "--algo", "stocfl"]
    assert main([*args, *[a for s in sets for a in ("--set", s)]]) == 0
    rows = {r["algorithm"]: r for r in csv.DictReader((tmp_path / "compare.csv").open())}
    for label in ("fedavg", "stocfl"):
        runs = [json.loads((tmp_path / f"{label}-seed{s}" / "summary.json").read_text()) for s in (0, 1)]
        lowest = [r["drift"]["changes"]["4"]["lowest"] for r in runs]
        assert float(rows[label]["drift_4_lowest_mean"]) == pytest.approx(np.mean(lowest), abs=1e-6)
        assert rows[label]["drift_4_recovered_in_n"] == str(
            sum(r["drift"]["changes"]["4"]["recovered_in"] is not None for r in runs)
        )
    md = (tmp_path / "compare.md").read_text()
    assert "Clients whose data changed at round 4" in md and "| stocfl |" in md.split("round 4")[1]
    assert (tmp_path / "compare_drift.png").stat().st_size > 1000
