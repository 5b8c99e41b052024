"""Canonical parameters <-> the PyTorch model: `build_model` and `to_params`, as
jax_impl/convert.py's, through the module's state_dict (`to_state_dict`, `from_state_dict`: also
what gradients and sharded state go through). The one place where layouts change: nn.Linear stores
`weight` as [out, in], the transpose of our math-layout `kernel` (PITFALLS 7), and nn.Embedding and
nn.LayerNorm call their tensors `weight`."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import torch

from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError
from rosetta.params import Params, param_shapes
from torch_impl.model import Transformer


def torch_name(name: str) -> tuple[str, bool]:
    """Canonical tensor name -> (state_dict key, whether the layout is transposed)."""
    module, leaf = name.rsplit(".", 1)
    if leaf == "kernel":
        return f"{module}.weight", True
    if leaf in ("embedding", "scale"):
        return f"{module}.weight", False
    return name, False  # biases keep their name


def to_state_dict(
    cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    check_params(cfg, params)
    state = {}
    for name in param_shapes(cfg):
        key, transposed = torch_name(name)
        value = _torch_compatible(np.asarray(params[name]))
        # torch.tensor copies: the module must never share memory with the caller's arrays,
        # or an optimizer step would write into them.
        state[key] = torch.tensor(value.T if transposed else value, dtype=dtype)
    return state


def _torch_compatible(value: np.ndarray) -> np.ndarray:
    """`value` as an array torch.tensor accepts. NumPy has no bfloat16 of its own: bfloat16
    checkpoints arrive as ml_dtypes.bfloat16, which torch cannot read; float32 holds every
    bfloat16 value exactly (same exponent range, more mantissa), so widening loses nothing."""
    if value.dtype == ml_dtypes.bfloat16:
        return value.astype(np.float32)
    return value


def from_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor], dtype: type = np.float32) -> Params:
    """Canonical NumPy arrays from a Transformer's state_dict (strict about keys): float32, or
    `dtype` np.float64 (a float64 trainer's weights: the float64 tests, docs/testing.md)."""
    expected = {torch_name(name)[0]: name for name in param_shapes(cfg)}
    missing = [k for k in expected if k not in state]
    extra = sorted(k for k in state if k not in expected)
    if missing or extra:
        raise CheckpointError(f"state_dict does not match the config: missing {missing}, "
                              f"unexpected {extra}")
    params = {}
    for key, name in expected.items():
        value = state[key].detach().to("cpu", torch.float64 if dtype == np.float64 else torch.float32).numpy()
        params[name] = np.array(value.T if torch_name(name)[1] else value)  # a copy, not a view
    check_params(cfg, params, source="state_dict")
    return params


def build_model(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """A Transformer holding `params` on `device`, parameters in `dtype`, in eval mode. Built on the
    meta device: nothing is initialised inside the framework, every value comes from `params`
    (PITFALLS 9)."""
    with torch.device("meta"):  # no memory, no random draws
        module = Transformer(cfg)
    module.load_state_dict(to_state_dict(cfg, params, dtype), assign=True)
    return module.to(device, dtype).eval()


def to_params(module: Transformer, dtype: type = np.float32) -> Params:
    """Canonical NumPy arrays from the module's parameters: float32, or `dtype` np.float64 (a
    float64 trainer's weights: the float64 tests, docs/testing.md)."""
    return from_state_dict(module.cfg, module.state_dict(), dtype)
