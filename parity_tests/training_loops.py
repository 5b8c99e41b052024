"""Plain training loops, as users write them, for the training diff's tests
(parity_tests/test_diff_training.py): PyTorch + torch.optim and JAX + optax, each able to make
one catalogued mistake the way real code makes it (torch.optim.AdamW's default decay, optax's
schedule fed the count from 0, the Annotated Transformer's KLDivLoss...), tracing every step with
rosetta.diff.training.trace.TraceWriter as docs/training_diff.md's recipe does.

Independent of our trainers and of the catalogue's replay: only the model's forward pass is ours
(torch_impl's and jax_impl's modules, proven by the parity suite); the loss, the optimizer, the
schedule and the clipping are each framework's own functions or written out here.
"""

from __future__ import annotations

import numpy as np

from rosetta.config import ModelConfig
from rosetta.diff.training.trace import TraceWriter
from rosetta.training import Batch, TrainConfig

# Mistakes a torch.optim loop below can make (the catalogue's names).
TORCH_MISTAKES = (
    "eps_inside_sqrt", "no_bias_correction", "beta2_0.999", "eps_1e-8", "adamw_decay", "adamw_decay_matrices",
    "l2_in_gradient", "l2_in_gradient_matrices", "schedule_from_zero", "schedule_from_zero_clamped",
    "clip_per_tensor", "clip_torch_eps", "smooth_over_v_minus_1", "annotated_kl", "pad_in_loss",
    "per_sentence", "schedule_scaled", "clip_before_accumulation",
)
# Entries judged another way than by a replay (rosetta/diff/training/checks.py), each with its own test;
# the loop can make them too ("tf32_matmuls": float32 with emulated TF32 matmuls).
JUDGED = ("tf32_matmuls", "dropout_at_evaluation")
ACCUMULATE = 2  # micro-batches per update of the clip_before_accumulation loop (and of its reference)
NOAM_BASE_LR = 1e-3  # schedule_scaled: ESPnet's NoamLR, base_lr·warmup^0.5·min(step^-0.5, step·warmup^-1.5)
JAX_MISTAKES = ("eps_inside_sqrt", "beta2_0.999", "eps_1e-8", "adamw_decay", "schedule_from_zero")


