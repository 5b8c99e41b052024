"""Training in JAX/Flax NNX (SPEC §4): the label-smoothed loss, Adam with the paper's schedule,
one training step, canonical gradients for the parity tests, and `Trainer`, the adapter the
framework-free loop (rosetta/harness/loop.py) drives. Data-parallel training runs on JAX's own
engine: one jitted step over a `jax.sharding.Mesh` of devices (single-process multi-device by
default, several processes under torchrun via `jax.distributed`), with the parameters replicated
or, with `shard=True`, sharded ZeRO-3 style; the mesh and the layouts live in
jax_impl/distributed.py (the design: rosetta/distributed.py, docs/distributed.md).

Mirrors torch_impl/train.py function for function (parity_tests/test_structure.py lists what
one framework alone has); diff them to see only framework differences.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import rosetta.training as training  # for DEFAULT_LOSS: the from-import below is at the line limit
from jax_impl import compilation
from jax_impl.backend import DTYPES, Model, compute_weights, parity_mode, x64
from jax_impl.convert import build_model, flax_name, to_params
from jax_impl.distributed import (
    any_process,
    dropout_draws,
    init_distributed,
    local_device,
    make_mesh,
    pin,
    place,
    put,
    shard_variables,
    whole,
)
from jax_impl.loss import chunked_loss, cross_entropy, generator_params
from jax_impl.model import Transformer
from jax_impl.ops import dropout_rng
from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.device import cpu_name, max_rss_bytes, parse_device
from rosetta.distributed import LaunchEnv, launch_env, split_rows
from rosetta.inputs import Packing
from rosetta.params import Params, canonical_dtype, param_shapes
from rosetta.training import Batch, HostTimer, Prepared, TrainConfig, check_state, check_trainer_args


def loss_fn(logits: jax.Array, labels: jax.Array, pad_id: int, label_smoothing: float,
            num_tokens: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
    """Mean over non-pad labels of the cross entropy against q = (1-ε)·onehot(y) + ε/V, ε spread
    over all V classes, pad included (torch's and optax's definition; others differ: PITFALLS 11).
    With `num_tokens` (the global batch's count) the sum is divided by it instead: a block's
    share of the global mean (rosetta/distributed.py). Returns (loss, number of non-pad labels
    here); a batch with no labels gives loss 0."""
    # log-softmax in float32 at least, even for bfloat16 logits.
    wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    count = (labels != pad_id).sum()
    denominator = jnp.maximum(count if num_tokens is None else num_tokens, 1)
    return cross_entropy(wide, labels, denominator, pad_id, float(label_smoothing)), count


def schedule(d_model: int, train_cfg: TrainConfig) -> optax.Schedule:
    """optax's schedule: it sees the update count from 0, the paper's eq. 3 counts from 1. The
    traced twin of rosetta.training.learning_rate (float32: equal to within float32 rounding;
    float64 under 64-bit JAX)."""
    scale = train_cfg.lr_factor * d_model**-0.5
    warmup = train_cfg.warmup_steps**-1.5

    def lr(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, float) + 1.0  # JAX's default float: float32, float64 under x64
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


def forward_loss(model: Transformer, rngs: nnx.Rngs | None, src: jax.Array, tgt: jax.Array, labels: jax.Array,
                 label_smoothing: float, num_tokens: jax.Array | int | None = None,
                 packing: Packing | None = None) -> jax.Array:
    """The loss of one batch, forward only: what `_train_step` differentiates. `packing`: a packed
    batch's segment and position arrays (docs/packing.md). The weights are cast once to the model's
    compute dtype, its Generator's (backend.compute_weights)."""
    logits = compute_weights(model, model.generator.dtype)(src, tgt, rngs=rngs, packing=packing)
    return loss_fn(logits, labels, model.cfg.pad_id, label_smoothing, num_tokens)[0]


def chunked_forward_loss(model: Transformer, rngs: nnx.Rngs | None, src: jax.Array, tgt: jax.Array,
                         labels: jax.Array, label_smoothing: float, num_tokens: jax.Array | int | None = None,
                         packing: Packing | None = None) -> jax.Array:
    """`forward_loss` without the [tokens, V] float32 logits: the decoder's output, then the output
    projection and the loss chunk by chunk with their own backward (jax_impl/loss.py, docs/loss.md)."""
    hidden = compute_weights(model, model.generator.dtype)(src, tgt, rngs=rngs, hidden=True, packing=packing)
    return chunked_loss(hidden, *generator_params(model), labels, model.cfg.pad_id, label_smoothing,
                        num_tokens, logit_scale=model.cfg.logit_scale)[0]


# Each of rosetta.training.LOSSES by name: its forward pass and loss.
FORWARDS: dict[str, Callable[..., jax.Array]] = {"plain": forward_loss, "chunked": chunked_forward_loss}


@nnx.jit(static_argnames=("train_cfg", "mesh", "loss", "keep_grads"))
def _train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs, src: jax.Array,
                tgt: jax.Array, labels: jax.Array, num_tokens: jax.Array | None, train_cfg: TrainConfig,
                mesh: Mesh | None = None, packing: Packing | None = None,
                loss: str = training.DEFAULT_LOSS, keep_grads: bool = False) -> tuple[jax.Array, ...]:
    """`train_step` on K micro-batches `src, tgt, labels` [K, rows, L] (K = 1: one batch), also
    returning the global gradient norm before clipping (a 0-d array): the harness stops a run at
    the first non-finite one (rosetta/harness/loop.py). Each micro-batch's loss is its label sum
    over `num_tokens` (None: its own count), so the summed gradients are those of the whole
    batch's mean loss and clipping and Adam see exactly that. On a `mesh`, XLA splits the rows
    over the devices and inserts the gradient all-reduce (and, for sharded parameters, the
    all-gathers); the new state is pinned to the variables' shardings, so the next call hits
    the same compiled step. `packing`: a packed batch's segment and position arrays [K, rows, L]
    (docs/packing.md), a pytree: None or a Packing of arrays, each compiled once per shape.
    `keep_grads` (`rosetta train --trace`): the gradients before clipping are returned fourth."""
    forward = FORWARDS[loss]

    def loss_of(model: Transformer, rngs: nnx.Rngs, src: jax.Array, tgt: jax.Array,
                labels: jax.Array, packing: Packing | None) -> jax.Array:
        return forward(model, rngs, src, tgt, labels, train_cfg.label_smoothing, num_tokens, packing)

    lr = schedule(model.cfg.d_model, train_cfg)(optimizer.step[...])  # what adam reads this update
    value_and_grad = nnx.value_and_grad(loss_of)  # d/d(nnx.Param of model) only
    with dropout_draws():
        loss, grads = _accumulated(value_and_grad, model, rngs, src, tgt, labels, packing)
    optimizer.update(model, grads)
    if mesh is not None:
        pin((model, optimizer), mesh)
    return (loss, lr, optax.tree.norm(grads)) + ((grads,) if keep_grads else ())


