"""Fault injection for the tests of rank failure (parity_tests/test_distributed.py), kept out of the
harness: a test puts this folder first on PYTHONPATH, so that every Python process it starts, the
processes torchrun launches included, imports this module at start-up. With ROSETTA_TEST_KILL_AT
set to "RANK:STEP", the process of that rank kills itself with SIGKILL right after dispatching that
step (rosetta/harness/stepping.py), as a crashed or OOM-killed worker dies: before that step's
checkpoint is written. Without the variable it does nothing."""

import os

if os.environ.get("ROSETTA_TEST_KILL_AT"):
    import signal

    from rosetta.distributed import launch_env
    from rosetta.harness import stepping

    _step = stepping.Stepper.step

    def _step_then_die(self, *args, **kwargs):
        stepped = _step(self, *args, **kwargs)
        if os.environ["ROSETTA_TEST_KILL_AT"] == f"{launch_env().rank}:{stepped.metrics['step']}":
            os.kill(os.getpid(), signal.SIGKILL)
        return stepped

    stepping.Stepper.step = _step_then_die
