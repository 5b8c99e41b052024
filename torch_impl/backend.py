"""The PyTorch model behind the common backend interface (rosetta.backends). jax_impl/backend.py is
JAX's, under the same names where they match, in the same order (parity_tests/test_structure.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from rosetta.backends import BackendModel
from rosetta.device import check_device
from rosetta.errors import RosettaError
from rosetta.generation import NO_CONSTRAINTS, Constraints
from rosetta.params import Params
from torch_impl import decode
from torch_impl.convert import build_model, to_params
from torch_impl.model import source_mask
from torch_impl.ops import packed_linears


@dataclass(frozen=True)
class Precision:
    """What one compute dtype means in PyTorch: the weights' dtype (and Adam's moments'), the dtype
    torch.autocast computes in (None: no autocast), whether the trainer offers it, and whether it
    needs a CUDA device."""

    params: torch.dtype
    autocast: torch.dtype | None = None
    trains: bool = True
    cuda_only: bool = False


# The backend's one dtype table: Model.dtypes and Trainer.dtypes (torch_impl/train.py) are read
# from it. bfloat16 and float16 keep float32 weights and compute the matmuls under autocast.
DTYPES: dict[str, Precision] = {
    "float32": Precision(torch.float32),
    "bfloat16": Precision(torch.float32, torch.bfloat16),
    # float64: the "same algorithm?" tests (DDP, accumulation, resume) and exact training traces.
    "float64": Precision(torch.float64),
    # float16 overflows in training without loss scaling (a GradScaler), which the trainer has not.
    "float16": Precision(torch.float32, torch.float16, trains=False, cuda_only=True),
}


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """"highest": float32 matmuls in full float32; "high": TF32 tensor cores on Ampere and
    newer GPUs (the speed mode). Restores the caller's setting afterwards (PITFALLS 5)."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def parity_mode(enabled: bool = True) -> contextlib.AbstractContextManager:
    """float32 results comparable on any device: no TF32 (PITFALLS 5)."""
    return float32_matmul_precision("highest") if enabled else contextlib.nullcontext()


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` (a DTYPES entry's `autocast`) on `device`'s type; None: no autocast."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def default_device(name: str | None = None) -> str:
    """torch's name of the device --device `name` picks (rosetta/device.py's one parser, checked
    against the GPUs torch sees here); None: CUDA if available, else the CPU."""
    device = check_device(name, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.torch


class Model(BackendModel):
    name = "torch"
    dtypes = tuple(DTYPES)

    def __init__(self, cfg, params, dtype=None, device: str | None = None, compile: bool | None = None):
        """`compile`: the search step compiled once (torch_impl/decode.py; CUDA graphs on GPUs); None:
        on CUDA devices only, True: on a CPU too (tests), False: eager."""
        self.device = torch.device(default_device(device))
        self.compile = self.device.type == "cuda" if compile is None else bool(compile)
        super().__init__(cfg, params, dtype)

    def _build(self, params: Mapping[str, np.ndarray]) -> None:
        precision = DTYPES[self.dtype]
        param_dtype, self.autocast_dtype = precision.params, precision.autocast
        if precision.cuda_only and self.device.type != "cuda":
            raise RosettaError(f"backend 'torch' offers {self.dtype} on CUDA only; use bfloat16 on a "
                               f"{self.device.type}")
        self.module = build_model(self.config, params, param_dtype, self.device)

    def to_params(self) -> Params:
        return to_params(self.module)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        autocast = autocast_context(self.device, self.autocast_dtype)
        with torch.inference_mode(), parity_mode(self.autocast_dtype is None), autocast:
            yield

    def _tensor(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    @staticmethod
    def _numpy(x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy() if x.dtype != torch.float64 else x.cpu().numpy()

    def _encode(self, src: np.ndarray) -> np.ndarray:
        with self._context():
            return self._numpy(self.module.encode(self._tensor(src)))

    def _decode(self, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray) -> np.ndarray:
        with self._context():
            param_dtype = DTYPES[self.dtype].params
            memory_t = torch.from_numpy(memory).to(self.device, param_dtype)
            return self._numpy(self.module.decode(self._tensor(tgt), memory_t, self._tensor(src)))

    def _logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        with self._context():
            return self._numpy(self.module(self._tensor(src), self._tensor(tgt)))

    def _stages(self, src: np.ndarray, tgt: np.ndarray, fine: bool = False) -> dict[str, np.ndarray]:
        stages: dict[str, torch.Tensor] = {}
        with self._context():
            self.module(self._tensor(src), self._tensor(tgt), stages, fine)
            return {name: self._numpy(value) for name, value in stages.items()}

    def _generate(self, src: np.ndarray, beam_size: int, alpha: float, max_len_margin: int,
                  length_rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS,
                  cache: bool = True) -> decode.Generation:
        compiled = self.compile and cache
        # oneDNN's packed weights on the eager CPU path only: a compiled step captures the plain module.
        packed = contextlib.nullcontext() if compiled else packed_linears(self.module, len(src) * beam_size)
        with self._context(), packed:
            if beam_size == 1:
                return decode.greedy_search(self.module, self.config, self._tensor(src), max_len_margin,
                                            cache, constraints, compiled=compiled)
            return decode.beam_search(self.module, self.config, self._tensor(src), beam_size, alpha,
                                      max_len_margin, cache, rule=length_rule, constraints=constraints,
                                      compiled=compiled)

    def _step_logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        with self._context():
            src_t, tgt_t = self._tensor(src), self._tensor(tgt)
            cache = self.module.init_cache(self.module.encode(src_t), tgt.shape[1])
            cross_mask = source_mask(src_t, self.config.pad_id)
            # A compiled search's step takes t as a tensor: its static-cache path, here uncompiled.
            position = (lambda t: torch.tensor(t, device=self.device)) if self.compile else (lambda t: t)
            steps = [self.module.decode_step(tgt_t[:, t], position(t), cache, cross_mask)
                     for t in range(tgt.shape[1])]
            return self._numpy(torch.stack(steps, dim=1))
