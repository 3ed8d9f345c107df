"""A dependency-free reader and writer for the safetensors file format (torch + numpy only).

Format (what this module writes and accepts)::

    8 bytes      N, the header length, unsigned little-endian
    N bytes      UTF-8 JSON object: {"__metadata__": {str: str}, name: {"dtype": D, "shape": [...],
                 "data_offsets": [begin, end]}, ...}, padded with spaces to a multiple of 8 bytes
    the rest     the tensors' raw little-endian bytes; offsets are relative to the end of the header

Writer contract (:func:`write_file`): tensors are laid out back to back in the order given, with no gaps;
the header JSON is compact (no spaces), keys in insertion order with ``__metadata__`` first; nothing
depends on time, host or process, so the same tensors and metadata give the same bytes everywhere. Files
written here load with the ``safetensors`` library (``safe_open``, ``load_file``), which is what vLLM's
default loader uses.

Reader contract (:func:`read_file`, :func:`read_header`): rejects a truncated file, a header that is not a
JSON object, an unknown dtype, a shape whose byte size differs from its offsets, offsets outside the data
area, and overlapping or gapped tensors (``ValueError`` naming the file and the tensor).

Public API::

    DTYPE_NAMES                    torch dtype -> safetensors dtype string (BF16, F32, F8_E4M3, I64, ...)
    write_file(path, tensors, metadata=None) -> int (bytes written)
    read_header(path) -> (header dict without __metadata__, metadata dict, data start offset)
    read_file(path) -> dict name -> tensor (CPU, in file order)
    tensor_nbytes(shape, dtype) -> int
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import torch

DTYPE_NAMES: dict = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPE_NAMES[torch.float8_e8m0fnu] = "F8_E8M0"
_NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def tensor_nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_file(path, tensors: dict, metadata: dict | None = None) -> int:
    """Write ``tensors`` (name -> tensor, written in this order) to ``path``; returns the file size.

    ``metadata`` values must be strings (the format's rule). Raises ``ValueError`` for a dtype the format
    has no name for, a non-string metadata value or a reserved tensor name."""
    header: dict = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"safetensors metadata must map str -> str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot name a tensor")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": [int(d) for d in t.shape],
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(_raw_bytes(t))
    return 8 + len(blob) + offset


def read_header(path):
    """``(entries, metadata, data_start)``: the per-tensor header entries (file order), the ``__metadata__``
    dict (empty when absent) and the byte offset where tensor data begins. Validates the layout."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_len = size - data_start
    spans = []
    for name, e in header.items():
        try:
            dtype = _NAME_TO_DTYPE[e["dtype"]]
            shape = [int(d) for d in e["shape"]]
            begin, end = (int(v) for v in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed or unknown header entry {e!r}") from None
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{path}: tensor {name!r} offsets [{begin}, {end}] lie outside the data "
                             f"({data_len} bytes)")
        if end - begin != tensor_nbytes(shape, dtype):
            raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes but {e['dtype']} {shape} "
                             f"needs {tensor_nbytes(shape, dtype)}")
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise ValueError(f"{path}: tensor {name!r} starts at {begin}, expected {pos} (gap or overlap)")
        pos = end
    if pos != data_len:
        raise ValueError(f"{path}: {data_len - pos} trailing bytes after the last tensor")
    return header, metadata, data_start


def read_file(path) -> dict:
    """Every tensor of a safetensors file, as CPU tensors that own their memory, in header order."""
    header, _, data_start = read_header(path)
    with open(path, "rb") as f:
        f.seek(data_start)
        data = f.read()
    out = {}
    for name, e in header.items():
        dtype = _NAME_TO_DTYPE[e["dtype"]]
        begin, end = e["data_offsets"]
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=begin).copy())
        out[name] = raw.view(dtype).reshape(e["shape"]) if end > begin else torch.empty(e["shape"], dtype=dtype)
    return out
