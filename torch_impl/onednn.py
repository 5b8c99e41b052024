"""oneDNN's float32 GEMMs for training on a CPU that is not Intel's (issue 55): there ATen's float32 matmul
(torch.mm, autograd's GEMMs) is MKL's generic path, as fast natively as capped at AVX2 on the 2-core
AVX-512 AMD EPYC (~200 GFLOP/s), where oneDNN's ran 455 natively. PyTorch 2.13 sends a float32 matmul to
oneDNN only when bfloat16 arithmetic is allowed (torch.backends.mkldnn.matmul.fp32_precision), which
float32 training does not take; this module calls oneDNN's linear (torch.ops.mkldnn._linear_pointwise, what
torch.compile's CPU backend calls) for the model's projections, forward and backward. PyTorch-only: XLA
picks its own dot library."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from rosetta.machine import intel_cpu


class Linear(nn.Linear):
    """nn.Linear computed by `linear` (the model's projections)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; in eager float32 training on a CPU that is not Intel's, by oneDNN (_OneDNNLinear):
    there ATen's float32 matmul is MKL's generic path (a [4096, 512] x [512, 2048] product forward and
    backward 134 ms, oneDNN 88 ms on the 2-core AVX-512 AMD EPYC, issue 55). The same products in
    another summation order. Anything else takes F.linear: a GPU, Intel's CPUs, another dtype or
    autocast, no gradient, no rows (oneDNN refuses an empty product), torch.compile, a tensor subclass
    (FSDP2's DTensor), or a torch function or dispatch mode that watches F.linear and its aten ops
    (rosetta diff's TF32 emulation, FlopCounterMode)."""
    if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0
            and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and not torch._C._is_torch_function_mode_enabled() and _get_current_dispatch_mode() is None
            and not torch._C._are_functorch_transforms_active() and _onednn_trains()):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_trains() -> bool:
    return _onednn_available() and not intel_cpu()


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _OneDNNLinear(torch.autograd.Function):
    """x W^T + b and its gradients, g W for x, g^T x for W and g summed over the rows for b, by
    torch.ops.mkldnn._linear_pointwise (W's gradient by MKL's GEMM where W has more rows than columns)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows_g, rows_x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad

        def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a b^T
            return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")

        # W's gradient takes g and x transposed, which oneDNN's linear copies first: where g ([rows, out])
        # is the larger, MKL's GEMM, which reads them transposed in place, was faster (2-core AMD EPYC:
        # [4080, 256] x [256, 8000] forward and backward 245 -> 209 ms natively, 335 -> 267 capped).
        grad_w = None if not need_w else rows_g.t() @ rows_x if g.shape[-1] > x.shape[-1] \
            else gemm(rows_g.t(), rows_x.t())
        return (gemm(g, weight.t()) if need_x else None, grad_w,
                rows_g.sum(0) if ctx.has_bias and need_b else None)
