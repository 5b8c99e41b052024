"""Checks of `rosetta train`'s settings that need the backends (rosetta/harness/run_config.py's
check_run needs none): each is made before the output directory is touched or data is read, for
every use the run will make of the setting, so that nothing fails after training has begun.
Imports the frameworks, as training would.
"""

from __future__ import annotations

from pathlib import Path

from rosetta.backends import BACKENDS, get_backend, get_trainer
from rosetta.distributed import LaunchEnv
from rosetta.errors import RosettaError
from rosetta.harness.run_config import RunConfig


def check_launch(run: RunConfig, env: LaunchEnv) -> None:
    """--nproc against the launch this process is part of, and --out (a file; --resume of nothing)."""
    if run.nproc > 1 and run.nproc != env.num_processes:
        raise RosettaError(f"--nproc {run.nproc}: this is process {env.rank} of {env.num_processes}; --nproc "
                           "launches its processes from the command line (rosetta train --nproc N) or give "
                           "none under torchrun")
    out = Path(run.out)
    if out.exists() and not out.is_dir():
        raise RosettaError(f"--out {out} is a file, not a directory")
    if run.resume and not out.is_dir():
        raise RosettaError(f"--resume: {out} holds no run to resume (no such directory)")


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
    """Refuse a --device this machine lacks before `out` is touched: each trainer's check of the name
    (`Trainer.resolve_device`, the one its constructor makes: rosetta/device.py's parser against the
    devices its framework sees), reached through the registry. Its evaluation decodes there too."""
    if run.device is None:
        return
    for backend in run.backends:
        get_trainer(backend).resolve_device(run.device, env)  # one line naming --device
