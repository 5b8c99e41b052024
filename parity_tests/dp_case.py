"""The data-parallel test case (parity_tests/test_distributed.py): a tiny model without dropout,
five global batches with an odd number of rows (so that splitting them pads), trained in float64,
and the comparison of two trained weight sets. Also run as a program by the workers that
`torchrun` launches (`python -m parity_tests.dp_case torch OUT.npz`).

Why float64: the question is "the same algorithm?". Two orders of summation of the same float32
gradients differ by rounding, and Adam's first steps map a gradient g to about g / (|g| + eps),
which turns a rounding difference in a small g into a difference as large as the step itself:
a float32 bound would have to admit a full update (and so a real bug), or be tuned to one CPU's
reduction order (an Intel Xeon failed 1e-5 where an AMD EPYC passed). In float64 the rounding is
2^29 times smaller, so the bound below holds on any CPU while a bug (a gradient scaled by the
worker count, a micro-batch dropped) still misses it by orders of magnitude."""

from __future__ import annotations

import sys

import numpy as np

from numpy_ref.model import forward as reference_forward
from rosetta.config import ModelConfig, preset
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import synthetic_pairs
from rosetta.params import init_params
from rosetta.training import Batch, TrainConfig

STEPS = 5
TRAIN = TrainConfig(warmup_steps=10)
DTYPE = "float64"  # the trainers' weights, moments and compute (see the docstring)
# Per tensor, max |a - b| / max |b|, float64. Two layouts of one algorithm differ only in the order
# of their sums: <= n u relative per gradient entry (u = 2^-53, n <= 264 tokens a batch), which
# Adam passes on with relative gain 1 where |g| >> eps (the structural zeros, the k biases, go
# through the outputs: dp_case.k_bias). Seen: <= 1.4e-14 (FSDP2, AMD EPYC); 1e-10 leaves 7,000x
# for any CPU's order, while the classic bug (gradients scaled by 1/2: a world size forgotten)
# moves the weights by 3.9e-4 and the logits by 2.9e-6 (measured on this case).
WEIGHTS_RTOL = 1e-10
# The loss: a sum of n <= 264 positive terms in float64, <= n u = 3e-14 relative in any order.
LOSS_RTOL = 1e-12
# float32 against float32 (or the float64 reference) from the same weights: one forward pass's
# rounding. The cross entropy moves by at most 2 max|Δlogit| (its gradient in the logits has L1 norm
# <= 2: p - q), and each framework's float32 logits are within ~1e-6 relative of float64 (the parity
# suite's 1e-5 bound, rosetta.parity.TOLERANCES, seen at 3e-7); on a loss near log V, 1e-5.
FIRST_STEP_RTOL = 1e-5
# Every trainer variant the launched workers run: name -> Trainer keyword arguments.
TORCH_VARIANTS = {"ddp": {}, "ddp_accumulate2": {"accumulate": 2}, "fsdp2": {"shard": True},
                  "fsdp2_accumulate2": {"shard": True, "accumulate": 2}}


def case() -> tuple[ModelConfig, dict[str, np.ndarray], list[Batch]]:
    cfg = preset("tiny", dropout=0.0, attention_dropout=0.0)
    pairs = synthetic_pairs("copy", 200, 64, 1, 16, seed=0)
    # Bucket 24 with a 264-token budget: 11 rows, padded to 12 for 2 workers and for 2 x 2.
    batches = BatchIterator.from_config(pairs, cfg, max_tokens=264, buckets=[24]).epoch_batches()
    batches = list(batches)[:STEPS]
    assert all(b.shape[0] % 2 == 1 for b in batches)
    return cfg, init_params(cfg, seed=0), batches


# The same case with dropout on (docs/distributed.md: PyTorch's processes draw their own masks).
DROPOUT = 0.1


def k_bias(name: str) -> bool:
    """The key projections' biases: their gradient is zero in exact arithmetic (a constant added
    to every score of a row cancels in the softmax), so Adam turns rounding noise into updates of
    arbitrary sign (PITFALLS 14): compared through the outputs instead."""
    return name.endswith(".k.bias")


def compare(cfg: ModelConfig, got: dict[str, np.ndarray], want: dict[str, np.ndarray],
            batch: Batch) -> tuple[float, float]:
    """(worst relative difference over every tensor but the k biases, relative difference of the
    two models' float64 logits on `batch`): max |a - b| / max |b|."""
    worst = max(float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want if not k_bias(k))

    def logits(p: dict[str, np.ndarray]) -> np.ndarray:
        wide = {k: v.astype(np.float64) for k, v in p.items()}
        return reference_forward(wide, cfg, batch.src, batch.tgt_in)

    a, b = logits(got), logits(want)
    return worst, float(np.abs(a - b).max() / np.abs(b).max())


def train_float64(backend: str, cfg: ModelConfig, params: dict[str, np.ndarray], train_cfg: TrainConfig,
                  batches: list[Batch], **kwargs) -> tuple[list[float], dict[str, np.ndarray]]:
    """`backend`'s Trainer ('torch' or 'jax', JAX under 64-bit JAX) trained in float64 on `batches`
    in one process: the losses and the float64 weights. kwargs: the Trainer's (accumulate, loss)."""
    if backend == "torch":
        from torch_impl.train import Trainer

        trainer = Trainer(cfg, params, train_cfg, device="cpu", dtype=DTYPE, **kwargs)
        return [trainer.read(trainer.step(b))["loss"] for b in batches], trainer.params()
    import jax

    from jax_impl.train import Trainer as JaxTrainer

    with jax.enable_x64(True):
        trainer = JaxTrainer(cfg, params, train_cfg, device="cpu", dtype=DTYPE, **kwargs)
        return [trainer.read(trainer.step(b))["loss"] for b in batches], trainer.params()


def _torch_worker(out: str) -> None:
    """Every TORCH_VARIANTS entry trained STEPS steps on this launch's processes; process 0 saves the
    weights and losses to `out`. Also a sharded resume: 3 steps, state_dict, a new trainer, 2 more."""
    import torch.distributed as dist

    from torch_impl.train import Trainer

    cfg, params, batches = case()
    saved: dict[str, np.ndarray] = {}
    for name, kwargs in TORCH_VARIANTS.items():
        trainer = Trainer(cfg, params, TRAIN, device="cpu", dtype=DTYPE, **kwargs)
        metrics = [trainer.read(trainer.step(b)) for b in batches]
        saved[f"{name}.loss"] = np.array([m["loss"] for m in metrics])
        saved[f"{name}.world_size"] = np.array(metrics[0]["world_size"])
        saved |= {f"{name}/{k}": v for k, v in trainer.params().items()}
    dropout = Trainer(preset("tiny", dropout=DROPOUT), params, TRAIN, device="cpu", dtype=DTYPE)
    saved["ddp_dropout.loss"] = np.array([dropout.read(dropout.step(b))["loss"] for b in batches])
    first = Trainer(cfg, params, TRAIN, device="cpu", dtype=DTYPE, shard=True)
    for b in batches[:3]:
        first.step(b)
    weights, state = first.params(), first.state_dict()
    second = Trainer(cfg, weights, TRAIN, device="cpu", dtype=DTYPE, shard=True)
    second.load_state_dict(state)
    for b in batches[3:]:
        second.step(b)
    saved |= {f"fsdp2_resumed/{k}": v for k, v in second.params().items()}
    if dist.get_rank() == 0:
        np.savez(out, **saved)
    dist.destroy_process_group()


if __name__ == "__main__":
    framework, out = sys.argv[1:3]
    if framework != "torch":
        raise SystemExit(f"unknown framework {framework!r}")
    _torch_worker(out)
