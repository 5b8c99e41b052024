"""The output projection and the label-smoothed cross-entropy (SPEC §4) in chunks of tokens, with
their own backward: no [tokens, V] float32 tensor is ever alive for the whole batch, only one
[chunk, V] block at a time. Same loss and gradients as torch_impl/train.py's
`loss_fn(hidden @ W.T + b, ...)`; the math and the choice of chunk: docs/loss.md. The matmuls take
their operands in the hidden states' dtype (bfloat16 in, bfloat16 GEMMs with float32 accumulation;
float32 and float64 as they are); logits, logsumexp, sums and the weight's gradient are float32 at
least. Also the plain path's core, `cross_entropy` (train.loss_fn), with its closed-form backward,
as jax_impl/loss.py's.

Maintained kernels that do this (Liger-Kernel's fused linear cross-entropy, Apple's Cut
Cross-Entropy) are Triton/CUDA only: Liger is not on the package index this project installs
from, Cut Cross-Entropy is but needs Triton and a GPU, and neither runs on our CPU machines.
Measuring them against this Function on a GPU is not done here (not measured): until it is, this
plain-PyTorch Function is the one used, on every device.

Mirrors jax_impl/loss.py, the same names in the same order (parity_tests/test_structure.py);
diff them to see only framework differences.
"""

from __future__ import annotations

import math

import torch

from rosetta.errors import RosettaError

# Tokens per chunk: the [chunk, V] float32 logits block is 4·chunk·V bytes (1024 × 32k: 128 MiB).
DEFAULT_CHUNK = 1024


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with both operands in their own (compute) dtype, the product in float32 at least.
    bfloat16 operands run the bfloat16 GEMM, which accumulates in float32 (cuBLAS, oneDNN);
    float32 and float64 ones run as they are, unchanged."""
    # Deliberate: the bfloat16 result is rounded to bfloat16, then widened (the plain path's
    # logits under autocast are too); torch.mm's out_dtype=float32 is CUDA-only, not used.
    return (a @ b).to(torch.promote_types(a.dtype, torch.float32))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scale: float
                  ) -> torch.Tensor:
    """Logits [n, V] = scale * (h W^T) (+ b) of one chunk, in float32 at least (§3.4), as
    torch_impl/model.py's Generator (`scale`: the config's logit_scale, SPEC §2). h and w (already
    in h's dtype) are the matmul's operands; `bias` is already in the logits' dtype. A new
    tensor, scaled and biased in place."""
    logits = _matmul(h, w.T)
    logits = logits if scale == 1.0 else logits.mul_(scale)
    return logits if bias is None else logits.add_(bias)


def _token_losses(logits: torch.Tensor, y: torch.Tensor, pad_id: int, label_smoothing: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over non-pad tokens of the cross-entropy against q, logsumexp per token) of logits
    [..., V] in their own (float32 or wider) dtype."""
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(-1, y[..., None])[..., 0]  # -log p[y]
    smooth = lse - logits.mean(dim=-1)  # -(1/V) Σ_v log p[v]: ε over all V (PITFALLS 11)
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return torch.where(y != pad_id, per_token, 0.0).sum(), lse


def _logits_grad(logits: torch.Tensor, lse: torch.Tensor | None, y: torch.Tensor, pad_id: int,
                 label_smoothing: float, scale: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = mask · (softmax - q) · scale, from the logits and their logsumexp (lse
    None: `logits` are already the log-probabilities, cross_entropy's), written over the logits (no
    new [..., V] tensor)."""
    V = logits.shape[-1]
    logp = logits if lse is None else logits.sub_(lse[..., None])
    g = logp.exp_().sub_(label_smoothing / V)  # softmax - ε/V
    minus = torch.full_like(y[..., None], label_smoothing - 1.0, dtype=g.dtype)
    g.scatter_add_(-1, y[..., None], minus)  # - (1-ε)·onehot(y)
    return g.mul_(torch.where(y != pad_id, scale, 0.0)[..., None])


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, denominator: torch.Tensor, pad_id: int,
                  label_smoothing: float) -> torch.Tensor:
    """Σ over non-pad tokens of the cross-entropy against q = (1-ε)·onehot(y) + ε/V, divided by
    `denominator`, for logits [..., V] already in float32 or wider and int64 labels: train.loss_fn's
    core. Its own backward is the closed form: autograd's (mean's, gather's and log_softmax's
    backwards: three new [tokens, V] tensors) took ~115 ms against ~22 in a `small` step on this
    project's CPU (docs/loss.md)."""
    return _CrossEntropy.apply(logits, labels, denominator, pad_id, label_smoothing)


def _cross_entropy_forward(ctx, logits: torch.Tensor, labels: torch.Tensor, denominator: torch.Tensor,
                           pad_id: int, label_smoothing: float) -> torch.Tensor:
    # From the log-softmax, not jax_impl's logsumexp: ATen's logsumexp makes a [tokens, V] temporary
    # beside its passes (the whole loss 1.9x as long); the same sums as autograd's path, bit for bit.
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, labels[..., None])[..., 0]  # -log p[y]
    smooth = -logp.mean(dim=-1)  # -(1/V) Σ_v log p[v]: ε over all V (PITFALLS 11)
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    ctx.save_for_backward(logp, labels, denominator)
    ctx.pad_id, ctx.label_smoothing = pad_id, label_smoothing
    return torch.where(labels != pad_id, per_token, 0.0).sum() / denominator


