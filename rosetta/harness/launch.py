"""`rosetta train --nproc N`: the same command relaunched as N processes by `torchrun` (PyTorch's
own launcher, `python -m torch.distributed.run`) on this machine. Each process reads its place
from torchrun's environment (rosetta.distributed.launch_env); the PyTorch trainer joins a process
group, the JAX trainer `jax.distributed`. Several machines: run torchrun yourself on each
(docs/distributed.md).

torchrun watches its processes: when one dies or fails, it stops the others and reports the
failed rank (its "root cause" block); the command then ends with exit code 2 and a line naming it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence

from rosetta.errors import RosettaError


def without_nproc(argv: Sequence[str]) -> list[str]:
    """`argv` less its `--nproc N` / `--nproc=N`: the launched processes are the N (and torchrun's
    own parser would take `--nproc` for its `--nproc-per-node`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_command(argv: Sequence[str], nproc: int) -> list[str]:
    """The torchrun command line that runs `rosetta <argv>` as `nproc` processes here
    (`--standalone`: a rendezvous on a free local port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rosetta.cli", *without_nproc(argv)]


def launch(argv: Sequence[str], nproc: int) -> None:
    """Run `rosetta <argv>` as `nproc` processes and wait for them; a failure is one RosettaError."""
    if importlib.util.find_spec("torch") is None:
        raise RosettaError("--nproc launches its processes with torchrun, which comes with PyTorch: "
                           "pip install 'rosetta-transformer[torch]'")
    code = subprocess.run(torchrun_command(argv, nproc), check=False).returncode
    if code != 0:
        raise RosettaError(f"the launch of {nproc} processes failed (exit code {code}): torchrun's report "
                           "above names the failed rank and its error; every other process was stopped")
