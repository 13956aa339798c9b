"""A malicious client among honest ones, its replies crafted and sent through the Flower codec
and wire format (the loopback executor, one simulated SuperNode per client). Each bad reply
drops that client for the round (counted in metrics.jsonl), exactly as if it had not
answered; the run never crashes and no crafted number reaches an aggregate."""

from __future__ import annotations

import json

import pytest
import torch

from stocfl.algorithms.stocfl.representation import Represented
from stocfl.client.descriptor import Described
from stocfl.client.gradient import Gradiented
from stocfl.client.mixture import MixtureTrained
from stocfl.client.split import SplitTrained
from stocfl.client.subspace import Subspaced
from stocfl.client.tasks import ClientsDropped, Evaluated, Trained
from stocfl.executors import SequentialExecutor
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment
from stocfl.flower.loopback import LoopbackExecutor
from tests.flower.grid import ScriptedGrid, in_a_run  # noqa: F401 (a fixture)

EVIL = 3
SMALL = [
    "scenario.n_clients=12",
    "scenario.samples_per_client=20",
    "run.rounds=4",
    "run.sample_rate=0.5",
    "run.engine=sequential",
]


class Client(SequentialExecutor):
    """Honest clients; client EVIL answers the tasks of type ``kind`` with ``craft(result)``, or
    (``craft`` None) does not answer them at all."""

    def __init__(self, fed, model, kind, craft):
        super().__init__(fed, model)
        self.kind, self.craft = kind, craft

    def execute(self, tasks):
        results = super().execute(tasks)
        mine = [k for k, r in enumerate(results) if tasks[k].client == EVIL and isinstance(r, self.kind)]
        if mine and self.craft is None:
            raise ClientsDropped([EVIL], [f"client {EVIL}: no reply"])
        for k in mine:
            results[k] = self.craft(results[k])
        return results


