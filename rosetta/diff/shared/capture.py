"""Stages from your own model: one forward pass, the outputs of the submodules you name.

    stages = capture_torch(module, src, tgt, {"encoder.layers.0": "transformer.encoder.layers.0", ...})
    stages = capture_nnx(model, src, tgt, {"encoder.layers.0": "encoder.blocks.0", ...})
    write_dump("mine.npz", src, tgt, stages)  # rosetta.diff.shared.dump, then `rosetta diff mine.npz ...`

The name map takes our stage names (rosetta.diff.shared.dump.STAGE_PATTERNS) to dotted submodule paths
of your model (`get_submodule`'s for PyTorch; attribute names and list indices for Flax NNX). A
stage's value is the submodule's output in that forward pass:
- `PATH#N`: the output of its call N (from 0) when the module runs more than once, such as one
  dropout module applied to both embeddings (`dropout#0`, `dropout#1`); plain `PATH` is call 0;
- a tuple output (an attention module's `(output, weights)`) gives its element 0, or element 1
  for a `.weights` stage; a `torch.nn.MultiheadAttention` named for a `.weights` stage is asked
  for per-head weights (`need_weights=True, average_attn_weights=False`) by a forward pre-hook;
- an output with a `logits` attribute (a Hugging Face model's `Seq2SeqLMOutput`) gives it for the
  `logits` stage: `{"logits": ""}` on a `MarianMTModel` is `lm_head(·) + final_logits_bias`;
- NNX only: PATH may end in a method name of the module there (`embed#1`: the second call of the
  root module's `embed`).
Values come back as NumPy arrays of the dtype computed (the dump's dtype sets `rosetta diff`'s
tolerance); bfloat16 comes back as float32, NumPy having no bfloat16. docs/diff.md has recipes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from rosetta.diff.shared.dump import stage_kind, stage_order
from rosetta.errors import InputError

NameMap = Mapping[str, str]
_TARGET = re.compile(r"(?P<path>[^#]*)(#(?P<call>\d+))?")


def _parse(name_map: NameMap) -> dict[str, tuple[str, int]]:
    """stage -> (path, call); an unknown stage name or a malformed target is an InputError."""
    out = {}
    for stage, target in name_map.items():
        if stage_kind(stage) is None:
            raise InputError(f"name map: {stage!r} is not a stage name (those of BackendModel.stages(src, "
                             f"tgt, fine=True), e.g. 'encoder.layers.0.self_attn'; docs/diff.md)")
        m = _TARGET.fullmatch(target) if isinstance(target, str) else None
        if m is None:
            raise InputError(f"name map: stage {stage!r}: {target!r} is not a submodule path "
                             f"('a.b.0' or 'a.b.0#N' for its call N)")
        out[stage] = (m["path"], int(m["call"] or 0))
    return out


def _pick(stage: str, target: str, outputs: list, call: int) -> Any:
    """The stage's value among one module's recorded outputs (see the module docstring)."""
    if call >= len(outputs):
        ran = f"ran {len(outputs)} time{'' if len(outputs) == 1 else 's'}"
        hint = " (a fused fast path may skip submodules: see docs/diff.md)" if not outputs else ""
        raise InputError(f"name map: stage {stage!r}: {target!r} {ran} in the forward pass, "
                         f"no call {call}{hint}")
    out = outputs[call]
    if stage == "logits" and hasattr(out, "logits"):  # a model's own output object (transformers'
        return out.logits  # Seq2SeqLMOutput): Marian's logits only exist there, final_logits_bias added
    if isinstance(out, tuple | list):
        index = 1 if stage.endswith(".weights") else 0
        if len(out) <= index or out[index] is None:
            raise InputError(f"name map: stage {stage!r}: {target!r} returned no element {index}")
        out = out[index]
    return out


def _ordered(stages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(sorted(stages.items(), key=lambda item: stage_order(item[0])))


# -- PyTorch: forward hooks ------------------------------------------------------------------

def capture_torch(module: Any, src: Any, tgt: Any, name_map: NameMap,
                  run: Callable[[Any, Any, Any], Any] | None = None) -> dict[str, np.ndarray]:
    """The stages of a torch.nn.Module's forward pass on (src, tgt), by forward hooks on the
    submodules `name_map` names (module docstring). `run(module, src, tgt)` runs it (default:
    `module(src, tgt)`, the ids as int64 tensors on the module's device). The module runs in eval
    mode (restored after) with grad mode on: without grad, nn.TransformerEncoderLayer's inference
    fast path runs fused and skips its submodules' hooks. Every hook is removed afterwards."""
    import torch

    parsed = _parse(name_map)
    modules: dict[str, Any] = {}
    for stage, (path, _) in parsed.items():
        try:
            modules[path] = module.get_submodule(path)
        except AttributeError as e:
            raise InputError(f"name map: stage {stage!r}: {path!r} is not a submodule of the "
                             f"{type(module).__name__} ({e})") from None
    weights = {parsed[s][0] for s in parsed if s.endswith(".weights")}
    outputs: dict[str, list] = {path: [] for path in modules}
    handles = []

    def keep(path: str):
        return lambda _module, _args, output: outputs[path].append(output)

    def want_weights(_module, args, kwargs):
        return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

    device = next(module.parameters(), torch.zeros(())).device
    src_t, tgt_t = (torch.as_tensor(np.asarray(x), dtype=torch.int64, device=device) for x in (src, tgt))
    modes = {sub: sub.training for sub in module.modules()}
    try:
        for path, sub in modules.items():
            if path in weights and isinstance(sub, torch.nn.MultiheadAttention):
                handles.append(sub.register_forward_pre_hook(want_weights, with_kwargs=True))
            handles.append(sub.register_forward_hook(keep(path)))
        module.eval()
        with torch.enable_grad():
            (run or (lambda m, s, t: m(s, t)))(module, src_t, tgt_t)
    finally:
        for handle in handles:
            handle.remove()
        for sub, mode in modes.items():
            sub.training = mode
    stages = {}
    for stage, (path, call) in parsed.items():
        value = _pick(stage, name_map[stage], outputs[path], call)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"name map: stage {stage!r}: {name_map[stage]!r} returned "
                             f"{type(value).__name__}, not a tensor")
        value = value.detach().cpu()
        stages[stage] = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return _ordered(stages)


