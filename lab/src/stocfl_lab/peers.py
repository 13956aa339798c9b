"""``stocfl-lab bench --peers``: the same FedAvg work on stocfl and on its peers, in one command.

Systems, each as its users write it:

- ``stocfl``: ``stocfl.run`` with FedAvg, ``run.engine = "auto"``;
- ``naive``: a tutorial's PyTorch loop, with a module copy, a DataLoader and torch.optim.SGD
  per client;
- ``pfl``: pfl-research's FedAvg simulation (``pfl`` package, PyTorch backend:
  ``PyTorchModel``, ``FederatedDataset``, ``SimulatedBackend``, ``FederatedAveraging``);
- ``flower``: Flower's simulation engine with a plain ``NumPyClient`` and its ``FedAvg``
  strategy, which samples the round's clients itself (Ray's start-up is left out of the round
  times).

Cases:

- (a) the StoCFL paper's Rotated MNIST: 480 clients of 50 (N = 4800 at 10%), MLP 784-2048-10,
  5 full-batch epochs, lr 0.1, every client each round;
- (b) pfl-research's CIFAR-10 benchmark shape: 1,000 clients x 50 images, 50 per round, batch
  10, 1 epoch, its simple CNN without dropout;
- (c) many small clients: 500 digits clients x 10 (rotated digits: 500 x 10 needs more than the
  1,347 train images), batch 10, 5 epochs, every client each round.

Every system runs the same rounds on the same clients' data with the same number of local steps
and lr, each in a process of its own (:func:`run_isolated`), repeated in alternating order
(:func:`bench_peers`). The seconds per round are the mean over the rounds after the first
(warm-up), and a system's figure is the median of its repetitions. The
global model's accuracy on every client's test data after the last round is reported, to show
that nobody skipped work. A peer that is not installed is skipped with a note.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stocfl.data import Federation, build
from stocfl_lab.naive import naive_round, tutorial_fit


@dataclass
class Case:
    name: str
    fed: Federation
    module: Callable[[], nn.Module]
    per_round: int
    epochs: int
    batch_size: int  # 0 = full batch
    lr: float
    rounds: int


def pfl_cnn(n_classes: int = 10) -> nn.Module:
    """pfl-research's simple CNN for CIFAR-10 (two 3x3 convolutions of 32 and 64 channels, a 2x2
    max-pool, a dense layer of 128), without its dropout layers."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 14 * 14, 128),
        nn.ReLU(),
        nn.Linear(128, n_classes),
    )