CASES = {
    "psi of the wrong length": ("stocfl", Represented, lambda r: Represented(r.psi[:-1], r.n_samples)),
    "n_samples = inf": ("fedavg", Trained, lambda r: Trained(r.weights, float("inf"))),
    "n_samples < 0": ("fedavg", Trained, lambda r: Trained(r.weights, -5)),
    "n_samples = 10**12 (to outweigh everyone)": ("fedavg", Trained, lambda r: Trained(r.weights, 10**12)),
    "weights of 1e38": ("fedavg", Trained, lambda r: Trained(torch.full_like(r.weights, 1e38), r.n_samples)),
    "NaN weights": ("stocfl", Trained, lambda r: Trained(r.weights * float("nan"), r.n_samples)),
    "correct = NaN": ("fedavg", Evaluated, lambda r: Evaluated(r.loss, float("nan"), r.n_samples)),
    "correct = 10**6 > n_samples": ("fedavg", Evaluated, lambda r: Evaluated(r.loss, 10**6, r.n_samples)),
    "loss = -inf": ("fedavg", Evaluated, lambda r: Evaluated(float("-inf"), r.correct, r.n_samples)),
    # the mixture family's reply (FedEM): K models, the client's mixture weights, its label masses
    "mixture weights that favour one model beyond 1": (
        "fedem",
        MixtureTrained,
        lambda r: MixtureTrained(r.models, r.mixture * 0 + torch.tensor([5.0, -2.0, -2.0]), r.label_mass, r.n_samples),
    ),
    "mixture models of 1e38": (
        "fedem",
        MixtureTrained,
        lambda r: MixtureTrained(torch.full_like(r.models, 1e38), r.mixture, r.label_mass, r.n_samples),
    ),
    "one mixture model fewer": (
        "fedem",
        MixtureTrained,
        lambda r: MixtureTrained(r.models[:-1], r.mixture, r.label_mass, r.n_samples),
    ),
    "label masses of another client's size": (
        "fedem",
        MixtureTrained,
        lambda r: MixtureTrained(r.models, r.mixture, r.label_mass * 3, r.n_samples),
    ),
    # FedSoft's reply on the same kind: one local model and the importance weights u_i
    "K models where one local model is due": (
        "fedsoft",
        MixtureTrained,
        lambda r: MixtureTrained(r.models.repeat(3, 1), r.mixture, r.label_mass, r.n_samples),
    ),
    "importance weights with a negative share": (
        "fedsoft",
        MixtureTrained,
        lambda r: MixtureTrained(r.models, torch.tensor([1.5, -0.25, -0.25]), r.label_mass, r.n_samples),
    ),
    # CFL's gradient variant: the query.gradient reply
    "a gradient of the wrong length": (
        "cfl similarity=gradients",
        Gradiented,
        lambda r: Gradiented(r.gradient[:-1], r.n_samples),
    ),
    "a gradient of inf": ("cfl similarity=gradients", Gradiented, lambda r: Gradiented(r.gradient / 0.0, r.n_samples)),
    # PACFL's query.subspace reply (client 3 answers the clustering query, and later when placed)
    "a subspace of vectors not of unit length": (
        "pacfl",
        Subspaced,
        lambda r: Subspaced(r.basis * 0.5, r.n_columns, r.n_samples),
    ),
    "a subspace of more vectors than asked": (
        "pacfl",
        Subspaced,
        lambda r: Subspaced(torch.cat([r.basis, r.basis]), 2 * r.n_columns, r.n_samples),
    ),
    "a subspace of NaN": ("pacfl", Subspaced, lambda r: Subspaced(r.basis * float("nan"), r.n_columns, r.n_samples)),
    # FLUX's query.describe reply (client 3 answers in the clustering round or when placed)
    "a descriptor of the wrong length": (
        "flux warmup_rounds=1",
        Described,
        lambda r: Described(r.descriptor[:-1], r.n_samples),
    ),
    "a descriptor of NaN": (
        "flux warmup_rounds=1",
        Described,
        lambda r: Described(r.descriptor * float("nan"), r.n_samples),
    ),
    "a descriptor with negative deviations": (
        "flux warmup_rounds=1",
        Described,
        lambda r: Described(r.descriptor - 1e3, r.n_samples),
    ),
    "a descriptor of 1e30 to own a cluster": (
        "flux warmup_rounds=1",
        Described,
        lambda r: Described(r.descriptor * 1e30, r.n_samples),
    ),
    # CLoVE's loss vector: the client's Evaluate replies on the train data of every cluster model
    "a loss vector holding NaN": (
        "clove max_models=3",
        Evaluated,
        lambda r: Evaluated(float("nan"), r.correct, r.n_samples),
    ),
    # FedCCFA's train.split reply: a model, a balanced classifier, class anchors and label counts
    "a balanced classifier of 1e30 to stand apart": (
        "fedccfa align_after=1",
        SplitTrained,
        lambda r: SplitTrained(r.weights, r.balanced_head * 1e30, r.prototypes, r.label_counts, r.n_samples),
    ),
    "anchors of NaN": (
        "fedccfa align_after=1",
        SplitTrained,
        lambda r: SplitTrained(r.weights, r.balanced_head, r.prototypes * float("nan"), r.label_counts, r.n_samples),
    ),
    "label counts that hide the client's data": (
        "fedccfa align_after=1",
        SplitTrained,
        lambda r: SplitTrained(r.weights, r.balanced_head, r.prototypes, r.label_counts * 0, r.n_samples),
    ),
    "a split model one entry short": (
        "fedccfa align_after=1",
        SplitTrained,
        lambda r: SplitTrained(r.weights[:-1], r.balanced_head, r.prototypes, r.label_counts, r.n_samples),
    ),
    "mixture evaluation correct > n_samples": (
        "fedem",
        Evaluated,
        lambda r: Evaluated(r.loss, r.n_samples + 1, r.n_samples),
    ),
}


