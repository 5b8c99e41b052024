"""One reader for JSON from outside (issue 39): every JSON file rosetta reads goes through here.

Model configs and checkpoint headers, Marian `config.json`, tokenizer files, `generation_config.json`,
training traces (`trace.json`, `steps.jsonl`, `evals.jsonl`), run files and benchmark results all come
from somewhere else, and Python's `json` module trusts its input: a 100,000-deep file overflows the
stack (RecursionError), an integer of 401 digits overflows `float()`, one of 5,001 digits passes
Python's digit limit, duplicate keys keep the last value, NaN and Infinity pass as numbers, and a
field of the wrong type surfaces far away as a traceback. Here each of those is refused in one line
naming the file (and the line of a JSON Lines file) and the field, before any value is used:

- size: at most `limit` bytes per file (checked on the file's size before it is read) or
  `line_limit` per line, never read whole when longer;
- nesting: at most MAX_DEPTH levels, counted without recursing before the parser runs;
- numbers: integers of at most MAX_INT_DIGITS digits, floats finite; NaN and Infinity only where a
  file's format gives them a meaning (`nonfinite=True`: a diverged loss in a trace or a log);
- keys: no duplicates;
- types: a small schema per file (`Field`: the JSON types a field may have, required or not,
  its allowed values), checked by `check_schema`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rosetta.errors import ConfigError, RosettaError

# 64 levels: every real file is far shallower (a tokenizer.json nests about 6 deep, a trace
# header 3), and far below the recursion limit under Python's parser.
MAX_DEPTH = 64
# 40 digits: the widest integer in real files is transformers' "no limit" sentinel int(1e30) (31
# digits, in tokenizer_config.json); 10^40 still converts to a float, and 4,300 digits is where
# Python refuses to convert at all.
MAX_INT_DIGITS = 40
DEFAULT_LIMIT = 64 * 2**20  # bytes: a 250k-piece vocabulary.json is ~8 MB, a model config a few kB

# One JSON string token, so that brackets inside strings are not counted (the unrolled-loop form
# runs at C speed on multi-megabyte vocabularies).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JSONRefused(ValueError):
    """Text that Python's json module would accept (or crash on) but that a strict reader must not."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, counted without recursion. On malformed
    text it counts at least as deep as the parser would go before it stops at the error."""
    if "[" not in text and "{" not in text:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Python keeps the last of duplicate keys; another reader may keep the first. A file that
    # means different things to different readers is refused.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise JSONRefused(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:  # before int(): 5,001 digits would pass Python's own limit
        raise JSONRefused(f"an integer of {digits:,} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as infinity
        raise JSONRefused(f"number {text:.40} is out of range")
    return value


def loads(text: str, *, nonfinite: bool = False) -> Any:
    """`text` parsed strictly (the module's bounds). Raises JSONRefused for what the bounds refuse and
    json.JSONDecodeError (a ValueError too) for what is not JSON at all. `nonfinite`: NaN, Infinity
    and -Infinity read as floats (the formats that write them for a diverged run)."""
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise JSONRefused(f"nested too deeply ({depth:,} levels, at most {MAX_DEPTH})")
    constant = float if nonfinite else _no_constant
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=constant,
                          parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:  # a safety net: nesting_depth counts first
        raise JSONRefused("nested too deeply") from None


def decode(raw: bytes, where: str, *, nonfinite: bool = False,
           error: type[RosettaError] = ConfigError) -> Any:
    """The JSON value of `raw`, or `error` in one line starting with `where` (a file, a file's line)."""
    try:
        return loads(raw.decode("utf-8"), nonfinite=nonfinite)
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text: {e}") from None
    except JSONRefused as e:
        raise error(f"{where}: JSON refused: {e}") from None
    except ValueError as e:  # JSONDecodeError: empty, truncated, not JSON
        raise error(f"{where}: not valid JSON: {e}") from None


def read_bytes(path: Path, limit: int, what: str, error: type[RosettaError] = ConfigError) -> bytes:
    """The bytes of the file `path`, refused when longer than `limit` (from its size, before reading;
    a device or pipe that claims no size is read only up to the limit)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{path}: {size:,} bytes, more than {what} may hold ({limit:,})")
            raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise error(f"{path}: more than {limit:,} bytes, more than {what} may hold")
    return raw


def read_json(path: str | os.PathLike, what: str, *, limit: int = DEFAULT_LIMIT,
              schema: Mapping[str, Field] | None = None, error: type[RosettaError] = ConfigError,
              nonfinite: bool = False) -> dict[str, Any]:
    """The JSON object in the file `path` (`what` it is, for the messages), read within `limit` bytes
    and the module's bounds, its fields checked against `schema`; otherwise `error` naming the file."""
    path = Path(path)
    data = decode(read_bytes(path, limit, what, error), str(path), nonfinite=nonfinite, error=error)
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must be a JSON object, got {_json_type(data)}")
    if schema is not None:
        check_schema(data, schema, str(path), error)
    return data


def read_json_lines(path: str | os.PathLike, line_limit: int, what: str, *,
                    error: type[RosettaError] = ConfigError, nonfinite: bool = False,
                    cut_off: str | None = "the writer stopped mid-line", note: str = "",
                    file_limit: int | None = None, crlf: bool = True) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each line of a JSON Lines file, every line read up to `line_limit`
    bytes (a hostile line is never read whole) and decoded within the module's bounds. A refusal is
    `error` naming the file and the line, `note` appended. A last line without its newline is refused
    with `cut_off` as the reason, or skipped when `cut_off` is None (a log whose writer was killed).
    `file_limit`: the most bytes the whole file may hold. `crlf` False: a line ending in \\r\\n is
    refused (a writer that ends lines in \\n alone; an edited file). FileNotFoundError passes through:
    the caller knows what a missing file means."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if file_limit is not None and size > file_limit:
                raise error(f"{path}: {size:,} bytes, more than {file_limit:,}{note}")
            for number in itertools.count(1):
                line = f.readline(line_limit + 1)
                if not line:
                    return
                if len(line) > line_limit:
                    raise error(f"{path}: line {number} is longer than {what} ({line_limit:,} bytes){note}")
                if not line.endswith(b"\n"):
                    if cut_off is None:
                        return
                    raise error(f"{path}: line {number} is cut off: {cut_off}")
                if not crlf and line.endswith(b"\r\n"):
                    raise error(f"{path}: line {number} ends in CRLF (\\r\\n), not \\n alone{note}")
                yield number, decode(line, f"{path}: line {number}", nonfinite=nonfinite, error=error)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None


# -- schemas ------------------------------------------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "number": (int, float),
    "boolean": (bool,), "null": (type(None),),
}


@dataclass(frozen=True)
class Field:
    """What one field of a JSON object may hold: one of `types` (JSON's names: object, array, string,
    integer, number, boolean, null), present when `required`, one of `choices` when given (null
    aside), and an object's own fields in `fields`."""

    types: tuple[str, ...]
    required: bool = False
    choices: tuple[Any, ...] = ()
    fields: Mapping[str, Field] | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.types if t not in _TYPES]
        if unknown or not self.types:
            raise ValueError(f"Field types must be among {', '.join(_TYPES)}, got {self.types}")


