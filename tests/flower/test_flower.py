"""Flower as the transport: the message codec and the simulation engine (real Flower, Ray)."""

import json
import math
import time

import pytest
import torch

from stocfl.algorithms.stocfl.representation import Represent, Represented
from stocfl.cli import main
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import BadResult, Evaluate, Evaluated, Train, Trained, check_result
from stocfl.client.training import LocalTraining

flwr = pytest.importorskip("flwr", reason="Flower is part of the test extra: pip install -e '.[test]'")
from flwr.app import ConfigRecord, RecordDict  # noqa: E402

from stocfl.flower.codec import BadReply, decode_results, decode_tasks, encode_results, encode_tasks, message_type  # noqa: E402
from tests.flower.grid import ScriptedGrid, in_a_run  # noqa: E402,F401 (a fixture)

pytestmark = pytest.mark.flower  # starts Flower processes (left out of make test-fast)

ONE_EPOCH = LocalTraining.sgd(1, 0, 0.1)  # one full-batch epoch of plain SGD

W = torch.arange(6, dtype=torch.float32)


@pytest.mark.parametrize(
    "task",
    [
        Train(3, W, LocalTraining.sgd(2, 10, 0.1), 77, W + 1, 0.05),
        Train(3, W, LocalTraining.sgd(1, 0, 0.5), 5),
        Train(3, W, LocalTraining(3, 7, Optimizer("adam", 0.01, 0.0, 1e-4, 0.8, 0.99, 1e-7)), 5),
        Train(3, W, LocalTraining(1, 5, Optimizer("sgd", 0.05, momentum=0.9, weight_decay=1e-3)), 6, W, 0.5),
        Evaluate(3, W, "train"),
        Represent(3, W, "update", "linear", LocalTraining.sgd(20, 50, 0.1), 9, 1024, 11),
    ],
)
def test_tasks_survive_the_message_codec(task):
    twin = type(task)(**{**task.__dict__, "weights" if hasattr(task, "weights") else "anchor": W * 2})
    backs = decode_tasks(message_type(type(task)), encode_tasks([task, twin]))  # one message, two tasks
    assert len(backs) == 2
    for sent, back in zip([task, twin], backs):
        assert type(back) is type(sent)
        for field in sent.__dataclass_fields__:
            a, b = getattr(sent, field), getattr(back, field)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("local.optimizer.name", "rmsprop", "is not one of 'sgd', 'adam'"),
        ("local.optimizer.lr", "fast", "is not a number"),
        ("local.epochs", 1.5, "is not an integer"),
        ("local.optimizer.momentum", float("nan"), "is not finite"),
        ("split", "validation", "is not one of 'train', 'test'"),
    ],
)
def test_a_nested_or_literal_value_of_the_wrong_kind_is_refused_by_name(key, value, says):
    task = Evaluate(3, W) if key == "split" else Train(3, W, ONE_EPOCH, 1)
    content = encode_tasks([task])
    content["0.task"][key] = value
    with pytest.raises(BadReply, match=f"{key} = .*{says}"):
        decode_tasks(message_type(type(task)), content)


def test_a_message_carries_one_kind_of_task_for_any_clients_of_a_node():
    two = decode_tasks(
        "train",
        encode_tasks([Train(3, W, ONE_EPOCH, 1), Train(4, W, ONE_EPOCH, 1)]),
    )
    assert [t.client for t in two] == [3, 4]
    with pytest.raises(ValueError):
        encode_tasks([Train(3, W, ONE_EPOCH, 1), Evaluate(3, W)])


def test_node_config_names_the_clients_a_node_serves():
    from stocfl.flower.engine import served_clients

    assert served_clients({"client-id": 3}, 20) == [3]
    assert served_clients({"partition-id": 5, "num-partitions": 20}, 20) == [5]
    assert served_clients({"partition-id": 1, "num-partitions": 3}, 8) == [1, 4, 7]  # run.sim_nodes = 3
    assert served_clients({"client-ids": "0-2,7, 9-10"}, 20) == [0, 1, 2, 7, 9, 10]
    for bad in ("a-b", "3-1", ""):
        with pytest.raises(ValueError, match="client-ids"):
            served_clients({"client-ids": bad}, 20)
    with pytest.raises(ValueError, match="clients 0-9"):
        served_clients({"client-ids": "8-12"}, 10)
    with pytest.raises(ValueError, match="client-id=<i>"):
        served_clients({}, 20)
    with pytest.raises(ValueError, match=r"would serve clients \[-1\]"):  # served nobody, without a word
        served_clients({"client-id": -1}, 20)
    with pytest.raises(ValueError, match="num-partitions=0"):
        served_clients({"partition-id": 0, "num-partitions": 0}, 20)


