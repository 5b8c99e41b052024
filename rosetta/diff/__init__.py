"""rosetta diff: where two implementations part, and the mistake that explains it. Two tools over
one shared base, each with its own page:

    shared/    what both compare: one forward pass's stages (the dump format, capturing them from
               your own model, the metrics and the table, the catalogue of porting mistakes that
               explains a forward difference, the pictures)
    forward/   two models (or dumps) on one batch, stage by stage: docs/diff.md, docs/diagnose.md
    training/  two training runs' traces, step by step, and the loop mistake between them:
               docs/training_diff.md

forward/ and training/ never import each other; commands.py, the one `rosetta diff` command,
hands an invocation to one of them."""
