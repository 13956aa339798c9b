"""A scripted stand-in for Flower's Grid, for the executor's node bookkeeping (which node
serves which client, when a run may start): nodes come online and answer the identity query
with the claims and delays a test scripts. Training goes through real Flower elsewhere
(test_flower.py, the deployment tests); these cases need nodes that lie or stall on cue."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest


@pytest.fixture
def in_a_run(monkeypatch):
    """Messages made outside a ServerApp need a run's identity."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class ScriptedGrid:
    """``online``: node ids listed; ``claims``: node id -> the client ids it says it serves;
    ``answers_after``: node id -> seconds after the query before its reply is there (None:
    never); ``keys``: node id -> the public key it registered with (PEM), as Grid.get_nodes
    reports them."""

    def __init__(self, online, claims, answers_after=None, keys=None):
        self.online, self.claims, self.after = list(online), dict(claims), dict(answers_after or {})
        self.keys = dict(keys or {})
        self.pending: dict[str, tuple] = {}

    def get_node_ids(self):
        return list(self.online)

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=self.keys.get(n, b"")) for n in self.online]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            ids.append(f"m{len(self.pending)}")
            self.pending[ids[-1]] = (m, time.monotonic())
        return ids

    def pull_messages(self, ids):
        out = []
        for i in ids:
            msg, sent = self.pending[i]
            node = msg.metadata.dst_node_id
            after = self.after.get(node, 0.0)
            if after is None or time.monotonic() - sent < after:
                continue
            out.append(
                SimpleNamespace(
                    metadata=SimpleNamespace(reply_to_message_id=i),
                    has_error=lambda: False,
                    content={"client": {"client_ids": self.claims[node]}},
                )
            )
        return out
