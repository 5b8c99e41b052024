"""The peer: torch.nn.Transformer as our model, trained by our torch recipe (see peer_impl/model.py)."""
