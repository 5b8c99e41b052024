"""The catalogue of training-loop mistakes `rosetta diff --diagnose` tries on two traces, and the
float64 replay that builds each one from the reference side (docs/training_diff.md).

A replay starts from the reference trace's initial weights and trains on its batches, in
float64, without dropout: the loss (SPEC §4, label smoothing §5.4) and its gradient in the
logits, the gradient transforms (clipping, L2), Adam (§5.3) and eq. 3's schedule written out here
in NumPy, each switchable to one mistake; only the model's own backward is a framework's, the
float64 model the backend registry lends (autodiff.py: the reference trace's framework, or the one
installed). `Variant` holds the switches; `ENTRIES` names each mistake
with the fix it implies. Only the entries whose mistake changes anything under the reference's
settings apply (no label smoothing: its three variants are the correct loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from rosetta.config import ModelConfig
from rosetta.diff.shared.metrics import log_softmax
from rosetta.diff.training.autodiff import Float64Model, replay_framework
from rosetta.diff.training.trace import Trace
from rosetta.errors import RosettaError
from rosetta.params import Params
from rosetta.training import TrainConfig, learning_rate

LOSS_VARIANTS = ("ours", "smooth_over_v_minus_1", "annotated_kl", "pad_in_loss", "per_sentence", "summed")
SCHEDULES = ("eq3", "from_zero", "from_zero_clamped", "ahead", "constant")


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
    clip_micro: bool = False       # the running sum clipped after every micro-batch, not once per update
    lr_scale: float = 1.0          # eq. 3 times a factor (fitted)
    smoothing: float | None = None  # label smoothing ε; None: the reference's
    clip: float | None = None      # a clipping norm where the reference has none; None: the reference's
    tf32: bool = False             # matmul operands rounded to TF32's 10-bit mantissa (tf32.py)
    clip_update: bool = False      # Adam's update clipped to the norm (optax.chain(adam, clip)), not g


@dataclass(frozen=True)
class Entry:
    name: str
    wrong: str                      # what the mistaken loop does
    fix: str                        # printed
    variant: Callable[[Settings], Variant]
    applies: Callable[[Settings], bool] = lambda s: True
    fit: str | None = None          # a Variant field fitted to the observation: "decay" (λ) or "lr_scale"
    judged: str = "replay"          # or "size" (TF32), "evaluation" (dropout): checks.py


def _smoothing(s: Settings) -> bool:
    return s.train.label_smoothing > 0


class Settings(NamedTuple):
    """A trace's training settings: TrainConfig's fields, and `accumulate`, the micro-batches an
    update's batch is cut into (rosetta.distributed.split_rows; 1 when the trace does not say)."""

    train: TrainConfig
    accumulate: int = 1

    @classmethod
    def from_trace(cls, record: dict[str, Any]) -> Settings:
        record = dict(record)
        accumulate = record.pop("accumulate", 1)
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise RosettaError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        return cls(TrainConfig.from_dict(record), accumulate)