def field(*types: str, required: bool = False, choices: tuple[Any, ...] = (),
          fields: Mapping[str, Field] | None = None) -> Field:
    """`Field(types, ...)`, the types written out: `field("string", "null", choices=DTYPES)`."""
    return Field(types, required, tuple(choices), fields)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "an array"
    kind = "a string" if isinstance(value, str) else "an integer" if isinstance(value, int) else "a number"
    return f"{kind} {value!r:.40}"


def _is(value: Any, kind: str) -> bool:
    # JSON's types, not Python's: true is no integer, and 1.0 is no integer either.
    if isinstance(value, bool):
        return kind == "boolean"
    return isinstance(value, _TYPES[kind])


def check_schema(data: Mapping[str, Any], schema: Mapping[str, Field], where: str,
                 error: type[RosettaError] = ConfigError, prefix: str = "") -> None:
    """Each field of `schema` in the object `data`: present if required, of its types, one of its
    choices; otherwise `error`, one line: `where: FIELD must be ...`. Other fields pass (files carry
    fields their readers do not use)."""
    for name, spec in schema.items():
        label = f"{prefix}{name}"
        if name not in data:
            if spec.required:
                raise error(f"{where}: missing required field {label}")
            continue
        value = data[name]
        if not any(_is(value, kind) for kind in spec.types):
            wanted = " or ".join(spec.types)
            raise error(f"{where}: {label} must be {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}, "
                        f"got {_json_type(value)}")
        if spec.choices and value is not None and value not in spec.choices:
            raise error(f"{where}: {label} must be one of {', '.join(map(str, spec.choices))}, "
                        f"got {_json_type(value)}")
        if spec.fields is not None and isinstance(value, dict):
            check_schema(value, spec.fields, where, error, f"{label}.")