def case(name: str, data_dir: str, quick: bool = False) -> Case:
    """Case ``name`` (one of :data:`CASES`), its federation built."""
    s = 4 if quick else 1
    if name == "a_rotated_mnist_480x50_mlp2048":
        mnist = build("rotated", "mnist", 480 // s, 50, seed=0, data_dir=data_dir)
        mlp = lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 10))  # noqa: E731
        return Case(name, mnist, mlp, mnist.n_clients, 5 if not quick else 1, 0, 0.1, 3)
    if name == "b_cifar10_1000x50_cnn":
        cifar = build("iid", "cifar10", 1000 // s, 50, seed=0, data_dir=data_dir)
        return Case(name, cifar, pfl_cnn, 50 // s, 1, 10, 0.05, 4)
    if name == "c_digits_500x10":
        digits = build("rotated", "digits", 500 // s, 10, seed=0)  # 4 rotations: 500 x 10 needs more than 1,347 images
        small = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))  # noqa: E731
        return Case(name, digits, small, digits.n_clients, 5, 10, 0.1, 4)
    raise ValueError(f"unknown case {name!r}; choose one of {', '.join(CASES)}")


CASES = ("a_rotated_mnist_480x50_mlp2048", "b_cifar10_1000x50_cnn", "c_digits_500x10")


def _accuracy(module: nn.Module, fed: Federation) -> float:
    module.eval()
    with torch.no_grad():
        correct = sum(
            int((module(fed.x_test[a : a + 4096]).argmax(1) == fed.y_test[a : a + 4096]).sum())
            for a in range(0, len(fed.y_test), 4096)
        )
    return correct / len(fed.y_test)


def _plan(case: Case, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    n = case.fed.n_clients
    return [sorted(rng.choice(n, case.per_round, replace=False).tolist()) for _ in range(case.rounds)]


def _mean_after_first(times: list[float]) -> float:
    return float(np.mean(times[1:] if len(times) > 1 else times))


# ---- the systems ------------------------------------------------------------------------------
def run_stocfl(case: Case) -> dict[str, Any]:
    import stocfl

    torch.manual_seed(0)
    result = stocfl.run(
        {
            "algorithm": {"name": "fedavg"},
            "run": {
                "rounds": case.rounds,
                "sample_rate": case.per_round / case.fed.n_clients,
                "eval_every": case.rounds + 1,
                "engine": "auto",
            },
            "train": {"epochs": case.epochs, "batch_size": case.batch_size, "lr": case.lr},
        },
        federation=case.fed,
        model=case.module(),
    )
    seconds = [r["seconds"] for r in result.metrics]
    return {
        "seconds_per_round": _mean_after_first(seconds[:-1] if len(seconds) > 2 else seconds),
        "accuracy": result.summary["global_accuracy"],
        "engine": result.summary["engine"],
    }


def run_naive(case: Case) -> dict[str, Any]:
    torch.manual_seed(0)
    model = case.module()
    times = []
    for clients in _plan(case):
        t = time.perf_counter()
        states = naive_round(
            case.fed,
            model,
            torch.nn.utils.parameters_to_vector(model.parameters()).detach(),
            clients,
            case.epochs,
            case.batch_size,
            case.lr,
        )
        sizes = torch.tensor([float(case.fed.train_sizes[i]) for i in clients])
        w = torch.stack(states).T @ (sizes / sizes.sum())
        torch.nn.utils.vector_to_parameters(w, model.parameters())
        times.append(time.perf_counter() - t)
    return {"seconds_per_round": _mean_after_first(times), "accuracy": _accuracy(model, case.fed)}


def run_pfl(case: Case) -> dict[str, Any]:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    class Module(nn.Module):  # pfl asks the module for its loss and metrics
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

        def loss(self, x, y, eval=False):  # pfl hands labels over as floats
            self.eval() if eval else self.train()
            return nn.functional.cross_entropy(self(x), y.long())

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return {"accuracy": Weighted(float((self(x).argmax(1) == y.long()).sum()), len(y))}

    class Clock(TrainingProcessCallback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.times.append(time.perf_counter())
            return False, Metrics()

    torch.manual_seed(0)
    np.random.seed(0)
    fed = case.fed
    users = {i: [x.numpy(), y.numpy()] for i in range(fed.n_clients) for x, y in [fed.train_data(i)]}
    plan = iter([i for r in _plan(case) for i in r])
    train = FederatedDataset(lambda i: Dataset(users[i], user_id=str(i)), lambda: next(plan))
    val = FederatedDataset(lambda i: Dataset(users[i], user_id=str(i)), lambda: 0)
    module = Module(case.module())
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    clock = Clock()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=case.rounds,
            evaluation_frequency=case.rounds + 1,
            train_cohort_size=case.per_round,
            val_cohort_size=None,
        ),
        backend=SimulatedBackend(training_data=train, val_data=val),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=case.epochs, local_learning_rate=case.lr, local_batch_size=case.batch_size or None
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[clock],
    )
    return {
        "seconds_per_round": _mean_after_first(list(np.diff(clock.times))),
        "accuracy": _accuracy(module.inner, fed),
    }


def run_flower(case: Case) -> dict[str, Any]:
    import logging
    import os
    import tempfile

    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    fed = case.fed
    torch.manual_seed(0)
    start = case.module()

    def get(m):
        return [p.detach().numpy().copy() for p in m.state_dict().values()]

    def put(m, arrays):
        m.load_state_dict({k: torch.tensor(a) for k, a in zip(m.state_dict(), arrays)})

    class Client(NumPyClient):
        def __init__(self, i):
            self.i = i

        def fit(self, parameters, config):
            m = case.module()
            put(m, parameters)
            x, y = fed.train_data(self.i)
            return get(tutorial_fit(m, x, y, case.epochs, case.batch_size, case.lr)), len(y), {}

    times, final = [], {}

    def evaluate(server_round, arrays, config):
        times.append(time.perf_counter())
        final["arrays"] = arrays
        return None

    def server_fn(context: Context):
        strategy = FedAvg(
            fraction_fit=case.per_round / fed.n_clients,
            min_fit_clients=case.per_round,
            fraction_evaluate=0.0,
            min_evaluate_clients=0,
            min_available_clients=fed.n_clients,
            initial_parameters=ndarrays_to_parameters(get(start)),
            evaluate_fn=evaluate,
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=case.rounds))

    def client_fn(context: Context):
        torch.set_num_threads(1)
        return Client(int(context.node_config["partition-id"])).to_client()

    os.environ.setdefault("FLWR_HOME", tempfile.mkdtemp(prefix="stocfl-peers-flwr-"))
    logging.getLogger("flwr").setLevel(logging.ERROR)
    run_simulation(
        ServerApp(server_fn=server_fn),
        ClientApp(client_fn=client_fn),
        num_supernodes=fed.n_clients,
        backend_config={"client_resources": {"num_cpus": 1}},
    )
    model = case.module()
    put(model, final["arrays"])
    return {"seconds_per_round": _mean_after_first(list(np.diff(times))), "accuracy": _accuracy(model, fed)}


