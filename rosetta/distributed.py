"""Data-parallel training, framework-free: where this process stands in a launch (the environment
that `torchrun` sets, read by both trainers), and how one global batch is split among workers and
micro-batches. The communication itself is each framework's own engine (torch.distributed,
jax.sharding); nothing here sends a byte. docs/distributed.md explains the whole design.

One global batch: every process builds the same global batch from the seed and the step
(rosetta/harness/batching.py), pads its rows to a multiple of workers × micro-batches with rows
that are all padding, and cuts it into that many equal blocks of consecutive rows: block
`w * K + k` is worker `w`'s k-th micro-batch (`split_rows`). Every block's loss is a sum over
its non-pad labels divided by the *global* batch's count (`Batch.num_tgt_tokens`), so summing
the blocks' gradients over workers and micro-batches gives exactly the gradient of the global
batch's mean loss (SPEC §4), whatever the number of workers: a short block weighs what its
tokens weigh, not 1/W.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rosetta.errors import RosettaError
from rosetta.training import Batch

# How long a collective may wait for a peer before the run ends with an error naming the wait
# (a rank that hangs; one that dies is noticed by the launcher and by gloo/NCCL at once).
DEFAULT_TIMEOUT_S = 600
TIMEOUT_VARIABLE = "ROSETTA_DIST_TIMEOUT"  # seconds; `rosetta train --dist-timeout` sets it


@dataclass(frozen=True)
class LaunchEnv:
    """This process in a launch: `num_processes` processes in all (torchrun's WORLD_SIZE), this
    one `rank` (RANK), `local_rank` on its machine (LOCAL_RANK), and the rendezvous address of
    process 0 (MASTER_ADDR, MASTER_PORT). A plain `python` run is process 0 of 1."""

    num_processes: int = 1
    rank: int = 0
    local_rank: int = 0
    local_processes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs, plots and checkpoints."""
        return self.rank == 0


def _int_variable(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    if not text.isascii() or not text.isdigit() or int(text) < minimum:
        raise RosettaError(f"environment variable {name}={text!r} must be an integer >= {minimum}")
    return int(text)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch this process belongs to, from torchrun's variables (absent: a single process).
    Inconsistent values are refused by name rather than left to hang a rendezvous."""
    environ = os.environ if environ is None else environ
    num = _int_variable(environ, "WORLD_SIZE", 1, 1)
    rank = _int_variable(environ, "RANK", 0, 0)
    local_rank = _int_variable(environ, "LOCAL_RANK", 0, 0)
    local = _int_variable(environ, "LOCAL_WORLD_SIZE", 1 if num == 1 else num, 1)
    port = _int_variable(environ, "MASTER_PORT", 29500, 1)
    if rank >= num:
        raise RosettaError(f"RANK={rank} must be below WORLD_SIZE={num}")
    if local_rank >= local:
        raise RosettaError(f"LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local}")
    if port > 65534:  # JAX's coordinator listens on MASTER_PORT + 1
        raise RosettaError(f"MASTER_PORT={port} must be below 65535")
    timeout = environ.get(TIMEOUT_VARIABLE) or str(DEFAULT_TIMEOUT_S)
    try:
        timeout_s = float(timeout)
    except ValueError:
        timeout_s = float("nan")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise RosettaError(f"environment variable {TIMEOUT_VARIABLE}={timeout!r} must be a positive number "
                           "of seconds")
    return LaunchEnv(num, rank, local_rank, local, environ.get("MASTER_ADDR") or "127.0.0.1", port,
                     timeout_s)


def rank_seed(seed: int, rank: int) -> int:
    """The dropout seed of data-parallel process `rank`: `seed` itself for process 0 (a
    one-process run draws what it always drew), a distinct stream for every other rank."""
    if rank == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def split_rows(batch: Batch, parts: int, pad_id: int) -> list[Batch]:
    """`batch` cut into `parts` equal blocks of consecutive rows (module docstring): its rows first
    padded to a multiple of `parts` with rows that are all `pad_id` (index -1). Each block carries
    its own token counts; the loss denominator stays the global `batch.num_tgt_tokens`."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise RosettaError(f"a batch splits into a whole number >= 1 of parts, not {parts!r}")
    rows, length = batch.shape
    padded = -(-rows // parts) * parts
    extra = padded - rows

    def pad(a: np.ndarray, value: int) -> np.ndarray:
        return np.concatenate([a, np.full((extra,) + a.shape[1:], value, dtype=a.dtype)]) if extra else a

    src, tgt_in, labels = pad(batch.src, pad_id), pad(batch.tgt_in, pad_id), pad(batch.labels, pad_id)
    indices = pad(batch.indices, -1)
    arrays = batch.packing()._asdict() if batch.packed else {}  # the Batch fields by name
    packing = {name: pad(a, 0) for name, a in arrays.items()}  # segment 0: padding
    step = padded // parts
    blocks = []
    for p in range(parts):
        rows_p = slice(p * step, (p + 1) * step)
        blocks.append(Batch(src[rows_p], tgt_in[rows_p], labels[rows_p], indices[rows_p],
                            int((src[rows_p] != pad_id).sum()), int((labels[rows_p] != pad_id).sum()),
                            **{name: a[rows_p] for name, a in packing.items()}))
    return blocks
