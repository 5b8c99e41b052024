"""What both diff tools build on: one forward pass's stages, their file, metrics, explanations and
pictures (rosetta/diff/__init__.py)."""
