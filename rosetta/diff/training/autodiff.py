"""The float64 forward pass and its gradient that the training replay needs (catalogue.py), in a
framework the backend registry lends (rosetta.backends). A replay differentiates the model, which
the NumPy reference cannot do, so it borrows PyTorch's or JAX's autodiff; the loss is not the
framework's: catalogue.loss_value computes it and its gradient in the logits in NumPy (one
definition per loss variant), and the framework carries that gradient back to the weights (a
vector-Jacobian product).

Which framework (`replay_framework`): the one whose trainer wrote the reference trace (its writer,
"rosetta torch trainer" or "rosetta jax trainer", as rosetta/harness/loop.py names it) when it is
installed, else the first of REPLAY_FRAMEWORKS that is. So our own traces are replayed by the
framework that made them, and a JAX + optax user without PyTorch is diagnosed with JAX. The two
give the same float64 numbers up to summation order (~1e-16; the parity suite, and
test_diff_training.py's replays of either framework's trace).

The registry lends a model, `get_backend(name)(cfg, params, "float64")`, not its converter: where
each canonical weight sits among the framework's parameters (PyTorch keeps Linear kernels [out, in],
PITFALLS 7) is read off a model built from the numbers 0, 1, 2, ... (`_prepared`). By that map the
one model built per config takes each replay step's weights, and gradients go back to canonical
names, summed where several framework elements read one canonical weight. Nothing of torch_impl or
jax_impl is imported here, and no copy of their layout rules is kept; what is read of the lent
model is its framework module (`Model.module`: a torch.nn.Module, a Flax NNX module, each called
as `module(src, tgt)`, the NNX one taking its dropout randomness as `rngs=`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from rosetta.backends import get_backend, install_hint
from rosetta.config import ModelConfig
from rosetta.errors import RosettaError
from rosetta.params import Params, param_shapes

# The registry's names of the frameworks a replay can run in, in the order tried after the trace's own.
REPLAY_FRAMEWORKS = ("torch", "jax")
# Those that emulate TF32 matmuls (tf32.py: a torch function mode; JAX has no such hook).
TF32_FRAMEWORKS = ("torch",)
# (logits [B, T, V] float64) -> (the loss, its gradient in the logits [B, T, V]): catalogue.loss_value.
Loss = Callable[[np.ndarray], tuple[float, np.ndarray]]


def replay_framework(writer: str | None = None, tf32: bool = False) -> str:
    """The framework a trace written by `writer` is replayed in (module docstring); with `tf32`,
    one that emulates TF32 matmuls. A RosettaError when none is installed."""
    own = re.fullmatch(r"rosetta (\w+) trainer", writer or "")
    order = ([own[1]] if own and own[1] in REPLAY_FRAMEWORKS else []) + list(REPLAY_FRAMEWORKS)
    for name in dict.fromkeys(order):
        if tf32 and name not in TF32_FRAMEWORKS:
            continue
        try:
            get_backend(name)  # imports the framework: a RosettaError when it is not installed
        except RosettaError:
            continue
        return name
    wanted = TF32_FRAMEWORKS if tf32 else REPLAY_FRAMEWORKS
    need = "emulates TF32 matmuls in PyTorch" if tf32 else "differentiates the model and needs PyTorch or JAX"
    raise RosettaError(f"the float64 replay {need}, and none is installed: "
                       f"{' or '.join(install_hint(name) for name in wanted)}")


class Float64Model:
    """(cfg, params) in float64 in `framework`: its logits, with or without dropout, and the
    gradient of a loss of them in canonical names and layout. The framework's model is built once
    per config and takes these weights at each call."""

    def __init__(self, framework: str, cfg: ModelConfig, params: Params):
        if framework not in REPLAY_FRAMEWORKS:
            raise RosettaError(f"no float64 replay in {framework!r}; one of {', '.join(REPLAY_FRAMEWORKS)}")
        self.framework, self._ops = framework, _OPS[framework]
        self._prepared = _prepared(framework, cfg)
        shapes = self._prepared.shapes
        self._flat = np.concatenate([np.asarray(params[n], np.float64).ravel() for n in shapes])

    def _model(self) -> Any:
        """The framework's model holding these weights (each of its parameters gathered by the map)."""
        model, layout, _, _ = self._prepared
        self._ops.load(model, {key: self._flat[index] for key, index in layout.items()})
        return model

    def logits(self, src: np.ndarray, tgt_in: np.ndarray, dropout_seed: int | None = None) -> np.ndarray:
        """[B, T, V] float64; with `dropout_seed`, the config's dropout on, drawn from that seed."""
        return self._ops.logits(self._model(), src, tgt_in, dropout_seed)

    def loss_and_grads(self, src: np.ndarray, tgt_in: np.ndarray, loss: Loss, tf32: bool = False,
                       ) -> tuple[float, Params]:
        """`loss` of the logits (no dropout) and its canonical float64 gradients; with `tf32`, every
        matmul with TF32 operands (forward and backward, tf32.py)."""
        if tf32 and self.framework not in TF32_FRAMEWORKS:
            raise RosettaError(f"TF32 matmuls are emulated in PyTorch only, not {self.framework}")
        value, grads = self._ops.loss_and_grads(self._model(), src, tgt_in, loss, tf32)
        _, layout, total, _ = self._prepared
        flat = np.zeros(total)
        for key, index in layout.items():  # summed where several elements read one weight
            flat += np.bincount(index.ravel(), weights=grads[key].ravel(), minlength=total)
        return value, _unflatten(flat, self._prepared.shapes)


