"""The catalogue of training-loop mistakes `rosetta diff --diagnose` tries on two traces, and the
float64 replay that builds each one from the reference side (docs/training_diff.md).

A replay starts from the reference trace's initial weights and trains on its batches, in
float64, without dropout: the loss (SPEC §4, label smoothing §5.4) through torch_impl's model,
the gradient transforms (clipping, L2), Adam (§5.3) and eq. 3's schedule written out here in
NumPy, each switchable to one mistake. `Variant` holds the switches; `ENTRIES` names each mistake
with the fix it implies. Only the entries whose mistake changes anything under the reference's
settings apply (no label smoothing: its three variants are the correct loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from rosetta.config import ModelConfig
from rosetta.diff.trace import Trace
from rosetta.params import Params
from rosetta.training import TrainConfig, learning_rate

LOSS_VARIANTS = ("ours", "smooth_over_v_minus_1", "annotated_kl", "pad_in_loss", "per_sentence")
SCHEDULES = ("eq3", "from_zero", "from_zero_clamped")


@dataclass(frozen=True)
class Variant:
    """One way to train: ours (every default) or with the named mistakes switched on."""

    loss: str = "ours"
    schedule: str = "eq3"
    eps_inside_sqrt: bool = False
    bias_correction: bool = True
    b2: float | None = None       # None: the reference's
    eps: float | None = None
    decay: float = 0.0            # weight decay λ
    decoupled: bool = True        # AdamW (θ -= lr·λ·θ) or L2 in the gradient (g += λ·θ)
    decay_all: bool = True        # on every tensor, or on weight matrices only (not biases, norms)
    clip_per_tensor: bool = False  # clip each tensor to the norm, not the global norm
    clip_eps: float = 0.0          # torch's clip_grad_norm_ scales by c / (‖g‖ + 1e-6); optax's c / ‖g‖


@dataclass(frozen=True)
class Entry:
    name: str
    wrong: str                      # what the mistaken loop does
    fix: str                        # printed
    variant: Callable[[TrainConfig], Variant]
    applies: Callable[[TrainConfig], bool] = lambda tc: True
    fit_decay: bool = False         # λ is fitted to the observation


def _smoothing(tc: TrainConfig) -> bool:
    return tc.label_smoothing > 0


ENTRIES: tuple[Entry, ...] = (
    Entry("eps_inside_sqrt", "Adam's ε inside the square root: m̂ / sqrt(v̂ + ε)",
          "put ε outside the root, m̂ / (sqrt(v̂) + ε) (torch.optim.Adam, optax.adam; optax's eps_root is "
          "the inside one)", lambda tc: Variant(eps_inside_sqrt=True)),
    Entry("no_bias_correction", "Adam without bias correction (m and v used as they are)",
          "divide m by 1 - β1^t and v by 1 - β2^t (§5.3's Adam, Kingma & Ba alg. 1)",
          lambda tc: Variant(bias_correction=False)),
    Entry("beta2_0.999", "β2 = 0.999 (torch's and optax's default) instead of the paper's",
          "Adam(betas=(0.9, 0.98)) as §5.3", lambda tc: Variant(b2=0.999), lambda tc: tc.adam_b2 != 0.999),
    Entry("beta2_0.98", "β2 = 0.98 where the reference has 0.999", "β2 as the reference's",
          lambda tc: Variant(b2=0.98), lambda tc: tc.adam_b2 != 0.98),
    Entry("eps_1e-8", "ε = 1e-8 (torch's and optax's default) instead of the paper's 1e-9",
          "Adam(eps=1e-9) as §5.3", lambda tc: Variant(eps=1e-8), lambda tc: tc.adam_eps != 1e-8),
    Entry("adamw_decay", "decoupled weight decay on every tensor (torch.optim.AdamW: default 0.01)",
          "no weight decay (§5.3): Adam, or AdamW(weight_decay=0)",
          lambda tc: Variant(decay=0.01), fit_decay=True),
    Entry("adamw_decay_matrices", "decoupled weight decay on weight matrices only (not biases, norms)",
          "no weight decay (§5.3): drop the decayed parameter group",
          lambda tc: Variant(decay=0.01, decay_all=False), fit_decay=True),
    Entry("l2_in_gradient", "L2 added to the gradient (torch.optim.Adam(weight_decay=λ)), every tensor",
          "no weight decay (§5.3); where decay is wanted, decoupled (AdamW), not L2 through Adam",
          lambda tc: Variant(decay=0.01, decoupled=False), fit_decay=True),
    Entry("l2_in_gradient_matrices", "L2 added to the gradient of weight matrices only",
          "no weight decay (§5.3)", lambda tc: Variant(decay=0.01, decoupled=False, decay_all=False),
          fit_decay=True),
    Entry("schedule_from_zero", "eq. 3 counted from step 0: the first update's lr is min(0^-0.5, 0) = 0",
          "count eq. 3's step from 1 (LambdaLR passes 0 first: use step + 1)",
          lambda tc: Variant(schedule="from_zero")),
    Entry("schedule_from_zero_clamped", "eq. 3 counted from 0 with step 0 taken as 1 (the Annotated "
          "Transformer's rate()): steps 1 and 2 share lr(1), step k gets lr(k - 1)",
          "count eq. 3's step from 1 (LambdaLR passes 0 first: use step + 1)",
          lambda tc: Variant(schedule="from_zero_clamped")),
    Entry("clip_per_tensor", "gradients clipped per tensor instead of by their global norm",
          "clip by the global norm (clip_grad_norm_ over all parameters, optax.clip_by_global_norm)",
          lambda tc: Variant(clip_per_tensor=True), lambda tc: tc.clip_norm is not None),
    Entry("clip_torch_eps", "torch's clip_grad_norm_ (scale c / (‖g‖ + 1e-6)) against min(1, c / ‖g‖)",
          "scale by min(1, c / ‖g‖) as optax.clip_by_global_norm (or accept a 1e-6-relative difference)",
          lambda tc: Variant(clip_eps=1e-6), lambda tc: tc.clip_norm is not None),
    Entry("smooth_over_v_minus_1", "label smoothing spread over the V - 1 other classes",
          "spread ε over all V classes, pad included (torch's and optax's definition, PITFALLS 11)",
          lambda tc: Variant(loss="smooth_over_v_minus_1"), _smoothing),
    Entry("annotated_kl", "the Annotated Transformer's smoothing: KL divergence against ε/(V - 2) on every "
          "class but the label and pad, summed over tokens / tokens",
          "cross entropy against (1 - ε)·onehot + ε/V (PITFALLS 11)",
          lambda tc: Variant(loss="annotated_kl"), _smoothing),
    Entry("pad_in_loss", "pad positions counted in the loss (the mean over every position)",
          "mask the labels equal to pad_id out of the sum and the count (SPEC §4)",
          lambda tc: Variant(loss="pad_in_loss")),
    Entry("per_sentence", "the loss averaged per sentence, then over sentences",
          "divide the batch's summed loss by its number of non-pad labels (per token, SPEC §4)",
          lambda tc: Variant(loss="per_sentence")),
)
BY_NAME = {e.name: e for e in ENTRIES}


# -- the loss --------------------------------------------------------------------------------------

def loss_value(logits: Any, labels: Any, pad_id: int, eps: float, kind: str) -> Any:
    """The loss of one batch, float64 torch tensors: ours (SPEC §4) or one mistake."""
    import torch

    logp = torch.log_softmax(logits, dim=-1)
    V = logits.shape[-1]
    nll = -logp.gather(-1, labels[..., None])[..., 0]
    mask = (labels != pad_id).to(logits.dtype)
    if kind == "annotated_kl":
        # true_dist: ε/(V-2) everywhere, 1-ε at the label, 0 in the pad column and on pad rows.
        q = torch.full_like(logp, eps / (V - 2))
        q.scatter_(-1, labels[..., None], 1.0 - eps)
        q[..., pad_id] = 0.0
        q = q * mask[..., None]
        kl = torch.where(q > 0, q * (torch.log(torch.where(q > 0, q, 1.0)) - logp), 0.0).sum(-1)
        return kl.sum() / mask.sum().clamp(min=1)
    if kind == "smooth_over_v_minus_1":
        per_token = (1 - eps) * nll + eps / (V - 1) * (-logp.sum(-1) - nll)
    else:
        per_token = (1 - eps) * nll + eps * (-logp.mean(-1))
    if kind == "pad_in_loss":
        return per_token.mean()
    if kind == "per_sentence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def loss_and_grads(cfg: ModelConfig, params: Params, src: np.ndarray, tgt_in: np.ndarray, labels: np.ndarray,
                   eps: float, kind: str) -> tuple[float, Params]:
    """The loss and its canonical float64 gradients at `params`, no dropout."""
    import torch

    from torch_impl.backend import Model
    from torch_impl.convert import from_state_dict

    module = Model(cfg, params, "float64", device="cpu").module
    with torch.enable_grad():
        logits = module(torch.from_numpy(src), torch.from_numpy(tgt_in))
        loss = loss_value(logits, torch.from_numpy(labels), cfg.pad_id, eps, kind)
        loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}
    return float(loss.detach()), from_state_dict(cfg, grads, np.float64)


# -- the schedule, clipping, Adam ---------------------------------------------------------------------

def schedule_lr(k: int, d_model: int, tc: TrainConfig, kind: str) -> float:
    """The learning rate of update k (from 1): eq. 3, or a tutorial's miscount."""
    if kind == "from_zero":
        return 0.0 if k == 1 else learning_rate(k - 1, d_model, tc.warmup_steps, tc.lr_factor)
    if kind == "from_zero_clamped":
        return learning_rate(max(k - 1, 1), d_model, tc.warmup_steps, tc.lr_factor)
    return learning_rate(k, d_model, tc.warmup_steps, tc.lr_factor)


