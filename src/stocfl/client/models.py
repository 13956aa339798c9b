"""Models, used as pure functions of one flat float32 parameter vector.

A :class:`FlatModel` wraps an ``nn.Module`` as a template: weights live in a flat vector ``w``
(shape ``(P,)``), which is what tasks carry, servers average and checkpoints store;
``forward(w, x)`` unflattens it into views and calls :func:`torch.func.functional_call`, so
the same code runs one client (plain autograd) or a stack of clients (``vmap``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


def mlp(in_features: int, hidden: int, n_classes: int) -> nn.Module:
    """in-hidden-classes with ReLU (the StoCFL paper's MNIST model is 784-2048-10)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


def cnn28(in_channels: int, n_classes: int) -> nn.Module:
    """The FL+HC / LEAF FEMNIST CNN for 28x28: two 5x5 convs (32, 64 channels, 'same' padding),
    each followed by 2x2 max pooling, then FC 512 and the output layer. (The StoCFL paper adds
    dropout 0.5; left out because dropout makes local training depend on extra randomness.)"""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512),
        nn.ReLU(),
        nn.Linear(512, n_classes),
    )


def cifar_cnn(in_channels: int, n_classes: int) -> nn.Module:
    """Two 5x5 convs (32, 64) with 2x2 pooling and two FC layers (512, classes) for 32x32."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 5 * 5, 512),
        nn.ReLU(),
        nn.Linear(512, n_classes),
    )


def cifar_lenet(in_channels: int, n_classes: int) -> nn.Module:
    """The StoCFL authors' CIFAR-10 model (their models/cnn.py CNN_CIFAR10, the PyTorch tutorial's
    LeNet): two 5x5 convs (6, 16 channels) each with 2x2 pooling, FC 120, 84 and the output
    layer; PyTorch's default initialisation, as theirs (their Xavier lines are commented out)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, n_classes),
    )


class _XavierConv2d(nn.Conv2d):
    def reset_parameters(self) -> None:
        super().reset_parameters()  # the bias as PyTorch's default
        nn.init.xavier_uniform_(self.weight)


class _XavierLinear(nn.Linear):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.xavier_uniform_(self.weight)


