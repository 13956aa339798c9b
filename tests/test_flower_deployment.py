"""Real Flower deployments on 127.0.0.1: a SuperLink, SuperNodes and `flwr run` as separate
processes, the stocfl Flower app (flower_app/) on top."""

import json

import pytest

pytest.importorskip("flwr", reason="Flower is part of the test extra: pip install -e '.[test]'")

from flower_deployment import ROOT, Deployment, rows, wait_for  # noqa: E402

from stocfl.cli import main  # noqa: E402
from stocfl.flower.certs import make_certificates  # noqa: E402


def _experiment(path, rounds, n_clients, extra=""):
    """Hybrid digits, clients in 2 groups; clients are evaluated after the last round only (each
    message to a SuperNode starts a ClientApp process: about 4 s of CPU for imports and data)."""
    path.write_text(f'[run]\nrounds = {rounds}\nsample_rate = 1.0\neval_every = {rounds}\n{extra}\n[scenario]\nname = "hybrid"\n'
                    f'dataset = "digits"\nn_clients = {n_clients}\nsamples_per_client = 60\n\n[algorithm]\nname = "stocfl"\n')
    return path


def _finish(d, run, out, seconds=600):
    assert run.wait(timeout=seconds) == 0, d.log("flwr_run.log")[-3000:]
    # --stream may return just before the ServerApp writes the summary
    return json.loads(wait_for(lambda: (out / "summary.json").exists() and (out / "summary.json").read_text(), 120,
                               "summary.json"))


def test_stocfl_over_tls_superlink_and_three_supernodes(tmp_path):
    """Secure mode: the SuperLink serves TLS with a certificate signed by a CA made here; the
    SuperNodes and `flwr` trust only that CA. Four clients on three SuperNodes: one serves
    clients 1 and 2, which belong to different groups."""
    certs = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    out = tmp_path / "results"
    with Deployment(tmp_path, certs) as d:
        for clients in ("0", "1-2", "3"):
            d.start_supernode(clients)
        summary = _finish(d, d.flwr_run(_experiment(tmp_path / "exp.toml", 3, 4), out, 4), out)
        assert "insecure" not in d.log("supernode0.log").lower()
    assert summary["rounds_done"] == 3 and summary["n_clusters"] == 2 and summary["ari"] == 1.0, summary
    assert d.all_stopped(), "every process started by the test must be gone"
    assert not list(ROOT.glob(":flwr*")), "the SuperLink's state must not land in the project"
    # the same config in-process: the same numbers
    assert main(["run", str(tmp_path / "exp.toml"), "--quiet", "--out", str(tmp_path / "local")]) == 0
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert local["n_clusters"] == summary["n_clusters"]
    assert abs(local["accuracy"] - summary["accuracy"]) <= 1e-4, (local["accuracy"], summary["accuracy"])
    assert abs(local["global_accuracy"] - summary["global_accuracy"]) <= 1e-4


def test_killed_supernode_is_dropped_and_its_restart_rejoins(tmp_path):
    """SIGKILL one SuperNode while round 2 is under way: the round completes with the other two,
    metrics.jsonl names the dropped client; the SuperNode restarted with the same client id (a
    new node id) serves its client again in later rounds, in the same cluster."""
    out = tmp_path / "results"
    exp = _experiment(tmp_path / "exp.toml", 3, 3, "client_timeout = 30.0\n")
    with Deployment(tmp_path) as d:
        for i in range(3):
            d.start_supernode(str(i))
        run = d.flwr_run(exp, out, 3)
        wait_for(lambda: rows(out), 300, "round 1 in metrics.jsonl")
        d.kill_supernode("2")  # round 2's tasks are already on their way to it
        d.start_supernode("2")
        summary = _finish(d, run, out)
    metrics = rows(out)
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert metrics[0]["dropped_clients"] == [] and metrics[1]["dropped_clients"] == [2], metrics
    assert metrics[-1]["dropped_clients"] == [], "the restarted SuperNode must serve client 2 again"
    assert summary["rounds_done"] == 3 and summary["n_clusters"] == 2 and summary["ari"] == 1.0, summary
    assert d.all_stopped(), "every process started by the test must be gone"
    assert not list(ROOT.glob(":flwr*")), "the SuperLink's state must not land in the project"
