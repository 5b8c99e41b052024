"""The JAX/Flax NNX model behind the common backend interface (rosetta.backends), mirroring
torch_impl/backend.py (parity_tests/test_structure.py).

Forward passes are pure jitted functions of (graphdef, state, ids): after the first call for
a shape, a call is one dispatch, with no Python work per layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_impl import (
    compilation,  # noqa: F401 - sets XLA's flags before JAX starts
    decode,
)
from jax_impl.convert import build_model, to_params
from jax_impl.model import source_mask
from rosetta.backends import BackendModel
from rosetta.generation import NO_CONSTRAINTS, Constraints
from rosetta.params import Params

# The backend's one dtype table, compute dtype -> jnp dtype: Model.dtypes and Trainer.dtypes
# (jax_impl/train.py) are read from it. float32 parameters for float32 and bfloat16; float64 (the
# float64 algorithm-equivalence tests, docs/testing.md, and exact training traces) keeps float64
# parameters and runs under 64-bit JAX (`x64`).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def x64(dtype: str) -> contextlib.AbstractContextManager:
    """64-bit JAX around everything a float64 model or trainer traces or runs (JAX computes in
    float32 otherwise, whatever the arrays hold); nothing changes for other dtypes."""
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


@contextlib.contextmanager
def parity_mode(enabled: bool = True) -> Iterator[None]:
    """float32 matmuls at full precision: JAX uses TF32 (or bfloat16 passes on TPU) for
    float32 matmuls by default (PITFALLS 5). Part of the jit cache key, so it holds for
    every function traced inside."""
    with jax.default_matmul_precision("highest") if enabled else contextlib.nullcontext():
        yield


def compute_weights(model: nnx.Module, dtype: jnp.dtype) -> nnx.Module:
    """`model` with every floating nnx.Param cast to `dtype` once (a new module on the cast state; the
    same model when nothing is cast): the backend's one low-precision compute policy, as
    torch_impl/backend.py's compute_context. The layers compute in their `dtype` (the model's compute
    dtype) either way; cast here, each weight is cast once per traced call rather than where each use
    promotes it (a tied table: embedding and output projection), and LayerNorm's scale and bias are
    bfloat16 too (flax's LayerNorm keeps its statistics in float32 at least). Differentiated, astype's
    transpose casts the gradient back: it reaches the float32 parameter, Adam's state stays float32."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def cast(x: jax.Array) -> jax.Array:
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    if all(cast(x) is x for x in jax.tree.leaves(params)):
        return model
    return nnx.merge(graphdef, jax.tree.map(cast, params), rest)


@partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, src):
    return nnx.merge(graphdef, state).encode(src)


@partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, tgt, memory, src):
    return nnx.merge(graphdef, state).decode(tgt, memory, src)


@partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, src, tgt):
    return nnx.merge(graphdef, state)(src, tgt)


@partial(jax.jit, static_argnums=(0, 4))
def _stages(graphdef, state, src, tgt, fine=False):
    stages: dict[str, jax.Array] = {}
    nnx.merge(graphdef, state)(src, tgt, stages, fine=fine)
    return stages


@partial(jax.jit, static_argnums=0)
def _step_logits(graphdef, state, src, tgt):
    module = nnx.merge(graphdef, state)
    cache = module.init_cache(module.encode(src), tgt.shape[1])
    cross_mask = source_mask(src, module.cfg.pad_id)

    def step(cache, t):
        logits, cache = module.decode_step(tgt[:, t], t, cache, cross_mask)
        return cache, logits

    _, logits = jax.lax.scan(step, cache, jnp.arange(tgt.shape[1]))  # (T, B, V)
    return logits.transpose(1, 0, 2)


class Model(BackendModel):
    name = "jax"
    dtypes = tuple(DTYPES)

    def _build(self, params: Mapping[str, np.ndarray]) -> None:
        with x64(self.dtype):
            self.module = build_model(self.config, params, DTYPES[self.dtype])
            # bfloat16: the weights cast once for every call; the float32 ones stay the model's (to_params).
            self.graphdef, self.state = nnx.split(compute_weights(self.module, DTYPES[self.dtype]))

    def to_params(self) -> Params:
        return to_params(self.module)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with parity_mode(self.dtype != "bfloat16"), x64(self.dtype):
            yield

    @staticmethod
    def _numpy(x: jax.Array) -> np.ndarray:
        return np.asarray(x) if x.dtype == jnp.float64 else np.asarray(x.astype(jnp.float32))

    def _encode(self, src: np.ndarray) -> np.ndarray:
        with self._context():
            return self._numpy(_encode(self.graphdef, self.state, src))

    def _decode(self, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray) -> np.ndarray:
        with self._context():
            memory = jnp.asarray(memory, DTYPES[self.dtype])
            return self._numpy(_decode(self.graphdef, self.state, tgt, memory, src))

    def _logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        with self._context():
            return self._numpy(_logits(self.graphdef, self.state, src, tgt))

    def _stages(self, src: np.ndarray, tgt: np.ndarray, fine: bool = False) -> dict[str, np.ndarray]:
        with self._context():
            stages = _stages(self.graphdef, self.state, src, tgt, fine)
        return {name: self._numpy(value) for name, value in stages.items()}

    def _generate(self, src: np.ndarray, beam_size: int, alpha: float, max_len_margin: int,
                  length_rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS,
                  cache: bool = True) -> decode.Generation:
        with self._context():
            if beam_size == 1:
                return decode.greedy_search(self.graphdef, self.state, self.config, src, max_len_margin,
                                            cache, constraints)
            return decode.beam_search(self.graphdef, self.state, self.config, src, beam_size, alpha,
                                      max_len_margin, cache, rule=length_rule, constraints=constraints)

    def _step_logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        with self._context():
            return self._numpy(_step_logits(self.graphdef, self.state, src, tgt))
