"""The PyTorch model behind the common backend interface (rosetta.backends). jax_impl/backend.py is
JAX's, under the same names where they match, in the same order (parity_tests/test_structure.py)."""

from __future__ import annotations

import contextlib
import sys
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
from torch_impl.model import Transformer, source_mask
from torch_impl.ops import keep_heap, packed_linears


@dataclass(frozen=True)
class Precision:
    """What one compute dtype means in PyTorch: the weights' dtype (and Adam's moments'), the dtype
    the forward pass computes in (None: the weights'; `compute_context`), whether it computes by
    torch.autocast instead, whether the trainer offers it, and whether it needs a CUDA device."""

    params: torch.dtype
    compute: torch.dtype | None = None
    autocast: bool = False
    trains: bool = True
    cuda_only: bool = False


# The backend's one dtype table: Model.dtypes and Trainer.dtypes (torch_impl/train.py) are read
# from it. bfloat16 keeps float32 weights (and Adam's state) and computes with bfloat16 copies of
# them, cast once per forward pass (`compute_context`); float16 computes under torch.autocast.
DTYPES: dict[str, Precision] = {
    "float32": Precision(torch.float32),
    "bfloat16": Precision(torch.float32, torch.bfloat16),
    # float64: the "same algorithm?" tests (DDP, accumulation, resume) and exact training traces.
    "float64": Precision(torch.float64),
    # float16 overflows in training without loss scaling (a GradScaler), which the trainer has not;
    # autocast keeps LayerNorm and softmax in float32, away from float16's range (inference, CUDA).
    "float16": Precision(torch.float32, torch.float16, autocast=True, trains=False, cuda_only=True),
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


def compute_weights(module: torch.nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Each floating parameter of `module` cast to `dtype`, once, keyed by the parameter's id (a tied
    parameter is cast once): `p.to(dtype)`, differentiable, so gradients reach the float32 parameter
    (the master weight) as float32. Parameters already in `dtype` are kept as they are."""
    return {id(p): p.to(dtype) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype}


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, weights: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Every parameter of `module` with a cast copy in `weights` replaced by it, restored on exit
    (what torch.func.functional_call does; also around encode/decode_step, and traced by dynamo)."""
    saved = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if id(p) in weights]
    for m, name, p in saved:
        m._parameters[name] = weights[id(p)]
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p


def loaded_instance(value: object, module: str, name: str) -> bool:
    """isinstance(value, module.name), False where `module` was never imported: FSDP2 and DTensor are
    imported where a module is sharded (torch_impl/distributed.py's replicate), not at start (~0.5 s of
    CPU, sympy included, that a process that only decodes need not pay), and none of their modules or
    tensors exist before."""
    found = sys.modules.get(module)
    return found is not None and isinstance(value, getattr(found, name))


def compute_context(module: torch.nn.Module, dtype: torch.dtype | None, autocast: bool = False,
                    weights: Mapping[int, torch.Tensor] | None = None) -> contextlib.AbstractContextManager:
    """The backend's one low-precision compute policy, around a forward pass of `module` (one process,
    or DDP around it) in `dtype` (a DTYPES entry's `compute`; None: the weights' own dtype, nothing
    changes). bfloat16: the float32 weights are cast to bfloat16 once, on entry (`compute_weights`;
    or the `weights` given: a model's cast kept for every call), and the forward pass computes with
    those: every matmul, the residual stream and LayerNorm's output in bfloat16, LayerNorm's
    statistics in float32 (torch's kernels accumulate 16-bit inputs in float32), the softmax of
    attention and of the loss in float32 (torch_impl/ops.py, train.py). Why a cast per pass and not
    bfloat16 parameters with float32 masters kept by the optimizer: Adam, clipping, the checkpoint
    and an exact resume stay the float32 ones they are, with no second copy to keep in step; the
    cast costs one read of the weights per step (compiled: fused into the graph). Autocast, which
    this replaces, caches its weight casts within a pass, but casts the float32 residual stream at
    every Linear's input (q, k and v each cast the same one). JAX's trainer does the same as this
    (jax_impl/backend.py's compute_weights).
    torch.autocast (`autocast`, float16; and a module that is not ours: the nn.Transformer peer,
    trained with the AMP recipe a user of it writes, or one sharded by FSDP2, whose unsharding
    would put its float32 parameters back: its MixedPrecisionPolicy is the cast-once there, not
    wired yet) computes the matmuls in `dtype` from float32 weights, LayerNorm and the residual
    stream in float32. DDP: tested in a one-process group (parity_tests/test_bf16_compute.py)."""
    if dtype is None:
        return contextlib.nullcontext()
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    sharded = loaded_instance(module, "torch.distributed.fsdp", "FSDPModule")
    if autocast or not isinstance(inner, Transformer) or sharded:
        device = next(module.parameters()).device
        return torch.autocast(device.type, dtype=dtype)
    return _swapped(module, compute_weights(module, dtype) if weights is None else weights)


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
        self.precision = precision = DTYPES[self.dtype]
        if precision.cuda_only and self.device.type != "cuda":
            raise RosettaError(f"backend 'torch' offers {self.dtype} on CUDA only; use bfloat16 on a "
                               f"{self.device.type}")
        self.module = build_model(self.config, params, precision.params, self.device)
        # bfloat16: the weights cast once for every call (fixed addresses for a compiled search's CUDA
        # graphs); the float32 ones stay the model's (to_params).
        self._weights = None
        if precision.compute is not None and not precision.autocast:
            with torch.no_grad():
                self._weights = compute_weights(self.module, precision.compute)

    def to_params(self) -> Params:
        return to_params(self.module)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        precision = self.precision
        compute = compute_context(self.module, precision.compute, precision.autocast, self._weights)
        with torch.inference_mode(), parity_mode(precision.compute is None), compute:
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
            dtype = self.precision.params if self._weights is None else self.precision.compute
            memory_t = torch.from_numpy(memory).to(self.device, dtype)
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
        keep_heap(self.device.type)
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
