"""Training in JAX/Flax NNX (SPEC §4): the label-smoothed loss, Adam with the paper's schedule,
one training step, canonical gradients for the parity tests, and `Trainer`, the adapter the
framework-free loop (rosetta/harness/loop.py) drives.

Mirrors torch_impl/train.py function for function; diff them to see only framework differences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_impl.backend import DTYPES, Model, parity_mode
from jax_impl.convert import build_model, flax_name, to_params
from jax_impl.model import Transformer
from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.device import cpu_name, max_rss_bytes
from rosetta.errors import RosettaError
from rosetta.params import Params, param_shapes
from rosetta.training import Batch, TrainConfig, check_state


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
                tgt: jax.Array, labels: jax.Array,
                train_cfg: TrainConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`train_step`, also returning the global gradient norm before clipping (a 0-d array): the
    harness stops a run at the first non-finite one (rosetta/harness/loop.py)."""
    def loss_of(model: Transformer, rngs: nnx.Rngs) -> jax.Array:
        return loss_fn(model(src, tgt, rngs=rngs), labels, model.cfg.pad_id, train_cfg.label_smoothing)[0]

    lr = schedule(model.cfg.d_model, train_cfg)(optimizer.step[...])  # what adam reads this update
    loss, grads = nnx.value_and_grad(loss_of)(model, rngs)  # d/d(nnx.Param of model) only
    optimizer.update(model, grads)
    return loss, lr, optax.tree.norm(grads)


def train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs, src: jax.Array,
               tgt: jax.Array, labels: jax.Array, train_cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """One update: forward with dropout (keys from the explicit `rngs`, e.g.
    nnx.Rngs(dropout=train_cfg.seed): PITFALLS 10), loss, gradients, optional global-norm
    clipping, Adam, schedule. One compiled call. Returns (loss, lr used) as 0-d arrays."""
    model.train()
    loss, lr, _ = _train_step(model, optimizer, rngs, jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(labels),
                              train_cfg=train_cfg)
    return loss, lr


def make_train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs,
                    train_cfg: TrainConfig) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """`train_step` with the model, optimizer and generator bound: step(src, tgt, labels) ->
    (loss, lr, global gradient norm before clipping). nnx.jit walks the whole object graph in
    Python on every call (about 50 ms per call for a 6+6-layer model on this project's CPU, as
    long as a whole `base` step on an H100); nnx.cached_partial walks it once and reuses the
    traversal, as Flax's guide advises. The bound model stays in train mode (its cached copy
    was taken in train mode); the weights, Adam's state and the generator are the same
    Variables, so every update lands in `model`, `optimizer`, `rngs`."""
    model.train()
    cached = nnx.cached_partial(_train_step, model, optimizer, rngs)

    def step(src: jax.Array, tgt: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return cached(jnp.asarray(src), jnp.asarray(tgt), jnp.asarray(labels), train_cfg=train_cfg)

    return step


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


@nnx.jit(static_argnames="label_smoothing")
def _eval_loss(model: Transformer, src: jax.Array, tgt: jax.Array, labels: jax.Array,
               label_smoothing: float) -> tuple[jax.Array, jax.Array]:
    return loss_fn(model(src, tgt), labels, model.cfg.pad_id, label_smoothing)


def _device(name: str | None) -> jax.Device:
    """'cpu', 'gpu', 'cuda' or 'cuda:1' (torch's spelling) -> that JAX device; None: the default."""
    if not name:
        return jax.devices()[0]
    platform, _, index = name.partition(":")
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, ValueError, IndexError) as e:
        raise RosettaError(f"JAX has no device {name!r} here ({e})") from None


# -- The harness adapter ---------------------------------------------------------------------

