"""Training math in PyTorch (SPEC §4): the label-smoothed loss, Adam with the paper's schedule,
one training step, and canonical gradients for the parity tests.

Mirrors jax_impl/train.py function for function; diff them to see only framework differences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosetta.params import Params
from rosetta.training import TrainConfig, learning_rate
from torch_impl.convert import from_state_dict
from torch_impl.model import Transformer


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, pad_id: int,
            label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over non-pad labels of the cross entropy against q = (1-ε)·onehot(y) + ε/V, ε spread
    over all V classes, pad included (torch's and optax's definition; others differ: PITFALLS 11).
    Returns (loss, number of non-pad labels); a batch with no labels gives loss 0."""
    # log-softmax in float32 at least, even for bfloat16 logits.
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    nll = -logp.gather(-1, labels.long()[..., None])[..., 0]  # -log p[y]
    smooth = -logp.mean(dim=-1)  # -(1/V) Σ_v log p[v]
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    mask = labels != pad_id
    num_tokens = mask.sum()
    return torch.where(mask, per_token, 0.0).sum() / num_tokens.clamp(min=1), num_tokens


def schedule(d_model: int, train_cfg: TrainConfig) -> Callable[[int], float]:
    """LambdaLR's multiplier: it sees the step counted from 0, the paper's eq. 3 counts from 1."""
    return lambda step: learning_rate(step + 1, d_model, train_cfg.warmup_steps, train_cfg.lr_factor)


def make_optimizer(module: Transformer, train_cfg: TrainConfig
                   ) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam (eps after the square root, bias correction, no weight decay: §5.3) with base lr 1,
    so that LambdaLR's lr at optimizer step s (from 1) is exactly learning_rate(s)."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1.0, betas=(train_cfg.adam_b1, train_cfg.adam_b2),
                                 eps=train_cfg.adam_eps, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(module.cfg.d_model, train_cfg))


def train_step(module: Transformer, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, src: torch.Tensor, tgt: torch.Tensor,
               labels: torch.Tensor, train_cfg: TrainConfig) -> tuple[torch.Tensor, float]:
    """One update: forward with dropout (torch's generator: PITFALLS 10), loss, backward,
    optional global-norm clipping, Adam, schedule. Returns (loss, lr used); the loss is a
    detached 0-d tensor (reading it synchronises)."""
    module.train()
    optimizer.zero_grad(set_to_none=True)
    loss, _ = loss_fn(module(src, tgt), labels, module.cfg.pad_id, train_cfg.label_smoothing)
    loss.backward()
    if train_cfg.clip_norm is not None:
        # Scales by clip/(norm + 1e-6) where optax scales by clip/norm: ~1e-6 relative apart.
        torch.nn.utils.clip_grad_norm_(module.parameters(), train_cfg.clip_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return loss.detach(), lr


def gradients(module: Transformer, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor,
              label_smoothing: float) -> tuple[float, Params]:
    """The loss and every parameter's gradient for one batch, no update, in the module's current
    mode (eval: no dropout). Gradients come back canonical: float32 NumPy, canonical names, math
    layout (torch_impl/convert.py transposes Linear weights back); a tied table has one gradient."""
    module.zero_grad(set_to_none=True)
    loss, _ = loss_fn(module(src, tgt), labels, module.cfg.pad_id, label_smoothing)
    loss.backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad
             for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return float(loss), from_state_dict(module.cfg, grads)

