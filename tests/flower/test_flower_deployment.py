"""Real Flower deployments on 127.0.0.1: a SuperLink, SuperNodes and `flwr run` as separate
processes, the stocfl Flower app (flower_app/) on top."""

import json

import pytest

pytest.importorskip("flwr", reason="Flower is part of the test extra: pip install -e '.[test]'")


from stocfl.client.tasks import ClientsDropped  # noqa: E402
from stocfl.executors import SequentialExecutor  # noqa: E402
from stocfl.experiment import configure  # noqa: E402
from stocfl.experiment.loop import Experiment  # noqa: E402
from stocfl.flower.certs import make_certificates  # noqa: E402
from tests.flower.flower_deployment import ROOT, Deployment, rows, wait_for  # noqa: E402

pytestmark = pytest.mark.flower  # starts Flower processes (left out of make test-fast)


def _experiment(path, rounds, n_clients, extra=""):
    """Hybrid digits, clients in 2 groups; clients are evaluated after the last round only (each
    message to a SuperNode starts a ClientApp process: about 4 s of CPU for imports and data)."""
    path.write_text(
        f'[run]\nrounds = {rounds}\nsample_rate = 1.0\neval_every = {rounds}\n{extra}\n[scenario]\nname = "hybrid"\n'
        f'dataset = "digits"\nn_clients = {n_clients}\nsamples_per_client = 60\n\n[algorithm]\nname = "stocfl"\n'
    )
    return path


def _finish(d, run, out, seconds=600):
    assert run.wait(timeout=seconds) == 0, d.log("flwr_run.log")[-3000:]
    # --stream may return just before the ServerApp writes the summary; `flwr run` exits 0 even
    # when the ServerApp failed, so a missing summary shows the ServerApp's log
    try:
        text = wait_for(lambda: (out / "summary.json").exists() and (out / "summary.json").read_text(), 120, "summary")
    except TimeoutError:
        raise AssertionError("no summary.json; the ServerApp's log ends:\n" + d.log("flwr_run.log")[-3000:]) from None
    return json.loads(text)


class DropWhileFailing(SequentialExecutor):
    """In-process stand-in for a SuperNode that is gone: while ``failing``, client ``gone`` never answers."""

    gone, failing = 3, False

    def execute(self, tasks):
        if self.failing and any(t.client == self.gone for t in tasks):
            raise ClientsDropped([self.gone], [f"client {self.gone}: no reply"])
        return super().execute(tasks)


def test_stocfl_over_tls_with_a_supernode_killed_and_restarted(tmp_path):
    """One real deployment, every process separate:

    - secure mode: the SuperLink serves TLS with a certificate signed by a CA made here, and the
      SuperNodes and `flwr` trust only that CA; SuperNode authentication: only SuperNodes whose
      public key was registered connect, and the run config's node-keys binds each client to a key;
    - four clients on three SuperNodes, one of which serves clients 1 and 2 (different groups);
    - a fourth registered SuperNode, started first, claims all four clients (issue 70, finding 5:
      it used to serve them all, and to take over any client whose node failed once); its key is
      bound to none, so it serves none;
    - the SuperNode of client 3 is SIGKILLed while round 2 is under way and restarted with its key
      once the SuperLink has marked it offline (the same node id): round 2 completes with the
      other three, metrics.jsonl names client 3, the claiming node does not take client 3 over,
      and the restarted SuperNode serves it again in round 3, in the same cluster;
    - the numbers equal the same config run in-process with client 3 failing in round 2."""
    certs = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    out = tmp_path / "results"
    # 120 s: on one core (a pytest-xdist worker) a reply includes starting a ClientApp process per
    # node, which imports torch, flwr and stocfl: more than 30 s when the three nodes start at once,
    # over 60 s on a machine at half its speed. The killed node's tasks end sooner, when the
    # SuperLink marks it offline, so the timeout lengthens no round of a passing run
    # 5 rounds: the killed node can rejoin only once the SuperLink has marked it offline (about 60 s
    # after the kill, whatever the run does), and a busy machine may need another round for it
    exp = _experiment(tmp_path / "exp.toml", 5, 4, "client_timeout = 120.0\n")
    with Deployment(tmp_path, certs, auth=True) as d:
        keys = {name: d.node_key(name) for name in ("n0", "n12", "n3", "evil")}
        ids = {name: d.register(path) for name, path in keys.items()}
        bindings = tmp_path / "node-keys.toml"
        bindings.write_text(
            "".join(
                f'[[node]]\nkey = "{keys[n]}"\nclients = "{c}"\n\n'
                for n, c in [("n0", "0"), ("n12", "1-2"), ("n3", "3")]
            )
        )
        d.start_supernode("0-3", key="evil")  # first online, claiming every client
        wait_for(lambda: ids["evil"] in d.online(), 120, "the claiming node online, before the others")
        for clients, name in (("0", "n0"), ("1-2", "n12"), ("3", "n3")):
            d.start_supernode(clients, key=name)
        run = d.flwr_run(exp, out, 4, node_keys=bindings)
        wait_for(lambda: rows(out), 300, "round 1 in metrics.jsonl")
        d.kill_supernode("3")  # round 2's tasks are already on their way to it
        # an authenticated SuperNode rejoins under its node id once the SuperLink has marked that
        # id offline (missed heartbeats); before, Flower refuses to activate it (exit code 305)
        wait_for(lambda: ids["n3"] not in d.online(), 180, "node 3 marked offline", poll=2)
        d.start_supernode("3", key="n3")
        summary = _finish(d, run, out)
        assert "insecure" not in d.log("supernode0.log").lower()
        server_log = d.log("flwr_run.log")
        assert f"Flower node {ids['evil']} did not say which clients it serves" in server_log, server_log[-3000:]
    metrics = rows(out)
    assert [r["round"] for r in metrics] == [1, 2, 3, 4, 5]
    dropped = [r["dropped_clients"] for r in metrics]
    assert dropped[0] == [] and dropped[1] == [3], metrics
    back = next(t for t, d in enumerate(dropped) if t > 1 and d == [])  # the round it serves client 3 again
    assert all(d == [3] for d in dropped[1:back]) and all(d == [] for d in dropped[back:]), dropped
    assert all(r["node_takeovers"] == 0 for r in metrics), "no node takes a bound client over"
    assert summary["rounds_done"] == 5 and summary["n_clusters"] == 2 and summary["ari"] == 1.0, summary
    assert d.all_stopped(), "every process started by the test must be gone"
    assert not list(ROOT.glob(":flwr*")), "the SuperLink's state must not land in the project"
    # the same config in-process, client 3 failing in the rounds it failed over Flower: the same numbers
    cfg = configure.load(str(exp))
    probe = Experiment(cfg, None)
    ex = DropWhileFailing(probe.fed, probe.model)
    local_run = Experiment.create(cfg, tmp_path / "local", ex)
    for t, d in enumerate(dropped, 1):
        ex.failing = d == [3]
        local_run.run(progress=False, stop_after=t)
    local = local_run.run(progress=False)
    assert [r["dropped_clients"] for r in local_run.rows] == [r["dropped_clients"] for r in metrics]
    assert local["n_clusters"] == summary["n_clusters"]
    assert abs(local["accuracy"] - summary["accuracy"]) <= 1e-4, (local["accuracy"], summary["accuracy"])
    assert abs(local["global_accuracy"] - summary["global_accuracy"]) <= 1e-4
