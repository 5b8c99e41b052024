"""The training harness: one loop that trains the PyTorch and the JAX backend on the same data
with the same schedule, and reports them side by side.

Layers: the contract (`rosetta`: config, params, checkpoint, backends, training recipe) <- the
backends (`numpy_ref`, `torch_impl`, `jax_impl`) <- this harness <- `benchmarks`. Nothing in the
contract or the backends imports from here.

data.py (Multi30k and synthetic tasks), tokenizer.py (BPE), batching.py (token-budget batches),
tasks.py (a task's pairs and tokenizer), loop.py (the run: `RunConfig`, `train`), run_dir.py
(step-N checkpoint directories), trainer_state.py (optimizer state files), metrics.py (MFU of
real tokens), report.py (log, summary, plot), translate.py (`rosetta translate`).
"""