def femnist_cnn(in_channels: int, n_classes: int) -> nn.Module:
    """The StoCFL authors' FEMNIST model (their models/cnn.py CNN_FEMNIST, the EMNIST CNN of Reddi
    et al. 2020) for 28x28: 3x3 convs of 32 and 64 channels, 2x2 max pooling, dropout 0.25, FC
    128, dropout 0.5 and the output layer; Xavier-uniform weights, as the paper states for its
    FEMNIST model (biases as PyTorch's default)."""
    return nn.Sequential(
        _XavierConv2d(in_channels, 32, 3),
        nn.ReLU(),
        _XavierConv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        _XavierLinear(64 * 12 * 12, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        _XavierLinear(128, n_classes),
    )


ModelFactory = Callable[[tuple[int, ...], int, int], nn.Module]  # (input shape, classes, model.hidden)


def _images(name: str, size: tuple[int, int], build: Callable[[int, int], nn.Module]) -> ModelFactory:
    """The factory of a conv model ``build(in_channels, n_classes)`` made for images of ``size``."""

    def factory(input_shape, n_classes: int, hidden: int) -> nn.Module:
        if tuple(input_shape[1:]) != size:
            raise ValueError(f"{name} needs {size[0]}x{size[1]} images, got inputs of shape {tuple(input_shape)}")
        return build(input_shape[0], n_classes)

    return factory


MODELS: dict[str, ModelFactory] = {
    "mlp": lambda shape, k, hidden: mlp(math.prod(shape), hidden, k),
    "cnn28": _images("cnn28", (28, 28), cnn28),
    "cifar_cnn": _images("cifar_cnn", (32, 32), cifar_cnn),
    "cifar_lenet": _images("cifar_lenet", (32, 32), cifar_lenet),
    "femnist_cnn": _images("femnist_cnn", (28, 28), femnist_cnn),
    "digits_mlp": lambda shape, k, hidden: mlp(math.prod(shape), 32, k),
}
BUILTIN_MODELS = frozenset(MODELS)


def register_model(name: str, factory: ModelFactory) -> None:
    """Make model ``name`` usable by name (``model.name``) in this process: ``factory(input_shape,
    n_classes, hidden)`` returns a fresh ``nn.Module`` (``hidden`` is ``model.hidden``)."""
    from stocfl.errors import UserError, refuse_builtin

    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise UserError(f"register_model: name {name!r} must be an identifier other than 'auto'")
    refuse_builtin("register_model", name, name in BUILTIN_MODELS)
    if not callable(factory):
        raise UserError(
            f"register_model({name!r}): factory must be a function (input_shape, n_classes, hidden) -> nn.Module"
        )
    MODELS[name] = factory


def build_module(name: str, input_shape: tuple[int, ...], n_classes: int, hidden: int = 200) -> nn.Module:
    """Build model ``name`` (or ``auto``: digits_mlp for 8x8, cifar_cnn for 3x32x32, mlp otherwise)."""
    shape = tuple(input_shape)
    if name == "auto":
        name = "digits_mlp" if shape[-2:] == (8, 8) else "cifar_cnn" if shape == (3, 32, 32) else "mlp"
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of auto, {', '.join(MODELS)}")
    module = MODELS[name](shape, n_classes, hidden)
    if not isinstance(module, nn.Module):
        raise ValueError(f"model {name!r}: the factory returned {type(module).__name__}, not an nn.Module")
    return module


RANDOM_LAYERS = (nn.modules.dropout._DropoutNd, nn.RReLU)
EVAL_CPU_BYTES = 32 * 2**20  # a CPU evaluation chunk's largest layer output (about a last-level cache)
EVAL_CHUNK_MIN, EVAL_CHUNK_MAX = 64, 8192  # samples per evaluation chunk


def _flat(module: nn.Module) -> torch.Tensor:
    """Parameters then buffers (BatchNorm's running statistics and batch count), one float32 vector."""
    parts = [p.detach().reshape(-1).float() for p in module.parameters()]
    parts += [b.detach().reshape(-1).float() for b in module.buffers()]
    return torch.cat(parts) if parts else torch.zeros(0)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """Images ``x`` (N, C, H, W) with channels-last strides (a copy unless it has them), also for C = 1.

    With one channel an NCHW tensor already counts as channels-last contiguous, so
    ``contiguous(memory_format=channels_last)`` returns it unchanged, and PyTorch's layout
    guess from its strides (C's stride H*W) then runs every layer after it in NCHW; the
    explicit strides (C's stride 1) make convolutions and pooling run, and keep, NHWC."""
    _, c, h, w = x.shape
    strides = (c * h * w, 1, w * c, c)
    if x.stride() == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


Step = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


def plain_steps(module: nn.Module, names: list[str]) -> list[Step] | None:
    """An ``nn.Sequential`` of layers whose forward is one functional call (Linear, Conv2d with
    zero padding, ReLU, Flatten, MaxPool2d, Dropout) as those calls, each taking its parameters
    from a list ordered as ``names``; None for any other module.

    :func:`torch.func.functional_call` swaps every parameter into the module and back around
    each forward, which costs more than the small models' arithmetic (a step of the MLP-200 on
    a batch of 20). The calls made here are the layers' own, with the same arguments, so the
    numbers are theirs to the bit (a test checks outputs and gradients). Hooks need the module's
    own call (:func:`hooked`)."""
    if not isinstance(module, nn.Sequential):
        return None
    index = {n: k for k, n in enumerate(names)}
    steps: list[Step] = []
    for name, layer in module.named_children():
        kind = type(layer)
        linear = isinstance(layer, nn.Linear) and kind.forward is nn.Linear.forward
        conv = (
            isinstance(layer, nn.Conv2d)
            and kind.forward is nn.Conv2d.forward
            and getattr(kind, "_conv_forward", None) is nn.Conv2d._conv_forward
            and layer.padding_mode == "zeros"
        )
        if linear or conv:
            w = index.get(f"{name}.weight")
            b = index.get(f"{name}.bias") if layer.bias is not None else -1
            if w is None or b is None:  # a parameter tied to another layer's: not a plain list
                return None
            if linear:
                steps.append(functools.partial(_linear, w=w, b=b))
            else:
                steps.append(functools.partial(_conv2d, w=w, b=b, layer=cast(nn.Conv2d, layer)))
        elif isinstance(layer, nn.ReLU) and kind is nn.ReLU:
            steps.append(functools.partial(_relu, layer=layer))
        elif isinstance(layer, nn.Flatten) and kind is nn.Flatten:
            steps.append(functools.partial(_flatten, layer=layer))
        elif isinstance(layer, nn.MaxPool2d) and kind is nn.MaxPool2d and not layer.return_indices:
            steps.append(functools.partial(_max_pool2d, layer=layer))
        elif isinstance(layer, nn.Dropout) and kind is nn.Dropout:
            steps.append(functools.partial(_dropout, layer=layer))
        else:
            return None
    return steps


# Each as the layer's own forward calls it.
def _linear(x: torch.Tensor, p: list[torch.Tensor], w: int, b: int) -> torch.Tensor:
    return F.linear(x, p[w], p[b] if b >= 0 else None)


def _conv2d(x: torch.Tensor, p: list[torch.Tensor], w: int, b: int, layer: nn.Conv2d) -> torch.Tensor:
    return F.conv2d(x, p[w], p[b] if b >= 0 else None, layer.stride, layer.padding, layer.dilation, layer.groups)


def _relu(x: torch.Tensor, p: list[torch.Tensor], layer: nn.ReLU) -> torch.Tensor:
    return F.relu(x, inplace=layer.inplace)


def _flatten(x: torch.Tensor, p: list[torch.Tensor], layer: nn.Flatten) -> torch.Tensor:
    return x.flatten(layer.start_dim, layer.end_dim)


def _max_pool2d(x: torch.Tensor, p: list[torch.Tensor], layer: nn.MaxPool2d) -> torch.Tensor:
    return F.max_pool2d(x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, ceil_mode=layer.ceil_mode)


def _dropout(x: torch.Tensor, p: list[torch.Tensor], layer: nn.Dropout) -> torch.Tensor:
    return F.dropout(x, layer.p, layer.training, layer.inplace)  # training: the model's mode at the call


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{h}" for h in _HOOKS)


def hooked(modules: list[nn.Module]) -> bool:
    """Hooks on any of ``modules`` or global module hooks (stocfl's own features and
    descriptors hook a layer for one forward): then only the module's own call runs them."""
    from torch.nn.modules import module as base

    return any(getattr(m, h, None) for m in modules for h in _HOOKS) or any(
        getattr(base, h, None) for h in _GLOBAL_HOOKS
    )


class FlatModel:
    """A module as a pure function of a flat vector: its parameters, then its buffers.

    Buffers (BatchNorm's running mean, variance and batch count) travel, average and are
    checkpointed with the weights, as FedAvg does; gradients, proximal terms and weight decay
    act on the first ``n_trainable`` entries only. ``forward`` runs in eval mode (running
    statistics); local training runs in train mode and writes the updated statistics back
    (:meth:`forward_train`)."""

    def __init__(self, module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.loss = loss  # per-sample loss(logits, y) -> (n,); None: cross-entropy
        self.module = copy.deepcopy(module).to("meta")  # a template only: no real storage (the caller's stays)
        self._peak_bytes: dict[tuple, int] = {}  # (sample shape, dtype) -> largest layer output, for eval_chunk
        self._has_conv2d = any(isinstance(m, nn.Conv2d) for m in module.modules())
        self._channels_last: dict[tuple, bool] = {}  # sample shape -> the module runs on channels-last inputs
        # layers that draw random numbers in training: local training seeds them per task
        self.random = any(isinstance(m, RANDOM_LAYERS) for m in module.modules())
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        self.names = [n for n, _ in params] + [n for n, _ in buffers]
        self.shapes = [tuple(t.shape) for _, t in params] + [tuple(t.shape) for _, t in buffers]
        self.dtypes = [t.dtype for _, t in params] + [t.dtype for _, t in buffers]
        self.numels = [math.prod(s) for s in self.shapes]
        self.n_params = sum(self.numels)
        self.n_trainable = sum(self.numels[: len(params)])
        self.has_buffers = bool(buffers)
        self.n_tensors = len(params)  # the first n_tensors names are parameters, the rest buffers
        norms = {name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        self.batchnorm_tensors = [k for k, n in enumerate(self.names) if n.rpartition(".")[0] in norms]
        self._steps = None if buffers else plain_steps(self.module, self.names)
        self._hookable = list(self.module.modules())  # hooks on any rule the plain steps out

    def batchnorm_entries(self) -> torch.Tensor:
        """Indices into the flat vector of every BatchNorm layer's parameters and buffers."""
        starts = [0, *itertools.accumulate(self.numels)]
        idx = [torch.arange(starts[k], starts[k + 1]) for k in self.batchnorm_tensors]
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)

    @staticmethod
    def init_weights(module: nn.Module, seed: int) -> torch.Tensor:
        """PyTorch's default initialisation under ``seed``, flattened (global RNG untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in module.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            return _flat(module)

    @staticmethod
    def flatten(module: nn.Module) -> torch.Tensor:
        """The module's current parameters and buffers as one flat float32 vector (a copy)."""
        return _flat(module).clone()

    def state_dict(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat weights as the module's ``state_dict`` (copies), loadable with ``load_state_dict``."""
        return {n: t.detach().clone().to(d) for (n, t), d in zip(self.unflatten(w).items(), self.dtypes)}

    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: p.view(s) for n, p, s in zip(self.names, torch.split(w, self.numels), self.shapes)}

    def per_sample_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="none") if self.loss is None else self.loss(logits, y)

    def mean_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y) if self.loss is None else self.loss(logits, y).mean()

    def eval_chunk(self, x: torch.Tensor) -> int:
        """Samples per forward pass when evaluating on ``x`` (a batch). On a CPU a chunk's
        largest layer output is kept near the cache's size, where a conv model runs fastest
        with identical logits (docs: measured figures); accelerators take big chunks."""
        if x.device.type != "cpu":
            return EVAL_CHUNK_MAX
        key = (tuple(x.shape[1:]), x.dtype)
        if key not in self._peak_bytes:
            self._peak_bytes[key] = self._largest_output(*key)
        return max(EVAL_CHUNK_MIN, min(EVAL_CHUNK_MAX, EVAL_CPU_BYTES // max(1, self._peak_bytes[key])))

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a batch of images, not under ``vmap``) in the memory layout this model's layers
        run fastest on: channels-last for a model with 2-D convolutions on the CPU, oneDNN's native
        layout. Results are the same up to float rounding, and local SGD and evaluation take less
        time, most of it in max-pooling, whose NCHW kernel is several times slower than its NHWC
        one (docs: measured figures). A module that fails on such inputs or
        gives other outputs (a ``view`` of a convolution's output, say), found once per input
        shape on one sample, keeps the caller's layout."""
        if not self._has_conv2d or x.dim() != 4 or x.device.type != "cpu":
            return x
        key = tuple(x.shape[1:])
        if key not in self._channels_last:
            self._channels_last[key] = self._same_on_channels_last(torch.rand((1, *key), dtype=x.dtype))
        return channels_last(x) if self._channels_last[key] else x

    def _same_on_channels_last(self, x: torch.Tensor) -> bool:
        w = 0.1 * torch.randn(self.n_params, generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                want = self.forward(w, x)
                got = self.forward(w, channels_last(x))
            return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        except Exception:  # noqa: BLE001 - any failure: keep the caller's layout
            return False

    def step_params(self, shape: tuple[int, ...]) -> int:
        """The parameters a sample of ``shape`` meets in a forward pass, a convolution's once
        per output pixel (its weights are applied at every one): a training step's FLOPs are
        about 6 x this x the batch, as they are 6 x the parameters x the batch for a dense
        model, where each weight meets a sample once. A module that cannot run on the meta
        device counts its parameters once."""
        seen = self._meta_outputs(shape, torch.float32)
        if seen is None:
            return self.n_params
        outputs = dict(seen)  # a module called twice: its last output
        extra = 0
        for m in self.module.modules():
            out = outputs.get(id(m))
            if isinstance(m, nn.modules.conv._ConvNd) and out is not None and out.dim() > 2:
                extra += sum(p.numel() for p in m.parameters(recurse=False)) * (math.prod(out.shape[2:]) - 1)
        return self.n_params + extra

    def _largest_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of the largest output of any layer for one sample; a module that cannot run on
        the meta device is taken as one of 128 KB a sample."""
        outputs = self._meta_outputs(shape, dtype)
        if outputs is None:
            return 128 * 1024
        return max([0, *(t.numel() * t.element_size() for _, t in outputs if t.dim() > 0)])

    def _meta_outputs(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, torch.Tensor]] | None:
        """The modules' tensor outputs, as (the module's id, the output) in the order of their
        calls, for one sample of ``shape``, found on the meta device (shapes, no arithmetic,
        eval mode); None where the module cannot run there (an op without a meta kernel)."""
        outputs: list[tuple[int, torch.Tensor]] = []

        def hook(module, _inputs, out):
            if isinstance(out, torch.Tensor):
                outputs.append((id(module), out))

        handles = [m.register_forward_hook(hook) for m in self.module.modules()]
        try:
            with torch.no_grad():
                self._mode(train=False)
                self.module(torch.zeros((1, *shape), dtype=dtype, device="meta"))
        except Exception:  # noqa: BLE001 - any op without a meta kernel: the caller's fallback
            return None
        finally:
            for h in handles:
                h.remove()
        return outputs

    def forward(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of the model at ``w`` (eval mode: BatchNorm uses the running statistics,
        dropout is off)."""
        self._mode(train=False)
        if self._plain_ok():
            return self._plain(list(self.unflatten(w).values()), x)
        return functional_call(self.module, self.unflatten(w), (x,))

    def _plain_ok(self) -> bool:
        """The plain steps may run: the module has them, and no hook needs its own call."""
        return self._steps is not None and not hooked(self._hookable)

    def _plain(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        assert self._steps is not None
        for step in self._steps:
            x = step(x, params)
        return x

    def _mode(self, train: bool) -> None:
        if self.module.training != train:
            self.module.train(train)

    def forward_train(self, params: torch.Tensor, buffers: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits in train mode from ``params`` (the first ``n_trainable`` entries, may require
        grad) and ``buffers`` (one tensor per buffer, from :meth:`split_buffers`: BatchNorm
        updates them in place; separate tensors, so that autograd's version checks of one
        layer do not see another layer's update)."""
        return self.forward_tensors(self.param_views(params), buffers, x)

    def param_views(self, params: torch.Tensor) -> list[torch.Tensor]:
        """The parameters of flat ``params`` (its first ``n_trainable`` entries) as shaped views,
        one per parameter tensor: writing into them writes into ``params``."""
        k = self.n_tensors
        return [t.view(s) for t, s in zip(torch.split(params[: self.n_trainable], self.numels[:k]), self.shapes[:k])]

    def forward_tensors(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor] | None, x: torch.Tensor
    ) -> torch.Tensor:
        """Logits from shaped parameter tensors (each may be its own autograd leaf, so gradients
        come back per tensor, never concatenated); with ``buffers`` in train mode (as
        :meth:`forward_train`), without them as :meth:`forward`."""
        k = self.n_tensors
        if self._plain_ok():  # no buffers: the module has none
            self._mode(train=buffers is not None)
            return self._plain(params, x)
        tensors = dict(zip(self.names[:k], params))
        if buffers is not None:
            tensors.update({n: t.view(s) for n, t, s in zip(self.names[k:], buffers, self.shapes[k:])})
        self._mode(train=buffers is not None)
        return functional_call(self.module, tensors, (x,))

    def split_buffers(self, w: torch.Tensor) -> list[torch.Tensor]:
        """The buffers of flat weights ``w``, each a tensor of its own (copies)."""
        return [t.clone() for t in torch.split(w[self.n_trainable :], self.numels[self.n_tensors :])]


def linear_model(input_shape, n_classes: int) -> FlatModel:
    """A linear softmax model on the raw inputs (an anchor for representations, paper Fig. 2)."""
    return FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), n_classes)))


def linear_anchor_weights(input_shape, n_classes: int, seed: int) -> torch.Tensor:
    return FlatModel.init_weights(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), n_classes)), seed)


def make_model(name: str, input_shape, n_classes: int, hidden: int, seed: int) -> tuple[FlatModel, torch.Tensor]:
    """The flat model and its initial weights w_0 (seeded)."""
    module = build_module(name, tuple(input_shape), n_classes, hidden)
    w0 = FlatModel.init_weights(module, seed)
    return FlatModel(module), w0