def clip(grads: Params, c: float | None, variant: Variant) -> Params:
    """Scale by min(1, c / (‖g‖ + clip_eps)), ‖g‖ the global norm or each tensor's."""
    if c is None:
        return grads
    if variant.clip_per_tensor:
        return {n: g * min(1.0, c / max(float(np.linalg.norm(g)) + variant.clip_eps, 1e-300))
                for n, g in grads.items()}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    return {n: g * min(1.0, c / max(norm + variant.clip_eps, 1e-300)) for n, g in grads.items()}


def decayed(name: str, value: np.ndarray, variant: Variant) -> bool:
    """Whether the variant's decay reaches this tensor: all, or weight matrices only (no biases,
    norms or embeddings, the usual parameter groups)."""
    return variant.decay_all or (value.ndim == 2 and "embed" not in name)


class AdamState(NamedTuple):
    t: int
    m: Params
    v: Params


def adam_step(params: Params, grads: Params, state: AdamState, lr: float, tc: TrainConfig,
              variant: Variant) -> tuple[Params, AdamState]:
    """One Adam update (Kingma & Ba alg. 1, as torch.optim.Adam/AdamW and optax.adam(w) apply it),
    float64, with the variant's mistakes."""
    b1, b2 = tc.adam_b1, variant.b2 if variant.b2 is not None else tc.adam_b2
    eps = variant.eps if variant.eps is not None else tc.adam_eps
    t = state.t + 1
    new, m, v = {}, {}, {}
    for n, theta in params.items():
        g = grads[n]
        if variant.decay and decayed(n, theta, variant) and not variant.decoupled:
            g = g + variant.decay * theta  # L2 through Adam
        m[n] = b1 * state.m[n] + (1 - b1) * g
        v[n] = b2 * state.v[n] + (1 - b2) * g * g
        m_hat, v_hat = (m[n] / (1 - b1**t), v[n] / (1 - b2**t)) if variant.bias_correction else (m[n], v[n])
        step = m_hat / np.sqrt(v_hat + eps) if variant.eps_inside_sqrt else m_hat / (np.sqrt(v_hat) + eps)
        if variant.decay and decayed(n, theta, variant) and variant.decoupled:
            theta = theta * (1 - lr * variant.decay)  # AdamW: decay first, on the lr
        new[n] = theta - lr * step
    return new, AdamState(t, m, v)


