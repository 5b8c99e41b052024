"""The three model files read line for line (as recurrentgemma's jax/ and torch/ packages: the same
classes in the same order), checked on their syntax trees with `ast`; nothing is imported.

The outline of a file is its top-level classes (each with its methods, in order) and top-level
functions, in order. PyTorch's `forward` and Flax's `__call__` are one name ("forward").

- torch_impl/model.py and jax_impl/model.py: the same outline, and each function and method takes
  the same parameters once JAX's `rngs` and `dtype` (explicit randomness and compute type, which
  PyTorch keeps in global state and in `.to()`) are left out.
- numpy_ref/model.py has one function per box where the frameworks have a class: its function
  names, in order, are the framework outline with each class written in snake_case
  (MultiHeadAttention -> multi_head_attention) and `Transformer` replaced by its methods (embed,
  encode, decode, forward are module functions of the reference), after leaving out the names
  listed in FRAMEWORK_ONLY and NUMPY_ONLY below (each listed name must exist, so the lists cannot
  go stale). Training-only parts (dropout) and speed paths live in torch_impl/ops.py and
  jax_impl/ops.py, outside the compared files.
- every model file is at most MAX_LINES lines: one sitting, as nanoGPT's model.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = {name: ROOT / name / "model.py" for name in ("numpy_ref", "torch_impl", "jax_impl")}
MAX_LINES = 350
FRAMEWORK_ARGS = {"rngs", "dtype"}  # JAX-only parameters (see the module docstring)
# In the framework models only: module builders and containers (norm_layer, Stack), the state a
# Transformer holds (its tables, the position table it grows), and incremental decoding (the
# reference's numpy_ref/decode.py re-runs the decoder on the whole prefix instead).
FRAMEWORK_ONLY = {"norm_layer", "stack", "__init__", "position_table", "src_table", "tgt_table",
                  "init_cache", "decode_step"}
# In the reference only: the parameter-dict helper and the building blocks the frameworks take from
# their libraries (nn.Linear / nnx.Linear, LayerNorm, softmax inside attention).
NUMPY_ONLY = {"sub", "dense", "layer_norm", "softmax"}

Outline = list[tuple[str, list[str] | None]]  # (name, its methods) for a class, (name, None) for a function


def _name(name: str) -> str:
    return "forward" if name == "__call__" else name


def outline(path: Path) -> Outline:
    tree = ast.parse(path.read_text(), filename=str(path))
    entries: Outline = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = [_name(n.name) for n in node.body if isinstance(n, ast.FunctionDef)]
            entries.append((node.name, methods))
        elif isinstance(node, ast.FunctionDef):
            entries.append((node.name, None))
    return entries


def parameters(path: Path) -> dict[str, list[str]]:
    """'Class.method' or 'function' -> its parameter names, FRAMEWORK_ARGS left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {}
    for node in tree.body:
        is_class = isinstance(node, ast.ClassDef)
        members = [(f"{node.name}.", n) for n in node.body] if is_class else [("", node)]
        for prefix, f in members:
            if isinstance(f, ast.FunctionDef):
                args = f.args.posonlyargs + f.args.args + f.args.kwonlyargs
                found[prefix + _name(f.name)] = [a.arg for a in args if a.arg not in FRAMEWORK_ARGS]
    return found


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def mirrored(entries: Outline) -> list[str]:
    """The names numpy_ref/model.py should define for a framework outline, in order."""
    names: list[str] = []
    for name, methods in entries:
        if name == "Transformer":
            names += methods
        else:
            names.append(name if methods is None else snake_case(name))
    return names


def test_torch_and_jax_define_the_same_classes_methods_and_functions_in_the_same_order():
    torch_outline, jax_outline = outline(MODEL_FILES["torch_impl"]), outline(MODEL_FILES["jax_impl"])
    assert torch_outline == jax_outline


def test_torch_and_jax_functions_take_the_same_parameters():
    assert parameters(MODEL_FILES["torch_impl"]) == parameters(MODEL_FILES["jax_impl"])


def test_numpy_functions_mirror_the_framework_classes_in_order():
    framework = mirrored(outline(MODEL_FILES["torch_impl"]))
    numpy = [name for name, _ in outline(MODEL_FILES["numpy_ref"])]
    assert FRAMEWORK_ONLY <= set(framework), FRAMEWORK_ONLY - set(framework)  # no stale exception
    assert NUMPY_ONLY <= set(numpy), NUMPY_ONLY - set(numpy)
    assert not set(numpy) & FRAMEWORK_ONLY and not set(framework) & NUMPY_ONLY
    assert [n for n in numpy if n not in NUMPY_ONLY] == [n for n in framework if n not in FRAMEWORK_ONLY]


@pytest.mark.parametrize("backend", sorted(MODEL_FILES))
def test_model_file_reads_in_one_sitting(backend):
    lines = len(MODEL_FILES[backend].read_text().splitlines())
    assert lines <= MAX_LINES, f"{backend}/model.py has {lines} lines, more than {MAX_LINES}"


MAX_FILE_LINES = 500  # issue 25: no file of the package or the backends reads past one sitting


def test_no_source_file_is_over_500_lines():
    files = [p for d in ("rosetta", "numpy_ref", "torch_impl", "jax_impl") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 40  # the walk found the tree
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    assert {name: n for name, n in lines.items() if n > MAX_FILE_LINES} == {}