def _accumulated(value_and_grad: Callable, model: Transformer, rngs: nnx.Rngs, src: jax.Array,
                 tgt: jax.Array, labels: jax.Array, packing: Packing | None
                 ) -> tuple[jax.Array, nnx.State]:
    """The summed loss and gradients of K micro-batches [K, rows, L] (`_train_step`)."""
    first = jax.tree.map(lambda a: a[0], packing)  # None stays None: a pytree without leaves
    loss, grads = value_and_grad(model, rngs, src[0], tgt[0], labels[0], first)
    if src.shape[0] > 1:
        # The other micro-batches in a lax.scan, not a Python loop: XLA may not reorder it, so
        # one micro-batch's activations are alive at a time (accumulation's point), and the
        # compiled step does not grow with K. The body rebuilds the model and generator from
        # states in the carry (NNX refuses variables of the enclosing trace inside the scan);
        # the weights pass through unchanged, the generator's count moves.
        model_def, model_state = nnx.split(model)
        rngs_def, rngs_state = nnx.split(rngs)

        def micro(carry: tuple, batch: tuple[jax.Array, ...]) -> tuple[tuple, None]:
            loss, grads, model_state, rngs_state = carry
            rngs_k = nnx.merge(rngs_def, rngs_state)
            loss_k, grads_k = value_and_grad(nnx.merge(model_def, model_state), rngs_k, *batch)
            grads = jax.tree.map(jnp.add, grads, grads_k)
            return (loss + loss_k, grads, model_state, nnx.state(rngs_k)), None

        (loss, grads, _, rngs_state), _ = jax.lax.scan(micro, (loss, grads, model_state, rngs_state),
                                                       (src[1:], tgt[1:], labels[1:],
                                                        jax.tree.map(lambda a: a[1:], packing)))
        nnx.update(rngs, rngs_state)
    return loss, grads


