"""TF32 matmuls, emulated on any CPU for `rosetta diff --diagnose` (the `tf32_matmuls` entry).

NVIDIA's TF32 (Ampere and later: `torch.backends.cuda.matmul.allow_tf32`, cuDNN's
`allow_tf32`, JAX's default matmul precision on GPUs) multiplies float32 operands rounded to a
10-bit mantissa (unit roundoff 2^-11) and accumulates in float32. Here every matmul of a torch
forward pass (F.linear, matmul/@, bmm, scaled_dot_product_attention written out) rounds its
operands to 11 significant bits, to nearest, ties to even, and multiplies in the tensors' own
dtype; its backward rounds the incoming gradient and the other operand the same way, as the
GPU's dgrad and wgrad matmuls do. In float64 that isolates TF32's rounding from float32's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

MANTISSA_BITS = 10  # TF32: 1 sign, 8 exponent, 10 mantissa bits


def round_tf32(x: Any) -> Any:
    """x rounded to 11 significant bits (to nearest, ties to even): m·2^e with m in [0.5, 1)
    becomes round(m·2^11)·2^(e-11). Zero, infinities and NaN pass through."""
    import torch

    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2.0 ** (MANTISSA_BITS + 1)), (e - (MANTISSA_BITS + 1)).to(x.dtype))


def _matmul_function():
    import torch

    class TF32Matmul(torch.autograd.Function):
        """a @ b with both operands (and, backward, the gradient) rounded to TF32."""

        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            ra, rb = round_tf32(a), round_tf32(b)
            ctx.save_for_backward(ra, rb)
            return torch.matmul(ra, rb)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any]:
            ra, rb = ctx.saved_tensors
            g = round_tf32(grad)
            grad_a = torch.matmul(g, rb.transpose(-2, -1))
            grad_b = torch.matmul(ra.transpose(-2, -1), g)
            return _unbroadcast(grad_a, ra.shape), _unbroadcast(grad_b, rb.shape)

    return TF32Matmul


def _unbroadcast(grad: Any, shape: Any) -> Any:
    """A gradient summed back over the batch dimensions matmul broadcast."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and grad.shape[i] != 1:
            grad = grad.sum(i, keepdim=True)
    return grad


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """Inside: every matmul of a torch forward pass in emulated TF32 (module docstring). The
    backward runs outside, from the saved rounded operands."""
    if not enabled:
        yield
        return
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    matmul = _matmul_function().apply

    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        y = matmul(x, weight.t())
        return y if bias is None else y + bias

    def attention(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None, **_: Any) -> Any:
        """SDPA written out (eq. 1) with TF32 products; no dropout (the replay has none)."""
        scores = matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if is_causal:
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        if attn_mask is not None:
            scores = scores + attn_mask if attn_mask.dtype != torch.bool else \
                scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        return matmul(scores.softmax(-1), v)

    replaced = {F.linear: linear, torch.matmul: matmul, torch.Tensor.__matmul__: matmul, torch.bmm: matmul,
                F.scaled_dot_product_attention: attention}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            return replaced.get(func, func)(*args, **(kwargs or {}))

    with Mode():
        yield
