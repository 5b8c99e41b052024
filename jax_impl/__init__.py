"""JAX/Flax NNX implementation (see jax_impl/model.py)."""
