"""Checks of `rosetta train`'s settings that need the backends (rosetta/harness/run_config.py's
check_run needs none): each is made before the output directory is touched or data is read, for
every use the run will make of the setting, so that nothing fails after training has begun.
Imports the frameworks, as training would.
"""

from __future__ import annotations

from rosetta.backends import BACKENDS, get_backend, get_trainer
from rosetta.distributed import LaunchEnv
from rosetta.errors import RosettaError
from rosetta.harness.run_config import RunConfig


def check_backends(run: RunConfig, env: LaunchEnv) -> None:
    """Every backend of `run` is installed, trains in --dtype, decodes in it at evaluation (its
    decoder backend's model: BLEU during training and of the averaged checkpoints), and has --device."""
    for backend in run.backends:
        trainer = get_trainer(backend)  # installed, or one line saying so
        if run.dtype not in trainer.dtypes:
            raise RosettaError(f"--dtype {run.dtype}: backend {backend!r} trains in "
                               f"{', '.join(trainer.dtypes)}")
        decoder = BACKENDS[backend].decoder
        model = get_backend(decoder)
        if run.dtype not in model.dtypes:
            raise RosettaError(f"--dtype {run.dtype}: backend {backend!r} trains in it but its evaluation "
                               f"decodes with backend {decoder!r}, which offers {', '.join(model.dtypes)}")
    _check_device(run, env)


def _check_device(run: RunConfig, env: LaunchEnv) -> None:
    """Refuse a --device this machine lacks before `out` is touched (each trainer checks it again
    when it is built). Imports the frameworks, as training would."""
    if run.device is None:
        return
    for backend in run.backends:
        get_trainer(backend)  # installed, or one line saying so
        # Each framework's own parser of the device name, the one its Trainer calls.
        try:
            if BACKENDS[backend].framework == "torch":
                from torch_impl.distributed import local_device as torch_device

                torch_device(run.device, env)
            elif not env.distributed:  # JAX's backends start after jax.distributed joins (init_distributed)
                from jax_impl.distributed import local_device as jax_device

                jax_device(run.device)
        except RosettaError as e:
            raise RosettaError(f"--device {run.device}: {e}") from None
