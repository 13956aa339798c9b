"""FedCCFA: its client step against a plain PyTorch version written as the authors' code does
it (requires_grad switched per phase, torch.optim.SGD, the cosine contrast by
nn.CosineSimilarity over stacked anchors), MADD against its defining loop, DBSCAN's merge
groups, the server round's merges, a crafted reply refused, and the method on concept shift."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stocfl.algorithms.fedccfa import FedCCFA, merge_patterns
from stocfl.client.models import FlatModel
from stocfl.client.optim import Optimizer
from stocfl.client.split import (
    Split,
    SplitTrain,
    SplitTrained,
    balanced_sample,
    check_split_trained,
    madd,
    split_train,
    task_phase,
)
from stocfl.client.tasks import BadResult, ClientData
from stocfl.client.training import LocalTraining, batch_plan
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment
from tests.reference import torch_optimizer

C, D_IN, D_FEAT = 4, 6, 5


def module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_FEAT), nn.ReLU(), nn.Linear(D_FEAT, C))


def plain_step(mod: nn.Module, t: SplitTrain, x: torch.Tensor, y: torch.Tensor):
    """The authors' client step, as their code writes it (entities/FedCCFA.py), with stocfl's batch orders."""
    last = mod[-1]
    clf = {id(last.weight), id(last.bias)}

    def train(m, xs, ys, local, seed, head, align=None):
        for p in m.parameters():
            p.requires_grad = (id(p) in clf) == head
        opt = torch_optimizer(local.optimizer, [p for p in m.parameters() if p.requires_grad])
        feats = []
        h = m[-1].register_forward_pre_hook(lambda _m, a: feats.append(a[0]))
        for epoch in batch_plan(len(ys), local.epochs, local.batch_size, seed):
            for idx in epoch or [torch.arange(len(ys))]:
                feats.clear()
                loss = nn.CrossEntropyLoss()(m(xs[idx]), ys[idx])
                if align is not None:
                    loss = loss + align(feats[-1], ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        h.remove()

    torch.nn.utils.vector_to_parameters(t.weights.clone(), mod.parameters())
    bal = copy.deepcopy(mod)
    with torch.no_grad():
        n = D_FEAT * C
        bal[-1].weight.copy_(t.balanced_head[:n].view(C, D_FEAT))
        bal[-1].bias.copy_(t.balanced_head[n:])
    clf_bal = {id(bal[-1].weight), id(bal[-1].bias)}
    clf_saved = clf.copy()
    clf.clear()
    clf |= clf_bal
    idx = balanced_sample(y, t.per_class, t.seed)
    if t.balanced.epochs:
        train(bal, x[idx], y[idx], t.balanced, task_phase(t.seed, 0), True)
    clf.clear()
    clf |= clf_saved
    train(mod, x, y, t.head, task_phase(t.seed, 1), True)
    counts = torch.bincount(y, minlength=C)
    p = counts.double() / counts.sum()
    p = p[p > 0]
    weight = float(-(p * p.log()).sum()) / t.gamma
    anchors = t.anchors.view(C, D_FEAT)

    def align(features, labels):  # all anchors present: the authors' contrastive alignment
        logits = nn.CosineSimilarity(dim=2)(features.unsqueeze(1), anchors.repeat(len(labels), 1, 1))
        return weight * nn.CrossEntropyLoss()(logits / t.temperature, labels)

    train(mod, x, y, t.body, task_phase(t.seed, 2), False, align if bool(t.anchor_mask.all()) else None)
    w = torch.nn.utils.parameters_to_vector(mod.parameters()).detach()
    with torch.no_grad():
        f = mod[:-1](x)
    protos = torch.stack([f[y == c].mean(0) if (y == c).any() else torch.zeros(D_FEAT) for c in range(C)])
    bh = (
        torch.cat([bal[-1].weight.detach().flatten(), bal[-1].bias.detach()])
        if t.balanced.epochs
        else w[-C * (D_FEAT + 1) :]
    )
    return w, bh, protos.flatten(), counts.float()


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(6, 30),
    seed=st.integers(0, 2**31 - 1),
    batch=st.sampled_from([0, 4]),
    momentum=st.sampled_from([0.0, 0.9]),
    balanced_epochs=st.sampled_from([0, 2]),
    align=st.booleans(),
)
def test_the_split_step_is_the_authors_step(n, seed, batch, momentum, balanced_epochs, align):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    mod = module(seed % 100)
    model = FlatModel(mod)
    w0 = FlatModel.flatten(mod)
    opt = Optimizer("sgd", 0.05, momentum=momentum, weight_decay=1e-3 if momentum else 0.0)
    local = LocalTraining(2, batch, opt)
    t = SplitTrain(
        0,
        w0 + 0.01 * torch.randn(len(w0), generator=g),
        head=LocalTraining(1, batch, opt),
        body=local,
        balanced=LocalTraining(balanced_epochs, batch, opt),
        balanced_head=w0[-C * (D_FEAT + 1) :].clone(),
        anchors=torch.randn(C * D_FEAT, generator=g),
        anchor_mask=torch.ones(C) if align else torch.zeros(C),
        seed=seed,
        gamma=2.0,
    )
    got = split_train(ClientData(0, x, y, x[:0], y[:0], model, C), t)
    want = plain_step(mod, t, x, y)
    for a, b, what in zip((got.weights, got.balanced_head, got.prototypes, got.label_counts), want, "wbpc"):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), what
    assert check_split_trained(t, got, n, 0) is got


def madd_loop(v: np.ndarray) -> np.ndarray:
    """The definition, as the authors' code loops it."""

    def cos(a, b):
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        return 0.0 if na == 0 or nb == 0 else a.dot(b) / (na * nb)

    n = len(v)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            s = sum(abs(cos(v[i], v[z]) - cos(v[j], v[z])) for z in range(n) if z not in (i, j))
            out[i, j] = out[j, i] = s / (n - 2)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(3, 12).flatmap(
        lambda n: st.lists(
            st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=3, max_size=3), min_size=n, max_size=n
        )
    )
)
def test_madd_is_its_definition(rows):
    v = np.array(rows, dtype=np.float32)
    assert np.allclose(madd(torch.tensor(v)).numpy(), madd_loop(v.astype(np.float64)), atol=1e-9)