def train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs, src: jax.Array,
               tgt: jax.Array, labels: jax.Array, train_cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """One update: forward with dropout (keys from the explicit `rngs`, e.g.
    nnx.Rngs(dropout=train_cfg.seed): PITFALLS 10), loss, gradients, optional global-norm
    clipping, Adam, schedule. One compiled call. Returns (loss, lr used) as 0-d arrays."""
    model.train()
    loss, lr, _ = _train_step(model, optimizer, rngs, jnp.asarray(src)[None], jnp.asarray(tgt)[None],
                              jnp.asarray(labels)[None], None, train_cfg=train_cfg)
    return loss, lr


# make_train_step's step donates the weights and Adam's state: XLA writes the update into their buffers
# (one model and moments alive, not two), deleting the arrays held before (one the host views is copied
# instead). `train_step` keeps its inputs: its caller may hold them (nnx.clone shares arrays).
_donating_step = nnx.jit(_train_step.fun, static_argnames=("train_cfg", "mesh", "loss", "keep_grads"),
                         donate_argnames=("model", "optimizer"))


def make_train_step(model: Transformer, optimizer: nnx.Optimizer, rngs: nnx.Rngs,
                    train_cfg: TrainConfig, mesh: Mesh | None = None, loss: str = training.DEFAULT_LOSS
                    ) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """`train_step` with the model, optimizer and generator bound: step(src, tgt, labels,
    num_tokens=None, packing=None) -> (loss, lr, global gradient norm before clipping); 2-d ids are one
    batch, 3-d ones [K, rows, L] K micro-batches of one update (`_train_step`, donating the weights and
    Adam's state). nnx.jit walks the object graph in Python every call (about 50 ms for a 6+6-layer model
    on this project's CPU, a whole `base` step on an H100); nnx.cached_partial walks it once (Flax's
    guide). The bound model stays in train mode; every update lands in `model`, `optimizer`, `rngs`."""
    model.train()
    cached = nnx.cached_partial(_donating_step, model, optimizer, rngs)

    def step(src: jax.Array, tgt: jax.Array, labels: jax.Array, num_tokens: jax.Array | int | None = None,
             packing: Packing | None = None, keep_grads: bool = False) -> tuple[jax.Array, ...]:
        src, tgt, labels = (jnp.asarray(a) for a in (src, tgt, labels))
        packing = None if packing is None else Packing(*(jnp.asarray(a) for a in packing))
        if src.ndim == 2:
            src, tgt, labels = src[None], tgt[None], labels[None]
            packing = jax.tree.map(lambda a: a[None], packing)
        return cached(src, tgt, labels, num_tokens, train_cfg=train_cfg, mesh=mesh, packing=packing,
                      loss=loss, keep_grads=keep_grads)

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


@jax.jit
def _watch(non_finite: jax.Array, step: jax.Array, loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """(step, loss, gradient norm) of the first step whose loss or norm is not finite; step 0: none yet."""
    bad = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm)) & (non_finite[0] == 0)
    now = jnp.stack([step, loss, grad_norm]).astype(non_finite.dtype)
    return jnp.where(bad, now, non_finite)


@nnx.jit(static_argnames="label_smoothing")
def _eval_loss(model: Transformer, src: jax.Array, tgt: jax.Array, labels: jax.Array,
               label_smoothing: float) -> tuple[jax.Array, jax.Array]:
    return loss_fn(model(src, tgt), labels, model.cfg.pad_id, label_smoothing)


# -- The harness adapter ---------------------------------------------------------------------