ENTRIES: tuple[Entry, ...] = (
    Entry("eps_inside_sqrt", "Adam's ε inside the square root: m̂ / sqrt(v̂ + ε)",
          "put ε outside the root, m̂ / (sqrt(v̂) + ε) (torch.optim.Adam, optax.adam; optax's eps_root is "
          "the inside one)", lambda s: Variant(eps_inside_sqrt=True)),
    Entry("no_bias_correction", "Adam without bias correction (m and v used as they are)",
          "divide m by 1 - β1^t and v by 1 - β2^t (§5.3's Adam, Kingma & Ba alg. 1; torch.optim.Adam and "
          "optax.adam do)",
          lambda s: Variant(bias_correction=False)),
    Entry("beta2_0.999", "β2 = 0.999 (torch's and optax's default) instead of the paper's",
          "β2 = 0.98 as §5.3: Adam(betas=(0.9, 0.98)), optax.adam(lr, b2=0.98)",
          lambda s: Variant(b2=0.999), lambda s: s.train.adam_b2 != 0.999),
    Entry("beta2_0.98", "β2 = 0.98 where the reference has 0.999",
          "β2 as the reference's: Adam(betas=(0.9, β2)), optax.adam(lr, b2=β2)",
          lambda s: Variant(b2=0.98), lambda s: s.train.adam_b2 != 0.98),
    Entry("eps_1e-8", "ε = 1e-8 (torch's and optax's default) instead of the paper's 1e-9",
          "ε = 1e-9 as §5.3: Adam(eps=1e-9), optax.adam(lr, eps=1e-9)",
          lambda s: Variant(eps=1e-8), lambda s: s.train.adam_eps != 1e-8),
    Entry("adamw_decay", "decoupled weight decay on every tensor (torch.optim.AdamW: default 0.01)",
          "no weight decay (§5.3): Adam or AdamW(weight_decay=0); optax.adam, not optax.adamw",
          lambda s: Variant(decay=0.01), fit="decay"),
    Entry("adamw_decay_matrices", "decoupled weight decay on weight matrices only (not biases, norms)",
          "no weight decay (§5.3): drop the decayed parameter group (optax: the adamw mask)",
          lambda s: Variant(decay=0.01, decay_all=False), fit="decay"),
    Entry("l2_in_gradient", "L2 added to the gradient (torch.optim.Adam(weight_decay=λ)), every tensor",
          "no weight decay (§5.3); where decay is wanted, decoupled (AdamW, optax.adamw), not L2 through "
          "Adam (Adam(weight_decay=λ), optax.chain(optax.add_decayed_weights(λ), optax.adam(...)))",
          lambda s: Variant(decay=0.01, decoupled=False), fit="decay"),
    Entry("l2_in_gradient_matrices", "L2 added to the gradient of weight matrices only",
          "no weight decay (§5.3): no weight_decay in Adam, no optax.add_decayed_weights before optax.adam",
          lambda s: Variant(decay=0.01, decoupled=False, decay_all=False),
          fit="decay"),
    Entry("schedule_from_zero", "eq. 3 counted from step 0: the first update's lr is min(0^-0.5, 0) = 0",
          "count eq. 3's step from 1 (LambdaLR passes 0 first, and optax's schedule gets its count from 0: "
          "use step + 1 in either)",
          lambda s: Variant(schedule="from_zero")),
    Entry("schedule_from_zero_clamped", "eq. 3 counted from 0 with step 0 taken as 1 (the Annotated "
          "Transformer's rate()): steps 1 and 2 share lr(1), step k gets lr(k - 1)",
          "count eq. 3's step from 1 (LambdaLR passes 0 first, and optax's schedule gets its count from 0: "
          "use step + 1 in either, no clamp)",
          lambda s: Variant(schedule="from_zero_clamped")),
    Entry("schedule_scaled", "eq. 3 times a constant: another factor in front of the schedule (ESPnet's "
          "and coqui's NoamLR peak at base_lr: base_lr·warmup^0.5·min(...) for d_model^-0.5)",
          "lr = lr_factor·d_model^-0.5·min(step^-0.5, step·warmup^-1.5) (eq. 3); a peak-normalised "
          "NoamLR matches it with base_lr = lr_factor·(d_model·warmup)^-0.5; an optax schedule is this "
          "function of its count + 1",
          lambda s: Variant(lr_scale=2.0), fit="lr_scale"),
    Entry("constant_rate", "a constant learning rate (Adam(lr=...) without a scheduler, optax.adam(1e-3)) "
          "instead of eq. 3's warm-up and decay",
          "eq. 3's schedule: LambdaLR(optimizer, lambda n: rate(n + 1)) with lr=1.0, or optax.adam(schedule) "
          "with schedule(count) = rate(count + 1)",
          lambda s: Variant(schedule="constant"), fit="lr_scale"),
    Entry("clip_after_adam", "Adam's update clipped by its global norm instead of the gradient "
          "(optax.chain(optax.adam(...), optax.clip_by_global_norm(c)))",
          "clip the gradient before Adam: optax.chain(optax.clip_by_global_norm(c), optax.adam(...)); "
          "clip_grad_norm_ before optimizer.step()",
          lambda s: Variant(clip_update=True), lambda s: s.train.clip_norm is not None),
    Entry("clip_per_tensor", "gradients clipped per tensor instead of by their global norm",
          "clip by the global norm (clip_grad_norm_ over all parameters, optax.clip_by_global_norm)",
          lambda s: Variant(clip_per_tensor=True), lambda s: s.train.clip_norm is not None),
    Entry("clip_torch_eps", "torch's clip_grad_norm_ (scale c / (‖g‖ + 1e-6)) against min(1, c / ‖g‖)",
          "scale by min(1, c / ‖g‖) as optax.clip_by_global_norm (or accept a 1e-6-relative difference)",
          lambda s: Variant(clip_eps=1e-6), lambda s: s.train.clip_norm is not None),
    Entry("clip_before_accumulation", "gradients clipped inside the accumulation loop (clip_grad_norm_ after "
          "every micro-batch's backward): the running sum is clipped K times, not the update's gradient once",
          "clip once per update, after the last micro-batch's backward (optax: clip inside MultiSteps' "
          "inner chain)",
          lambda s: Variant(clip_micro=True), lambda s: s.train.clip_norm is not None and s.accumulate > 1),
    Entry("tf32_matmuls", "matmuls in TF32 (10-bit mantissa operands): torch.backends.cuda.matmul.allow_tf32 "
          "or cudnn.allow_tf32, JAX's default precision on GPUs",
          "float32 matmuls: torch.backends.cuda.matmul.allow_tf32 = False (and cudnn's), "
          "jax.default_matmul_precision('highest'); rosetta's parity mode sets both",
          lambda s: Variant(tf32=True), judged="size"),
    Entry("dropout_at_evaluation", "dropout left on when evaluating (no model.eval(); deterministic=False "
          "in Flax): the evaluation loss is a random draw, not the model's",
          "evaluate with dropout off: model.eval() (and back to model.train()), nnx's model.eval() or "
          "deterministic=True", lambda s: Variant(), judged="evaluation"),
    Entry("smooth_over_v_minus_1", "label smoothing spread over the V - 1 other classes",
          "spread ε over all V classes, pad included (torch's and optax's definition, PITFALLS 11)",
          lambda s: Variant(loss="smooth_over_v_minus_1"), _smoothing),
    Entry("annotated_kl", "the Annotated Transformer's smoothing: KL divergence against ε/(V - 2) on every "
          "class but the label and pad, summed over tokens / tokens",
          "cross entropy against (1 - ε)·onehot + ε/V (PITFALLS 11): label_smoothing=ε, "
          "optax.smooth_labels(onehot, ε)",
          lambda s: Variant(loss="annotated_kl"), _smoothing),
    Entry("pad_in_loss", "pad positions counted in the loss (the mean over every position)",
          "mask the labels equal to pad_id out of the sum and the count (SPEC §4): ignore_index=pad_id; "
          "with optax, multiply by labels != pad_id and divide by its sum",
          lambda s: Variant(loss="pad_in_loss")),
    Entry("per_sentence", "the loss averaged per sentence, then over sentences",
          "divide the batch's summed loss by its number of non-pad labels (per token, SPEC §4), in torch "
          "as with optax's per-token losses",
          lambda s: Variant(loss="per_sentence")),
    Entry("loss_summed", "the loss summed over the tokens, not averaged (reduction='sum'): Adam nearly "
          "undoes the scale, not its ε",
          "divide by the number of non-pad labels (SPEC §4): reduction='mean' with ignore_index=pad_id; "
          "optax: (per_token * mask).sum() / mask.sum()",
          lambda s: Variant(loss="summed"), lambda s: s.accumulate == 1),
    Entry("no_label_smoothing", "label smoothing left out (ε = 0: nn.CrossEntropyLoss's and "
          "optax.softmax_cross_entropy's default)",
          "smooth the targets with the reference's ε (§5.4: 0.1): label_smoothing=ε, optax.smooth_labels",
          lambda s: Variant(smoothing=0.0), lambda s: s.train.label_smoothing > 0),
    Entry("scheduler_before_optimizer", "scheduler.step() before optimizer.step(): update k uses eq. 3's "
          "rate of step k + 1 (the trace's lr: the rate the update used)",
          "step the optimizer, then the scheduler (PyTorch warns of the other order; optax's schedule "
          "is called inside the update, with the count before it)",
          lambda s: Variant(schedule="ahead")),
    Entry("clip_where_none", "gradients clipped to norm 1 by torch's clip_grad_norm_ (c / (‖g‖ + 1e-6)) "
          "where the reference clips none",
          "no clipping, as the reference (the paper has none: rosetta train's --clip-norm default): drop "
          "clip_grad_norm_, or optax.clip_by_global_norm from the chain",
          lambda s: Variant(clip=1.0, clip_eps=1e-6), lambda s: s.train.clip_norm is None),
)
BY_NAME = {e.name: e for e in ENTRIES}