def _run(tmp_path, name, algorithm, kind, craft):
    method, *extra = algorithm.split()  # "NAME KEY=VALUE ...": the algorithm and its parameters
    cfg = configure.load(overrides=[*SMALL, f"algorithm.name={method}", *(f"algorithm.{e}" for e in extra)])
    probe = Experiment(cfg, tmp_path / "probe")
    ex = LoopbackExecutor(Client(probe.fed, probe.model, kind, craft))
    summary = Experiment.create(cfg, tmp_path / name, ex).run(progress=False)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def _strip(rows):
    """Rows without their times and traffic: a crafted reply crossed the wire (its bytes count),
    a silent client's did not; every other figure must be the same."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "bytes_up")} for r in rows]


_SILENT: dict = {}  # (algorithm, kind) -> the rows of the run in which client EVIL never answers that kind


@pytest.mark.long  # two whole runs through the codec a case: make test, not make test-fast
@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_reply_drops_its_client_as_if_it_had_not_answered(tmp_path, case):
    algorithm, kind, craft = CASES[case]
    summary, rows = _run(tmp_path, "evil", algorithm, kind, craft)
    if (algorithm, kind) not in _SILENT:  # the same for every case of that kind: run once per worker
        _SILENT[algorithm, kind] = _run(tmp_path, "silent", algorithm, kind, None)[1]
    silent = _SILENT[algorithm, kind]
    assert summary["rounds_done"] == 4 and 0 <= summary["accuracy"] <= 1
    assert _strip(rows) == _strip(silent), "a crafted reply must count exactly as no reply"
    if kind is not Evaluated:  # evaluation leaves a silent client out without counting a drop
        assert any(EVIL in r["dropped_clients"] for r in rows), "client 3 is sampled in this run"


def test_a_representation_of_huge_entries_is_renormalised_not_fatal(tmp_path):
    """Psi entries near 3e38 once finished the rounds and then crashed the plots on every
    resume; the server now re-normalises every Psi before use."""
    scale = lambda r: Represented(r.psi / r.psi.abs().max() * 3e38, r.n_samples)  # noqa: E731
    summary, rows = _run(tmp_path, "huge", "stocfl", Represented, scale)
    honest, ref = _run(tmp_path, "honest", "stocfl", Represented, lambda r: r)
    assert summary["ari"] == honest["ari"] and summary["n_clusters"] == honest["n_clusters"]
    assert all(r["dropped"] == 0 for r in rows) and (tmp_path / "huge" / "embedding.png").exists()


def test_a_second_node_claiming_a_served_client_is_refused(in_a_run):
    """A node that claims every client id receives no other client's tasks while their own
    nodes are online; a restarted node (its old id gone offline) takes its client back."""
    from stocfl.flower.engine import FlowerExecutor

    grid = ScriptedGrid([1, 2], {1: [0], 2: [1], 3: [0, 1, 2], 4: [0]})
    ex = FlowerExecutor(grid, timeout=5)
    ex.refresh()
    assert ex.node_of == {0: 1, 1: 2}
    grid.online = [1, 2, 3]  # node 3 claims clients 0, 1 and 2
    ex.refresh()
    assert ex.node_of == {0: 1, 1: 2, 2: 3} and ex.refused_claims == 2
    grid.online = [1, 2, 3, 4]  # node 4, node 1 restarted, claims client 0 while node 1 is still listed
    ex.refresh()
    assert ex.node_of == {0: 1, 1: 2, 2: 3} and ex.refused_claims == 3
    ex.failed.add(1)  # node 1 stopped answering (as the executor notes on a timeout or error)
    ex.refresh()
    assert ex.node_of == {0: 4, 1: 2, 2: 3}, "the claim waits and is granted once node 1 fails"
    assert ex.takeovers == 1 and ex.counters()["node_takeovers"] == 1, "logged and counted in metrics"
    grid.online = [2, 3, 4]  # node 1 offline
    ex.refresh()
    assert ex.node_of == {0: 4, 1: 2, 2: 3}


@pytest.mark.parametrize(
    "claims",
    [[1000, 1001], [-1], [10**6], [float("inf")], [3.7], ["1"]],
    ids=["ids beyond the federation", "-1", "10**6", "inf", "3.7", "a string"],
)
def test_a_claim_outside_the_federation_is_refused_and_never_counts_toward_the_quorum(in_a_run, claims):
    """One node claiming client ids the federation does not hold (N = 2), with no honest node
    online: the run does not start (it used to start at once and finish with every client
    dropped); with the honest nodes online their clients are served and the liar gets nothing."""
    from stocfl.errors import UserError
    from stocfl.flower.engine import FlowerExecutor

    def Grid(online):  # noqa: N802
        return ScriptedGrid(online, {7: claims, 1: [0], 2: [1]})

    with pytest.raises(UserError, match="only 0 of 2"):
        FlowerExecutor(Grid([7]), timeout=1, n_clients=2).connect(2, wait=0.5)
    ex = FlowerExecutor(Grid([7, 1, 2]), timeout=1, n_clients=2).connect(2, wait=0.5)
    assert ex.node_of == {0: 1, 1: 2} and 7 in ex.refusals


def _keys(tmp_path, names):
    """An OpenSSH public key file per name (what 'flwr supernode register' reads) and its PEM
    (what the SuperLink stores and Grid.get_nodes reports)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    files, pems = {}, {}
    for name in names:
        pub = ec.generate_private_key(ec.SECP384R1()).public_key()
        files[name] = tmp_path / f"{name}.pub"
        files[name].write_bytes(pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
        pems[name] = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return files, pems


def test_with_node_keys_no_node_serves_a_client_bound_to_another_key(in_a_run, tmp_path):
    """Finding 5: a node claiming every client id served them all if it connected first, and
    took over any client whose node was slow once. With the clients bound to SuperNodes' public
    keys (node-keys; SuperNode authentication makes a node's key its identity), a node serves
    only its key's clients: connecting first, a higher node id or another node failing changes
    nothing."""
    from stocfl.errors import UserError
    from stocfl.flower.engine import FlowerExecutor, read_node_keys

    files, pems = _keys(tmp_path, ["a", "b", "evil"])
    (tmp_path / "keys.toml").write_text(
        f'[[node]]\nkey = "{files["a"]}"\nclients = "0"\n\n[[node]]\nkey = "{files["b"]}"\nclients = "1-2"\n'
        f'\n[[node]]\nkey = "{files["evil"]}"\nclients = "3"\n'
    )
    bound = read_node_keys(str(tmp_path / "keys.toml"), 4)
    # the attacker (key "evil", node 9: the higher id) claims every client and is online first
    grid = ScriptedGrid([9], {9: [0, 1, 2, 3], 1: [0], 2: [1, 2]}, keys={9: pems["evil"], 1: pems["a"], 2: pems["b"]})
    ex = FlowerExecutor(grid, timeout=5, n_clients=4, node_keys=bound)
    with pytest.raises(UserError, match="only 0 of 4"):
        ex.connect(4, wait=0.3)
    assert ex.node_of == {} and "binds to other keys" in ex.refusals[9]
    grid.online = [9, 1, 2]
    ex = FlowerExecutor(grid, timeout=5, n_clients=4, node_keys=bound)
    ex.refresh()
    assert ex.node_of == {0: 1, 1: 2, 2: 2}
    ex.failed.add(1)  # node 1 times out once: nobody takes client 0 over
    ex.refresh()
    assert ex.node_of == {0: 1, 1: 2, 2: 2} and ex.takeovers == 0
    # a node whose key is not bound at all gets nothing either
    (tmp_path / "x").mkdir()
    grid.online, grid.keys[5], grid.claims[5] = [5], _keys(tmp_path / "x", ["stranger"])[1]["stranger"], [0]
    ex = FlowerExecutor(grid, timeout=5, n_clients=4, node_keys=bound)
    ex.refresh()
    assert ex.node_of == {} and ex.refusals[5] == "its public key is not one of node-keys"


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "expected [[node]] tables"),
        ("[[node]]\nkey = 'A'\nclients = '0'\nextra = 1\n", "needs key ="),
        ("[[node]]\nkey = 'MISSING'\nclients = '0'\n", "cannot be read"),
        ("[[node]]\nkey = 'NOTAKEY'\nclients = '0'\n", "is not a public key"),
        ("[[node]]\nkey = 'A'\nclients = '0-x'\n", "expected ids and ranges"),
        ("[[node]]\nkey = 'A'\nclients = '0-99999999999'\n", "ids must lie in 0..3"),
        ("[[node]]\nkey = 'A'\nclients = '2-1'\n", "ids must lie in 0..3"),
        ("[[node]]\nkey = 'A'\nclients = '0-1'\n[[node]]\nkey = 'B'\nclients = '1'\n", "client 1 is bound to"),
        ("[[node]]\nkey = 'A'\nclients = '0'\n[[node]]\nkey = 'A'\nclients = '1'\n", "is bound twice"),
        ("[[node]\n", "cannot be read"),
        ("a = " + "[" * 40 + "]" * 40, "nest"),
    ],
)
def test_a_bad_node_keys_file_is_one_line(tmp_path, text, says):
    from stocfl.errors import UserError
    from stocfl.flower.engine import read_node_keys

    files, _ = _keys(tmp_path, ["A", "B"])
    (tmp_path / "NOTAKEY").write_text("hello")
    for name in ("A", "B", "MISSING", "NOTAKEY"):
        text = text.replace(f"'{name}'", f"'{files.get(name, tmp_path / name)}'")
    (tmp_path / "keys.toml").write_text(text)
    with pytest.raises(UserError) as err:
        read_node_keys(str(tmp_path / "keys.toml"), 4)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
