"""The float64 NumPy reference: forward pass and decoding only; the executable spec."""

from numpy_ref.backend import Model

__all__ = ["Model"]
