"""The NumPy reference behind the common backend interface (rosetta.backends)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from numpy_ref import decode, model
from rosetta.backends import BackendModel
from rosetta.generation import NO_CONSTRAINTS, Constraints
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

    def _stages(self, src: np.ndarray, tgt: np.ndarray, fine: bool = False) -> dict[str, np.ndarray]:
        stages: dict[str, np.ndarray] = {}
        model.forward(self.params, self.config, src, tgt, stages, fine)
        return stages

    def _generate(self, src: np.ndarray, beam_size: int, alpha: float, max_len_margin: int,
                  length_rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS) -> decode.Generation:
        if beam_size == 1:
            return decode.greedy_search(self.params, self.config, src, max_len_margin, constraints)
        return decode.beam_search(self.params, self.config, src, beam_size, alpha, max_len_margin,
                                  rule=length_rule, constraints=constraints)

    def _step_logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        # The plain way: position t from the whole prefix tgt[:, :t+1], recomputed each time.
        memory = model.encode(self.params, self.config, src)
        return np.concatenate([
            model.generator(self.params, self.config,
                            model.decode(self.params, self.config, tgt[:, : t + 1], memory, src)[:, -1:])
            for t in range(tgt.shape[1])], axis=1)