def _tf32(x):
    """float32 -> TF32 by its bits: add half of the 13 dropped bits' unit (ties to even), clear them."""
    import torch

    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def tf32_mode():
    """A TorchFunctionMode giving every linear, matmul and SDPA of a float32 forward TF32 operands
    (backward: the gradient and the saved operands too), as a GPU with allow_tf32 does."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            a, b = _tf32(a), _tf32(b)
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            g = _tf32(g)
            ga, gb = g @ b.transpose(-2, -1), a.transpose(-2, -1) @ g
            while gb.dim() > b.dim():
                gb = gb.sum(0)
            return ga, gb

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        scores = Product.apply(q, k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        if attn_mask is not None:  # as SDPA reads a mask: a boolean one's False is -inf, a float one is added
            scores = scores.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        return Product.apply(scores.softmax(-1), v)

    table = {F.linear: lambda x, w, b=None: Product.apply(x, w.t()) + (0 if b is None else b),
             torch.matmul: Product.apply, torch.Tensor.__matmul__: Product.apply,
             F.scaled_dot_product_attention: sdpa}

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return table.get(func, func)(*args, **(kwargs or {}))

    return Mode()


def rate(step: float, d_model: int, tc: TrainConfig) -> float:
    """Eq. 3 as tutorials write it (NumPy float: 0 ** -0.5 is inf, and min(inf, 0) = 0)."""
    step = np.float64(step)
    with np.errstate(divide="ignore"):
        return float(tc.lr_factor * d_model**-0.5 * min(step**-0.5, step * tc.warmup_steps**-1.5))


# -- PyTorch + torch.optim ---------------------------------------------------------------------------

def _torch_loss(logits, labels, pad: int, eps: float, mistake: str | None):
    import torch
    import torch.nn.functional as F

    flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    V = logits.shape[-1]
    if mistake == "pad_in_loss":
        return F.cross_entropy(flat, target, label_smoothing=eps)
    if mistake == "per_sentence":
        per = F.cross_entropy(flat, target, ignore_index=pad, label_smoothing=eps, reduction="none")
        per = per.reshape(labels.shape)
        return (per.sum(1) / (labels != pad).sum(1).clamp(min=1)).mean()
    if mistake == "smooth_over_v_minus_1":
        logp = torch.log_softmax(flat, -1)
        q = torch.full_like(logp, eps / (V - 1)).scatter_(1, target[:, None], 1 - eps)
        keep = target != pad
        return -(q * logp).sum(1)[keep].mean()
    if mistake == "annotated_kl":  # The Annotated Transformer's LabelSmoothing + SimpleLossCompute
        logp = torch.log_softmax(flat, -1)
        true_dist = torch.full_like(logp, eps / (V - 2))
        true_dist.scatter_(1, target[:, None], 1 - eps)
        true_dist[:, pad] = 0
        rows = torch.nonzero(target == pad)
        if rows.numel():
            true_dist.index_fill_(0, rows.squeeze(-1), 0.0)
        return torch.nn.KLDivLoss(reduction="sum")(logp, true_dist) / (target != pad).sum()
    return F.cross_entropy(flat, target, ignore_index=pad, label_smoothing=eps)


class _HandAdam:
    """A hand-written Adam (as in TF1-era and from-scratch code), for the two mistakes torch.optim
    cannot make: ε inside the root, no bias correction."""

    def __init__(self, params, tc: TrainConfig, mistake: str):
        import torch

        self.params, self.tc, self.mistake, self.t = list(params), tc, mistake, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def step(self, lr: float) -> None:
        import torch

        self.t += 1
        b1, b2, eps = self.tc.adam_b1, self.tc.adam_b2, self.tc.adam_eps
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v, strict=True):
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                if self.mistake == "no_bias_correction":
                    p.sub_(lr * m / (v.sqrt() + eps))
                else:  # eps_inside_sqrt
                    p.sub_(lr * (m / (1 - b1**self.t)) / (v / (1 - b2**self.t) + eps).sqrt())


def torch_loop(cfg: ModelConfig, params: dict[str, np.ndarray], tc: TrainConfig, batches: list[Batch],
               path, mistake: str | None = None, full_steps: int = 2, evaluate: bool = False) -> None:
    """Train `batches` in float64 (TF32's loop: float32, as on a GPU) with torch.optim, one `mistake`
    (or none), tracing to `path`; with `evaluate`, an evaluation on each whole step's batch after
    its update (dropout_at_evaluation: without model.eval())."""
    import contextlib

    import torch

    from torch_impl.backend import Model
    from torch_impl.convert import from_state_dict

    dtype, np_dtype = ("float32", np.float32) if mistake == "tf32_matmuls" else ("float64", np.float64)
    model = Model(cfg, params, dtype, device="cpu").module.train()  # our forward; dropout 0 in cfg
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if p.ndim == 2 and "embed" not in n]
    others = [p for p in named.values() if all(p is not m for m in matrices)]
    betas = (tc.adam_b1, 0.999 if mistake == "beta2_0.999" else tc.adam_b2)
    eps = 1e-8 if mistake == "eps_1e-8" else tc.adam_eps
    hand = mistake in ("eps_inside_sqrt", "no_bias_correction")
    if mistake == "adamw_decay":
        opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=betas, eps=eps)  # weight_decay=0.01 default
    elif mistake == "adamw_decay_matrices":
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0}]
        opt = torch.optim.AdamW(groups, lr=1.0, betas=betas, eps=eps)
    elif mistake == "l2_in_gradient":
        opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=betas, eps=eps, weight_decay=1e-3)
    elif mistake == "l2_in_gradient_matrices":
        opt = torch.optim.Adam([{"params": matrices, "weight_decay": 1e-3}, {"params": others}],
                               lr=1.0, betas=betas, eps=eps)
    else:
        opt = _HandAdam(model.parameters(), tc, mistake) if hand else \
            torch.optim.Adam(model.parameters(), lr=1.0, betas=betas, eps=eps)
    if mistake == "schedule_from_zero":
        lr_of = lambda step: rate(step, cfg.d_model, tc)  # noqa: E731 -- LambdaLR's count from 0, as given
    elif mistake == "schedule_from_zero_clamped":
        lr_of = lambda step: rate(max(step, 1), cfg.d_model, tc)  # noqa: E731 -- the Annotated Transformer's
    elif mistake == "schedule_min_swapped":  # min(step·warmup^-1.5, step^-0.5), as coqui writes it
        lr_of = lambda step: tc.lr_factor * cfg.d_model**-0.5 * min(  # noqa: E731
            (step + 1) * tc.warmup_steps**-1.5, (step + 1) ** -0.5)
    elif mistake == "schedule_scaled":  # ESPnet's NoamLR, a factor in front of the same shape
        lr_of = lambda step: NOAM_BASE_LR * tc.warmup_steps**0.5 * min((step + 1) ** -0.5,  # noqa: E731
                                                                      (step + 1) * tc.warmup_steps**-1.5)
    else:
        lr_of = lambda step: rate(step + 1, cfg.d_model, tc)  # noqa: E731
    sched = None if hand else torch.optim.lr_scheduler.LambdaLR(opt, lr_of)
    parts = ACCUMULATE if mistake == "clip_before_accumulation" else 1

    def clip_by_global_norm():
        norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
        for p in model.parameters():
            p.grad.mul_(torch.clamp(tc.clip_norm / norm, max=1.0))

    with TraceWriter(path, cfg, full_steps) as trace:
        trace.start(from_state_dict(cfg, model.state_dict(), np_dtype))
        for k, batch in enumerate(batches, 1):
            src, tgt_in, labels = (torch.from_numpy(x) for x in (batch.src, batch.tgt_in, batch.labels))
            for p in model.parameters():
                p.grad = None
            tokens, loss = (labels != cfg.pad_id).sum(), 0.0
            for i, (s, t, y) in enumerate(zip(*(x.chunk(parts) for x in (src, tgt_in, labels)), strict=True)):
                if i:  # the mistake: clip_grad_norm_ inside the accumulation loop, after each backward
                    clip_by_global_norm()
                with tf32_mode() if mistake == "tf32_matmuls" else contextlib.nullcontext():
                    logits = model(s, t)
                share = (y != cfg.pad_id).sum().to(logits.dtype) / tokens  # of the per-token mean
                part = _torch_loss(logits, y, cfg.pad_id, tc.label_smoothing, mistake) * share
                part.backward()
                loss += part.item()
            grads = from_state_dict(cfg, {n: p.grad.clone() for n, p in named.items()}, np_dtype)
            if mistake in ("clip_per_tensor", "clip_per_parameter_torch"):
                for p in model.parameters():  # by hand: min(1, c/‖g‖); torch's clip_grad_norm_ adds its 1e-6
                    if mistake == "clip_per_tensor":
                        p.grad.mul_(torch.clamp(tc.clip_norm / p.grad.norm(), max=1.0))
                    else:
                        torch.nn.utils.clip_grad_norm_([p], tc.clip_norm)
            elif mistake == "clip_torch_eps":
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
            elif tc.clip_norm is not None:
                clip_by_global_norm()
            lr = lr_of(k - 1) if hand else opt.param_groups[0]["lr"]
            opt.step(lr) if hand else opt.step()
            if sched is not None:
                sched.step()
            trace.step(k, src, tgt_in, labels, loss, lr, grads,
                       from_state_dict(cfg, model.state_dict(), np_dtype))
            if evaluate and k <= full_steps:
                model.train(mistake == "dropout_at_evaluation")  # the mistake: model.eval() forgotten
                with torch.no_grad():
                    logits = model(src, tgt_in)
                value = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                          ignore_index=cfg.pad_id)
                trace.evaluation(k, src, tgt_in, labels, value.item())
                model.train()


# -- JAX + optax -------------------------------------------------------------------------------------

def jax_loop(cfg: ModelConfig, params: dict[str, np.ndarray], tc: TrainConfig, batches: list[Batch],
             path, mistake: str | None = None, full_steps: int = 2) -> None:
    """Train `batches` in float64 with optax (call under jax.enable_x64(True)), one `mistake`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_impl.convert import build_model, flax_name, to_params

    model = build_model(cfg, params, jnp.float64)
    scale, warm = tc.lr_factor * cfg.d_model**-0.5, tc.warmup_steps**-1.5

    def schedule(count):  # optax passes the update count from 0
        step = jnp.asarray(count, jnp.float64) + (0.0 if mistake == "schedule_from_zero" else 1.0)
        return scale * jnp.minimum(step**-0.5, step * warm)

    b2 = 0.999 if mistake == "beta2_0.999" else tc.adam_b2
    if mistake == "eps_inside_sqrt":
        tx = optax.adam(schedule, b1=tc.adam_b1, b2=b2, eps=0.0, eps_root=tc.adam_eps)
    elif mistake == "adamw_decay":
        tx = optax.adamw(schedule, b1=tc.adam_b1, b2=b2, eps=tc.adam_eps)  # weight_decay=1e-4 by default
    else:
        tx = optax.adam(schedule, b1=tc.adam_b1, b2=b2, eps=1e-8 if mistake == "eps_1e-8" else tc.adam_eps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_of(model, src, tgt_in, labels):
        logits = model(src, tgt_in)
        onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
        q = optax.smooth_labels(onehot, tc.label_smoothing)  # ε over all V, pad included: ours
        per = optax.softmax_cross_entropy(logits, q)
        mask = labels != cfg.pad_id
        return jnp.where(mask, per, 0.0).sum() / mask.sum()

    @nnx.jit
    def step(model, optimizer, src, tgt_in, labels):
        loss, grads = nnx.value_and_grad(loss_of)(model, src, tgt_in, labels)
        optimizer.update(model, grads)
        return loss, grads

    def canonical(grads) -> dict[str, np.ndarray]:
        flat = {flax_name(p): np.asarray(v.get_value() if hasattr(v, "get_value") else v, np.float64)
                for p, v in nnx.to_flat_state(grads)}
        return {n: flat[n] for n in params}

    with TraceWriter(path, cfg, full_steps) as trace:
        trace.start(to_params(model, np.float64))
        for k, batch in enumerate(batches, 1):
            lr = float(schedule(k - 1))
            ids = (jnp.asarray(x) for x in (batch.src, batch.tgt_in, batch.labels))
            loss, grads = step(model, optimizer, *ids)
            trace.step(k, batch.src, batch.tgt_in, batch.labels, float(loss), lr, canonical(grads),
                       to_params(model, np.float64))


def expected_first_step(mistake: str) -> int:
    """The update where a mistake first shows. From step 2: β2 (the bias-corrected v̂1 is g1² for
    any β2), the Annotated Transformer's clamp (updates 1 and 2 both get lr(1)), and torch's
    clip_grad_norm_ (its scale differs from min(1, c/‖g‖) by 1e-6/‖g‖ relative, which step 1's
    g/(|g| + ε) removes up to ε/|g|: ~1e-11 here; from step 2 the two steps' scales differ in m/√v)."""
    return 2 if mistake in ("beta2_0.999", "schedule_from_zero_clamped", "clip_torch_eps") else 1
