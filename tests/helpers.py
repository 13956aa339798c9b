"""Paths and probes the tests share."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository's root


def watch(exp, hook: str, key: str) -> dict[int, dict[str, list[int]]]:
    """Record, per round, the clients ``exp``'s algorithm samples (``"sampled"``) and those it
    is handed through its ``hook`` method (``arrive``, ``drifted``: under ``key``)."""
    seen: dict[int, dict[str, list[int]]] = {}
    play, handed = exp.algorithm.round, getattr(exp.algorithm, hook)

    def round_(t, sampled, ask):
        seen.setdefault(t, {})["sampled"] = list(sampled)
        return play(t, sampled, ask)

    def hook_(t, clients, ask):
        seen.setdefault(t, {})[key] = list(clients)
        return handed(t, clients, ask)

    exp.algorithm.round = round_
    setattr(exp.algorithm, hook, hook_)
    return seen
