"""Named training recipes: `rosetta train --recipe NAME` starts from these settings (RunConfig
fields); any flag given on the command line overrides its recipe value. docs/training.md lists
them with what each was measured to reach.

multi30k: Multi30k task 1 (de→en by default; `--pair en-de`, `de-fr` the same), the `small`
preset (3 + 3 layers, d_model 256, 4 heads, d_ff 1024: the size of the small models published for
this corpus) on a joint 8,000-token BPE vocabulary, 4,096-token batches (about 300 sentence pairs),
the paper's schedule (eq. 3) shortened to this corpus (800 warm-up steps; factor 0.5 puts the peak
at 1.1e-3), dropout 0.1 and label smoothing 0.1 (§5.4), 30 epochs, evaluation every 500 steps with
beam 4 and α 0.6 (§6.1), checkpoints every 500 steps, the last 5 kept for averaging (§6.1).
"""

from __future__ import annotations

from typing import Any

from rosetta.errors import RosettaError

RECIPES: dict[str, dict[str, Any]] = {
    "multi30k": dict(
        task="multi30k", pair="de-en", preset="small", overrides={"dropout": 0.1}, vocab_size=8000,
        max_tokens=4096, warmup=800, lr_factor=0.5, label_smoothing=0.1, epochs=30, eval_every=500,
        beam=4, alpha=0.6, checkpoint_every=500, keep=5, average_last=5,
    ),
}


def recipe(name: str) -> dict[str, Any]:
    """The settings of recipe `name` (a copy)."""
    if name not in RECIPES:
        raise RosettaError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return {key: dict(value) if isinstance(value, dict) else value for key, value in RECIPES[name].items()}
