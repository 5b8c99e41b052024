"""Training in PyTorch (SPEC §4): the label-smoothed loss, Adam with the paper's schedule, one
training step, canonical gradients for the parity tests, and `Trainer`, the adapter the
framework-free loop (rosetta/harness/loop.py) drives. Data-parallel training runs on torch's own
engine: one process per device under torchrun, DistributedDataParallel, or FSDP2's `fully_shard`
with `shard=True`; the process group and the engine live in torch_impl/distributed.py (the design:
rosetta/distributed.py, docs/distributed.md). Mirrors jax_impl/train.py function for function
(parity_tests/test_structure.py lists what one framework alone has): diff them to see only
framework differences.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from rosetta.config import ModelConfig
from rosetta.device import cpu_name, max_rss_bytes
from rosetta.distributed import LaunchEnv, launch_env, rank_seed, split_rows
from rosetta.errors import RosettaError
from rosetta.inputs import Packing
from rosetta.params import Params, canonical_dtype
from rosetta.training import (
    DEFAULT_LOSS,
    Batch,
    HostTimer,
    Prepared,
    TrainConfig,
    check_state,
    check_trainer_args,
    learning_rate,
)
from torch_impl import compilation, ops
from torch_impl.backend import DTYPES, Model, compute_context, float32_matmul_precision, parity_mode
from torch_impl.convert import build_model, from_state_dict
from torch_impl.distributed import (
    all_sum,
    any_process,
    every_process,
    gradient_sync,
    init_distributed,
    local_device,
    put,
    replicate,
    unwrap,
    whole,
)
from torch_impl.loss import chunked_loss, cross_entropy, generator_params
from torch_impl.model import Transformer

log = logging.getLogger(__name__)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, pad_id: int, label_smoothing: float,
            num_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over non-pad labels of the cross entropy against q = (1-ε)·onehot(y) + ε/V, ε spread
    over all V classes, pad included (torch's and optax's definition; others differ: PITFALLS 11).
    `num_tokens` given (a part of a global batch: rosetta/distributed.py): the sum divided by it
    instead. Returns (loss, number of non-pad labels); a batch with no labels gives loss 0."""
    # log-softmax in float32 at least, even for bfloat16 logits.
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    count = (labels != pad_id).sum()
    given = None if num_tokens is None else torch.as_tensor(num_tokens, device=wide.device)
    denominator = count.clamp(min=1) if given is None else given
    return cross_entropy(wide, labels.long(), denominator, pad_id, float(label_smoothing)), count


def schedule(d_model: int, train_cfg: TrainConfig) -> Callable[[int], float]:
    """LambdaLR's multiplier: it sees the step counted from 0, the paper's eq. 3 counts from 1."""
    return lambda step: learning_rate(step + 1, d_model, train_cfg.warmup_steps, train_cfg.lr_factor)


def make_optimizer(module: Transformer, train_cfg: TrainConfig
                   ) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam (eps after the square root, bias correction, no weight decay: §5.3) with base lr 1,
    so that LambdaLR's lr at optimizer step s (from 1) is exactly learning_rate(s)."""
    # The fused kernel (one launch for every tensor, CUDA and CPU) where the device has one, else the
    # foreach path. Fused keeps Adam's step count on the device: the default foreach path reads it
    # back with .item() every update (a device-to-host wait on a GPU).
    fused = next(module.parameters()).device.type in ("cpu", "cuda")
    optimizer = torch.optim.Adam(module.parameters(), lr=1.0, betas=(train_cfg.adam_b1, train_cfg.adam_b2),
                                 eps=train_cfg.adam_eps, weight_decay=0.0, fused=fused or None,
                                 foreach=None if fused else True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(module.cfg.d_model, train_cfg))


def forward_loss(module: Transformer, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor,
                 label_smoothing: float, compute: torch.dtype | None = None,
                 num_tokens: torch.Tensor | None = None, packing: Packing | None = None) -> torch.Tensor:
    """The loss of one batch, forward only, in the dtype `compute` (backend.compute_context): what
    `compiled_forward` compiles. `packing`: a packed batch's (docs/packing.md); none if unpacked (peer)."""
    with compute_context(module, compute):
        logits = module(src, tgt) if packing is None else module(src, tgt, packing=packing)
        return loss_fn(logits, labels, unwrap(module).cfg.pad_id, label_smoothing, num_tokens)[0]