def decode_result(task, result, client):
    return decode_results([task], encode_results([result], [client]))[0]


def test_replies_are_checked_before_aggregation():
    t = Train(3, W, ONE_EPOCH, 1)
    assert torch.equal(decode_result(t, Trained(W + 1, 10), 3).weights, W + 1)
    with pytest.raises(BadResult, match="shape"):  # the length is checked against the task, for every engine
        check_result(t, decode_result(t, Trained(torch.zeros(5), 10), 3), 10, 10)
    with pytest.raises(BadReply, match="NaN or inf"):
        decode_result(t, Trained(torch.full((6,), math.nan), 10), 3)
    with pytest.raises(BadReply, match="from client 4"):
        decode_result(t, Trained(W, 10), 4)
    with pytest.raises(BadReply, match="1 results for 2 tasks"):
        decode_results([t, t], encode_results([Trained(W, 10)], [3]))
    with pytest.raises(BadReply, match="2 results for 1 tasks"):
        decode_results([t], encode_results([Trained(W, 10), Trained(W, 10)], [3, 3]))
    with pytest.raises(BadReply, match="expected records"):
        decode_results([t], RecordDict({"clients": ConfigRecord({"ids": [3]})}))
    u = Train(4, W, ONE_EPOCH, 2)
    two = decode_results([t, u], encode_results([Trained(W, 10), Trained(W + 1, 10)], [3, 4]))
    assert [torch.equal(r.weights, w) for r, w in zip(two, (W, W + 1))] == [True, True]
    with pytest.raises(BadReply, match="from client 3 to a task for client 4"):  # results swapped
        decode_results([u, t], encode_results([Trained(W, 10), Trained(W + 1, 10)], [3, 4]))
    e = decode_result(Evaluate(3, W), Evaluated(0.5, 7, 10), 3)
    assert (e.loss, e.correct, e.n_samples) == (0.5, 7, 10)
    with pytest.raises(BadReply, match="not finite"):
        decode_result(Evaluate(3, W), Evaluated(math.inf, 7, 10), 3)
    r = decode_result(Represent(3, W), Represented(torch.ones(4), 10), 3)
    assert r.psi.shape == (4,)
    with pytest.raises(BadReply, match="correct = 7.5 is not an integer"):
        decode_result(Evaluate(3, W), Evaluated(0.5, 7.5, 10), 3)


def test_flower_simulation_agrees_with_the_local_engine(tmp_path, capfd, recwarn):
    """A 20-client StoCFL run through Flower's simulation engine (one SuperNode per client)
    gives the same clusters and accuracies as the in-process engine, without Flower's
    deprecation banner or Ray's warnings about a future default."""
    common = [
        "configs/default.toml",
        "--quiet",
        "--set",
        "scenario.n_clients=20",
        "--set",
        "run.rounds=4",
        "--set",
        "run.client_timeout=300.0",
        "--set",
        "run.sample_rate=0.3",
    ]
    assert main(["run", *common, "--engine", "local", "--out", str(tmp_path / "local")]) == 0
    assert main(["run", *common, "--engine", "flower-sim", "--out", str(tmp_path / "flower")]) == 0
    # two simulated SuperNodes sharing the 20 clients: one message per node and kind of task
    assert (
        main(["run", *common, "--engine", "flower-sim", "--set", "run.sim_nodes=2", "--out", str(tmp_path / "flower2")])
        == 0
    )
    rows = [
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("local", "flower", "flower2")
    ]
    assert len(rows[0]) == len(rows[1]) == len(rows[2]) == 4
    for other in rows[1:]:
        for a, b in zip(rows[0], other):
            assert a["n_clusters"] == b["n_clusters"] and a["ari"] == b["ari"]
            assert abs(a["accuracy"] - b["accuracy"]) <= 1e-4
            assert abs(a["global_accuracy"] - b["global_accuracy"]) <= 1e-4
    assert not (tmp_path / "flower" / ".flwr").exists(), "Flower's home is a temporary directory, removed"
    err = capfd.readouterr().err
    assert "DEPRECATED FEATURE" not in err and "Manually terminating" not in err, err[-2000:]
    assert not [w for w in recwarn if "Ray" in str(w.message)], [str(w.message) for w in recwarn]


