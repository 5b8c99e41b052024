"""The original implementation as a side of `rosetta diff`: Hugging Face's own `MarianMTModel`,
run once with forward hooks that capture its stages under our names (docs/diff.md, "Against the
original").

    model = load_marian_model("opus-mt-de-en/")               # float32, eager attention, eval mode
    stages = marian_stages(model, src, tgt)                    # {"src_embed": ..., "logits": ...}

Which hook gives which stage (transformers/models/marian/modeling_marian.py, checked against 5.23;
`layers` are `model.model.encoder.layers` or `model.model.decoder.layers`):

| our stage | hook |
| --- | --- |
| `src_embed`, `tgt_embed` | pre-hook of `layers[0]`: its input, E[x]·√d + PE (dropout: none in eval) |
| `….layers.{i}.self_attn` (`.weights`) | `layers[i].self_attn`: the o projection's output (the softmax) |
| `decoder.layers.{i}.cross_attn` (`.weights`) | `layers[i].encoder_attn` |
| `….layers.{i}.ffn` | `layers[i].fc2`: the second linear's output, before dropout and the residual add |
| `….layers.{i}` | `layers[i]`: the layer's output |
| `encoder`, `decoder` | the stacks' outputs (Marian has no final norm) |
| `logits` | the model's own output, `lm_head(·) + final_logits_bias` |

Only attention computed "eager" returns its probabilities (fused kernels return None), so the
model runs eager for the pass. transformers and torch are imported only when a model is used.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.diff.shared.dump import stage_order
from rosetta.errors import CheckpointError, ConfigError, InputError, RosettaError
from rosetta.inputs import check_ids

BACKEND = "transformers"  # the name a `rosetta diff` side spec gives it: DIR@transformers
DTYPE = "float32"  # what load_marian_model computes in; the diff tolerance follows it
INSTALL_HINT = "pip install transformers"


def _import() -> tuple[Any, Any]:
    """(torch, transformers), or one line saying what to install."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RosettaError(f"@{BACKEND} runs Hugging Face's MarianMTModel, which needs {e.name}, not "
                           f"installed here: {INSTALL_HINT}") from None
    return torch, transformers


@contextlib.contextmanager
def _quiet_progress_bars(transformers: Any) -> Iterator[None]:
    """from_pretrained draws a progress bar on stderr; hide it for the load only."""
    logging = transformers.utils.logging
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


# The Hugging Face classes @transformers runs, by rosetta.interop.convert.detect_format's name. M2M100's
# modules carry Marian's names (layers, self_attn, encoder_attn, fc2), so one set of hooks serves both;
# its stacks' outputs are after their final LayerNorm, as our `encoder` and `decoder` stages are.
MODEL_CLASSES = {"marian": "MarianMTModel", "m2m100": "M2M100ForConditionalGeneration"}


def load_marian_model(directory: str | os.PathLike) -> Any:
    """Hugging Face's `MarianMTModel` of a Marian directory (`M2M100ForConditionalGeneration` of an
    M2M100 one), in float32 with eager attention, in eval mode; a RosettaError in one line when
    transformers or torch is missing or `directory` is neither."""
    from rosetta.interop.convert import detect_format

    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"{directory}: no such file or directory")
    kind = detect_format(path) if path.is_dir() else None  # detect_format names a broken config.json
    if kind not in MODEL_CLASSES:
        raise ConfigError(f"{directory}: @{BACKEND} runs a Hugging Face Marian directory (config.json with "
                          f"model_type 'marian' and its weights) or an M2M100 one ('m2m_100'), and this is "
                          f"not one")
    torch, transformers = _import()
    name = MODEL_CLASSES[kind]
    try:
        with _quiet_progress_bars(transformers):
            model = getattr(transformers, name).from_pretrained(path, dtype=torch.float32,
                                                                attn_implementation="eager")
    except (OSError, ValueError, RuntimeError) as e:  # weights missing, unreadable or misshapen
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{directory}: transformers cannot load it as a {name}: {first_line}") from None
    return model.eval()