# -- Flax NNX: the named modules' methods, wrapped for one call --------------------------------

def _resolve_nnx(model: Any, stage: str, path: str) -> tuple[Any, str]:
    """(module, method name) that `path` names: a submodule (its __call__) or a method of one."""
    from flax import nnx

    obj, parts = model, path.split(".") if path else []
    for i, part in enumerate(parts):
        parent = obj
        if part.isdigit() and not hasattr(obj, part):  # an nnx.List (or list) of layers
            try:
                obj = obj[int(part)]
            except (IndexError, KeyError, TypeError):
                obj = None
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            where = ".".join(parts[:i]) or "the model"
            raise InputError(f"name map: stage {stage!r}: {path!r} does not exist ({where} has no {part!r})")
        if isinstance(parent, nnx.Module) and getattr(obj, "__self__", None) is parent:  # a bound method
            if i != len(parts) - 1:
                where = ".".join(parts[:i + 1])
                raise InputError(f"name map: stage {stage!r}: {path!r}: {where} is a method, not a module")
            return parent, part
    if not isinstance(obj, nnx.Module) or not callable(obj):
        raise InputError(f"name map: stage {stage!r}: {path!r} is a {type(obj).__name__}, not a callable "
                         f"NNX module or method")
    return obj, "__call__"


def _recorder(cls: type, name: str, outputs: dict) -> Callable:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # Only the named instances, and only at their own class: a subclass's super().__call__()
        # (or a subclass inheriting this wrapper) must not record the same call twice.
        if type(self) is cls and (id(self), name) in outputs:
            outputs[id(self), name].append(out)
        return out
    return wrapper


@contextmanager
def _recording(targets: Mapping[tuple[int, str], tuple[Any, str]]) -> Iterator[dict[tuple[int, str], list]]:
    """For the duration, each (module, method) of `targets` (keyed by (id(module), method)) appends
    its outputs to a list. NNX modules have no hooks, and nnx.capture(method_outputs=...) records
    only methods a class defines itself, so the method is wrapped on the module's class (every
    instance of it runs the wrapper; only the named ones record) and put back afterwards."""
    outputs: dict[tuple[int, str], list] = {key: [] for key in targets}
    saved = []
    try:
        for cls, name in dict.fromkeys((type(module), method) for module, method in targets.values()):
            saved.append((cls, name, cls.__dict__.get(name)))
            setattr(cls, name, _recorder(cls, name, outputs))
        yield outputs
    finally:
        for cls, name, own in reversed(saved):
            if own is None:
                delattr(cls, name)  # the method was inherited: the parent's shows through again
            else:
                setattr(cls, name, own)


def capture_nnx(model: Any, src: Any, tgt: Any, name_map: NameMap,
                run: Callable[[Any, Any, Any], Any] | None = None) -> dict[str, np.ndarray]:
    """The stages of a Flax NNX model's forward pass on (src, tgt): the outputs of the submodules
    (or methods) `name_map` names (module docstring), recorded by wrapping those methods on their
    classes for this one call (restored after, inherited methods too). `run(model, src, tgt)`
    runs it (default: `model(src, tgt)` on int32 arrays), eagerly: under jax.jit the values would
    be tracers. For float32 on a GPU or TPU, run inside `jax.default_matmul_precision("highest")`
    (PITFALLS 5)."""
    import jax.numpy as jnp

    parsed = _parse(name_map)
    targets = {}
    for stage, (path, _) in parsed.items():
        module, method = _resolve_nnx(model, stage, path)
        targets[stage] = (id(module), method), (module, method)
    with _recording(dict(targets.values())) as outputs:
        (run or (lambda m, s, t: m(s, t)))(model, jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32))
    stages = {}
    for stage, (_, call) in parsed.items():
        value = _pick(stage, name_map[stage], outputs[targets[stage][0]], call)
        if not hasattr(value, "dtype") or not hasattr(value, "shape"):
            raise InputError(f"name map: stage {stage!r}: {name_map[stage]!r} returned "
                             f"{type(value).__name__}, not an array")
        value = value.astype(jnp.float32) if value.dtype == jnp.bfloat16 else value
        stages[stage] = np.asarray(value)
    return _ordered(stages)