def test_madd_in_blocks_equals_one_block(monkeypatch):
    import stocfl.client.split as sp

    v = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    whole = madd(v)
    monkeypatch.setattr(sp, "MADD_BLOCK", 3 * 20 * 20)  # blocks of 3 rows
    assert torch.equal(madd(v), whole)
    assert np.allclose(whole.numpy(), madd_loop(v.double().numpy()), atol=1e-9)


def test_balanced_sample_takes_the_smallest_count_of_each_label():
    y = torch.tensor([0] * 9 + [1] * 3 + [3] * 7)
    idx = balanced_sample(y, 5, 0)
    assert sorted(torch.bincount(y[idx], minlength=4).tolist()) == [0, 3, 3, 3]
    assert len(set(idx.tolist())) == len(idx)
    assert torch.equal(idx, balanced_sample(y, 5, 0)) and not torch.equal(idx, balanced_sample(y, 5, 1))


def test_merge_patterns_groups_clients_merged_alike():
    groups = [(0, [0, 1, 2, 3]), (1, [0, 1]), (1, [2, 3]), (2, [0, 1, 2])]
    assert merge_patterns(5, 3, groups).tolist() == [0, 0, 1, 2, 3]


def _ctx(n_clients=6):
    from stocfl.algorithms import Context

    mod = module()
    w0 = FlatModel.flatten(mod)
    local = LocalTraining(1, 0, Optimizer("sgd", 0.05))
    return FlatModel(mod), Context(n_clients, w0, local, 0, (D_IN,), C, last_layer=C * (D_FEAT + 1))


