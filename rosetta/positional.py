"""The sinusoidal positional tables of SPEC §2 (paper §3.5), shared by every backend.

One float64 NumPy function: each backend casts the table it needs, so the three agree on
every position (PITFALLS 1 lists the three conventions).
"""

from __future__ import annotations

import numpy as np

from rosetta.config import ModelConfig


def positional_encoding(kind: str, length: int, d_model: int, offset: int = 0) -> np.ndarray:
    """Sinusoidal table [length, d] for positions offset..offset+length-1 (paper §3.5).

    Computed in float64 here and cast by every backend: float32 sin(p*w) would lose about
    p * 6e-8 absolute at position p. Three conventions in the wild (PITFALLS 1).
    """
    pos = np.arange(offset, offset + length, dtype=np.float64)[:, None]
    i = np.arange(d_model // 2, dtype=np.float64)[None, :]
    if kind == "sinusoidal_concat_t2t":  # tensor2tensor / Flax example / fairseq frequencies
        freq = 10000.0 ** (-i / max(d_model // 2 - 1, 1))
    else:  # the paper's frequencies 1 / 10000^(2i/d)
        freq = 10000.0 ** (-2.0 * i / d_model)
    angles = pos * freq
    table = np.empty((length, d_model))
    if kind == "sinusoidal_interleaved":  # PE[p, 2i] = sin, PE[p, 2i+1] = cos (paper)
        table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    else:  # all sines, then all cosines (Marian, tensor2tensor)
        table[:, : d_model // 2], table[:, d_model // 2 :] = np.sin(angles), np.cos(angles)
    return table


# A model's table covers the first min(max_len, POSITION_ROWS) positions when the model is built,
# and longer ones only once a longer sequence runs: its size follows the sequences actually run,
# not the config's max_len, which comes from a possibly hostile file (10^8 positions would take
# gigabytes). torch_impl grows its buffer (grown_rows); jax_impl builds a longer table at trace
# time, a constant of that compiled shape (state cannot grow inside jit). numpy_ref builds each
# table at the length it needs.
POSITION_ROWS = 1024


def model_table(cfg: ModelConfig, rows: int | None = None) -> np.ndarray:
    """The table a model holds: its first `rows` positions, min(max_len, POSITION_ROWS) if None
    (when the model is built), in float64; each backend casts it once to its parameters' type.
    Row r is PE[r + position_offset] (SPEC §2), so position t, in training and at decoding step t
    alike, reads row t and every caller stays unaware of the offset (fairseq: pad_id + 1)."""
    rows = min(cfg.max_len, POSITION_ROWS) if rows is None else rows
    return positional_encoding(cfg.positional_encoding, rows, cfg.d_model, cfg.position_offset)


def grown_rows(rows: int, built: int, max_len: int) -> int:
    """The rows of a table replacing one of `built` rows for a sequence needing `rows` > `built`:
    at least `rows`, and double the old table (at most max_len), so that lengths growing one at a
    time rebuild it a logarithmic number of times."""
    return max(rows, min(2 * built, max_len))
