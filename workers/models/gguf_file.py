"""A fast read-only GGUF (v2/v3, little-endian) parser. Torch-free.

``gguf.GGUFReader`` builds numpy views for every metadata item, which takes seconds for a
49k-token vocabulary; this walks the header with ``struct`` over an ``mmap`` instead (tens of
ms) and serves the part of GGUFReader's surface the engine uses: ``fields`` (``.contents()``
with the same values) and ``tensors`` (``name``, ``shape``, ``tensor_type`` and ``data`` in
GGUFReader's layout, so ``gguf.quants.dequantize(t.data, t.tensor_type)`` works on it).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

VT = GGUFValueType
SUPPORTED_VERSIONS = (2, 3)
# fixed-size value types: (struct format, numpy dtype)
_SCALAR_FORMATS = {
    VT.UINT8: ("<B", "<u1"),
    VT.INT8: ("<b", "<i1"),
    VT.UINT16: ("<H", "<u2"),
    VT.INT16: ("<h", "<i2"),
    VT.UINT32: ("<I", "<u4"),
    VT.INT32: ("<i", "<i4"),
    VT.FLOAT32: ("<f", "<f4"),
    VT.BOOL: ("<?", "?"),
    VT.UINT64: ("<Q", "<u8"),
    VT.INT64: ("<q", "<i8"),
    VT.FLOAT64: ("<d", "<f8"),
}
_SCALARS = {t: (struct.Struct(f), np.dtype(d)) for t, (f, d) in _SCALAR_FORMATS.items()}
# ggml types GGUFReader maps as element arrays; every other type is rows of block bytes (uint8)
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32, _U64, _ARRAY_HEAD = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IQ")


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can read (bad magic, truncated, unknown type ...)."""


class GGUFField:
    """One metadata key. ``contents()`` is ``gguf.ReaderField.contents()``: a Python scalar or str,
    or for an array a list (nested arrays flattened) or its ``index_or_slice`` item(s)."""

    __slots__ = ("name", "types", "_value", "_error")

    def __init__(self, name: str, types: list[GGUFValueType], value: Any):
        self.name, self.types, self._error = name, types, None
        try:  # strings stay bytes while walking; a bad one fails contents(), as in gguf, not the open
            if types[0] == VT.STRING:
                value = value.decode("utf-8")
            elif types[0] == VT.ARRAY and (VT.STRING in types or types[1:2] == [VT.ARRAY]):
                value = [v.decode("utf-8") if type(v) is bytes else v for v in value]
        except UnicodeDecodeError as exc:
            value, self._error = None, exc
        self._value = value

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self._error is not None:
            raise self._error
        return self._value[index_or_slice] if self.types[0] == VT.ARRAY else self._value

    def __repr__(self) -> str:
        return f"GGUFField({self.name!r}, {[t.name for t in self.types]})"


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """Dimensions fastest-moving first, as GGUF (and GGUFReader) list them."""
    n_elements: int
    n_bytes: int
    data_offset: int
    """Absolute offset of the data in the file."""
    data: np.ndarray
    """A read-only view of the mapped file: elements for F32/F16/F64/I*, else uint8 block bytes
    with the last dimension in bytes (GGUFReader's layout)."""


