"""The NumPy reference behind the common backend interface (rosetta.backends)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from numpy_ref import model
from rosetta.backends import BackendModel
from rosetta.params import Params


class Model(BackendModel):
    name = "numpy"
    dtypes = ("float64", "float32")  # float64 is the reference; float32 shows rounding alone

    def _build(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = {k: np.asarray(v, dtype=np.float64).astype(self.dtype) for k, v in params.items()}

    def to_params(self) -> Params:
        return {k: v.copy() for k, v in self.params.items()}

    def _encode(self, src: np.ndarray) -> np.ndarray:
        return model.encode(self.params, self.config, src)

    def _decode(self, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray) -> np.ndarray:
        return model.decode(self.params, self.config, tgt, memory.astype(self.dtype), src)

    def _logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        return model.forward(self.params, self.config, src, tgt)

    def _stages(self, src: np.ndarray, tgt: np.ndarray) -> dict[str, np.ndarray]:
        stages: dict[str, np.ndarray] = {}
        model.forward(self.params, self.config, src, tgt, stages)
        return stages