def test_a_round_merges_the_rows_of_clients_with_one_concept():
    """Six clients, two concepts (labels 0 and 1 swapped for clients 3-5): the balanced
    classifiers put 0-2 and 3-5 apart on classes 0 and 1 and merge them on the others; the
    merged rows are the mean of the members' trained rows; every client's anchors are set."""
    model, ctx = _ctx()
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(6):
        x = torch.randn(60, D_IN, generator=g)
        y = x[:, :C].argmax(1)  # a learnable concept
        if i >= 3:
            y = torch.where(y == 0, 1, torch.where(y == 1, 0, y))
        data.append(ClientData(i, x, y, x[:0], y[:0], model, C))
    alg = FedCCFA(FedCCFA.Params(balanced_epochs=30, balanced_per_class=15, align_after=0), ctx)
    seen = {}

    def ask(tasks):
        out = [split_train(data[t.client], t) for t in tasks]
        seen.update({t.client: r for t, r in zip(tasks, out)})
        return out

    alg.round(1, list(range(6)), ask)
    groups = alg.merge_groups(torch.stack([seen[i].balanced_head for i in range(6)]))
    by_class = {c: sorted(sorted(m) for lab, m in groups if lab == c) for c in range(C)}
    assert by_class[0] == [[0, 1, 2], [3, 4, 5]] and by_class[1] == [[0, 1, 2], [3, 4, 5]], by_class
    assert alg.cluster_labels().tolist() == [0, 0, 0, 1, 1, 1]
    split = alg.split
    rows = split.rows(torch.stack([seen[i].weights[split.start : split.stop] for i in range(6)]))
    head = split.rows(alg.state.heads.get(4))
    assert torch.allclose(head[0], rows[3:, 0].mean(0)) and torch.allclose(head[1], rows[3:, 1].mean(0))
    assert all(alg.state.anchors.get(i)[-C:].sum() == C for i in range(6))
    # the next round's task carries the client's kept anchors and classifier
    t = alg.client_step(2, 4)
    assert bool(t.anchor_mask.all()) and torch.equal(t.weights[split.start : split.stop], alg.state.heads.get(4))


def test_a_reply_that_lies_is_refused():
    model, ctx = _ctx()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, D_IN, generator=g), torch.tensor([0, 1, 2] * 6 + [0, 0])
    alg = FedCCFA(FedCCFA.Params(), ctx)
    t = alg.client_step(1, 0)
    r = split_train(ClientData(0, x, y, x[:0], y[:0], model, C), t)
    bad = {
        "counts of another size": SplitTrained(r.weights, r.balanced_head, r.prototypes, r.label_counts * 2, 20),
        "a fractional count": SplitTrained(
            r.weights, r.balanced_head, r.prototypes, r.label_counts + torch.tensor([0.5, -0.5, 0, 0]), 20
        ),
        "a prototype for a class it lacks": SplitTrained(
            r.weights, r.balanced_head, r.prototypes + 1.0, r.label_counts, 20
        ),
        "a short head": SplitTrained(r.weights, r.balanced_head[:-1], r.prototypes, r.label_counts, 20),
        "NaN prototypes": SplitTrained(r.weights, r.balanced_head, r.prototypes * float("nan"), r.label_counts, 20),
    }
    for what, reply in bad.items():
        with pytest.raises(BadResult):
            check_split_trained(t, reply, 20, 0)
        assert what


def test_a_model_without_a_linear_classifier_is_one_line():
    with pytest.raises(UserError, match="nn.Linear"):
        Split.of(10, 7, 3)
    mod = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))  # its last parameters are the norm's
    model = FlatModel(mod)
    x = torch.randn(5, 4)
    t = SplitTrain(
        0, FlatModel.flatten(mod), LocalTraining(), LocalTraining(), LocalTraining(),
        torch.zeros(6), torch.zeros(3), torch.zeros(3), 0,
    )  # fmt: skip
    with pytest.raises(UserError, match="last nn.Linear"):
        split_train(ClientData(0, x, torch.zeros(5, dtype=torch.long), x, x[:, 0].long(), model, 3), t)


@pytest.mark.slow
def test_fedccfa_merges_by_concept_on_label_swapped_mnist(tmp_path, data_dir):
    """Label-swapped MNIST (four concepts), 10% a round: the rows FedCCFA merges follow the
    concepts (NMI of the latest round's merge patterns) and it beats FedAvg's one model."""
    over = [
        "scenario.name=label_swap",
        "scenario.dataset=mnist",
        "scenario.n_clients=100",
        "scenario.samples_per_client=100",
        "run.rounds=60",
        "run.eval_every=60",
        "train.epochs=2",
        "train.batch_size=20",
        "train.lr=0.05",
        "model.name=mlp",
        "model.hidden=100",
    ]
    out = {}
    for name in ("fedccfa", "fedavg"):
        cfg = configure.load(overrides=[*over, f"algorithm.name={name}"], data_dir=str(data_dir))
        out[name] = Experiment.create(cfg, tmp_path / name).run(progress=False)
    ccfa, avg = out["fedccfa"], out["fedavg"]
    # the latest round's merge patterns follow the concepts (ten clients; a concept may split)
    assert ccfa["nmi"] >= 0.8, json.dumps(ccfa)
    assert ccfa["accuracy"] > avg["accuracy"] + 0.1, (ccfa["accuracy"], avg["accuracy"])