def chunked_forward_loss(module: Transformer, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor,
                         label_smoothing: float, compute: torch.dtype | None = None,
                         num_tokens: torch.Tensor | None = None,
                         packing: Packing | None = None) -> torch.Tensor:
    """`forward_loss` without the [tokens, V] float32 logits: the decoder's output, then the output
    projection and the loss chunk by chunk with their own backward (torch_impl/loss.py, docs/loss.md).
    The tied table is used outside the wrapper's forward; its one gradient still reaches DDP's hook."""
    with compute_context(module, compute):
        hidden = module(src, tgt, hidden=True, packing=packing)
    model = unwrap(module)
    weight, bias = generator_params(model)
    return chunked_loss(hidden, weight, bias, labels, model.cfg.pad_id, label_smoothing, num_tokens,
                        logit_scale=model.cfg.logit_scale)[0]


# Each of rosetta.training.LOSSES by name: its forward pass and loss.
FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"plain": forward_loss, "chunked": chunked_forward_loss}


def _train_step(replica: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler,
                micro_batches: Sequence[tuple[torch.Tensor, ...]],
                num_tokens: torch.Tensor | None, train_cfg: TrainConfig, autocast: torch.dtype | None,
                forward: Callable[..., torch.Tensor],
                world_size: int = 1) -> tuple[torch.Tensor, float, torch.Tensor]:
    """`train_step` on this worker's micro-batches of one global batch (rosetta/distributed.py:
    each loss is its sum over the global `num_tokens`), also returning the global gradient norm
    before clipping (a 0-d tensor): the harness stops a run at the first non-finite one."""
    module = unwrap(replica)
    module.train()
    optimizer.zero_grad(set_to_none=True)
    total = None
    for k, (src, tgt, labels, *packing) in enumerate(micro_batches):  # packing: one optional Packing
        with gradient_sync(replica, k == len(micro_batches) - 1):
            loss = forward(replica, src, tgt, labels, train_cfg.label_smoothing, autocast, num_tokens,
                           *packing)
            # DDP and FSDP2 average gradients over the W workers; the global mean needs their sum.
            (loss * world_size if world_size > 1 else loss).backward()
        total = loss.detach().clone() if total is None else total + loss.detach()  # CUDA graphs reuse outputs
    if world_size > 1:
        all_sum(total)  # the global batch's loss, reported identically on every process
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if train_cfg.clip_norm is not None:
        # Scaled by min(1, clip/norm), optax's clip_by_global_norm: torch's clip_grad_norm_ divides
        # by norm + 1e-6, which parts the two frameworks' runs by ~1e-9 in 20 float64 steps.
        torch._foreach_mul_(grads, torch.clamp(train_cfg.clip_norm / grad_norm, max=1.0))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return total, lr, whole(grad_norm).detach()


def train_step(module: Transformer, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, src: torch.Tensor, tgt: torch.Tensor,
               labels: torch.Tensor, train_cfg: TrainConfig, autocast: torch.dtype | None = None,
               forward: Callable[..., torch.Tensor] = forward_loss) -> tuple[torch.Tensor, float]:
    """One update: forward with dropout (torch's generator: PITFALLS 10), loss, backward,
    optional global-norm clipping, Adam, schedule. `autocast` (e.g. torch.bfloat16): the forward
    pass's compute dtype, float32 weights cast once (backend.compute_context; JAX: alike).
    Returns (loss, lr used); the loss is a detached 0-d tensor (reading it synchronises)."""
    loss, lr, _ = _train_step(module, optimizer, scheduler, [(src, tgt, labels)], None, train_cfg, autocast,
                              forward)
    return loss, lr


def compiled_forward(loss: str, device_type: str = "cpu", accumulate: int = 1) -> Callable[..., torch.Tensor]:
    """FORWARDS[loss] compiled whole with its backward (AOTAutograd), inductor's options per device
    (compilation.training_options): `rosetta train --compile`. The loss over a 37k vocabulary alone is
    ~3x faster compiled than eager on an H100 (docs/benchmarks.md). One graph per batch shape: a CPU
    `small` step ran 3.5% faster than with dynamic shapes (1.70 against 1.76 s; docs/training.md)."""
    return compilation.compiled(FORWARDS[loss], dynamic=False,
                                options=compilation.training_options(device_type, accumulate))


