"""safetensors files taken apart and put together by hand, independently of rosetta/checkpoint.py,
for the tests that feed the reader hostile headers."""

from __future__ import annotations

import json


def split(data: bytes) -> tuple[dict, bytes]:
    """(header JSON, data section) of safetensors bytes: 8-byte little-endian length, JSON, data."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict | str, body: bytes) -> bytes:
    """safetensors bytes of a header (a dict, or raw JSON text) and a data section."""
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return len(raw).to_bytes(8, "little") + raw + body
