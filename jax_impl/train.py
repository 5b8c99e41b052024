"""Training math in JAX/Flax NNX (SPEC §4): the label-smoothed loss, Adam with the paper's
schedule, one training step, and canonical gradients for the parity tests.

Mirrors torch_impl/train.py function for function; diff them to see only framework differences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_impl.convert import flax_name
from jax_impl.model import Transformer
from rosetta.checkpoint import check_params
from rosetta.params import Params, param_shapes
from rosetta.training import TrainConfig


def loss_fn(logits: jax.Array, labels: jax.Array, pad_id: int,
            label_smoothing: float) -> tuple[jax.Array, jax.Array]:
    """Mean over non-pad labels of the cross entropy against q = (1-ε)·onehot(y) + ε/V, ε spread
    over all V classes, pad included (torch's and optax's definition; others differ: PITFALLS 11).
    Returns (loss, number of non-pad labels); a batch with no labels gives loss 0."""
    # log-softmax in float32 at least, even for bfloat16 logits.
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # -log p[y]
    smooth = -logp.mean(axis=-1)  # -(1/V) Σ_v log p[v]
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    mask = labels != pad_id
    num_tokens = mask.sum()
    return jnp.where(mask, per_token, 0.0).sum() / jnp.maximum(num_tokens, 1), num_tokens


def schedule(d_model: int, train_cfg: TrainConfig) -> optax.Schedule:
    """optax's schedule: it sees the update count from 0, the paper's eq. 3 counts from 1. The
    traced twin of rosetta.training.learning_rate (float32: equal to within float32 rounding)."""
    scale = train_cfg.lr_factor * d_model**-0.5
    warmup = train_cfg.warmup_steps**-1.5

    def lr(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * jnp.minimum(jax.lax.rsqrt(step), step * warmup)

    return lr


def make_optimizer(model: Transformer, train_cfg: TrainConfig) -> nnx.Optimizer:
    """Adam (eps after the square root, bias correction, no weight decay: §5.3) on the schedule,
    after optional global-norm clipping; the optimizer's step counts updates from 0."""
    tx = optax.adam(schedule(model.cfg.d_model, train_cfg), b1=train_cfg.adam_b1, b2=train_cfg.adam_b2,
                    eps=train_cfg.adam_eps)
    if train_cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm), tx)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit(static_argnames="train_cfg")
def _train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs, src: jax.Array,
                tgt: jax.Array, labels: jax.Array, train_cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    def loss_of(model: Transformer, rngs: nnx.Rngs) -> jax.Array:
        return loss_fn(model(src, tgt, rngs=rngs), labels, model.cfg.pad_id, train_cfg.label_smoothing)[0]

    lr = schedule(model.cfg.d_model, train_cfg)(optimizer.step[...])  # what adam reads this update
    loss, grads = nnx.value_and_grad(loss_of)(model, rngs)  # d/d(nnx.Param of model) only
    optimizer.update(model, grads)
    return loss, lr


def train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs, src: jax.Array,
               tgt: jax.Array, labels: jax.Array, train_cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """One update: forward with dropout (keys from the explicit `rngs`, e.g.
    nnx.Rngs(dropout=train_cfg.seed): PITFALLS 10), loss, gradients, optional global-norm
    clipping, Adam, schedule. One compiled call. Returns (loss, lr used) as 0-d arrays."""
    model.train()
    return _train_step(model, optimizer, rngs, jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(labels),
                       train_cfg=train_cfg)


@nnx.jit(static_argnames="label_smoothing")
def _gradients(model: Transformer, src: jax.Array, tgt: jax.Array, labels: jax.Array,
               label_smoothing: float, rngs: nnx.Rngs | None) -> tuple[jax.Array, nnx.State]:
    def loss_of(model: Transformer) -> jax.Array:
        return loss_fn(model(src, tgt, rngs=rngs), labels, model.cfg.pad_id, label_smoothing)[0]

    return nnx.value_and_grad(loss_of)(model)


def gradients(model: Transformer, src: jax.Array, tgt: jax.Array, labels: jax.Array,
              label_smoothing: float, rngs: nnx.Rngs | None = None) -> tuple[float, Params]:
    """The loss and every parameter's gradient for one batch, no update, in the model's current
    mode (eval: no dropout; train mode needs `rngs`). Gradients come back canonical: float32
    NumPy, canonical names (Flax kernels are already [in, out]); a tied table has one gradient."""
    loss, grads = _gradients(model, jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(labels),
                             label_smoothing=label_smoothing, rngs=rngs)
    flat = {flax_name(path): np.asarray(value, dtype=np.float32)
            for path, value in nnx.to_flat_state(grads)}
    check_params(model.cfg, flat, source="gradients")
    return float(loss), {name: flat[name] for name in param_shapes(model.cfg)}  # checkpoint order