def gradients(module: Transformer, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor,
              label_smoothing: float) -> tuple[float, Params]:
    """The loss and every parameter's gradient for one batch, no update, in the module's current
    mode (eval: no dropout). Gradients come back canonical: float32 NumPy, canonical names, math
    layout (torch_impl/convert.py transposes Linear weights back); a tied table has one gradient."""
    module.zero_grad(set_to_none=True)
    loss, _ = loss_fn(module(src, tgt), labels, module.cfg.pad_id, label_smoothing)
    loss.backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
             for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return float(loss.detach()), from_state_dict(module.cfg, grads)


def _watch(non_finite: torch.Tensor, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """(step, loss, gradient norm) of the first step whose loss or norm is not finite; step 0: none yet."""
    bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm)) & (non_finite[0] == 0)
    now = torch.stack([torch.full((), step, dtype=non_finite.dtype, device=non_finite.device),
                       loss.to(non_finite.dtype), grad_norm.to(non_finite.dtype)])
    return torch.where(bad, now, non_finite)


class CudaTimer:
    """A stretch of steps timed by CUDA events on the device's stream (rosetta.training.HostTimer's
    interface): the time the GPU took from the first step's first kernel to the last one's end."""

    def __init__(self, device: torch.device):
        self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._start.record(torch.cuda.current_stream(device))
        self._device = device

    def stop(self) -> None:
        self._end.record(torch.cuda.current_stream(self._device))

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


# -- The harness adapter ---------------------------------------------------------------------