class _Prepared(NamedTuple):
    model: Any                     # the registry's float64 model of the config
    layout: dict[Any, np.ndarray]  # framework parameter -> the canonical flat index of each element
    total: int                     # canonical weights, all tensors
    shapes: dict[str, tuple[int, ...]]  # rosetta.params.param_shapes: the canonical order


@functools.lru_cache(maxsize=2)
def _prepared(framework: str, cfg: ModelConfig) -> _Prepared:
    """The registry's model of `cfg` built from the numbers 0, 1, 2, ... over every canonical
    weight (rosetta.params order), whose parameters then say where each canonical element sits."""
    shapes = param_shapes(cfg)
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    probe = _unflatten(np.arange(total, dtype=np.float64), shapes)  # exact: integers below 2^53
    model = get_backend(framework)(cfg, probe, "float64")
    layout = {key: np.rint(v).astype(np.int64) for key, v in _OPS[framework].parameters(model).items()}
    covered = np.bincount(np.concatenate([v.ravel() for v in layout.values()]), minlength=total)
    if len(covered) != total or not covered.all():
        raise RosettaError(f"the {framework} model's parameters do not hold every canonical weight once")
    return _Prepared(model, layout, total, shapes)


def _unflatten(flat: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> Params:
    out, start = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = flat[start:start + size].reshape(shape)
        start += size
    return out


# -- PyTorch ----------------------------------------------------------------------------------------

class _Torch:
    @staticmethod
    def parameters(model: Any) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy() for name, p in model.module.named_parameters()}

    @staticmethod
    def load(model: Any, values: dict[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, p in model.module.named_parameters():
                p.copy_(torch.from_numpy(values[name]))
                p.grad = None

    @staticmethod
    def logits(model: Any, src: np.ndarray, tgt_in: np.ndarray, dropout_seed: int | None) -> np.ndarray:
        import torch

        module = model.module.train(dropout_seed is not None)
        if dropout_seed is not None:
            torch.manual_seed(dropout_seed)
        with torch.no_grad():
            return module(torch.from_numpy(src), torch.from_numpy(tgt_in)).numpy()

    @staticmethod
    def loss_and_grads(model: Any, src: np.ndarray, tgt_in: np.ndarray, loss: Loss, tf32: bool):
        import torch

        from rosetta.diff.training.tf32 import tf32_matmuls

        module = model.module.eval()
        with torch.enable_grad():
            with tf32_matmuls(tf32):  # the backward runs outside, from the saved rounded operands
                logits = module(torch.from_numpy(src), torch.from_numpy(tgt_in))
            value, grad = loss(logits.detach().numpy())
            logits.backward(torch.from_numpy(grad))
        return value, {n: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
                       for n, p in module.named_parameters()}


# -- JAX --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _x64() -> Iterator[None]:
    import jax

    with jax.enable_x64(True):  # float64 arithmetic: JAX computes in float32 otherwise
        yield


@functools.cache
def _jax_programs() -> tuple[Callable, Callable]:
    """The jitted forward and pullback, made once (jax is imported only when JAX replays)."""
    import jax
    from flax import nnx

    @functools.partial(jax.jit, static_argnums=0)
    def forward(graphdef, params, rest, src, tgt):
        return nnx.merge(graphdef, params, rest)(src, tgt)

    @functools.partial(jax.jit, static_argnums=0)
    def pullback(graphdef, params, rest, src, tgt, cotangent):
        _, vjp = jax.vjp(lambda p: nnx.merge(graphdef, p, rest)(src, tgt), params)
        return vjp(cotangent)[0]

    return forward, pullback


class _Jax:
    @staticmethod
    def parameters(model: Any) -> dict[tuple, np.ndarray]:
        from flax import nnx

        flat = nnx.to_flat_state(nnx.state(model.module, nnx.Param))
        return {path: np.asarray(v.get_value()) for path, v in flat}

    @staticmethod
    def load(model: Any, values: dict[tuple, np.ndarray]) -> None:
        import jax.numpy as jnp
        from flax import nnx

        with _x64():
            for path, variable in nnx.to_flat_state(nnx.state(model.module, nnx.Param)):
                variable.set_value(jnp.asarray(values[path]))

    @staticmethod
    def logits(model: Any, src: np.ndarray, tgt_in: np.ndarray, dropout_seed: int | None) -> np.ndarray:
        from flax import nnx

        with _x64():
            if dropout_seed is None:
                model.module.eval()
                return np.asarray(_jax_programs()[0](*nnx.split(model.module, nnx.Param, ...), src, tgt_in))
            model.module.train()
            try:
                return np.asarray(model.module(src, tgt_in, rngs=nnx.Rngs(dropout=dropout_seed)))
            finally:
                model.module.eval()

    @staticmethod
    def loss_and_grads(model: Any, src: np.ndarray, tgt_in: np.ndarray, loss: Loss, tf32: bool):
        from flax import nnx

        forward, pullback = _jax_programs()
        with _x64():
            model.module.eval()
            graphdef, params, rest = nnx.split(model.module, nnx.Param, ...)
            value, grad = loss(np.asarray(forward(graphdef, params, rest, src, tgt_in)))
            grads = pullback(graphdef, params, rest, src, tgt_in, grad)
        return value, {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


_OPS = {"torch": _Torch(), "jax": _Jax()}
