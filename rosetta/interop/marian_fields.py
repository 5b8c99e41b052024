"""Every field of a Marian `config.json` handled as transformers' `MarianMTModel` handles it
(modeling_marian.py and configuration_marian.py, read at 5.24), so that a directory never means one
model there and another here without a word:

- a field MarianMTModel reads for the function it computes is read here too (rosetta/interop/marian.py:
  config_from_marian), or refused naming it where our model cannot compute it (an activation
  outside relu, gelu, the tanh GELU and SiLU; a non-floating `dtype`, which from_pretrained refuses);
- its aliases (MarianConfig.attribute_map: `hidden_size`, `num_attention_heads`, `num_hidden_layers`)
  are read as the fields they stand for, and refused where they contradict them;
- a field it never reads (`normalize_before`, `add_bias_logits`, `static_position_embeddings`, a
  non-Marian `architectures` entry, ...) is ignored here as there, noted on stderr once per process
  when its value claims something MarianMTModel does not compute;
- training, initialization, caching, generation and metadata fields change nothing in the logits:
  read silently.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from rosetta.errors import ConfigError

# MarianConfig.attribute_map: a config.json may give these names instead of the fields.
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads",
           "num_hidden_layers": "encoder_layers"}
# Fields MarianMTModel never reads, and the value that says what it computes anyway: post-norm, no
# embedding or final norm, a logits bias (final_logits_bias), the fixed sinusoidal table, an
# encoder-decoder, every layer at training. Another value is ignored there, so here, with a note.
IGNORED: dict[str, tuple[Any, str]] = {
    "normalize_before": (False, "it computes post-norm layers, LN(x + sublayer(x))"),
    "normalize_embedding": (False, "it applies no norm to the embeddings"),
    "add_final_layer_norm": (False, "it applies no final norm"),
    "add_bias_logits": (False, "its logits bias is final_logits_bias, read as it is"),
    "static_position_embeddings": (True, "its positions are the fixed sinusoidal table"),
    "is_decoder": (False, "MarianMTModel is an encoder-decoder"),
    "is_encoder_decoder": (True, "MarianMTModel is an encoder-decoder"),
    "encoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
    "decoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
}
# Read by MarianMTModel or PreTrainedConfig without changing its logits (initialization, the KV
# cache, generation's settings -- generation_config.json's reader handles those --, metadata).
SILENT = frozenset({
    "init_std", "use_cache", "bos_token_id", "forced_eos_token_id", "forced_bos_token_id",
    "transformers_version", "_name_or_path", "id2label", "label2id", "num_labels", "bad_words_ids",
    "num_beams", "max_length",
    "min_length", "max_new_tokens", "length_penalty", "early_stopping", "no_repeat_ngram_size",
    "renormalize_logits", "extra_pos_embeddings", "classif_dropout", "classifier_dropout",
    "gradient_checkpointing", "output_past", "tokenizer_class", "task_specific_params", "prefix",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward",
    "tie_encoder_decoder", "add_cross_attention", "pruned_heads", "torchscript", "_attn_implementation",
    "model_type",
})
MARIAN_ARCHITECTURES = ("MarianMTModel", "MarianModel", "MarianForCausalLM")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_noted: set[tuple[str, str]] = set()


def resolve_fields(hf: Mapping[str, Any], read: set[str], source: str) -> dict[str, Any]:
    """`hf` with its aliases read as their fields; every other field refused, noted or passed as
    the module docstring says. `read`: the fields config_from_marian reads."""
    out = dict(hf)
    for alias, name in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ConfigError(f"{source}: {alias} {value!r} contradicts {name} {out[name]!r} "
                                  f"(MarianConfig reads {alias} as {name}); give one value")
            out[name] = value
    # torch_dtype: dtype's old name, read where dtype is absent or null (issue 57: a null dtype beside
    # torch_dtype "float16" got no note)
    dtype_key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    dtype = hf.get(dtype_key)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConfigError(f"{source}: {dtype_key} {dtype!r} is not a floating-point type (from_pretrained "
                          f"refuses it too); give one of {', '.join(FLOAT_DTYPES)}")
    notes = []
    for key, value in hf.items():
        if key in IGNORED and value != IGNORED[key][0]:
            why = IGNORED[key][1]
            notes.append((key, f"{key} {_json(value)} is ignored, as MarianMTModel ignores it ({why})"))
    architectures = hf.get("architectures")
    architectures = [architectures] if isinstance(architectures, str) else architectures  # one name
    if isinstance(architectures, list) and any(a not in MARIAN_ARCHITECTURES for a in architectures):
        notes.append(("architectures", f"architectures {_json(architectures)} is ignored, as MarianMTModel "
                                       f"ignores it (model_type marian decides)"))
    unknown = sorted(k for k in hf if k not in read and k not in ALIASES and k not in IGNORED
                     and k not in SILENT and k not in ("architectures", "dtype", "torch_dtype"))
    if unknown:
        notes.append((" ".join(unknown), f"{', '.join(unknown)}: not fields of MarianConfig; ignored, as "
                                         f"MarianMTModel ignores them"))
    for key, line in notes:
        if (source, key) not in _noted:
            _noted.add((source, key))
            print(f"rosetta: note: {source}: {line}", file=sys.stderr)
    if dtype in ("float16", "bfloat16") and (source, dtype_key) not in _noted:
        _noted.add((source, dtype_key))
        print(f"rosetta: note: {source}: {dtype_key} {dtype}: transformers computes in it; rosetta computes "
              f"in the dtype you choose (--dtype, float32 by default)", file=sys.stderr)
    return out


def _json(value: Any) -> str:
    return "true" if value is True else "false" if value is False else repr(value)