class Trainer:
    """One model, its optimizer and its dropout generator behind the interface that
    rosetta/harness/loop.py drives; torch_impl/train.py's `Trainer` has the same methods.

    Built from canonical weights (`rosetta.init_params` or a checkpoint: never re-initialised
    here, PITFALLS 9). `dtype` "bfloat16" computes in bfloat16 (the model's dtype) with float32
    weights and optimizer state. `parity` (default: on CPU only) pins full-precision float32
    matmuls (PITFALLS 5); on a GPU the trainer leaves JAX's default (TF32), for speed. The
    dropout generator is the trainer's own explicit `nnx.Rngs` (ops.dropout_rng: its key per platform).

    Data-parallel: a Mesh with one axis "data" over `num_devices` devices of `device`'s platform
    (None: all of them) of every process; under a launcher (torchrun; launch_env) the processes
    first join through jax.distributed. `step` takes the global batch, the same on every process,
    and splits its rows over the devices and `accumulate` micro-batches (rosetta/distributed.py);
    one jitted step sums the gradients. Parameters and Adam's moments are replicated, or with
    `shard=True` split over "data" along their first divisible axis (ZeRO-3). The dropout draws
    are the global batch's, row by row, on any layout of devices (CPU: ops.cpu_dropout, dropout_draws).

    The step is always compiled (`compile` changes nothing), once per batch shape, with the XLA
    flags and the persistent compilation cache of jax_impl/compilation.py (`compile_cache`: its
    directory; "off": none; None: JAX's own setting, JAX_COMPILATION_CACHE_DIR or none). A step
    never waits for the device (rosetta.training.Trainer): JAX dispatches asynchronously, the step
    count is kept on the host, and the loss and gradient norm stay on the device until `read`.
    float64 runs inside `jax.enable_x64` (jax_impl/backend.py: x64).
    """

    framework: ClassVar[str] = "jax"
    # float64: weights, moments and compute, for the tests that ask "same algorithm?" (the mesh,
    # accumulation, resume; PyTorch's trainer against this one): docs/testing.md. 64-bit JAX only.
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float64")

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], train_cfg: TrainConfig,
                 device: str | None = None, dtype: str = "float32", parity: bool | None = None,
                 accumulate: int = 1, shard: bool = False, num_devices: int | None = None,
                 loss: str = training.DEFAULT_LOSS, compile: bool = True, compile_cache: str | None = None):
        check_trainer_args("jax", self.dtypes, dtype, loss, accumulate)
        compilation.configure(compile_cache)  # before JAX starts its backends: XLA reads its flags then
        self.cfg, self.train_cfg, self.dtype = cfg, train_cfg, dtype
        self.compile = True
        self.accumulate, self.shard = accumulate, bool(shard)
        env = launch_env()
        if env.distributed:
            init_distributed(env)
        self.device = local_device(device)  # this process's first device: eval, memory statistics
        self.mesh = make_mesh(device, num_devices)
        self.world_size = self.mesh.size
        self.num_processes, self.rank = jax.process_count(), jax.process_index()
        self.is_main = self.rank == 0
        self.parity = self.device.platform == "cpu" if parity is None else parity
        with jax.default_device(self.device), x64(dtype):
            self.model = build_model(cfg, params, DTYPES[dtype])  # abstract, then the weights set
            self.optimizer = make_optimizer(self.model, train_cfg)
            if self.shard:
                shard_variables(self.model, self.optimizer, self.world_size)  # after the optimizer exists
            self.rngs = dropout_rng(train_cfg.seed, self.device.platform)  # jax_impl/ops.py
            place((self.model, self.optimizer, self.rngs), self.mesh)
            self._train_step = make_train_step(self.model, self.optimizer, self.rngs, train_cfg, self.mesh,
                                               loss)
            # The first step whose loss or gradient norm was not finite, (step, loss, norm); 0: none.
            self._non_finite = put(np.zeros(3, np.float64 if dtype == "float64" else np.float32),
                                   NamedSharding(self.mesh, P()))
        self._steps = 0  # updates done, on the host: reading optimizer.step would wait for the device
        self.device_name = cpu_name() if self.device.platform == "cpu" else self.device.device_kind

    @staticmethod
    def resolve_device(name: str | None, env: LaunchEnv) -> str:
        """The first device a trainer built with `device=name` in the launch `env` takes ('cpu:0',
        'gpu:1'), checked as the constructor checks it: a RosettaError if JAX has no such device here.
        Under a launcher JAX may not look at its devices before the processes join (init_distributed),
        so there `name` comes back as given (None: 'default'), its spelling checked (rosetta/device.py)
        and its devices when the trainer is built."""
        if env.distributed:
            return "default" if name is None else parse_device(name).name
        device = local_device(name)
        return f"{device.platform}:{jax.local_devices(backend=device.platform).index(device)}"

    def _global_batch(self, batch: Batch) -> tuple[tuple[jax.Array, ...], Packing | None, int]:
        """src, tgt_in, labels as [K, W·m, L] arrays, rows sharded over "data": block w·K + k of
        `split_rows` (worker w's k-th micro-batch) is rows w·m..(w+1)·m of micro-batch k. Also a
        packed batch's segment and position arrays laid out alike, and m."""
        workers, k = self.world_size, self.accumulate
        blocks = split_rows(batch, workers * k, self.cfg.pad_id)
        rows = blocks[0].shape[0]
        sharding = NamedSharding(self.mesh, P(None, "data", None))

        def stack(field: str) -> jax.Array:
            ids = np.stack([getattr(b, field) for b in blocks])  # [W·K, m, L]
            ids = ids.reshape(workers, k, rows, -1).transpose(1, 0, 2, 3).reshape(k, workers * rows, -1)
            return put(ids, sharding)

        packing = Packing(*(stack(name) for name in Packing._fields)) if batch.packed else None
        return (stack("src"), stack("tgt_in"), stack("labels")), packing, rows

    # -- precision and placement -------------------------------------------------------------
    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """The trainer's device as the default one, the matmul precision, 64-bit JAX for float64."""
        with jax.default_device(self.device), parity_mode(self.parity), x64(self.dtype):
            yield

    # -- training and evaluation -------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Updates done so far (the next update is step_count + 1 in the paper's eq. 3)."""
        return self._steps

    def prepare(self, batch: Batch) -> Prepared:
        """The global batch on the mesh (`_global_batch`) and its label count, copied without waiting."""
        with self._context():
            count = put(np.asarray(batch.num_tgt_tokens, np.int32), NamedSharding(self.mesh, P()))
            return Prepared(batch, (*self._global_batch(batch), count))

    def step(self, batch: Batch | Prepared, keep_grads: bool = False) -> dict[str, Any]:
        """One update on the global `batch` (§5.3), a Batch or `prepare`'s copy of one; returns {step,
        loss, lr, grad_norm, num_src_tokens, num_tgt_tokens, world_size, worker_rows}: the global batch's
        loss and counts, grad_norm the global norm before clipping, worker_rows one device's micro-batch
        rows; loss, lr, grad_norm device arrays: nothing here transfers (test_step_levers.py) but
        `keep_grads`: `grads`, before clipping, canonical (`rosetta train --trace`; this waits)."""
        prepared = batch if isinstance(batch, Prepared) else self.prepare(batch)
        batch, ((src, tgt, labels), packing, rows, count) = prepared.batch, prepared.arrays
        with self._context():
            loss, lr, grad_norm, *grads = self._train_step(src, tgt, labels, count, packing,
                                                           keep_grads=keep_grads)
            self._steps += 1  # the host's count; _watch reads the optimizer's, on the device
            self._non_finite = _watch(self._non_finite, self.optimizer.step[...], loss, grad_norm)
        metrics = {"step": self.step_count, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   "num_src_tokens": int(batch.num_src_tokens), "num_tgt_tokens": int(batch.num_tgt_tokens),
                   "world_size": self.world_size, "worker_rows": rows}
        if keep_grads:
            metrics["grads"] = self._kept_gradients(grads[0])
        return metrics

    def read(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` of `step` with loss, lr and grad_norm as floats, and `non_finite`: None or the
        first step with a non-finite loss or gradient norm (rosetta.training.Trainer). One transfer."""
        loss, lr, grad_norm, (step, bad_loss, bad_norm) = jax.device_get(
            (metrics["loss"], metrics["lr"], metrics["grad_norm"], self._non_finite))
        return metrics | {"loss": float(loss), "lr": float(lr), "grad_norm": float(grad_norm),
                          "non_finite": {"step": int(step), "loss": float(bad_loss),
                                         "grad_norm": float(bad_norm)} if step else None}

    def timer(self) -> HostTimer:
        """The host's clock: JAX has no device events; `read` waits for the device, then it is read."""
        return HostTimer()

    def compilation(self) -> tuple[float, int]:
        """JAX's seconds and programs compiled so far in this process (jax_impl/compilation.py)."""
        return compilation.compile_totals()

    def _kept_gradients(self, grads: nnx.State) -> Params:
        """The step's gradients before clipping (`_train_step` returns them), canonical and whole on
        every process (a collective when they are sharded across processes)."""
        flat = {flax_name(path): whole(value.get_value() if hasattr(value, "get_value") else value)
                .astype(canonical_dtype(self.dtype)) for path, value in nnx.to_flat_state(grads)}
        check_params(self.cfg, flat, source="gradients")
        return {name: flat[name] for name in param_shapes(self.cfg)}  # checkpoint order

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` holds on any process of the launch (a collective; alone: `flag`), so that
        every process stops at the same step (a time budget read from each one's own clock)."""
        return any_process(flag)

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """The training loss (label-smoothed) without dropout, averaged over every non-pad label
        of `batches` (a token-weighted mean, not a mean of batch means). Every process computes
        the whole of it, on the mesh's layout of the weights."""
        total, count = 0.0, 0
        replicated = NamedSharding(self.mesh, P())
        self.model.eval()
        try:
            with self._context():
                for batch in batches:
                    ids = (put(np.asarray(a), replicated) for a in (batch.src, batch.tgt_in, batch.labels))
                    loss, n = _eval_loss(self.model, *ids, self.train_cfg.label_smoothing)
                    total += float(loss) * int(n)
                    count += int(n)
        finally:
            self.model.train()
        return total / max(count, 1)

    def params(self) -> Params:
        """The current weights as canonical NumPy copies, float32 (float64 for a float64 trainer),
        whole on every process (a collective when they are sharded across processes: every
        process calls it)."""
        dtype = canonical_dtype(self.dtype)
        if self.num_processes == 1:
            return to_params(self.model, dtype)
        flat = {flax_name(path): whole(variable.get_value()).astype(dtype)
                for path, variable in nnx.to_flat_state(nnx.state(self.model, nnx.Param))}
        check_params(self.cfg, flat, source="flax state")
        return {name: flat[name] for name in param_shapes(self.cfg)}  # checkpoint order

    def backend_model(self) -> Model:
        """A backend model (rosetta.backends interface: generate, logits) holding a copy of the
        current weights, on this process's first device and the compute dtype."""
        params = self.params()
        with jax.default_device(self.device):
            return Model(self.cfg, params, self.dtype)

    def peak_memory_bytes(self) -> int:
        """Peak device memory in use (memory_stats, GPUs); on CPU the process's peak RSS."""
        stats = self.device.memory_stats() or {}
        return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else max_rss_bytes()

    # -- resumable state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything besides the weights that an exact resume needs, as flat NumPy arrays
        (written by the harness as safetensors): the step, every optax state leaf (Adam's count
        and moments) and the nnx.Rngs key data and count. Whole on every process, whatever the
        layout, so a resume may use another number of devices (every process calls it)."""
        state: dict[str, np.ndarray] = {"step": np.asarray(self.step_count, dtype=np.int64)}
        for path, variable in nnx.to_flat_state(nnx.state(self.optimizer)):
            state[f"optimizer.{flax_name(path)}"] = whole(variable.get_value())
        for path, variable in nnx.to_flat_state(nnx.state(self.rngs)):
            state[f"rng.{flax_name(path)}"] = whole(variable.get_value())
        return state

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The keys and shapes of `state_dict()` (optax's state exists from the start)."""
        return {key: value.shape for key, value in self.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore a `state_dict()` saved by a trainer of the same config, on any number of
        devices; strict about keys. Every leaf keeps its dtype and its layout on the mesh, so the
        compiled step is the same one and resumes bit-exactly."""
        check_state(state, self._state_shapes(), "jax")
        with jax.default_device(self.device):
            flat = nnx.to_flat_state(nnx.state(self.optimizer))
            for path, variable in flat:
                old = variable.get_value()
                variable.set_value(np.array(state[f"optimizer.{flax_name(path)}"], dtype=old.dtype))
            nnx.update(self.optimizer, nnx.from_flat_state(flat))
            flat = nnx.to_flat_state(nnx.state(self.rngs))
            for path, variable in flat:
                old, saved = variable.get_value(), state[f"rng.{flax_name(path)}"]
                if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
                    new = jax.random.wrap_key_data(jnp.array(saved), impl=jax.random.key_impl(old))
                else:
                    new = np.array(saved, dtype=old.dtype)
                variable.set_value(new)
            nnx.update(self.rngs, nnx.from_flat_state(flat))
            place((self.model, self.optimizer, self.rngs), self.mesh)
        self._steps = int(np.asarray(state["step"]))
