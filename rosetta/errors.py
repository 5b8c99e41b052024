"""The project's exceptions. Each message names the field, tensor or argument at fault."""


class RosettaError(ValueError):
    """Base class: bad input that the user can fix."""


class ConfigError(RosettaError):
    """An unknown, missing, mistyped or inconsistent configuration field."""


class CheckpointError(RosettaError):
    """A checkpoint file that is missing, corrupt, or does not match its config."""


class InputError(RosettaError):
    """Token ids the model cannot take: wrong type, shape, range or length."""


class TokenizerError(RosettaError):
    """A tokenizer file or argument that cannot be used (rosetta/tokenizer.py)."""
