"""Where every byte of a safetensors file goes, from names, shapes and dtypes only.

A safetensors file is an 8-byte little-endian header length, a JSON header (``__metadata__`` first, then
one entry per tensor with its dtype, shape and ``data_offsets``), padded with spaces to a multiple of 8,
then the raw bytes of every tensor back to back. ``safetensors.torch.save_file`` (the Rust ``prepare``)
orders the tensors by *descending dtype alignment, then by name* (byte order) and writes the header
compactly (``serde_json``). :class:`SafetensorsLayout` reproduces that layout before any tensor exists, so
a writer can put the header first and each tensor at its offset as soon as it is ready, in any order; the
file is then byte-identical to what ``save_file`` writes for the same dict (checked against the installed
safetensors in ``tests/unit/test_offloaded_save_stream.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

#: safetensors' dtype names in the order of its ``Dtype`` enum (increasing alignment): files hold the
#: largest alignment first. ``F6_*`` have no torch dtype.
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}
_TORCH_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "complex64": "C64",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint64": "U64", "uint32": "U32", "uint16": "U16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float4_e2m1fn_x2": "F4",
}
#: torch dtype -> safetensors dtype name (only dtypes this torch has).
DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, a): n for a, n in _TORCH_NAMES.items() if hasattr(torch, a)}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The name safetensors writes for ``dtype`` (``torch.bfloat16`` -> ``"BF16"``); ``str(dtype)`` for a
    dtype safetensors cannot store.

    Example:
        >>> safetensors_dtype(torch.bfloat16)
        'BF16'
    """
    return DTYPE_NAMES.get(dtype, str(dtype))


def header_shape(shape: tuple[int, ...], dtype: torch.dtype) -> list[int]:
    """The shape safetensors records: torch's ``float4_e2m1fn_x2`` packs two values per element, and the
    header counts values."""
    if DTYPE_NAMES.get(dtype) == "F4" and shape:
        return [*shape[:-1], shape[-1] * 2]
    return list(shape)


@dataclass(frozen=True)
class SafetensorsLayout:
    """The header and every tensor's byte range of one safetensors file.

    Attributes:
        header: The bytes before the tensor data (8-byte length, JSON, padding).
        ranges: Tensor name -> ``(begin, end)``, absolute offsets in the file.
        size: Size of the whole file.
    """

    header: bytes
    ranges: dict[str, tuple[int, int]]
    size: int

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
           metadata: Mapping[str, str] | None = None) -> SafetensorsLayout:
        """The layout ``safetensors.torch.save_file`` gives a dict of tensors with these names, shapes and
        dtypes.

        Args:
            tensors: ``(name, shape, dtype)`` per tensor, in any order.
            metadata: The ``__metadata__`` entry (transformers writes ``{"format": "pt"}``); at most one key
                if the result must be byte-identical (safetensors writes several in hash order).

        Raises:
            ValueError: For a dtype safetensors cannot store, or a name given twice.

        Example:
            >>> lay = SafetensorsLayout.of([("b", (2,), torch.float32), ("a", (3,), torch.float16)])
            >>> lay.ranges["b"][0] == len(lay.header), lay.size - len(lay.header)
            (True, 14)
        """
        entries = []
        for name, shape, dtype in tensors:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor `{name}` has dtype {dtype}, which safetensors cannot store.")
            n = 1
            for s in shape:
                n *= int(s)
            entries.append((-_RANK[DTYPE_NAMES[dtype]], name, tuple(int(s) for s in shape), dtype, n * dtype.itemsize))
        entries.sort(key=lambda e: (e[0], e[1].encode("utf-8")))
        names = [e[1] for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"a tensor name is given twice: {sorted(n for n in names if names.count(n) > 1)[:3]}")
        doc: dict[str, object] = {}
        if metadata is not None:
            doc["__metadata__"] = dict(metadata)
        offset = 0
        relative = {}
        for _, name, shape, dtype, nbytes in entries:
            doc[name] = {"dtype": DTYPE_NAMES[dtype], "shape": header_shape(shape, dtype),
                         "data_offsets": [offset, offset + nbytes]}
            relative[name] = (offset, offset + nbytes)
            offset += nbytes
        # serde_json's compact form: no spaces, non-ASCII as UTF-8, the same escapes as Python's json.
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        header = len(text).to_bytes(8, "little") + text
        base = len(header)
        return cls(header, {k: (base + b, base + e) for k, (b, e) in relative.items()}, base + offset)