class GGUFFile:
    """A GGUF file's metadata (``fields``: key -> ``GGUFField``, with ``GGUF.version``,
    ``GGUF.tensor_count`` and ``GGUF.kv_count`` first, as in GGUFReader) and ``tensors``
    (``GGUFTensor``, in file order), parsed once; tensor data stay memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(self.path, "rb") as f:
            head = f.read(24)
            if len(head) >= 4 and head[:4] != b"GGUF":
                raise GGUFError(f"bad magic {head[:4]!r} (a GGUF file starts with b'GGUF')")
            if len(head) < 24:
                raise GGUFError(f"file too short for a GGUF header ({len(head)} bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.fields: dict[str, GGUFField] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse(self._map)
        except GGUFError:
            raise
        except (struct.error, IndexError, OverflowError, RecursionError, UnicodeDecodeError) as exc:
            raise GGUFError(f"truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from None

    def header_digest(self) -> str:
        """sha256 of everything before the tensor data (metadata, vocabulary, tensor index):
        what a tokenizer or an architecture read from the file depends on."""
        return hashlib.sha256(self._map[: self.data_offset]).hexdigest()

    def _parse(self, buf: mmap.mmap) -> None:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            if version and not version & 0xFFFF:
                raise GGUFError("big-endian GGUF files are not supported")
            raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        self._add("GGUF.version", [VT.UINT32], version)
        self._add("GGUF.tensor_count", [VT.UINT64], n_tensors)
        self._add("GGUF.kv_count", [VT.UINT64], n_kv)
        off = 24
        for _ in range(n_kv):
            key, off = _read_str(buf, off)
            (vtype,) = _U32.unpack_from(buf, off)
            leaves: list[Any] = []
            off, types = _read_value(buf, off + 4, vtype, leaves)
            self._add(key.decode("utf-8"), types, leaves if types[0] == VT.ARRAY else leaves[0])
        infos = []
        for _ in range(n_tensors):
            name, off = _read_str(buf, off)
            (n_dims,) = _U32.unpack_from(buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            raw_type, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name.decode("utf-8"), dims, raw_type, rel))
        align = self.fields.get("general.alignment")
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if align is not None:
            if align.types != [VT.UINT32]:
                raise GGUFError("general.alignment is not a uint32")
            self.alignment = align.contents()
            if self.alignment <= 0 or self.alignment & (self.alignment - 1):
                raise GGUFError(f"invalid general.alignment {self.alignment} (not a power of two)")
        self.data_offset = -(-off // self.alignment) * self.alignment
        seen = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise GGUFError(f"duplicate tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(buf, name, dims, raw_type, self.data_offset + rel))

    def _add(self, key: str, types: list[GGUFValueType], value: Any) -> None:
        if key in self.fields:
            raise GGUFError(f"duplicate metadata key {key!r}")
        self.fields[key] = GGUFField(key, types, value)

    @staticmethod
    def _tensor(buf: mmap.mmap, name: str, dims: tuple[int, ...], raw_type: int, start: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elems = 1
        for d in dims:
            n_elems *= d
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(qtype)
        if dtype is None:  # rows of blocks, as bytes
            if not np_dims or np_dims[-1] % block:
                raise GGUFError(f"tensor {name!r}: row size {np_dims[-1:]} is not a multiple of {qtype.name} blocks")
            dtype, np_dims = np.uint8, (*np_dims[:-1], np_dims[-1] // block * type_size)
        if start + n_bytes > len(buf):
            raise GGUFError(f"tensor {name!r} runs past the end of the file (truncated?)")
        count = n_bytes // np.dtype(dtype).itemsize
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(np_dims)
        return GGUFTensor(name, qtype, tuple(dims), n_elems, n_bytes, start, data)


def _read_str(buf: mmap.mmap, off: int) -> tuple[bytes, int]:
    (n,) = _U64.unpack_from(buf, off)
    end = off + 8 + n
    if end > len(buf):
        raise GGUFError(f"string at offset {off} runs past the end of the file (truncated?)")
    return buf[off + 8 : end], end


def _value_type(raw: int) -> GGUFValueType:
    try:
        return VT(raw)
    except ValueError:
        raise GGUFError(f"unknown GGUF value type {raw}") from None


def _read_value(buf: mmap.mmap, off: int, raw_type: int, out: list) -> tuple[int, list[GGUFValueType]]:
    """Read one value at ``off``, appending it (an array: its leaves, flattened) to ``out``;
    returns the offset past it and its types as GGUFReader lists them ([ARRAY, ..., leaf])."""
    vtype = _value_type(raw_type)
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        out.append(scalar[0].unpack_from(buf, off)[0])
        return off + scalar[0].size, [vtype]
    if vtype == VT.STRING:
        s, off = _read_str(buf, off)
        out.append(s)
        return off, [vtype]
    if vtype != VT.ARRAY:
        raise GGUFError(f"unhandled GGUF value type {vtype.name}")
    raw_item, n = _ARRAY_HEAD.unpack_from(buf, off)
    off += 12
    itype = _value_type(raw_item)
    types = [VT.ARRAY] + ([itype] if n else [])
    scalar = _SCALARS.get(itype)
    if scalar is not None:  # one frombuffer for the lot
        end = off + n * scalar[1].itemsize
        if end > len(buf):
            raise GGUFError(f"array at offset {off} runs past the end of the file (truncated?)")
        out.extend(np.frombuffer(buf, dtype=scalar[1], count=n, offset=off).tolist())
        return end, types
    if itype == VT.STRING:
        if n * 8 > len(buf) - off:
            raise GGUFError(f"string array at offset {off} runs past the end of the file (truncated?)")
        unpack, append = _U64.unpack_from, out.append
        for _ in range(n):
            (length,) = unpack(buf, off)
            off += 8
            append(buf[off : off + length])
            off += length
        if off > len(buf):
            raise GGUFError("string array runs past the end of the file (truncated?)")
        return off, types
    types = [VT.ARRAY]  # arrays of arrays: the types of the first item, as GGUFReader
    for i in range(n):
        off, item_types = _read_value(buf, off, raw_item, out)
        if i == 0:
            types += item_types
    return off, types