# -- the replay -----------------------------------------------------------------------------------------

class ReplayStep(NamedTuple):
    loss: float
    lr: float
    grads: Params   # before clipping and L2, as a trace records them
    params: Params  # after the update


def replay(ref: Trace, tc: TrainConfig, variant: Variant, steps: int,
           grads_cache: dict | None = None) -> list[ReplayStep]:
    """`steps` updates from the reference's initial weights on its batches, float64, no dropout.
    `grads_cache` (keyed by step and loss kind) reuses gradients while the weights are the
    reference replay's own (the optimizer-only variants share step 1's)."""
    params = {n: v.astype(np.float64) for n, v in ref.initial().items()}
    state = AdamState(0, {n: np.zeros_like(v) for n, v in params.items()},
                      {n: np.zeros_like(v) for n, v in params.items()})
    out = []
    for k in range(1, steps + 1):
        step = ref.full(k)
        key = (k, variant.loss)
        if grads_cache is not None and k == 1 and key in grads_cache:
            loss, grads = grads_cache[key]
        else:
            loss, grads = loss_and_grads(ref.cfg, params, step.src, step.tgt_in, step.labels,
                                         tc.label_smoothing, variant.loss)
            if grads_cache is not None and k == 1:
                grads_cache[key] = (loss, grads)
        lr = schedule_lr(k, ref.cfg.d_model, tc, variant.schedule)
        params, state = adam_step(params, clip(grads, tc.clip_norm, variant), state, lr, tc, variant)
        out.append(ReplayStep(loss, lr, grads, params))
    return out


def with_decay(variant: Variant, decay: float) -> Variant:
    return replace(variant, decay=decay)
