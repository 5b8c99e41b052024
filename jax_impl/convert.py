"""Canonical parameters <-> the Flax NNX model. Flax kernels are already in math layout
[in, out] and the module attributes carry the canonical names, so a canonical name is the
model's state path joined by dots: no transposes here (compare torch_impl/convert.py, which offers
the same `build_model` and `to_params`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_impl.model import Positions, Transformer
from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.params import Params, param_shapes
from rosetta.positional import model_table


def flax_name(path: tuple) -> str:
    """A state path such as ('encoder', 'layers', 0, 'ffn', 'linear1', 'kernel') -> its
    canonical name 'encoder.layers.0.ffn.linear1.kernel'."""
    return ".".join(str(part) for part in path)


@functools.lru_cache(maxsize=64)
def _structure(cfg: ModelConfig, dtype: jnp.dtype, x64: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and abstract state (shapes only), traced once per config and dtype: the
    trace (nnx.eval_shape of the constructor) cost ~0.4 CPU s a tiny model, at every build. Every
    value is set by build_model; `x64` is in the key as the constructor's default dtypes follow it."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0))))


def build_model(cfg: ModelConfig, params: Mapping[str, np.ndarray],
                dtype: jnp.dtype = jnp.float32) -> Transformer:
    """A Transformer holding `params`. Built abstractly (nnx.eval_shape): nothing is
    initialised inside the framework, every value comes from `params` (PITFALLS 9). Parameters
    are float32 (float64 for a float64 `dtype`, under 64-bit JAX)."""
    check_params(cfg, params)
    param_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    graphdef, abstract = _structure(cfg, dtype, jax.config.jax_enable_x64)
    flat = nnx.to_flat_state(jax.tree.map(lambda x: x, abstract))  # new Variables: this model's own
    for path, variable in flat:
        if isinstance(variable, Positions):
            # The one non-parameter: recomputed from the config, as in the constructor.
            variable.set_value(jnp.asarray(model_table(cfg), dtype=param_dtype))
        else:
            # jnp.array copies (jnp.asarray may alias NumPy memory on CPU).
            variable.set_value(jnp.array(params[flax_name(path)], dtype=param_dtype))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.eval()  # dropout off until a trainer calls model.train()
    return model


def to_params(model: Transformer, dtype: type = np.float32) -> Params:
    """Canonical NumPy arrays from the model's parameters: float32, or `dtype` np.float64 (a
    float64 trainer's weights: the float64 tests, docs/testing.md)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {flax_name(path): np.array(variable.get_value(), dtype=dtype)  # writable copies
              for path, variable in flat}
    check_params(model.cfg, params, source="flax state")
    return {name: params[name] for name in param_shapes(model.cfg)}  # checkpoint order