@torch.autograd.function.once_differentiable
def _cross_entropy_backward(ctx, grad_out: torch.Tensor):
    """d loss / d logits = mask · (softmax - q) · grad_out / denominator, softmax = exp(logp): written
    over the saved log-probabilities (no new [tokens, V] tensor) unless the graph is kept for another
    backward (retain_graph, gradcheck) or compiled (inductor plans its own buffers)."""
    logp, labels, denominator = ctx.saved_tensors
    kept = torch.compiler.is_compiling() or torch._C._autograd._get_current_graph_task_keep_graph()
    # A probability below twice the dtype's smallest normal number is read as that (an absolute error
    # of about 2·finfo.tiny, 2.4e-38 in float32; log(tiny) itself rounds to a float32 whose exp is
    # subnormal): ATen's vectorized exp takes a slow path into the subnormals, 12x the time where 80%
    # of a `small` step's log-probabilities lay there (docs/benchmarks.md).
    low = math.log(2 * torch.finfo(logp.dtype).tiny)
    logp = logp.clamp(min=low) if kept else logp.clamp_(min=low)
    scale = grad_out.to(logp.dtype) / denominator
    return _logits_grad(logp, None, labels, ctx.pad_id, ctx.label_smoothing, scale), None, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """cross_entropy's custom backward in torch's form (JAX's: jax.custom_vjp's defvjp)."""

    forward = staticmethod(_cross_entropy_forward)
    backward = staticmethod(_cross_entropy_backward)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, denominator: torch.Tensor, pad_id: int,
                          label_smoothing: float, chunk: int, scale: float) -> torch.Tensor:
    """Σ over non-pad tokens of the cross-entropy against q = (1-ε)·onehot(y) + ε/V, divided by
    `denominator`; forward and backward both walk the tokens `chunk` at a time."""
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, labels, denominator, pad_id, label_smoothing,
                                      chunk, scale)


