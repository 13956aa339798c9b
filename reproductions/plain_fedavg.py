"""Plain-torch FedAvg of one domain, a reference for StoCFL Table 3's lambda = 0 rows.

At lambda = 0 a StoCFL cluster model is FedAvg over its cluster's clients. This script trains that
FedAvg with nothing from stocfl but the data loader: 100 clients x 600 images of one data set (all
60,000), 10 of them a round (10% of the 200 hybrid clients fall about half in each domain), E local
epochs of SGD, a plain mean, the MLP 784-2048-10, and the 10,000-image test set every 5 rounds.

    .venv/bin/python reproductions/plain_fedavg.py fashion_mnist --data-dir DIR [--batch-size 50]

--batch-size 0 (the default) is full batch, Table 1's stated training. DIR holds mnist/ and
fashion_mnist/ as stocfl reads them (reproductions/fashion-mnist.sh builds one with all 70,000
Fashion-MNIST images).
"""

import argparse
import sys
import time

import numpy as np
import torch

from stocfl.data.datasets import load_dataset
from stocfl.errors import UserError


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", choices=["mnist", "fashion_mnist"])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--batch-size", type=int, default=0, help="0 = full batch")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.batch_size < 0 or a.lr <= 0 or a.epochs < 1 or a.rounds < 1 or not 1 <= a.per_round <= 100:
        print(
            "plain_fedavg: need --batch-size >= 0, --lr > 0, --epochs >= 1, --rounds >= 1, 1 <= --per-round <= 100",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(a.threads)
    try:
        d = load_dataset(a.dataset, a.data_dir)
    except UserError as e:
        print(f"plain_fedavg: {e}", file=sys.stderr)
        return 2
    if len(d.y_train) < 60000:
        print(
            f"plain_fedavg: {a.dataset} in {a.data_dir} has {len(d.y_train)} train images, 100 clients x 600 "
            "need 60,000 (reproductions/fashion-mnist.sh builds a data directory with all of them)",
            file=sys.stderr,
        )
        return 2
    x, y = d.x_train[:60000].reshape(60000, -1), d.y_train[:60000]
    xt, yt = d.x_test.reshape(len(d.y_test), -1), d.y_test

    g = torch.Generator().manual_seed(a.seed)
    torch.manual_seed(a.seed)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))

    model = mlp()
    shards = torch.randperm(60000, generator=g).reshape(100, 600)
    rng = np.random.default_rng(a.seed)
    bs = a.batch_size or 600
    t0 = time.time()
    for r in range(1, a.rounds + 1):
        states = []
        for c in rng.choice(100, size=a.per_round, replace=False):
            local = mlp()
            local.load_state_dict(model.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=a.lr)
            xi, yi = x[shards[c]], y[shards[c]]
            for _ in range(a.epochs):
                order = torch.randperm(600, generator=g) if a.batch_size else torch.arange(600)
                for i in range(0, 600, bs):
                    idx = order[i : i + bs]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(local(xi[idx]), yi[idx]).backward()
                    opt.step()
            states.append(local.state_dict())
        model.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})
        if r % 5 == 0 or r == a.rounds:
            with torch.no_grad():
                acc = float((model(xt).argmax(1) == yt).float().mean()) * 100
            print(
                f"{a.dataset} batch={a.batch_size or 'full'} lr={a.lr} round {r}: {acc:.2f}% "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