class Trainer:
    """One model, its optimizer and its dropout generator behind the interface that
    rosetta/harness/loop.py drives; torch_impl/train.py's `Trainer` has the same methods.

    Built from canonical weights (`rosetta.init_params` or a checkpoint: never re-initialised
    here, PITFALLS 9). `dtype` "bfloat16" computes in bfloat16 (the model's dtype) with float32
    weights and optimizer state. `parity` (default: on CPU only) pins full-precision float32
    matmuls (PITFALLS 5); on a GPU the trainer leaves JAX's default (TF32), for speed. The
    dropout generator is the trainer's own explicit `nnx.Rngs(dropout=seed)`.
    """

    framework: ClassVar[str] = "jax"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], train_cfg: TrainConfig,
                 device: str | None = None, dtype: str = "float32", parity: bool | None = None):
        if dtype not in self.dtypes:
            raise RosettaError(f"the jax trainer computes in {', '.join(self.dtypes)}, not {dtype!r}")
        self.cfg, self.train_cfg, self.dtype = cfg, train_cfg, dtype
        self.device = _device(device)
        self.parity = self.device.platform == "cpu" if parity is None else parity
        with jax.default_device(self.device):
            self.model = build_model(cfg, params, DTYPES[dtype])  # abstract, then the weights set
            self.optimizer = make_optimizer(self.model, train_cfg)
            self.rngs = nnx.Rngs(dropout=train_cfg.seed)
            self._train_step = make_train_step(self.model, self.optimizer, self.rngs, train_cfg)
        self.device_name = cpu_name() if self.device.platform == "cpu" else self.device.device_kind

    # -- precision and placement -------------------------------------------------------------
    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """The trainer's device as the default one, and the matmul precision."""
        with jax.default_device(self.device), parity_mode(self.parity):
            yield

    # -- training and evaluation -------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Updates done so far (the next update is step_count + 1 in the paper's eq. 3)."""
        return int(self.optimizer.step[...])

    def step(self, batch: Batch) -> dict[str, Any]:
        """One update on `batch` (§5.3); returns {step, loss, lr, grad_norm, num_src_tokens,
        num_tgt_tokens}, grad_norm the global gradient norm before clipping. Reading the loss
        synchronises the device, so a wall clock around this call is honest."""
        with self._context():
            loss, lr, grad_norm = self._train_step(batch.src, batch.tgt_in, batch.labels)
            loss_value, norm_value = float(loss), float(grad_norm)
        return {"step": self.step_count, "loss": loss_value, "lr": float(lr), "grad_norm": norm_value,
                "num_src_tokens": int(batch.num_src_tokens), "num_tgt_tokens": int(batch.num_tgt_tokens)}

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """The training loss (label-smoothed) without dropout, averaged over every non-pad label
        of `batches` (a token-weighted mean, not a mean of batch means)."""
        total, count = 0.0, 0
        self.model.eval()
        try:
            with self._context():
                for batch in batches:
                    loss, n = _eval_loss(self.model, jnp.asarray(batch.src), jnp.asarray(batch.tgt_in),
                                         jnp.asarray(batch.labels), self.train_cfg.label_smoothing)
                    total += float(loss) * int(n)
                    count += int(n)
        finally:
            self.model.train()
        return total / max(count, 1)

    def params(self) -> Params:
        """The current weights as canonical float32 NumPy copies."""
        return to_params(self.model)

    def backend_model(self) -> Model:
        """A backend model (rosetta.backends interface: generate, logits) holding a copy of the
        current weights, on the same device and compute dtype."""
        with jax.default_device(self.device):
            return Model(self.cfg, self.params(), self.dtype)

    def peak_memory_bytes(self) -> int:
        """Peak device memory in use (memory_stats, GPUs); on CPU the process's peak RSS."""
        stats = self.device.memory_stats() or {}
        return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else max_rss_bytes()

    # -- resumable state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything besides the weights that an exact resume needs, as flat NumPy arrays
        (written by the harness as safetensors): the step, every optax state leaf (Adam's count
        and moments) and the nnx.Rngs key data and count."""
        state: dict[str, np.ndarray] = {"step": np.asarray(self.step_count, dtype=np.int64)}
        for path, variable in nnx.to_flat_state(nnx.state(self.optimizer)):
            state[f"optimizer.{flax_name(path)}"] = np.array(variable.get_value())
        for path, variable in nnx.to_flat_state(nnx.state(self.rngs)):
            value = variable.get_value()
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value)  # the raw uint32 words of the typed key
            state[f"rng.{flax_name(path)}"] = np.array(value)
        return state

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The keys and shapes of `state_dict()` (optax's state exists from the start)."""
        return {key: value.shape for key, value in self.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore a `state_dict()` saved by a trainer of the same config; strict about keys.
        Every leaf keeps its dtype, so the compiled step is the same one and resumes bit-exactly."""
        check_state(state, self._state_shapes(), "jax")
        with jax.default_device(self.device):
            flat = nnx.to_flat_state(nnx.state(self.optimizer))
            for path, variable in flat:
                old = variable.get_value()
                variable.set_value(jnp.array(state[f"optimizer.{flax_name(path)}"], dtype=old.dtype))
            nnx.update(self.optimizer, nnx.from_flat_state(flat))
            flat = nnx.to_flat_state(nnx.state(self.rngs))
            for path, variable in flat:
                old, saved = variable.get_value(), state[f"rng.{flax_name(path)}"]
                if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
                    new = jax.random.wrap_key_data(jnp.array(saved), impl=jax.random.key_impl(old))
                else:
                    new = jnp.array(saved, dtype=old.dtype)
                variable.set_value(new)
            nnx.update(self.rngs, nnx.from_flat_state(flat))
