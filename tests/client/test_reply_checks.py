"""The reply checks' measures against their plain forms: max |t| and max |a - b| are read in
blocks (no model-sized temporary), and the scale of what was sent is found once per tensor."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.client import tasks
from stocfl.client.tasks import (
    BadResult,
    Train,
    Trained,
    check_trained,
    checking,
    largest_change,
    largest_entry,
    largest_entry_and_change,
    out_of_bound,
)

special = st.sampled_from([0.0, -0.0, 1e30, -1e30, math.inf, -math.inf, math.nan])


@settings(max_examples=200, deadline=None)
@given(
    n=st.sampled_from([0, 1, 5, tasks.BLOCK - 1, tasks.BLOCK, tasks.BLOCK + 3, 3 * tasks.BLOCK + 1]),
    at=st.lists(st.tuples(st.floats(0, 1), special, st.booleans()), max_size=3),
    seed=st.integers(0, 1000),
)
def test_largest_entry_and_change_are_the_plain_ones(n, at, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, generator=g) * 100, torch.randn(n, generator=g)
    for where, value, which in at:
        if n:
            (a if which else b)[min(n - 1, int(where * n))] = value

    def plain(t):
        return float(t.abs().max()) if t.numel() else 0.0

    top, move = largest_entry_and_change(a, b)
    for got, want in (
        (largest_entry(a), plain(a)),
        (largest_change(a, b), plain(a - b)),
        (top, plain(a)),
        (move, plain(a - b)),
    ):
        assert got == want or (math.isnan(got) and math.isnan(want)), (got, want)


@settings(max_examples=100, deadline=None)
@given(
    n=st.sampled_from([1, 7, tasks.BLOCK + 3]),
    moves=st.lists(st.sampled_from([0.0, 0.01, 3.0, 1e7, 1e12, math.inf, math.nan]), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_checks_in_one_pass_refuse_and_bound_as_the_two_passes(n, moves, seed):
    """Inside ``checking`` a trained reply is read once for its check and its move: the same
    replies refused, for the same reasons, as checked and bounded apart."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    sent = [Train(i, w, None, 0) for i in range(len(moves))]
    replies = [Trained(w + m * torch.rand(n, generator=g), 1) for m in moves]

    def run():
        refused, passed = {}, []
        for k, (t, r) in enumerate(zip(sent, replies)):
            try:
                check_trained(t, r, 1, 0)
                passed.append(k)
            except BadResult as err:
                refused[k] = str(err)
        for j, why in out_of_bound([sent[k] for k in passed], [replies[k] for k in passed]).items():
            refused[passed[j]] = why
        return refused

    apart = run()
    with checking():
        together = run()
    assert together == apart


def test_the_scale_of_a_model_sent_to_many_is_found_once(monkeypatch):
    w = torch.randn(1000)
    sent = [Train(i, w, None, 0) for i in range(50)]  # local is not read by the check
    replies = [Trained(w + 0.01 * i, 1) for i in range(50)]
    calls = []
    entry = tasks.largest_entry
    monkeypatch.setattr(tasks, "largest_entry", lambda t: calls.append(t) or entry(t))
    assert out_of_bound(sent, replies) == {}
    assert len(calls) == 1, "w's largest entry, once for the 50 tasks that sent it"
    replies[7] = Trained(w + 1e9, 1)
    assert list(out_of_bound(sent, replies)) == [7]
