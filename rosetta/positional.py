"""The sinusoidal positional tables of SPEC §2 (paper §3.5), shared by every backend.

One float64 NumPy function: each backend casts the table it needs, so the three agree on
every position (PITFALLS 1 lists the three conventions).
"""

from __future__ import annotations

import numpy as np


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