class Trainer:
    """One model, its optimizer and its dropout generator behind the interface that
    rosetta/harness/loop.py drives; jax_impl/train.py's `Trainer` has the same methods.

    Built from canonical weights (`rosetta.init_params` or a checkpoint: never re-initialised
    here, PITFALLS 9). `dtype` "bfloat16" computes with bfloat16 copies of the float32 weights,
    cast once per step (backend.compute_context), Adam's state float32. `parity` (default: on CPU
    only) pins full-precision float32 matmuls (PITFALLS 5); a GPU trainer allows TF32, for speed.
    The dropout generator is the trainer's own: torch's global generator is swapped in for each
    step and saved back after it, so nothing else in the process moves this trainer's stream.

    Data-parallel: under a launcher (torchrun; rosetta.distributed.launch_env) the trainer joins
    the process group and wraps the model in DistributedDataParallel, or shards it with FSDP2's
    `fully_shard` (`shard=True`), one device per process. `accumulate` K sums the gradients of K
    micro-batches per update. `step` takes the global batch, the same on every process, and
    trains on this process's blocks of it (rosetta/distributed.py).

    `compile`: the forward pass, the loss and the backward as torch.compile graphs, one per batch
    shape, replayed as CUDA graphs on a GPU (`compiled_forward`). A step never waits for the device:
    every host value is copied in `prepare` (pinned, non-blocking), the loss and gradient norm stay on
    the device until `read`, and the step times of a GPU come from CUDA events (`timer`).
    """

    framework: ClassVar[str] = "torch"
    # float64: weights, moments and compute, for the tests that ask "same algorithm?" (DDP, FSDP2,
    # accumulation, resume), where float32 rounding would hide a real difference (docs/testing.md).
    dtypes: ClassVar[tuple[str, ...]] = tuple(name for name, p in DTYPES.items() if p.trains)

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], train_cfg: TrainConfig,
                 device: str | None = None, dtype: str = "float32", parity: bool | None = None,
                 accumulate: int = 1, shard: bool = False, num_devices: int | None = None,
                 loss: str = DEFAULT_LOSS, compile: bool = False, compile_cache: str | None = None):
        check_trainer_args("torch", self.dtypes, dtype, loss, accumulate)
        if loss == "chunked" and shard:  # FSDP2 reshards the tied table once the forward pass ends
            raise RosettaError("--loss chunked does not combine with --shard yet: use one of them")
        self.compile = bool(compile)
        if num_devices not in (None, 1):
            raise RosettaError("torch trains on one device per process: launch one process per device "
                               "(rosetta train --nproc N, or torchrun --nproc-per-node N -m rosetta.cli "
                               "train)")
        env = launch_env()
        if shard and not env.distributed:
            raise RosettaError("--shard shards the parameters over processes: launch more than one "
                               "(rosetta train --nproc N, or torchrun)")
        self.cfg, self.train_cfg, self.dtype = cfg, train_cfg, dtype
        self.accumulate, self.shard = accumulate, shard
        self.world_size, self.num_processes, self.rank = env.num_processes, env.num_processes, env.rank
        self.is_main = env.is_main
        self.device = local_device(device, env)
        # compile_cache: inductor keeps its own cache of compiled graphs (TORCHINDUCTOR_CACHE_DIR).
        self.forward = compiled_forward(loss, self.device.type, accumulate) if compile else FORWARDS[loss]
        self.graphs = self.compile and compilation.training_options(self.device.type, accumulate) is not None
        if env.distributed:
            if compile:  # DDP's and FSDP2's hooks under torch.compile are not tested here yet
                raise RosettaError("--compile trains in one process for now: leave out --nproc or --compile")
            init_distributed(env, self.device)
        self.module = build_model(cfg, params, DTYPES[dtype].params, self.device)  # meta, then the weights
        self.autocast = DTYPES[dtype].compute  # the compute dtype (backend.compute_context)
        self.parity = self.device.type == "cpu" if parity is None else parity
        self.replica = replicate(self.module, self.device, env, self.shard)
        self.optimizer, self.scheduler = make_optimizer(self.module, train_cfg)  # after fully_shard
        self.device_name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                            else cpu_name())
        with torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(rank_seed(train_cfg.seed, self.rank))  # the CPU and every CUDA generator
            self._rng = self._get_rng()
        # On the device: the first step whose loss or gradient norm was not finite, as (step, loss,
        # gradient norm); step 0 while there is none (read() fetches it with the step's values).
        self._non_finite = torch.zeros(3, dtype=torch.float64, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @staticmethod
    def resolve_device(name: str | None, env: LaunchEnv) -> str:
        """The device a trainer built with `device=name` in the launch `env` takes ('cpu', 'cuda:1'),
        checked as the constructor checks it: a RosettaError if torch has no such device here."""
        return str(local_device(name, env))

    # -- precision and randomness ------------------------------------------------------------
    def _rng_devices(self) -> list[torch.device]:
        return [self.device] if self.device.type == "cuda" else []

    def _get_rng(self) -> dict[str, torch.Tensor]:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """The trainer's generator in place of torch's global one, its RNG mode, the matmul precision."""
        rng = ops.dropout_rng(self.device.type, self.compile, self.graphs)  # functionalised or not
        with torch.random.fork_rng(devices=self._rng_devices()), self._precision(), rng:
            torch.set_rng_state(self._rng["cpu"])
            if "cuda" in self._rng:
                torch.cuda.set_rng_state(self._rng["cuda"], self.device)
            yield
            self._rng = self._get_rng()

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.parity:
            return parity_mode()
        if self.device.type == "cuda":
            return float32_matmul_precision("high")
        return contextlib.nullcontext()

    def _tensor(self, ids: np.ndarray) -> torch.Tensor:
        """Host values on the device without waiting (compilation.host_copy): every copy of `prepare`."""
        return compilation.to_device(torch.from_numpy(np.asarray(ids, order="C")), self.device)  # 0-d stays

    # -- training and evaluation -------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Updates done so far (the next update is step_count + 1 in the paper's eq. 3)."""
        return int(self.scheduler.last_epoch)

    def prepare(self, batch: Batch) -> Prepared:
        """This process's micro-batches of the global `batch` on the device, copied without waiting."""
        k = self.accumulate
        mine = split_rows(batch, self.world_size * k, self.cfg.pad_id)[self.rank * k:(self.rank + 1) * k]
        micro = [(self._tensor(b.src), self._tensor(b.tgt_in), self._tensor(b.labels),
                  Packing(*(self._tensor(a) for a in b.packing())) if b.packed else None)
                 for b in mine]
        num_tokens = self._tensor(np.asarray(batch.num_tgt_tokens, dtype=np.int64))  # torch.tensor: a sync
        return Prepared(batch, (micro, num_tokens, int(mine[0].shape[0])))

    def step(self, batch: Batch | Prepared, keep_grads: bool = False) -> dict[str, Any]:
        """One update on `batch` (§5.3), a Batch or `prepare`'s copy; returns {step, loss, lr, grad_norm,
        num_src_tokens, num_tgt_tokens, world_size, worker_rows}, loss and grad_norm (global, before
        clipping) 0-d device tensors, not waited for (`read` waits). Nothing here waits for the device
        (parity_tests/test_step_levers.py) but `keep_grads`: `grads`, canonical, before clipping (--trace)."""
        prepared = batch if isinstance(batch, Prepared) else self.prepare(batch)
        batch, (micro, num_tokens, rows) = prepared.batch, prepared.arrays
        if self.compile:  # a new step for CUDA graphs (outputs kept from the last one were copied)
            torch.compiler.cudagraph_mark_step_begin()
            if isinstance(self.module, Transformer):  # the table grows outside the graph
                self.module.position_table(batch.shape[1])
        with self._context():
            loss, lr, grad_norm = _train_step(self.replica, self.optimizer, self.scheduler, micro, num_tokens,
                                              self.train_cfg, self.autocast, self.forward, self.world_size)
            self._non_finite = _watch(self._non_finite, self.step_count, loss, grad_norm)
        metrics = {"step": self.step_count, "loss": loss, "lr": float(lr), "grad_norm": grad_norm,
                   "num_src_tokens": int(batch.num_src_tokens), "num_tgt_tokens": int(batch.num_tgt_tokens),
                   "world_size": self.world_size, "worker_rows": rows}
        if keep_grads:
            metrics["grads"] = self._kept_gradients(float(grad_norm))
        return metrics

    def read(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` of `step` with loss and grad_norm as floats, and `non_finite`: None or the first
        step with a non-finite loss or gradient norm (rosetta.training.Trainer). One transfer."""
        device = [metrics["loss"], metrics["grad_norm"]]
        values = torch.cat([torch.stack([torch.as_tensor(v).double() for v in device]).to(self.device),
                            self._non_finite]).tolist()
        loss, grad_norm, step, bad_loss, bad_norm = values
        return metrics | {"loss": loss, "grad_norm": grad_norm, "lr": float(metrics["lr"]),
                          "non_finite": {"step": int(step), "loss": bad_loss, "grad_norm": bad_norm}
                          if step else None}

    def timer(self) -> HostTimer:
        """CUDA events around a stretch of steps on a GPU (the device's own time); the host's clock
        elsewhere (a CPU computes as the host waits)."""
        return CudaTimer(self.device) if self.device.type == "cuda" else HostTimer()

    def compilation(self) -> tuple[float, int]:
        """torch.compile's seconds and graphs so far in this process (0 in eager mode)."""
        return compilation.compile_totals()

    def _kept_gradients(self, grad_norm: float) -> Params:
        """The last update's gradients before clipping, canonical (a collective when sharded). The
        clipped ones are what `p.grad` holds: divided back by clipping's min(1, clip / norm)."""
        clip = self.train_cfg.clip_norm
        scale = 1.0 if clip is None else min(1.0, clip / grad_norm)
        grads = {name: whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach() / scale
                 for name, p in self.module.named_parameters()}
        return from_state_dict(self.cfg, grads, canonical_dtype(self.dtype))

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` holds on any process of the launch (a collective; alone: `flag`), so that
        every process stops at the same step (a time budget read from each one's own clock)."""
        return any_process(flag, self.num_processes, self.device)

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """The training loss (label-smoothed) without dropout, averaged over every non-pad label
        of `batches` (a token-weighted mean, not a mean of batch means)."""
        total, count = 0.0, 0
        self.module.eval()
        try:
            with torch.inference_mode(), self._precision():
                for batch in batches:
                    with compute_context(self.module, self.autocast):
                        logits = self.module(self._tensor(batch.src), self._tensor(batch.tgt_in))
                    loss, n = loss_fn(logits, self._tensor(batch.labels), self.cfg.pad_id,
                                      self.train_cfg.label_smoothing)
                    total += float(loss) * int(n)
                    count += int(n)
        finally:
            self.module.train()
        return total / max(count, 1)

    def params(self) -> Params:
        """The current weights as canonical NumPy copies, float32 (float64 for a float64 trainer;
        sharded: gathered whole, a collective that every process calls)."""
        state = {name: whole(value) for name, value in self.module.state_dict().items()}
        return from_state_dict(self.cfg, state, canonical_dtype(self.dtype))

    def backend_model(self) -> Model:
        """A backend model (rosetta.backends interface: generate, logits) holding a copy of the
        current weights, on the same device and compute dtype."""
        return Model(self.cfg, self.params(), self.dtype, device=str(self.device))

    def peak_memory_bytes(self) -> int:
        """Peak device memory allocated by torch (CUDA); on CPU the process's peak RSS."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max_rss_bytes()

    # -- resumable state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything besides the weights that an exact resume needs, as flat NumPy arrays
        (written by the harness as safetensors): the step, Adam's moments and step per
        parameter, the optimizer's lr, the scheduler's counters, and the generator states: process
        0's as `rng.<device>`, process r's as `rng.rank<r>.<device>`. Distributed: a
        collective (moments gathered whole, generators gathered) that every process calls."""
        state: dict[str, np.ndarray] = {"step": np.asarray(self.step_count, dtype=np.int64)}
        opt = self.optimizer.state_dict()
        for index, (name, _) in enumerate(self.module.named_parameters()):
            for key, value in opt["state"].get(index, {}).items():
                state[f"optimizer.{name}.{key}"] = whole(value).detach().cpu().numpy().copy()
        state["optimizer.lr"] = np.asarray(opt["param_groups"][0]["lr"], dtype=np.float64)
        sched = self.scheduler.state_dict()
        state["scheduler.last_epoch"] = np.asarray(sched["last_epoch"], dtype=np.int64)
        state["scheduler.step_count"] = np.asarray(sched["_step_count"], dtype=np.int64)
        state["scheduler.last_lr"] = np.asarray(sched["_last_lr"], dtype=np.float64)
        for rank, rng in enumerate(every_process(self._rng, self.num_processes)):
            prefix = "rng." if rank == 0 else f"rng.rank{rank}."
            for device, value in rng.items():
                state[prefix + device] = value.numpy().copy()
        return state

    def _state_shapes(self, with_moments: bool) -> dict[str, tuple[int, ...]]:
        """The keys and shapes of `state_dict()`; Adam's moments exist after the first update."""
        shapes = {"step": (), "optimizer.lr": (), "scheduler.last_epoch": (), "scheduler.step_count": (),
                  "scheduler.last_lr": (1,)}
        if with_moments:
            for name, p in self.module.named_parameters():
                shapes |= {f"optimizer.{name}.step": (), f"optimizer.{name}.exp_avg": tuple(p.shape),
                           f"optimizer.{name}.exp_avg_sq": tuple(p.shape)}
        return shapes | {f"rng.{device}": tuple(value.shape) for device, value in self._rng.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore a `state_dict()` saved by a trainer of the same config; strict about keys."""
        others = {key: value for key, value in state.items() if key.startswith("rng.rank")}
        state = {key: value for key, value in state.items() if key not in others}
        check_state(state, self._state_shapes(int(np.asarray(state.get("step", 0))) > 0), "torch")
        opt = self.optimizer.state_dict()
        for index, (name, p) in enumerate(self.module.named_parameters()):
            if f"optimizer.{name}.step" in state:
                opt["state"][index] = {key: put(state[f"optimizer.{name}.{key}"], p)
                                       for key in ("step", "exp_avg", "exp_avg_sq")}
        opt["param_groups"][0]["lr"] = float(state["optimizer.lr"])
        self.optimizer.load_state_dict(opt)  # moves the moments to the parameters' device
        sched = self.scheduler.state_dict()
        sched.update(last_epoch=int(state["scheduler.last_epoch"]),
                     _step_count=int(state["scheduler.step_count"]),
                     _last_lr=[float(x) for x in np.atleast_1d(state["scheduler.last_lr"])])
        self.scheduler.load_state_dict(sched)
        self._load_rng(state, others)

    def _load_rng(self, state: Mapping[str, np.ndarray], others: Mapping[str, np.ndarray]) -> None:
        """This process's generator: process 0's is `rng.<device>`, process r's `rng.rank<r>.<device>`.
        A run saved with fewer processes has none for this one: it starts a fresh stream (the
        updates stay the same; only the dropout masks differ from an uninterrupted run)."""
        mine = f"rng.rank{self.rank}."
        saved = state if self.rank == 0 else {"rng." + key[len(mine):]: value for key, value in others.items()
                                              if key.startswith(mine)}
        if self.rank == 0 or all(f"rng.{device}" in saved for device in self._rng):
            self._rng = {device: torch.from_numpy(np.array(saved[f"rng.{device}"])) for device in self._rng}
        else:
            log.warning("torch: the checkpoint holds no dropout generator for process %d (saved with fewer "
                        "processes): it draws from a fresh one", self.rank)
