"""The training diff: two training loops' traces compared step by step, the part of the first step
that differs, and the loop mistake that explains it (docs/training_diff.md)."""
