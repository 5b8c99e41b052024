"""rosetta-transformer: one encoder-decoder Transformer, three backends, one checkpoint format.

The shared package holds what every backend uses: the config, the canonical parameter
names and initializer, checkpoint I/O, input checks and the backend registry. It imports nothing
of the tools built on it: models in other formats are rosetta/interop's
(`from rosetta.interop.convert import convert, read_model`).
"""

from rosetta.backends import available_backends, from_params, get_backend, load
from rosetta.checkpoint import load_checkpoint, save_checkpoint
from rosetta.config import PRESETS, ModelConfig, preset
from rosetta.errors import CheckpointError, ConfigError, InputError, RosettaError
from rosetta.params import init_params, param_count, param_shapes

__all__ = [
    "PRESETS", "CheckpointError", "ConfigError", "InputError", "ModelConfig", "RosettaError",
    "available_backends", "from_params", "get_backend", "init_params", "load",
    "load_checkpoint", "param_count", "param_shapes", "preset", "save_checkpoint",
]