def _chunked_forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     labels: torch.Tensor, denominator: torch.Tensor, pad_id: int, label_smoothing: float,
                     chunk: int, scale: float) -> torch.Tensor:
    """The operands of the matmuls are in hidden's dtype (the compute dtype: bfloat16 when training
    in bfloat16), the weight cast to it once; logits, logsumexp and sums in float32 at least."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    w, b = weight.to(hidden.dtype), None if bias is None else bias.to(dtype)
    total = hidden.new_zeros((), dtype=dtype)
    lse = hidden.new_empty(hidden.shape[0], dtype=dtype)  # O(N): kept for the backward
    with torch.autocast(hidden.device.type, enabled=False):  # the operands stay in their dtype
        for start in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[start:start + chunk], w, b, scale)
            chunk_total, lse[start:start + chunk] = _token_losses(logits, labels[start:start + chunk],
                                                                  pad_id, label_smoothing)
            total = total + chunk_total
            del logits  # the next chunk's may reuse its memory
    ctx.save_for_backward(hidden, weight, bias, labels, lse, denominator)
    ctx.pad_id, ctx.label_smoothing, ctx.chunk, ctx.scale = pad_id, label_smoothing, chunk, scale
    return total / denominator.to(dtype)


def _chunked_backward(ctx, grad_out: torch.Tensor):
    """d loss / d logits = mask · (softmax - q) / denominator, recomputed chunk by chunk from
    the saved logsumexp in float32; then through logits = s (h W^T) + b: d/dh = s g W, d/dW = s g^T h,
    matmuls whose operands (g rounded to it, h, W) are in hidden's dtype, accumulated in float32."""
    hidden, weight, bias, labels, lse, denominator = ctx.saved_tensors
    eps, V = ctx.label_smoothing, weight.shape[0]
    dtype = lse.dtype
    scale = grad_out.to(dtype) / denominator.to(dtype)
    grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
    grad_b = torch.zeros(V, dtype=dtype, device=weight.device) if need_b else None
    w, b, s = weight.to(hidden.dtype), None if bias is None else bias.to(dtype), ctx.scale
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start:start + ctx.chunk], labels[start:start + ctx.chunk]
            g = _logits_grad(_chunk_logits(h, w, b, s), lse[start:start + ctx.chunk], y, ctx.pad_id, eps,
                             scale)
            if grad_b is not None:
                grad_b += g.sum(dim=0)  # float32 g; the bias is added after the scale
            g_op = g.to(hidden.dtype)  # the matmuls' operand (the same tensor in float32)
            # s multiplies the [chunk, d] sides (exact when s = 1), never the [chunk, V] block.
            if grad_h is not None:
                grad_h[start:start + ctx.chunk] = (s * _matmul(g_op, w)).to(hidden.dtype)
            if grad_w is not None:
                grad_w += _matmul(g_op.T, s * h)
            del g, g_op  # the next chunk's logits may reuse their memory
    grad_w = None if grad_w is None else grad_w.to(weight.dtype)
    grad_b = None if grad_b is None else grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b, None, None, None, None, None, None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """chunked_cross_entropy's custom backward in torch's form (JAX's: jax.custom_vjp's defvjp)."""

    forward = staticmethod(_chunked_forward)
    backward = staticmethod(_chunked_backward)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 labels: torch.Tensor, pad_id: int, label_smoothing: float,
                 num_tokens: torch.Tensor | int | None = None, chunk: int = DEFAULT_CHUNK,
                 logit_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """train.loss_fn(Generator(hidden), labels, ...) without the [tokens, V] logits:
    hidden [B, T, d] or [N, d] (the decoder's output after its final norm), weight nn.Linear's
    [V, d] (the target table itself when tied, §3.4), bias [V] or None, labels hidden's leading
    shape, `logit_scale` the config's (SPEC §2: logits = logit_scale * (hidden W^T) + bias).
    Returns (loss, number of non-pad labels); the loss is the masked sum over that number, or over
    `num_tokens` when given (a part of a global batch: rosetta/distributed.py); a batch with no
    labels gives loss 0."""
    if hidden.ndim < 1 or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise RosettaError(f"chunked_loss: labels {tuple(labels.shape)} must be hidden's "
                           f"{tuple(hidden.shape)} leading shape")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise RosettaError(f"chunked_loss: weight {tuple(weight.shape)} must be [V, d] with "
                           f"d = {hidden.shape[-1]} (hidden's last dimension)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise RosettaError(f"chunked_loss: bias {tuple(bias.shape)} must be [V] = ({weight.shape[0]},)")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise RosettaError(f"chunked_loss: chunk must be a positive int, not {chunk!r}")
    if labels.dtype.is_floating_point:
        raise RosettaError(f"chunked_loss: labels must be integer ids, not {labels.dtype}")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    count = (y != pad_id).sum()
    denominator = count.clamp(min=1) if num_tokens is None else torch.as_tensor(num_tokens, device=h.device)
    loss = chunked_cross_entropy(h, weight, bias, y, denominator, pad_id, float(label_smoothing), chunk,
                                 float(logit_scale))
    return loss, count


def generator_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, d], bias [V] or None) of a Transformer's Generator: the target embedding table
    when tied (§3.4), as torch_impl/model.py's Generator.forward picks it. Pass the module's
    `cfg.logit_scale` to chunked_loss with them."""
    weight = module.tgt_table.weight if module.generator.weight is None else module.generator.weight
    return weight, module.generator.bias
