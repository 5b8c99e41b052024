"""The float64 NumPy reference: forward pass and decoding only; the executable spec.

model.py is the model, decode.py the searches, backend.py the common interface."""
