"""Living federations: clients that join a running training and leave it (``[scenario]``'s
schedule keys, :meth:`Federation.with_schedule`). Checked against the plain definition of who
is present when, through real runs of every algorithm, and across a stop and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stocfl
from stocfl.algorithms import ALGORITHMS
from stocfl.cli import main
from stocfl.data.schedule import Schedule
from stocfl.errors import UserError
from stocfl.experiment import configure, metrics
from stocfl.experiment.build import build_federation
from stocfl.experiment.loop import Experiment
from stocfl.experiment.provenance import config_digest
from tests.helpers import watch
from tests.test_common import small_settings

SCHEDULE = [
    "scenario.present_at_start=0.5",
    "scenario.join_rounds=[3, 5]",
    "scenario.leave=0.25",
    "scenario.leave_rounds=[6]",
]
SMALL = ["run.rounds=7", "run.sample_rate=0.25", "scenario.n_clients=24", "scenario.samples_per_client=20"]


def brute_present(joins, leaves, t, among):
    return [i for i in among if joins[i] <= t and (leaves[i] == 0 or t < leaves[i])]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 40),
    start=st.floats(0.05, 1.0),
    joins=st.lists(st.integers(2, 30), max_size=4, unique=True),
    leave=st.floats(0.0, 0.95),
    leaves=st.lists(st.integers(2, 30), max_size=4, unique=True),
    seed=st.integers(0, 2**16),
)
def test_the_configs_schedule_is_who_is_present_when(n, start, joins, leave, leaves, seed):
    joins, leaves = sorted(joins), sorted(leaves)
    if (start < 1) != bool(joins) or (leave > 0) != bool(leaves):
        return  # the config refuses these (test_bad_schedule_keys_are_one_line_each)
    participants = list(range(n))
    s = Schedule.from_shares(participants, n, start, joins, leave, leaves, seed)
    if s is None:
        assert start >= 1 and leave <= 0
        return
    n_start = max(1, round(start * n))
    assert (s.joins == 1).sum() == n_start  # the share at the start
    later = s.joins[s.joins > 1]
    if len(later):  # the rest in equal parts at the join rounds
        counts = [int((s.joins == t).sum()) for t in joins]
        assert sum(counts) == n - n_start and max(counts) - min(counts) <= 1
    gone = np.flatnonzero(s.leaves > 0)
    assert len(gone) == int(leave * n_start) and (s.joins[gone] == 1).all()  # leavers: starters only
    for t in range(1, 32):
        assert s.present(t, participants) == brute_present(s.joins, s.leaves, t, participants)
        assert s.joining(t, participants) == ([] if t == 1 else [i for i in participants if s.joins[i] == t])
        assert s.leaving(t, participants) == [i for i in participants if s.leaves[i] == t]
    assert all(s.present(t, participants) for t in range(1, s.last_change + 1))


@pytest.mark.parametrize(
    "joins, leaves, says",
    [
        ([1, 1, 1, 0], None, "client 3 joins at round 0"),
        ([1, 2], None, "must be 4 whole numbers"),
        ([1.0, 1.0, 1.0, 1.0], None, "must be 4 whole numbers"),
        ([1, 1, 1, 3], [0, 0, 0, 3], "client 3 leaves at round 3, not after it joins"),
        ([1, 1, 1, 1], [0, -1, 0, 0], "client 1 leaves at round -1"),
        ([1, 3, 3, 3], [2, 0, 0, 0], "no client is present at round 2"),
    ],
)
def test_a_bad_schedule_from_python_is_one_line(joins, leaves, says):
    fed = build_federation(configure.load(overrides=["scenario.n_clients=4"]))
    with pytest.raises(UserError, match=says):
        fed.with_schedule(joins, leaves)


@pytest.mark.parametrize(
    "sets, says",
    [
        (["scenario.present_at_start=0.5"], "scenario.join_rounds: present_at_start < 1 needs"),
        (["scenario.join_rounds=[3]"], "rounds given but nobody moves"),
        (["scenario.leave=0.2"], "scenario.leave_rounds: leave > 0 needs"),
        (["scenario.leave=0.2", "scenario.leave_rounds=[4, 3]"], "increasing rounds"),
        (["scenario.present_at_start=0.5", "scenario.join_rounds=[1]"], "every round must be in 2..run.rounds"),
        (["scenario.present_at_start=0.5", "scenario.join_rounds=[5000]"], "every round must be in 2..run.rounds"),
        (["scenario.present_at_start=0.0", "scenario.join_rounds=[3]"], "present_at_start: must be > 0"),
        (['scenario.join_rounds=["3"]'], "join_rounds"),
    ],
)
def test_bad_schedule_keys_are_one_line_each(sets, says, capsys):
    with pytest.raises(UserError, match=says):
        configure.load(overrides=sets)
    assert main(["run", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert says.split(":")[0] in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_schedule_changes_the_configs_digest_and_is_refused_beside_a_given_federation():
    base = configure.load(overrides=SMALL)
    assert config_digest(base) != config_digest(configure.load(overrides=SMALL + SCHEDULE))
    fed = build_federation(base)
    with pytest.raises(UserError, match="Federation.with_schedule"):
        stocfl.run(configure.load(overrides=["run.rounds=7", *SCHEDULE]).to_dict(), federation=fed, progress=False)


def recorded(exp):
    return watch(exp, "arrive", "arrived")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_trains_and_is_scored_over_the_clients_present(name):
    sets = [*SMALL, *SCHEDULE, *small_settings(name), "run.eval_every=2"]
    exp = Experiment.create(configure.load(overrides=sets), None)
    seen = recorded(exp)
    summary = exp.run(progress=False)
    s = exp.fed.schedule
    pool = exp.fed.participants
    for row in exp.rows:
        t = row["round"]
        present = exp.fed.present(t)
        assert row["present"] == len(present) and row["placed"] <= len(present)
        assert set(seen[t]["sampled"]) <= set(present), "a client not present was sampled"
        assert len(seen[t]["sampled"]) == int(np.ceil(0.25 * len(present)))
        assert row["joined"] == s.joining(t, pool) == seen[t].get("arrived", [])
        assert row["left"] == s.leaving(t, pool)
    assert set(exp.last_eval) == set(exp.fed.present(7)), "the evaluation covers the clients present, only them"
    sched = summary["schedule"]
    assert sched["joined"] == 12 and sched["left"] == 3 and sched["present_at_end"] == 21


def test_stocfl_places_each_arrival_in_the_round_it_joins():
    """The paper's claim (section 4.4): a client that joins a running training sends Psi when
    it arrives and is clustered then, before it is ever sampled."""
    exp = Experiment.create(configure.load(overrides=[*SMALL, *SCHEDULE, "algorithm.name=stocfl"]), None)
    seen = recorded(exp)
    exp.run(progress=False)
    labels = exp.algorithm.cluster_labels()
    for t in (3, 5):
        row = exp.rows[t - 1]
        assert row["joined"] and row["joined_placed"] == 1.0 and row["arrivals_clustered"] == len(row["joined"])
        assert set(row["joined"]) - set(seen[t]["sampled"]), "some arrivals were placed without being sampled"
    assert (labels[exp.fed.schedule.joins > 1] >= 0).all()
    # without the hook (the default: met when sampled) only sampled arrivals would be placed
    assert exp.rows[2]["coverage"] > exp.rows[1]["coverage"] - 1e-9


def test_group_cluster_share_is_the_share_in_the_groups_modal_cluster():
    labels = np.array([0, 0, 1, 1, 1, 2, -1, 0])
    groups = np.array([0, 0, 1, 1, 0, 1, 1, 1])
    among = list(range(8))
    # group 0 is mostly cluster 0 (clients 0, 1), group 1 mostly cluster 1 (clients 2, 3)
    assert metrics.group_cluster_share([0, 4], labels, groups, among) == 0.5
    assert metrics.group_cluster_share([2, 5, 6, 7], labels, groups, among) == 0.25
    assert metrics.group_cluster_share([], labels, groups, among) is None


def test_a_stopped_run_with_a_schedule_resumes_to_the_numbers_of_one_in_one_go(tmp_path):
    cfg = [*SMALL, *SCHEDULE, "run.rounds=8"]
    one = Experiment.create(configure.load(overrides=cfg), tmp_path / "one")
    one.run(progress=False)
    cut = Experiment.create(configure.load(overrides=cfg), tmp_path / "cut")
    assert cut.run(progress=False, stop_after=4) is None  # between the two join rounds
    Experiment.resume(tmp_path / "cut").run(progress=False)

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in (d / "metrics.jsonl").open()]

    assert rows(tmp_path / "one") == rows(tmp_path / "cut")


def test_a_given_federation_with_a_schedule_runs_and_resumes_only_on_that_schedule(tmp_path):
    fed = build_federation(configure.load(overrides=SMALL))
    joins = np.where(np.arange(fed.n_clients) % 3 == 0, 4, 1)
    cfg = {"run": {"rounds": 6, "sample_rate": 0.25}}
    res = stocfl.run(cfg, federation=fed.with_schedule(joins), out=tmp_path / "r", progress=False)
    assert res.summary["schedule"]["joined"] == 8 and res.summary["schedule"]["present_at_end"] == 24
    with pytest.raises(UserError):
        stocfl.resume(tmp_path / "r", federation=fed)  # the schedule is part of what the clients hold
