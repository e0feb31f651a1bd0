"""Any safetensors file's tensors by name (``mgpu.load`` of a file mgpu did not write).

The format: an 8-byte little-endian unsigned header length N, N bytes of a UTF-8 JSON object
mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into
the bytes after the header, which the tensors cover exactly, without gaps or overlaps), and an
optional ``__metadata__`` of string keys and values; the tensors are row-major, little-endian.

mgpu tensors hold float32, bfloat16, int32, int64 and uint8: F32, BF16, I32, I64 and U8 load as
they are (BF16 as its raw bits, :class:`BFloat16Bits`), and element types that convert without
loss are converted: F16 to float32, I8, I16 and U16 to int32, U32 to int64, BOOL to uint8 (0 or
1). F64, U64 and the 8-bit floats would lose values
and are refused with an error naming the tensor (convert them where the file is made). Every
entry is checked before any tensor is made; reading parses JSON and copies bytes, nothing else.
"""
from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

MAX_HEADER = 100 << 20  # the reference implementation's cap on the header's size

# name -> (the stored element type, the dtype mgpu holds it as)
_STORED = {
    "F32": ("<f4", "float32"), "I32": ("<i4", "int32"), "I64": ("<i8", "int64"),
    "U8": ("u1", "uint8"), "F16": ("<f2", "float32"), "BF16": ("<u2", "bfloat16"),
    "I8": ("i1", "int32"), "I16": ("<i2", "int32"), "U16": ("<u2", "int32"),
    "U32": ("<u4", "int64"), "BOOL": ("u1", "uint8"),
}
_REFUSED = {"F64": "float64", "U64": "uint64", "F8_E4M3": "8-bit float (E4M3)",
            "F8_E5M2": "8-bit float (E5M2)", "F8_E8M0": "8-bit float (E8M0)",
            "F4": "4-bit float", "F6_E2M3": "6-bit float", "F6_E3M2": "6-bit float"}


class BFloat16Bits(NamedTuple):
    """A BF16 tensor of a file: its raw bits (uint16, the tensor's shape), which NumPy alone
    cannot hold as bfloat16 (mgpu.bfloat16_from_bits makes the tensor)."""

    bits: np.ndarray


class TensorFileError(ValueError):
    """A file that is not a valid safetensors file, or holds a dtype mgpu cannot hold."""


def read_header(data: bytes) -> Optional[Tuple[int, dict]]:
    """(header length, header) when ``data`` starts like a safetensors file, else None."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > min(len(data) - 8, MAX_HEADER):
        return None
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return (n, header) if isinstance(header, dict) else None


def _no_duplicates(pairs):
    out = OrderedDict()
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _as_held(raw: np.ndarray, code: str) -> np.ndarray:
    """The stored elements as the dtype mgpu holds them (exact for every accepted code)."""
    if code == "BOOL":
        return (raw != 0).astype(np.uint8)
    return raw.astype(_STORED[code][1])


def parse(data: bytes) -> Tuple["OrderedDict[str, np.ndarray]", Dict[str, str]]:
    """The tensors (NumPy arrays of the dtypes mgpu holds, BF16 ones as BFloat16Bits, in the
    header's order) and the metadata of a safetensors file's bytes; TensorFileError naming the
    fault otherwise."""
    parsed = read_header(data)
    if parsed is None:
        raise TensorFileError("not a safetensors file (its first 8 bytes must give the length of "
                              "a JSON header that follows them)")
    n, header = parsed
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TensorFileError("its __metadata__ is not a map of strings to strings")
    body = memoryview(data)[8 + n:]
    spans = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise TensorFileError(f"tensor '{name}' has an invalid entry {e!r} (it needs dtype, "
                                  "shape and data_offsets: corrupt)")
        code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if code in _REFUSED:
            raise TensorFileError(
                f"tensor '{name}' is {code} ({_REFUSED[code]}), which mgpu cannot hold without "
                "losing values (mgpu holds float32, bfloat16, int32, int64, uint8, and converts "
                "F16, I8, I16, U16, U32 and BOOL); convert it to F32 or I64 where the file is "
                "made")
        if code not in _STORED:
            raise TensorFileError(f"tensor '{name}' has an unknown dtype {code!r}")
        ints = shape + offsets if isinstance(shape, list) and isinstance(offsets, list) else None
        if (ints is None or len(offsets) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in ints)):
            raise TensorFileError(f"tensor '{name}' has an invalid shape or data_offsets {e!r} "
                                  "(corrupt)")
        itemsize = np.dtype(_STORED[code][0]).itemsize
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise TensorFileError(
                f"tensor '{name}': data_offsets {offsets} span {offsets[1] - offsets[0]} bytes "
                f"but {code} of shape {shape} needs {math.prod(shape) * itemsize}")
        spans.append((offsets[0], offsets[1], name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise TensorFileError(f"tensor '{name}' starts at byte {begin} of the data, expected "
                                  f"{at} (tensors must cover the data without gaps or overlaps)")
        at = end
    if at != len(body):
        raise TensorFileError(f"the header describes {at} bytes of tensor data but {len(body)} "
                              "follow it (truncated, or damaged)")
    arrays: "OrderedDict[str, np.ndarray]" = OrderedDict()
    for name, e in header.items():
        code, shape = e["dtype"], e["shape"]
        begin = e["data_offsets"][0]
        raw = np.frombuffer(body, dtype=_STORED[code][0], count=math.prod(shape), offset=begin)
        arrays[name] = (BFloat16Bits(raw.reshape(shape)) if code == "BF16"
                        else _as_held(raw, code).reshape(shape))
    return arrays, dict(meta)


def is_mgpu_header(header: dict, fmt: str) -> bool:
    """Whether a parsed header is (or was, before damage) one of mgpu's checkpoints: an entry of
    it (the metadata, or what a flipped bit made of its name) names mgpu's format ``fmt`` or
    holds the checksum or the structure mgpu writes."""
    return any(isinstance(v, dict) and (v.get("format") == fmt or "checksum" in v or "tree" in v)
               for v in header.values())


__all__ = ["MAX_HEADER", "TensorFileError", "read_header", "parse", "is_mgpu_header"]