def test_certs_command_writes_a_ca_and_a_server_certificate_it_signed(tmp_path, capsys):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    d = tmp_path / "certs"
    assert main(["certs", str(d), "--host", "127.0.0.1", "--host", "superlink.example"]) == 0
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "ca.key", "server.key", "server.pem"]
    assert oct((d / "server.key").stat().st_mode & 0o777) == "0o600"
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((d / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    ca.public_key().verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(server.signature_hash_algorithm))
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example"]
    capsys.readouterr()
    assert main(["certs", str(d)]) == 2  # a new CA would lock out the SuperNodes holding the old one
    assert "exists" in capsys.readouterr().err
    assert main(["certs", str(tmp_path / "other"), "--days", "0"]) == 2


def test_deployed_server_body_resumes_a_stopped_run_over_flower(tmp_path, monkeypatch):
    """`flwr run` with an `out` that holds a stopped run continues it from its checkpoint (the
    deployment's ServerApp body, here on Flower's simulation engine) and ends where an
    uninterrupted run ends."""
    import tomllib

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment
    from stocfl.flower.engine import client_app, deployed_main

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    exp = tmp_path / "exp.toml"
    exp.write_text(
        '[run]\nrounds = 4\nsample_rate = 0.5\n\n[scenario]\nname = "rotated"\ndataset = "digits"\n'
        'n_clients = 8\nsamples_per_client = 30\n\n[algorithm]\nname = "stocfl"\n'
    )
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    Experiment.create(configure.load(str(exp)), whole).run(progress=False)
    assert Experiment.create(configure.load(str(exp)), stopped).run(progress=False, stop_after=2) is None

    server = ServerApp()

    @server.main()
    def _main(grid, context):
        deployed_main(grid, {"config": str(exp), "out": str(stopped), "n-clients": 8})

    run_simulation(
        server,
        client_app(tomllib.loads(exp.read_text())),
        num_supernodes=8,
        backend_config={"client_resources": {"num_cpus": 1}},
    )
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, stopped)]
    assert [r["round"] for r in rows[1]] == [1, 2, 3, 4]
    for a, b in zip(*rows):
        assert a["ari"] == b["ari"] and abs(a["accuracy"] - b["accuracy"]) <= 1e-4
    assert json.loads((stopped / "summary.json").read_text())["rounds_done"] == 4


def test_a_client_that_cannot_start_stops_the_run_with_its_reason(tmp_path, monkeypatch):
    """A SuperNode whose ClientApp cannot build its data answers the identity query with an
    error; the server gives up at once with that reason instead of training without it."""
    import time

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from stocfl.errors import UserError
    from stocfl.flower.engine import FlowerExecutor, client_app

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    raw = {"scenario": {"name": "rotated", "dataset": "mnist", "n_clients": 2, "data_dir": str(tmp_path / "nowhere")}}
    result = {}
    server = ServerApp()

    @server.main()
    def _main(grid, context):
        t = time.monotonic()
        try:
            FlowerExecutor(grid, timeout=60.0).connect(2, wait=100.0)
        except UserError as err:
            result["error"], result["seconds"] = str(err), time.monotonic() - t

    run_simulation(server, client_app(raw), num_supernodes=2, backend_config={"client_resources": {"num_cpus": 1}})
    assert "nowhere" in result["error"] and result["seconds"] < 60, result