def _numpy(tensor: Any) -> np.ndarray:
    """A captured tensor as a NumPy array at the dtype computed (bfloat16, which NumPy lacks, as
    float32: exact)."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _hooks(model: Any, stages: dict[str, np.ndarray]) -> list[tuple[Any, str, Callable]]:
    """(module, "forward" or "pre", hook) for every stage of the fine table but the logits."""
    def output(name: str, index: int | None = None) -> Callable:
        def hook(module, args, out):
            # Attention returns (output, weights); a stack returns a ModelOutput, first field the states.
            stages[name] = _numpy(out if index is None else out[index])
        return hook

    def layer_input(name: str) -> Callable:
        def hook(module, args, kwargs):
            stages[name] = _numpy(args[0] if args else kwargs["hidden_states"])
        return hook

    hooks = []
    for stack, embed in (("encoder", "src_embed"), ("decoder", "tgt_embed")):
        module = getattr(model.model, stack)
        hooks.append((module, "forward", output(stack, 0)))
        # The first layer's input is the embedding stage; with no layers the stack's output is
        # the same tensor, Marian having no final norm (PITFALLS 3).
        hooks.append((module.layers[0], "pre", layer_input(embed)) if len(module.layers)
                     else (module, "forward", output(embed, 0)))
        attention = {"self_attn": "self_attn", "encoder_attn": "cross_attn"}
        for i, layer in enumerate(module.layers):
            ours = f"{stack}.layers.{i}"
            hooks += [(layer, "forward", output(ours)), (layer.fc2, "forward", output(f"{ours}.ffn"))]
            for theirs, sublayer in attention.items():
                if hasattr(layer, theirs):
                    hooks += [(getattr(layer, theirs), "forward", output(f"{ours}.{sublayer}", 0)),
                              (getattr(layer, theirs), "forward", output(f"{ours}.{sublayer}.weights", 1))]
    return hooks


def marian_stages(model_or_dir: Any, src: np.ndarray, tgt: np.ndarray) -> dict[str, np.ndarray]:
    """Every stage of the fine table (docs/diff.md) of one forward pass of Hugging Face's
    `MarianMTModel` (or of the directory's, loaded with load_marian_model) on source ids [B, S]
    and decoder input ids [B, T], at the dtype the model computes in, in forward order.

    The masks are our contract's (SPEC §2): source keys that are not `pad_token_id`; causal
    decoder self-attention over target keys that are not `pad_token_id`, position 0 (the start
    token, `pad_token_id` in opus-mt: PITFALLS 12) always a key. The model runs in eval mode with
    eager attention; its mode, attention implementation and hooks are restored afterwards."""
    torch, _ = _import()
    model = load_marian_model(model_or_dir) if isinstance(model_or_dir, (str, os.PathLike)) else model_or_dir
    cfg = model.config
    src_vocab = model.model.encoder.embed_tokens.num_embeddings
    tgt_vocab = model.model.decoder.embed_tokens.num_embeddings
    src = check_ids(src, src_vocab, cfg.max_position_embeddings, "src")
    tgt = check_ids(tgt, tgt_vocab, cfg.max_position_embeddings, "tgt")
    if src.shape[0] != tgt.shape[0]:
        raise InputError(f"src has batch size {src.shape[0]} but tgt has {tgt.shape[0]}")
    tgt_keys = tgt != cfg.pad_token_id
    tgt_keys[:, 0] = True
    inputs = {"input_ids": src, "attention_mask": src != cfg.pad_token_id, "decoder_input_ids": tgt,
              "decoder_attention_mask": tgt_keys}
    inputs = {k: torch.as_tensor(v.astype(np.int64), device=model.device) for k, v in inputs.items()}

    stages: dict[str, np.ndarray] = {}
    handles = []
    training, attention = model.training, cfg._attn_implementation
    try:
        model.eval()
        if attention != "eager":
            model.set_attn_implementation("eager")
        for module, kind, hook in _hooks(model, stages):
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True) if kind == "pre"
                           else module.register_forward_hook(hook))
        with torch.no_grad():
            out = model(**inputs, use_cache=False)
        stages["logits"] = _numpy(out.logits)
    finally:
        for handle in handles:
            handle.remove()
        if attention != "eager":
            model.set_attn_implementation(attention)
        model.train(training)
    return dict(sorted(stages.items(), key=lambda item: stage_order(item[0])))
