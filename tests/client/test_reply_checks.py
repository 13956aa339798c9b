"""The reply checks' measures against their plain forms: max |t| and max |a - b| are read in
blocks (no model-sized temporary), and the scale of what was sent is found once per tensor."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.client import tasks
from stocfl.client.tasks import Train, Trained, largest_change, largest_entry, out_of_bound

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

    for got, want in ((largest_entry(a), plain(a)), (largest_change(a, b), plain(a - b))):
        assert got == want or (math.isnan(got) and math.isnan(want)), (got, want)


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