# -- the loss --------------------------------------------------------------------------------------

def loss_value(logits: np.ndarray, labels: np.ndarray, pad_id: int, eps: float, kind: str,
               ) -> tuple[float, np.ndarray]:
    """The loss of one batch and its gradient in the logits [B, T, V], in float64 NumPy: ours
    (SPEC §4: cross entropy against (1 - ε)·onehot + ε/V, the mean over the labels that are not pad)
    or one mistake. Each is a weighted sum over positions of the cross entropy H(q, p) against a
    target q (and, for the KL, of q·log q, a constant), so its gradient is w·(p·Σq - q), p = softmax."""
    logp = log_softmax(logits)
    p, V = np.exp(logp), logits.shape[-1]
    mask = (labels != pad_id).astype(np.float64)
    count = max(float(mask.sum()), 1.0)
    # q: `spread` on every class and `at_label` on the label (the Annotated Transformer's: 0 for pad).
    spread, at_label = {"smooth_over_v_minus_1": (eps / (V - 1), 1 - eps),
                        "annotated_kl": (eps / (V - 2), 1 - eps)}.get(kind, (eps / V, 1 - eps + eps / V))
    q = np.full(p.shape, spread)
    np.put_along_axis(q, labels[..., None], at_label, axis=-1)
    if kind == "annotated_kl":
        q[..., pad_id] = 0.0  # true_dist: 0 in the pad column, after the label's (pad rows: w is 0)
    if kind == "pad_in_loss":
        w = np.full(mask.shape, 1.0 / mask.size)  # the mean over every position, pad included
    elif kind == "per_sentence":
        w = mask / (np.maximum(mask.sum(-1, keepdims=True), 1.0) * mask.shape[0])
    elif kind == "summed":
        w = mask  # the sum over the real tokens, not divided by their count
    else:
        w = mask / count
    per_position = -(q * logp).sum(-1)
    if kind == "annotated_kl":  # KL(q || p) = H(q, p) - H(q): the entropy term, 0·log 0 taken as 0
        per_position += (q * np.log(np.where(q > 0, q, 1.0))).sum(-1)
    grad = w[..., None] * (p * q.sum(-1, keepdims=True) - q)
    return float((w * per_position).sum()), grad


