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
    # --stream may return just before the ServerApp writes the summary
    return json.loads(
        wait_for(lambda: (out / "summary.json").exists() and (out / "summary.json").read_text(), 120, "summary.json")
    )


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
      SuperNodes and `flwr` trust only that CA;
    - four clients on three SuperNodes, one of which serves clients 1 and 2 (different groups);
    - the SuperNode of client 3 is SIGKILLed while round 2 is under way and restarted with the
      same client id (a new node id): round 2 completes with the other three, metrics.jsonl names
      client 3, and the restarted SuperNode serves it again in round 3, in the same cluster;
    - the numbers equal the same config run in-process with client 3 failing in round 2."""
    certs = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    out = tmp_path / "results"
    # 60 s: on one core (a pytest-xdist worker) a reply includes starting a ClientApp process per
    # node, which imports torch, flwr and stocfl: more than 30 s when the three nodes start at once
    exp = _experiment(tmp_path / "exp.toml", 3, 4, "client_timeout = 60.0\n")
    with Deployment(tmp_path, certs) as d:
        for clients in ("0", "1-2", "3"):
            d.start_supernode(clients)
        run = d.flwr_run(exp, out, 4)
        wait_for(lambda: rows(out), 300, "round 1 in metrics.jsonl")
        d.kill_supernode("3")  # round 2's tasks are already on their way to it
        d.start_supernode("3")
        summary = _finish(d, run, out)
        assert "insecure" not in d.log("supernode0.log").lower()
    metrics = rows(out)
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert metrics[0]["dropped_clients"] == [] and metrics[1]["dropped_clients"] == [3], metrics
    assert metrics[-1]["dropped_clients"] == [], "the restarted SuperNode must serve client 3 again"
    assert summary["rounds_done"] == 3 and summary["n_clusters"] == 2 and summary["ari"] == 1.0, summary
    assert d.all_stopped(), "every process started by the test must be gone"
    assert not list(ROOT.glob(":flwr*")), "the SuperLink's state must not land in the project"
    # the same config in-process, client 3 failing in round 2: the same numbers
    cfg = configure.load(str(exp))
    probe = Experiment(cfg, None)
    ex = DropWhileFailing(probe.fed, probe.model)
    local_run = Experiment.create(cfg, tmp_path / "local", ex)
    local_run.run(progress=False, stop_after=1)
    ex.failing = True
    local_run.run(progress=False, stop_after=2)
    ex.failing = False
    local = local_run.run(progress=False)
    assert [r["dropped_clients"] for r in local_run.rows] == [r["dropped_clients"] for r in metrics]
    assert local["n_clusters"] == summary["n_clusters"]
    assert abs(local["accuracy"] - summary["accuracy"]) <= 1e-4, (local["accuracy"], summary["accuracy"])
    assert abs(local["global_accuracy"] - summary["global_accuracy"]) <= 1e-4
