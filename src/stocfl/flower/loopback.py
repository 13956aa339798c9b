"""The Flower codec without Flower's transport: an in-process executor whose task lists and
replies go through exactly what a Flower message carries.

Each call groups the tasks by node and kind (``nodes`` simulated SuperNodes, node i serving clients
i, i + nodes, ...; 0: one node per client), as :class:`FlowerExecutor` does, encodes them with
:mod:`stocfl.flower.codec`, serialises the records to Flower's protobuf bytes and back, runs the
decoded tasks on an in-process executor, and sends the results back the same way; the server
decodes and checks them as :class:`FlowerExecutor` does, and a reply that fails the checks drops
that message's clients (:class:`ClientsDropped`). The common test suite runs every algorithm on it,
so a codec defect shows without Ray.
"""

from __future__ import annotations

from flwr.common import serde
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from stocfl.client.tasks import ClientsDropped, Reply, Task
from stocfl.flower.codec import BadReply, decode_results, decode_tasks, encode_results, encode_tasks, message_type


def over_the_wire(content):
    """A RecordDict as bytes, and back: what crossing a Flower connection does to it."""
    proto = ProtoRecordDict()
    proto.ParseFromString(serde.recorddict_to_proto(content).SerializeToString())
    return serde.recorddict_from_proto(proto)


class LoopbackExecutor:
    def __init__(self, inner, nodes: int = 0):
        self.inner, self.nodes = inner, nodes
        self.fed, self.model = inner.fed, inner.model
        self.messages = 0

    def execute(self, tasks: list[Task]) -> list[Reply]:
        out: list[Reply | None] = [None] * len(tasks)
        groups: dict[tuple[int, type], list[int]] = {}
        for k, t in enumerate(tasks):
            groups.setdefault((t.client % self.nodes if self.nodes else t.client, type(t)), []).append(k)
        why: dict[int, str] = {}
        for (node, kind), idx in groups.items():
            sent = [tasks[k] for k in idx]
            received = decode_tasks(message_type(kind), over_the_wire(encode_tasks(sent)))
            reply = encode_results(self.inner.execute(received), [t.client for t in received])
            self.messages += 1
            try:
                for k, r in zip(idx, decode_results(sent, over_the_wire(reply))):
                    out[k] = r
            except BadReply as err:
                for t in sent:
                    why[t.client] = f"client {t.client} (node {node}): {err}"
        if why:
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        return out  # type: ignore[return-value]
