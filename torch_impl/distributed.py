"""Data-parallel plumbing for PyTorch's trainer (torch_impl/train.py): this process's device in a
launch, the process group, the model's engine (DistributedDataParallel, or FSDP2's `fully_shard`
with `shard=True`), the gradient reduction of accumulated micro-batches, and the collectives
that make a value whole or the same on every process. One process per device, under torchrun.

The framework-free design (the launch environment, one global batch split into blocks) is
rosetta/distributed.py; docs/distributed.md explains the whole. jax_impl/distributed.py holds
the same jobs for JAX, under the same names where they match, in the same order
(parity_tests/test_structure.py).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rosetta.distributed import LaunchEnv
from rosetta.errors import RosettaError
from torch_impl.backend import default_device, loaded_instance
from torch_impl.model import Transformer


def local_device(name: str | None, env: LaunchEnv | None = None) -> torch.device:
    """'cpu', 'cuda' (or 'gpu') or 'cuda:1' -> that torch device, checked (torch_impl/backend.py's
    default_device); None: CUDA if available, else CPU. Under a launcher a bare 'cuda' means this
    process's own GPU, cuda:LOCAL_RANK."""
    device = torch.device(default_device(name))
    if device.type == "cuda" and device.index is None and env is not None and env.distributed:
        device = torch.device("cuda", env.local_rank)
    return device


def init_distributed(env: LaunchEnv, device: torch.device) -> None:
    """Join the launch's process group (torchrun's MASTER_ADDR/PORT, RANK, WORLD_SIZE): NCCL on
    GPUs, gloo on CPUs. A collective that waits `env.timeout_s` for a peer ends with an error, not
    a hang. Once per process; every trainer of the process shares the group."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=env.rank,
                                world_size=env.num_processes,
                                timeout=datetime.timedelta(seconds=env.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as e:
        raise RosettaError(f"process {env.rank} of {env.num_processes} could not join the process group at "
                           f"{env.master_addr}:{env.master_port}: {e}") from None


def replicate(module: Transformer, device: torch.device, env: LaunchEnv, shard: bool) -> torch.nn.Module:
    """The module the forward pass runs through: itself (one process), DDP around it, or itself
    sharded in place by FSDP2 (each layer one unit, the root the embeddings and the rest)."""
    if shard:
        from torch.distributed.fsdp import fully_shard

        for p in module.parameters():  # FSDP2 shards contiguous tensors only; Linear weights
            p.data = p.data.contiguous()  # arrive as transposed views of the canonical [in, out]
        for layer in [*module.encoder.layers, *module.decoder.layers]:
            fully_shard(layer)
        return fully_shard(module)
    if env.distributed:
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)  # broadcasts rank 0's weights
    return module


def unwrap(module: torch.nn.Module) -> Transformer:
    """The Transformer inside a DistributedDataParallel wrapper (FSDP2 shards it in place)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


@contextlib.contextmanager
def gradient_sync(replica: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Let DDP / FSDP2 reduce gradients over workers in this backward pass only if `sync`: the
    last micro-batch of an accumulated step reduces the sum of all of them, once."""
    if isinstance(replica, DistributedDataParallel) and not sync:
        with replica.no_sync():
            yield
    elif loaded_instance(replica, "torch.distributed.fsdp", "FSDPModule") and not sync:
        replica.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            replica.set_requires_gradient_sync(True)
    else:
        yield


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the processes, in place (a collective: every process calls it)."""
    dist.all_reduce(tensor)
    return tensor


def any_process(flag: bool, num_processes: int, device: torch.device) -> bool:
    """Whether `flag` holds on any process of the launch (a collective; alone: `flag`), so that
    every process stops at the same step (a time budget read from each one's own clock)."""
    if num_processes == 1:
        return bool(flag)
    value = torch.tensor(int(bool(flag)), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor shard gathered whole (a collective: every process calls it); others as they are."""
    return tensor.full_tensor() if loaded_instance(tensor, "torch.distributed.tensor", "DTensor") else tensor


def put(value: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """`value` (whole, the same on every process: a saved optimizer tensor) laid out as the parameter
    `like`: sharded like it under FSDP2, else with its strides (a Linear weight loaded from a
    canonical kernel is its transpose, a view): the fused Adam kernel walks parameter, gradient and
    moments in memory order, so a moment of another layout would be updated with the wrong gradient
    entries. The reverse of `whole`."""
    tensor = torch.from_numpy(np.array(value))
    if loaded_instance(like, "torch.distributed.tensor", "DTensor") and tensor.ndim:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements)
    if tensor.shape != like.shape:
        return tensor  # the step count (0-d), or a mismatch that check_state has already refused
    return torch.empty_strided(like.shape, like.stride(), dtype=tensor.dtype).copy_(tensor)


def every_process(value: Any, num_processes: int) -> list[Any]:
    """`value` of every process, in rank order (a collective; alone: [value])."""
    every = [value] * num_processes
    if num_processes > 1:
        dist.all_gather_object(every, value)
    return every
