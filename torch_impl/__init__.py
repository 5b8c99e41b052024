"""PyTorch implementation (see torch_impl/model.py)."""
