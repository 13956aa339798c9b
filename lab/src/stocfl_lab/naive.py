"""The plain PyTorch FedAvg of the tutorials, the reference the benchmarks time stocfl against: a
DataLoader, ``torch.optim.SGD`` and a deep copy of the module per client."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def tutorial_fit(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, lr: float
) -> nn.Module:
    """Local training as tutorials write it: a DataLoader (shuffled; batch 0 = full batch) and
    torch.optim.SGD on ``module``, in train mode, in place."""
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size or len(y), shuffle=True)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    module.train()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            opt.step()
    return module


def naive_round(fed, module: nn.Module, w0: torch.Tensor, clients, epochs, batch_size, lr) -> list[torch.Tensor]:
    """How many FL frameworks do it: a module copy, an optimizer and a DataLoader per client
    (``fed`` and ``module`` on the device to time)."""
    torch.nn.utils.vector_to_parameters(w0.clone().to(next(module.parameters()).device), module.parameters())
    return [
        torch.nn.utils.parameters_to_vector(
            tutorial_fit(copy.deepcopy(module), *fed.train_data(i), epochs, batch_size, lr).parameters()
        ).detach()
        for i in clients
    ]