def loss_and_grads(cfg: ModelConfig, params: Params, src: np.ndarray, tgt_in: np.ndarray, labels: np.ndarray,
                   eps: float, variant: Variant, scale: float = 1.0, framework: str | None = None,
                   ) -> tuple[float, Params]:
    """`scale` × the loss and its canonical float64 gradients at `params`, no dropout (TF32 matmuls
    with `variant.tf32`): loss_value's gradient carried back through the model by `framework`'s
    autodiff (autodiff.py; None: the first installed)."""
    model = Float64Model(framework or replay_framework(), cfg, params)

    def loss(logits: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = loss_value(logits, labels, cfg.pad_id, eps, variant.loss)
        return scale * value, scale * grad

    return model.loss_and_grads(src, tgt_in, loss, tf32=variant.tf32)


def accumulated(cfg: ModelConfig, params: Params, step: Any, settings: Settings, variant: Variant,
                framework: str | None = None) -> tuple[float, Params]:
    """The loss and the gradient an update records, from `settings.accumulate` micro-batches
    (rosetta.distributed.split_rows, each weighted by its share of the batch's tokens: the
    per-token mean of SPEC §4), the running sum clipped after each but the last with
    `variant.clip_micro`; the last clip is the update's own (`clip`). Without `clip_micro` the
    token-weighted sum over micro-batches is the whole batch's per-token mean in exact arithmetic
    (padding is masked), so the batch is taken whole: one forward and backward a step, not one a
    micro-batch (issue 57: `accumulate` = the batch's rows gave no verdict in 5 minutes); the two
    differ by float64 summation order only. `framework`: autodiff.py's."""
    from rosetta.distributed import split_rows
    from rosetta.training import Batch

    rows = step.src.shape[0]
    labels = (step.labels != cfg.pad_id).sum()
    batch = Batch(step.src, step.tgt_in, step.labels, np.arange(rows), int((step.src != cfg.pad_id).sum()),
                  int(labels))
    loss, total = 0.0, None
    # More parts than rows cut the same one-row blocks plus all-padding ones (skipped below):
    # min() keeps a trace's absurd `accumulate` from allocating that many padding rows.
    parts = min(settings.accumulate, rows) if variant.clip_micro else 1
    for micro in split_rows(batch, parts, cfg.pad_id):
        if not micro.num_tgt_tokens:
            continue  # padding rows only: no gradient
        eps = settings.train.label_smoothing if variant.smoothing is None else variant.smoothing
        part, grads = loss_and_grads(cfg, params, micro.src, micro.tgt_in, micro.labels, eps, variant,
                                     micro.num_tgt_tokens / labels, framework)
        if total is not None and variant.clip_micro:
            total = clip(total, settings.train.clip_norm, variant)
        loss, total = loss + part, grads if total is None else {n: total[n] + grads[n] for n in grads}
    return loss, total


# -- the schedule, clipping, Adam ---------------------------------------------------------------------

def schedule_lr(k: int, d_model: int, tc: TrainConfig, variant: Variant) -> float:
    """The learning rate of update k (from 1): eq. 3, or a tutorial's miscount, times lr_scale."""
    if variant.schedule == "from_zero":
        lr = 0.0 if k == 1 else learning_rate(k - 1, d_model, tc.warmup_steps, tc.lr_factor)
    elif variant.schedule == "from_zero_clamped":
        lr = learning_rate(max(k - 1, 1), d_model, tc.warmup_steps, tc.lr_factor)
    elif variant.schedule == "ahead":
        lr = learning_rate(k + 1, d_model, tc.warmup_steps, tc.lr_factor)
    elif variant.schedule == "constant":
        lr = 1.0  # the rate itself is lr_scale, fitted to the recorded rates
    else:
        lr = learning_rate(k, d_model, tc.warmup_steps, tc.lr_factor)
    return variant.lr_scale * lr


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
    new, m, v, step_of = {}, {}, {}, {}
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
        new[n] = theta
        step_of[n] = lr * step
    if variant.clip_update:  # optax.chain(adam(lr), clip_by_global_norm(c)): the scaled update clipped
        step_of = clip(step_of, tc.clip_norm, replace(variant, clip_per_tensor=False, clip_eps=0.0))
    return {n: new[n] - step_of[n] for n in new}, AdamState(t, m, v)


# -- the replay -----------------------------------------------------------------------------------------

class ReplayStep(NamedTuple):
    loss: float
    lr: float
    grads: Params   # before clipping and L2, as a trace records them
    params: Params  # after the update


def replay(ref: Trace, settings: Settings, variant: Variant, steps: int, grads_cache: dict | None = None,
           initial: Params | None = None) -> Iterator[ReplayStep]:
    """`steps` updates from the reference's initial weights (or `initial`) on its batches, float64,
    no dropout, one at a time (memory: one step's weights, whatever `steps`). `grads_cache` (keyed by
    the variant's forward and loss) keeps step 1's gradients, which every optimizer-only variant shares."""
    tc, framework = settings.train, replay_framework(ref.writer, tf32=variant.tf32)
    params = {n: v.astype(np.float64) for n, v in (ref.initial() if initial is None else initial).items()}
    state = AdamState(0, {n: np.zeros_like(v) for n, v in params.items()},
                      {n: np.zeros_like(v) for n, v in params.items()})
    for k in range(1, steps + 1):
        # What `accumulated` reads of the variant: the clip's form only where it clips inside.
        key = (variant.loss, variant.tf32, variant.smoothing, variant.clip_micro,
               (variant.clip_per_tensor, variant.clip_eps) if variant.clip_micro else None)
        if grads_cache is not None and k == 1 and key in grads_cache:
            loss, grads = grads_cache[key]
        else:
            loss, grads = accumulated(ref.cfg, params, ref.full(k), settings, variant, framework)
            if grads_cache is not None and k == 1:
                grads_cache[key] = (loss, grads)
        lr = schedule_lr(k, ref.cfg.d_model, tc, variant)
        c = tc.clip_norm if variant.clip is None else variant.clip
        params, state = adam_step(params, clip(grads, None if variant.clip_update else c, variant), state, lr,
                                  tc, variant)
        # The trace's lr is the rate the update used (trace.py): scheduler_before_optimizer's k + 1's too.
        yield ReplayStep(loss, lr, grads, params)


def first_step(ref: Trace, settings: Settings, variant: Variant, grads_cache: dict | None = None,
               initial: Params | None = None) -> ReplayStep:
    return next(replay(ref, settings, variant, 1, grads_cache, initial))


def with_decay(variant: Variant, decay: float) -> Variant:
    return replace(variant, decay=decay)
