"""The forward diff: two implementations of one model run on one batch and compared stage by
stage (docs/diff.md); `--diagnose` explains the difference with the shared catalogue."""
