"""Converters between the canonical checkpoint (SPEC §3) and other implementations' weights:
`from rosetta.interop.convert import convert, read_model` (any format to any).

Each converter is one module with its mapping table at the top: nn_transformer.py
(`torch.nn.Transformer` modules -> canonical), marian.py (Hugging Face `MarianMTModel`
directories, both directions), flax_wmt.py (the parameter tree of Flax's `examples/wmt`, both
directions), fsmt.py (Hugging Face `FSMTForConditionalGeneration` directories, both
directions), m2m100.py (Hugging Face `M2M100ForConditionalGeneration` directories: M2M100 and
NLLB-200, both directions). Converters read and write the contract (`rosetta.config`, `rosetta.params`,
`rosetta.checkpoint`) and never import the harness; marian.py, fsmt.py, m2m100.py and flax_wmt.py need neither
torch nor jax.
"""