SYSTEMS: dict[str, tuple[Callable[[Case], dict[str, Any]], str | None]] = {
    "stocfl": (run_stocfl, None),
    "naive": (run_naive, None),
    "pfl": (run_pfl, "pfl"),
    "flower": (run_flower, "flwr"),
}


def fraction_of_peak(case: Case, seconds_per_round: float, peak_gflops: float) -> float:
    """Work per round counted as 6 x parameters per sample per epoch (the plain path's count for
    dense layers; convolutions do more per parameter, the low-rank path less), over the measured
    float32 matmul peak."""
    params = sum(p.numel() for p in case.module().parameters())
    samples = case.per_round * float(case.fed.train_sizes.mean())
    return round(6.0 * params * samples * case.epochs / seconds_per_round / 1e9 / peak_gflops, 3)


REPEATED = ("stocfl", "naive", "pfl")  # Flower's rounds take minutes: it runs once


def run_isolated(case_name: str, system: str, data_dir: str, quick: bool, threads: int) -> dict[str, Any]:
    """One system on one case in a process of its own, as its users run it: nothing one system
    sets up (threads, allocator, imports) changes another's figures."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "stocfl_lab.peers", case_name, system, data_dir, str(threads)] + (
        ["quick"] if quick else []
    )
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench --peers: {system} on {case_name} failed: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_peers(
    data_dir: str,
    peak: float,
    threads: int,
    quick: bool = False,
    repeats: int = 3,
    only: list[str] | None = None,
    cases: list[str] | None = None,
    log=print,
    out: dict[str, Any] | None = None,
    saved=lambda: None,
) -> dict[str, Any]:
    """Per case, each system ``repeats`` times in alternating order (stocfl first, then last,
    ...), each time in a fresh process; a system's figure is the median of its repetitions.
    On a shared machine one sample can be 20% off; alternating spreads slow spells over all.
    Each case goes into ``out`` as it ends, and ``saved()`` is called."""
    import importlib.util

    out = {} if out is None else out
    out.update({"cases": [], "skipped": {}, "repeats": repeats})
    for name, (_, module) in SYSTEMS.items():
        if module is not None and importlib.util.find_spec(module) is None:
            out["skipped"][name] = f"{module} is not installed (pip install -e '.[bench]')"
    systems = [n for n in SYSTEMS if n not in out["skipped"] and (not only or n in only)]
    for case_name in cases or CASES:
        c = case(case_name, data_dir, quick)
        row: dict[str, Any] = {
            "case": case_name,
            "clients": c.fed.n_clients,
            "per_round": c.per_round,
            "epochs": c.epochs,
            "batch_size": c.batch_size or "full",
            "rounds": c.rounds,
            "systems": {},
        }
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in systems}
        for r in range(repeats):
            order = systems if r % 2 == 0 else systems[::-1]
            for name in order:
                if r and name not in REPEATED:
                    continue
                log(f"{case_name}: {name} (repetition {r + 1}) ...")
                runs[name].append(run_isolated(case_name, name, data_dir, quick, threads))
                log(f"{case_name}: {name}: {runs[name][-1]}")
        for name, rs in runs.items():
            secs = [x["seconds_per_round"] for x in rs]
            row["systems"][name] = {**rs[0], "seconds_per_round": float(np.median(secs)), "repetitions": secs}
        row["stocfl_fraction_of_peak"] = fraction_of_peak(c, row["systems"]["stocfl"]["seconds_per_round"], peak)
        base = row["systems"]["stocfl"]["seconds_per_round"]
        row["ratios"] = {k: round(v["seconds_per_round"] / base, 2) for k, v in row["systems"].items()}
        accs = [v["accuracy"] for v in row["systems"].values()]
        row["accuracy_spread"] = round(max(accs) - min(accs), 4)
        out["cases"].append(row)
        saved()
    return out


def _main(argv: list[str]) -> None:
    """``python -m stocfl.peers CASE SYSTEM DATA_DIR THREADS [quick]``: one measurement, as JSON."""
    import json

    case_name, system, data_dir, threads = argv[:4]
    torch.set_num_threads(int(threads))
    result = SYSTEMS[system][0](case(case_name, data_dir, "quick" in argv[4:]))
    print(json.dumps(result))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