def test_deployment_run_config_is_checked_before_anything_starts(tmp_path):
    from stocfl.errors import UserError
    from stocfl.flower.engine import run_config_paths

    exp = tmp_path / "exp.toml"
    exp.write_text("[run]\nrounds = 1\n")
    out = tmp_path / "results"
    assert run_config_paths({"config": str(exp), "out": str(out), "n-clients": 3}) == (exp, out, 3)
    for bad, match in [
        ({"config": str(exp), "out": "results"}, "out="),
        ({"config": "exp.toml", "out": str(out)}, "config="),
        ({"config": str(tmp_path / "missing.toml"), "out": str(out)}, "config="),
        ({"config": str(exp), "out": str(out), "n-clients": -1}, "n-clients"),
        ({"config": str(exp), "out": str(out), "n-clients": "three"}, "n-clients"),
    ]:
        with pytest.raises(UserError, match=match):
            run_config_paths(bad)
    out.mkdir()
    (out / "config.toml").write_text("")
    assert run_config_paths({"config": "", "out": str(out)})[1:] == (out, 0)  # resuming needs no config


def test_every_task_kind_is_routed_by_its_category_and_action():
    """Flower routes a message by CATEGORY.ACTION: two kinds with one action in two categories
    (the mixture family's train.mixture and evaluate.mixture) both get their own route."""
    from stocfl.client.tasks import KINDS
    from stocfl.flower.engine import client_app

    app = client_app({})
    routes = set(app._registered_funcs)  # Flower's own table of routes
    for kind in KINDS.values():
        category, _, action = kind.message.partition(".")
        assert f"{category}.{action or 'default'}" in routes, kind.message


def test_the_wait_for_nodes_follows_their_progress_not_a_fixed_deadline(in_a_run):
    """Finding 29: nodes that identify slowly, one every 0.3 s, each within run.node_wait
    (0.5 s) of the last, are all waited for, though the last answers after 1.5 s; a federation
    whose last nodes stall is given up 0.5 s after the last answer, in simulation words when
    simulated."""
    from stocfl.errors import UserError
    from stocfl.flower.engine import FlowerExecutor

    claims = {n: [n - 1] for n in range(1, 6)}
    slow = ScriptedGrid(range(1, 6), claims, {n: 0.3 * n for n in range(1, 6)})
    t = time.monotonic()
    ex = FlowerExecutor(slow, n_clients=5).connect(5, wait=0.5)
    assert ex.node_of == {c: c + 1 for c in range(5)} and time.monotonic() - t >= 1.4
    stalled = ScriptedGrid(range(1, 6), claims, {1: 0.1, 2: 0.2, 3: 0.3, 4: None, 5: None})
    t = time.monotonic()
    with pytest.raises(UserError) as err:
        FlowerExecutor(stalled, n_clients=5).connect(5, wait=0.5, simulated=True)
    assert 0.7 <= time.monotonic() - t < 5
    said = str(err.value)
    assert said.startswith("only 3 of 5 simulated Flower clients answered, and none more for 0.5 s (load average")
    assert "--set run.node_wait=<seconds> (now 0.5)" in said and "SuperNode" not in said
    with pytest.raises(
        UserError, match='none more for 0.5 s; start a SuperNode per client with --node-config "client-id'
    ):
        FlowerExecutor(ScriptedGrid(range(1, 6), claims, {4: None, 5: None}), n_clients=5).connect(5, wait=0.5)


@pytest.mark.flower
def test_a_simulation_whose_nodes_do_not_start_in_time_is_one_line_and_leaves_no_flower_home(tmp_path, capsys):
    """Finding 29: a flower-sim run that gives up waiting for its simulated nodes says so in
    simulation words, names run.node_wait, and leaves no .flwr directory anywhere it made."""
    import os

    before = os.environ.get("FLWR_HOME")
    out = tmp_path / "r"
    code = main(
        [
            "run",
            "--quiet",
            "--engine",
            "flower-sim",
            "--out",
            str(out),
            "--set",
            "scenario.n_clients=4",
            "--set",
            "run.rounds=1",
            "--set",
            "run.node_wait=0.01",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("stocfl: error: only 0 of 4 simulated Flower clients answered"), err
    assert "run.node_wait" in err
    assert not (out / ".flwr").exists() and os.environ.get("FLWR_HOME") == before
