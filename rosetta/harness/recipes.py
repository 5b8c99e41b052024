"""Named training recipes: `rosetta train --recipe NAME` starts from these settings (RunConfig
fields); any flag given on the command line overrides its recipe value. docs/training.md lists
them with what each was measured to reach.

multi30k: Multi30k task 1 (de→en by default; `--pair en-de`, `de-fr` the same), the `small`
preset (3 + 3 layers, d_model 256, 4 heads, d_ff 1024: the size of the small models published for
this corpus) on a joint 8,000-token BPE vocabulary, 2,048-token batches (about 150 sentence pairs:
more updates per CPU minute than the paper's 25k-token batches, which this corpus of 29k pairs
would turn into ~15 updates per epoch), the paper's schedule (eq. 3) shortened to this corpus
(300 warm-up steps; factor 0.5 puts the peak at 1.8e-3), dropout 0.1 and label smoothing 0.1
(§5.4), at most 30 epochs, evaluation every 300 steps (about one epoch: 289 batches) with beam 4
and α 0.6 (§6.1), checkpoints every 25 steps and the last 5 averaged at the end (§6.1 averages
the last 5, written 10 minutes apart; over a 25-minute CPU run the model still improves fast, and
the first measured run, averaging 3 checkpoints 100 steps apart, lost to its last checkpoint).
These are first choices, not a sweep: docs/training.md records what each measured run gave.
"""

from __future__ import annotations

from typing import Any

from rosetta.errors import RosettaError

RECIPES: dict[str, dict[str, Any]] = {
    "multi30k": dict(
        task="multi30k", pair="de-en", preset="small", overrides={"dropout": 0.1}, vocab_size=8000,
        max_tokens=2048, warmup=300, lr_factor=0.5, label_smoothing=0.1, epochs=30, eval_every=300,
        beam=4, alpha=0.6, checkpoint_every=25, keep=5, average_last=5,
    ),
}


def recipe(name: str) -> dict[str, Any]:
    """The settings of recipe `name` (a copy)."""
    if name not in RECIPES:
        raise RosettaError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return {key: dict(value) if isinstance(value, dict) else value for key, value in RECIPES[name].items()}
