"""Minimal safetensors reading (memory-mapped, zero-copy) and writing, bfloat16 included.

The format is an 8-byte little-endian header size, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw little-endian data. Reading maps the file and returns numpy views, so
loading a checkpoint touches only the pages of the tensors (and shards) actually read; the
`safetensors` package's numpy backend has no bfloat16, which every modern checkpoint uses.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct as _struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """A memory-mapped safetensors file: `names()`, `shape(name)`, `get(name) -> np.ndarray view`."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    with open(self.path, "rb") as f:
      n = _struct.unpack("<Q", f.read(8))[0]
      header = json.loads(f.read(n))
    self.metadata = header.pop("__metadata__", {})
    self._header = header
    self._offset = 8 + n
    self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

  def names(self) -> list[str]:
    return list(self._header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    info = self._header[name]
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    raw = self._mmap[self._offset + begin:self._offset + end]
    return raw.view(dtype).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
  """Writes `tensors` to `path` atomically (a temporary file renamed into place)."""
  path = pathlib.Path(path)
  header, offset = {}, 0
  for name, arr in tensors.items():
    dt = np.dtype(arr.dtype)
    if dt not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {dt} cannot be written to safetensors")
    header[name] = {"dtype": _NAMES[dt], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(_struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
  os.replace(tmp, path)
