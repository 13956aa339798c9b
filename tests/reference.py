"""Plain PyTorch references for local training: an nn.Module, torch.optim and the same
mini-batch order as the executors, the proximal term by autograd."""

from __future__ import annotations

import torch
from torch import nn

from stocfl.client.optim import Optimizer
from stocfl.client.training import batch_plan


def torch_optimizer(opt: Optimizer, params):
    if opt.name == "adam":
        return torch.optim.Adam(
            params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay, foreach=False
        )
    return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, foreach=False)


def plain_training(module: nn.Module, task, x, y) -> torch.Tensor:
    """``task`` (a Train) run on (x, y) the way a tutorial writes it; the final flat weights."""
    torch.nn.utils.vector_to_parameters(task.weights.clone(), module.parameters())
    opt = torch_optimizer(task.local.optimizer, module.parameters())
    for epoch in batch_plan(len(y), task.local.epochs, task.local.batch_size, task.seed):
        for idx in epoch or [torch.arange(len(y))]:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(module(x[idx]), y[idx])
            if task.prox_center is not None and task.prox_weight:
                w = torch.nn.utils.parameters_to_vector(module.parameters())
                loss = loss + task.prox_weight / 2 * (w - task.prox_center).pow(2).sum()
            loss.backward()
            opt.step()
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach()
