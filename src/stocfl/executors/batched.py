"""Runs chunks of clients as one computation: stacked flat weights, ``vmap(grad(loss))``.

Clients of unequal size are padded to the largest in the chunk and masked: padded samples
weigh 0 in the loss, and a client that has run out of mini-batches in an epoch is frozen for
the remaining steps (its whole update, proximal term included, is multiplied by 0). The batch
order comes from :func:`stocfl.client.training.batch_plan`, as in the sequential executor, so both
give the same weights up to float rounding.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.func import grad, vmap

from stocfl.client.mixture import MixtureTrain, MixtureTrained, e_step, proximal_center
from stocfl.client.tasks import KINDS, FactoredTrained, Train, Trained, check_train_task
from stocfl.client.training import LocalTraining, batch_plan, stacked_batch
from stocfl.devices import free_bytes
from stocfl.errors import UserError
from stocfl.executors.base import Executor
from stocfl.executors.lowrank import LowRankTrainer, structure
from stocfl.executors.pool import RowPool

MEMORY_BUDGET = 1 << 30  # bytes per chunk for weights, gradients, centers and activations
MAX_CHUNK = 512
MAX_CHUNK_ACCELERATOR = 4096


class BatchedExecutor(Executor):
    name = "batched"
    # plain SGD takes each of the model's tensors' gradients apart; False: the flat vector's
    # gradient, their concatenation (the same numbers: the reference a test compares with)
    split_gradients = True

    def __init__(
        self, federation, model, chunk_size: int = 0, lowrank: bool = False, device="cpu", factored: bool = False
    ):
        super().__init__(federation, model, device)
        if model.random:
            raise UserError(
                f"run.engine = {'lowrank' if lowrank else 'batched'}: the model has layers that draw "
                f"random numbers in training (Dropout, RReLU), which clients batched in one vmap cannot "
                f"draw as each would alone; use run.engine = sequential (auto picks it for such a model)"
            )
        self.chunk_size = chunk_size
        # replies of the low-rank path as their factors (run.factored_replies), kept on the device
        self.factored = factored and lowrank
        self.pool = RowPool()  # the chunks' stacked weights, reused once their replies are gone
        s = structure(model) if lowrank else None
        self.lowrank = LowRankTrainer(s) if s is not None else None  # plain SGD on a dense first layer
        if lowrank:
            self.name = "lowrank"

        def masked_loss(w, x, y, m):
            per_sample = self.model.per_sample_loss(self.model.forward(w, x), y)
            return (per_sample * m).sum() / m.sum().clamp(min=1.0)

        def weighted_loss(w, x, y, m, q):  # the mixture family's M-step: sum_b q_b l_b / |B|
            per_sample = self.model.per_sample_loss(self.model.forward(w, x), y)
            return (per_sample * m * q).sum() / m.sum().clamp(min=1.0)

        self._grads = vmap(grad(masked_loss))
        self._weighted_grads = vmap(grad(weighted_loss))

        # the same losses of the model's tensors, given apart (views of the stacked weights):
        # their gradients come back apart, where the gradient of one flat vector is their
        # concatenation, a model-sized copy a step that took as long as the step's arithmetic
        def masked_loss_parts(parts, x, y, m):
            per_sample = self.model.per_sample_loss(self.model.forward_tensors(list(parts), None, x), y)
            return (per_sample * m).sum() / m.sum().clamp(min=1.0)

        def weighted_loss_parts(parts, x, y, m, q):
            per_sample = self.model.per_sample_loss(self.model.forward_tensors(list(parts), None, x), y)
            return (per_sample * m * q).sum() / m.sum().clamp(min=1.0)

        self._part_grads = vmap(grad(masked_loss_parts))
        self._weighted_part_grads = vmap(grad(weighted_loss_parts))

    def fast_paths(self):
        """Training vectorised here; any kind registered with a ``batched`` version uses it."""
        paths = super().fast_paths()
        paths.update({k.task: (lambda tasks, f=k.batched: f(self, tasks)) for k in KINDS.values() if k.batched})
        if not self.model.has_buffers:  # vmap cannot update BatchNorm's running statistics in place:
            paths[Train] = self.train  # such models train client by client (the reference)
            paths[MixtureTrain] = self.train_mixture
        return paths

    def release(self) -> None:
        self.pool.buffers.clear()

    def reply_bytes(self, tasks) -> int:
        # factored replies carry each client's factors, a fraction of a model
        return 0 if self.factored else super().reply_bytes(tasks)

    def reusable_bytes(self) -> int:
        return self.pool.free_bytes()

    def _chunk_len(self, max_batch: int) -> int:
        if self.chunk_size:
            return self.chunk_size
        sample = max(1, int(torch.tensor(self.fed.input_shape).prod()))
        per_client = 4 * (5 * self.model.n_params + 4 * max_batch * sample)
        free = free_bytes(self.device)  # an accelerator: half of its free memory
        budget, most = (MEMORY_BUDGET, MAX_CHUNK) if free is None else (free // 2, MAX_CHUNK_ACCELERATOR)
        return max(1, min(most, budget // per_client))

    def train_mixture(self, tasks: list[MixtureTrain]) -> list[MixtureTrained]:
        """Each client's E-step as the reference computes it, then the K weighted trainings of
        every client batched as K * clients rows (the weights enter the masked loss), and the
        personal models' proximal trainings batched as plain training rows."""
        mixed, own, weights, done = [], [], [], []
        for t in tasks:
            x, y = self.data.train_data(t.client)
            q, pi, mass = e_step(self.model, t, x, y, self.fed.n_classes)
            if t.personal is not None:
                own.append(Train(t.client, t.personal, t.local, t.seed, proximal_center(t.models, pi), t.mu))
            else:
                mixed += [Train(t.client, w, t.local, t.seed) for w in t.models]
                weights += list(q)
            done.append((pi, mass, len(y)))
        trained_mixed = iter(self.train(mixed, weights) if mixed else [])
        trained_own = iter(self.train(own) if own else [])
        out = []
        for t, (pi, mass, n) in zip(tasks, done):
            if t.personal is not None:
                models = next(trained_own).weights[None]
            else:
                models = torch.stack([next(trained_mixed).weights for _ in range(len(t.models))])
            out.append(MixtureTrained(models, pi, mass, n))
        return out

    def train(self, tasks: list[Train], sample_weights: list[torch.Tensor] | None = None) -> list[Trained]:
        """``sample_weights``, one tensor per task when given: each sample's weight in its loss
        (see :func:`~stocfl.client.training.local_sgd`)."""
        out: list[Trained | None] = [None] * len(tasks)
        kinds: dict[LocalTraining, list[int]] = defaultdict(list)
        for k, t in enumerate(tasks):
            check_train_task(t, self.model.n_params)
            kinds[t.local].append(k)
        sizes = self.fed.train_sizes
        # factored replies refer to the models sent (their W_0 and C), which an algorithm may then
        # write in place (a row of its stacked state): each distinct one copied once for them
        sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for local, idx in kinds.items():
            idx.sort(key=lambda k: sizes[tasks[k].client])  # similar sizes share a chunk: less padding
            max_batch = int(max(sizes[tasks[k].client] for k in idx))
            max_batch = max_batch if local.batch_size == 0 else min(local.batch_size, max_batch)
            step = self._chunk_len(max_batch)
            for a in range(0, len(idx), step):
                chunk = idx[a : a + step]
                q = None if sample_weights is None else [sample_weights[k] for k in chunk]
                for k, r in zip(chunk, self._train_chunk([tasks[k] for k in chunk], local, q, sent)):
                    out[k] = r
        return out  # type: ignore[return-value]

    def _train_chunk(
        self,
        tasks: list[Train],
        local: LocalTraining,
        sample_weights: list[torch.Tensor] | None = None,
        sent: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[Trained]:
        epochs, batch_size, opt = local.epochs, local.batch_size, local.optimizer
        c = len(tasks)
        dev = self.device
        data = [self.data.train_data(t.client) for t in tasks]
        sizes = [len(y) for _, y in data]
        n = torch.tensor(sizes, device=dev)
        n_max = int(n.max())
        x_pad = torch.zeros((c, n_max, *self.fed.input_shape), dtype=data[0][0].dtype, device=dev)
        y_pad = torch.zeros((c, n_max), dtype=torch.long, device=dev)
        for i, (x, y) in enumerate(data):
            x_pad[i, : len(y)] = x
            y_pad[i, : len(y)] = y
        q_pad = None
        if sample_weights is not None:
            q_pad = torch.zeros((c, n_max), device=dev)
            for i, q in enumerate(sample_weights):
                q_pad[i, : len(q)] = q
        w = self._stack([t.weights for t in tasks])  # trained in place: its rows become the replies
        mu = torch.tensor([t.prox_weight if t.prox_center is not None else 0.0 for t in tasks], device=dev)
        has_prox = bool((mu != 0).any())
        if has_prox:
            centers = _centers(tasks)
        if self.lowrank is not None and opt.plain:
            args = (w, centers if has_prox else None, mu, x_pad, y_pad, sizes, epochs, batch_size, opt.lr)
            center_is_start = all(t.prox_center is None or t.prox_center is t.weights for t in tasks)
            if self.factored and sample_weights is None:
                f = self.lowrank.factors(*args, [t.seed for t in tasks], None, center_is_start)
                tails = torch.cat([f.b, f.rest], dim=1)
                copies = {} if sent is None else sent

                def own(m: torch.Tensor) -> torch.Tensor:  # the original kept too: its id is not reused
                    return copies.setdefault(id(m), (m, m.clone()))[1]

                return [
                    FactoredTrained(
                        own(t.weights),
                        own(t.prox_center) if t.prox_center is not None and float(f.mu[i]) != 0.0 else None,
                        float(f.alpha[i]),
                        float(f.beta[i]),
                        f.A[i, :n],
                        f.X[i, :n],
                        tails[i],
                        n,
                    )
                    for i, (t, n) in enumerate(zip(tasks, sizes))
                ]
            trained = self.lowrank.train(*args, [t.seed for t in tasks], q_pad, center_is_start)
            # each reply a row of the chunk's tensor, not a copy of it (the rows are the replies')
            return [Trained(row, n) for row, n in zip(trained.unbind(0), sizes)]
        plans = [batch_plan(sizes[i], epochs, batch_size, t.seed) for i, t in enumerate(tasks)]
        rows = torch.arange(c, device=dev)[:, None]
        state = None if opt.plain else opt.init(w)
        split = state is None and self.split_gradients
        if split:  # plain SGD: each of the model's tensors updated apart, in place
            k = self.model.n_tensors
            views = torch.split(w, self.model.numels[:k], dim=1)  # of w, (c, numel) each
            parts = tuple(v.view(c, *shape) for v, shape in zip(views, self.model.shapes[:k]))
            view_centers = torch.split(centers, self.model.numels[:k], dim=1) if has_prox else None
        full_mask = (torch.arange(n_max, device=dev)[None, :] < n[:, None]).float()
        for e in range(epochs):
            steps = [1 if (plan_e := p[e]) is None else len(plan_e) for p in plans]
            for s in range(max(steps)):
                if all(p[e] is None for p in plans):
                    xb, yb, mask, qb = x_pad, y_pad, full_mask, q_pad
                else:
                    idx, mask = stacked_batch(plans, e, s, steps, sizes, dev)
                    xb, yb = x_pad[rows, idx], y_pad[rows, idx]
                    qb = None if q_pad is None else q_pad[rows, idx]
                active = torch.tensor([float(s < k) for k in steps], device=dev)[:, None]
                if split:
                    gs = (
                        self._part_grads(parts, xb, yb, mask)
                        if qb is None
                        else self._weighted_part_grads(parts, xb, yb, mask, qb)
                    )
                    pieces = zip(views, [g.view(c, -1) for g in gs], view_centers or [None] * len(views))
                else:
                    g = self._grads(w, xb, yb, mask) if qb is None else self._weighted_grads(w, xb, yb, mask, qb)
                    pieces = zip([w], [g], [centers if has_prox else None])
                for wj, gj, cj in pieces:
                    if state is None:
                        sgd_step(wj, gj, cj, mu, opt.lr * active)
                    else:
                        if cj is not None:
                            gj.add_((wj - cj).mul_(mu[:, None]))
                        opt.step(wj, gj, state, active)
        return [Trained(row, n) for row, n in zip(w.unbind(0), sizes)]

    def _stack(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The rows stacked into a tensor of the pool (a copy; nothing else refers to it)."""
        dtype = rows[0].dtype
        if any(r.dtype != dtype for r in rows):  # check_train_task lets float dtypes through: as stack promotes
            return torch.stack(rows)
        out = self.pool.take(len(rows), rows[0].numel(), dtype, self.device)
        return torch.stack(rows, out=out)


# a block of rows whose weights, gradient and pull stay in a core's cache across the step's passes
_BLOCK_BYTES = 2 << 20


def sgd_step(
    w: torch.Tensor,
    g: torch.Tensor,
    center: torch.Tensor | None,
    mu: torch.Tensor,
    step: torch.Tensor,
    block_bytes: int = _BLOCK_BYTES,
) -> None:
    """One plain SGD step of stacked rows in place: w -= step (g + mu (w - center)), each row
    its own ``mu`` (c) and ``step`` (c x 1), ``center`` None for no pull. ``g`` is the step's
    own tensor: the pull and the step are formed in it, not in a model-sized temporary (a
    product of two floats is the same either way round).

    Five passes over the rows, each entry through the same operations whatever the rows'
    grouping. Over a whole chunk (hundreds of MB) every pass reads and writes main memory; on
    the CPU they run a block of rows at a time, each block's passes made while it stays in
    cache (``block_bytes`` a row's tensor, at least one row)."""
    rows = len(w)
    if w.device.type == "cpu":
        rows = max(1, block_bytes // max(1, w.shape[1] * w.element_size()))
    for a in range(0, len(w), rows):
        b = slice(a, a + rows)
        gb = g[b]
        if center is not None:
            gb.add_((w[b] - center[b]).mul_(mu[b, None]))
        w[b].sub_(gb.mul_(step[b]))


def _centers(tasks: list[Train]) -> torch.Tensor:
    """The proximal centers of a chunk's rows (a row without one: its start, where mu = 0 makes
    it weigh nothing). One center shared by every row that has one (StoCFL's and Ditto's global
    model, FedProx's when every client starts from it) is broadcast, not copied once a row; a
    row without one then carries it too, at mu = 0."""
    given = [t.prox_center for t in tasks if t.prox_center is not None]
    if given and all(x is given[0] for x in given):
        return given[0].expand(len(tasks), -1)
    return torch.stack([t.prox_center if t.prox_center is not None else t.weights for t in tasks])
