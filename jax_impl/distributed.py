"""Data-parallel plumbing for JAX's trainer (jax_impl/train.py): this process's device, joining a
launch through `jax.distributed`, the `jax.sharding.Mesh` of devices with one axis "data", the
ZeRO-3 placement of parameters and Adam's moments with `shard=True`, how the dropout masks are
drawn on a mesh, and the collectives that make a value whole or the same on every process. One
jitted step runs over the whole mesh: XLA inserts the all-reduces and all-gathers itself.

The framework-free design (the launch environment, one global batch split into blocks) is
rosetta/distributed.py; docs/distributed.md explains the whole. torch_impl/distributed.py holds
the same jobs for PyTorch, under the same names where they match, in the same order
(parity_tests/test_structure.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import compilation  # noqa: F401 - sets XLA's flags before JAX starts its backends
from rosetta.device import check_device, parse_device
from rosetta.distributed import LaunchEnv
from rosetta.errors import RosettaError


def local_device(name: str | None) -> jax.Device:
    """'cpu', 'gpu', 'cuda' or 'cuda:1' (torch's spelling) -> that JAX device of this process,
    checked by rosetta/device.py's one parser against the devices JAX sees; None: the default."""
    if name is None:
        return jax.local_devices()[0]
    platform = parse_device(name).platform
    try:
        present = jax.local_devices(backend=platform)
    except RuntimeError:  # no such platform here (a GPU on a CPU-only machine)
        present = []
    gpus, cpus = (len(present), 1) if platform == "gpu" else (0, len(present))
    return present[check_device(name, gpus, cpus).index or 0]


def init_distributed(env: LaunchEnv) -> None:
    """Join the launch (torchrun's MASTER_ADDR, RANK, WORLD_SIZE) through JAX's coordinator on
    MASTER_PORT + 1 (MASTER_PORT is torch's). Before JAX starts its backends; once per process.
    On CPU the collectives run over gloo; under a launcher with several processes per machine
    each takes its own accelerator, LOCAL_RANK."""
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; harmless on GPUs
    # Several processes on one machine: one accelerator each (the CPU client ignores this).
    local = [env.local_rank] if env.local_processes > 1 else None
    try:
        jax.distributed.initialize(coordinator_address=f"{env.master_addr}:{env.master_port + 1}",
                                   num_processes=env.num_processes, process_id=env.rank,
                                   local_device_ids=local, initialization_timeout=max(1, int(env.timeout_s)))
    except (RuntimeError, ValueError) as e:
        raise RosettaError(f"process {env.rank} of {env.num_processes} could not join JAX's coordinator at "
                           f"{env.master_addr}:{env.master_port + 1} (jax.distributed.initialize must run "
                           f"before anything else in the process uses JAX): {e}") from None


def make_mesh(name: str | None, num_devices: int | None) -> Mesh:
    """The data-parallel mesh: one axis "data" over `_mesh_devices(name, num_devices)`."""
    return Mesh(np.array(_mesh_devices(name, num_devices)), ("data",))


def _mesh_devices(name: str | None, num_devices: int | None) -> list[jax.Device]:
    """The data-parallel devices, in mesh order: the first `num_devices` local devices of the
    platform of `name` in every process (None: all of them; 'cuda:1' starts at that device and
    alone takes only it), process by process."""
    first = local_device(name)
    local = jax.local_devices(backend=first.platform)
    local = local[local.index(first):]
    if num_devices is None:
        num_devices = 1 if name and ":" in name else len(local)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise RosettaError(f"num_devices must be an integer >= 1, not {num_devices!r}")
    if num_devices > len(local):
        hint = ("; for more host devices set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                "JAX starts" if first.platform == "cpu" else "")
        seen = f"{len(local)} {first.platform} device{'' if len(local) == 1 else 's'}"
        where = f" from {name!r} on" if name and ":" in name else ""
        raise RosettaError(f"num_devices={num_devices}: JAX sees {seen}{where} here{hint}")
    if jax.process_count() == 1:
        return local[:num_devices]
    # Every process makes the same choice; jax.devices() lists the others' devices too.
    everyone = sorted(jax.devices(first.platform), key=lambda d: (d.process_index, d.id))
    offset = jax.local_devices(backend=first.platform).index(first)
    return [d for p in range(jax.process_count())
            for d in [d for d in everyone if d.process_index == p][offset:offset + num_devices]]


def shard_variables(model: nnx.Module, optimizer: nnx.Optimizer, size: int) -> None:
    """Mark every weight and every Adam moment to be split ZeRO-3 style over a mesh of `size`.
    Flax NNX's sharding metadata: `out_sharding` names each one's mesh axes (by shape alone, so
    a moment is laid out as its weight); nnx.get_named_sharding reads it in `place` and in the
    step. Set after the optimizer exists: Flax would otherwise shard the moments eagerly at
    creation, which needs every device to be this process's."""
    for node, kind in ((model, nnx.Param), (optimizer, nnx.Variable)):
        for _, variable in nnx.to_flat_state(nnx.state(node, kind)):
            variable.set_metadata(out_sharding=_shard_spec(variable.shape, size))


def _shard_spec(shape: tuple[int, ...], size: int) -> tuple[str | None, ...]:
    """ZeRO-3 placement: "data" on the first axis that the mesh size divides, else replicated."""
    for axis, n in enumerate(shape):
        if n % size == 0:
            return (None,) * axis + ("data",) + (None,) * (len(shape) - axis - 1)
    return (None,) * len(shape)


def place(nodes: Iterable[nnx.Pytree], mesh: Mesh) -> None:
    """Every variable of `nodes` (model, optimizer, generator) laid out on the mesh by its
    metadata (replicated where it has none)."""
    for node in nodes:
        state = nnx.state(node)
        nnx.update(node, jax.tree.map(put, state, nnx.get_named_sharding(state, mesh)))


def pin(nodes: Iterable[nnx.Pytree], mesh: Mesh) -> None:
    """Inside the jitted step: the new state of `nodes` constrained to their variables' layouts
    on the mesh, so that the next call hits the same compiled step."""
    for node in nodes:
        state = nnx.state(node)
        nnx.update(node, jax.lax.with_sharding_constraint(state, nnx.get_named_sharding(state, mesh)))


def dropout_draws() -> contextlib.AbstractContextManager:
    """How threefry draws the dropout masks while the step is traced: the classic mode, on one device
    and on a mesh alike (issue 57: partitionable on a mesh and classic on one device drew different
    masks, and 2 devices trained otherwise than 1). The partitionable default (JAX >= 0.5) hashes one
    counter pair per value, the classic mode one per two (per four 16-bit values): the masks of a
    `small` step on this project's 2-core CPU took ~1 s of its ~4.8 s the partitionable way
    (docs/benchmarks.md). The CPU's masks are drawn a row at a time (ops.cpu_dropout), so each device
    of a mesh draws its own rows, in either mode."""
    return jax.threefry_partitionable(False)


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process of the launch (a collective; alone: `flag`), so that
    every process stops at the same step (a time budget read from each one's own clock)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.asarray(bool(flag)))).any())


def whole(value: jax.Array) -> np.ndarray:
    """A writable NumPy copy of the whole of `value`, whichever process holds which shards
    (a collective across processes for a sharded one: every process calls it)."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)  # the raw uint32 words of the typed key
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.array(value)
    return np.array(multihost_utils.process_allgather(value, tiled=True))


def put(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`value` (whole, the same on every process) laid out as `sharding`; across processes each one
    builds only its own shards. The reverse of `whole`."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):  # typed keys travel as their raw words
        data = put(jax.random.key_data(value), NamedSharding(sharding.mesh, P()))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
