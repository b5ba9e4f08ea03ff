"""Minimal safetensors reading (memory-mapped, zero-copy) and writing, bfloat16 included.

The format is an 8-byte little-endian header size, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw little-endian data. Reading maps the file and returns numpy views, so
loading a checkpoint touches only the pages of the tensors (and shards) actually read; the
`safetensors` package's numpy backend has no bfloat16, which every modern checkpoint uses.

Opening a file validates its header against the file's size (O(header), no tensor data read): a
truncated file, a corrupted header or a tensor whose bytes do not match its dtype and shape raises
`CheckpointError` naming the file and the tensor. `count_nonfinite` and `all_finite` check tensor
values in bounded chunks.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct as _struct

import ml_dtypes
import numpy as np

from jaxagent.models.config import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Floating dtypes (ml_dtypes' report numpy kind "V", so they are listed, not found by kind).
FLOAT_DTYPES = frozenset(_DTYPES[k] for k in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"))
# The safetensors format caps the header at 100 MB; a larger length field is corruption.
MAX_HEADER_BYTES = 100 << 20
_FIX = "re-download the file or re-save the checkpoint"


class SafetensorsFile:
  """A memory-mapped safetensors file: `names()`, `shape(name)`, `get(name) -> np.ndarray view`.

  Raises `CheckpointError` (naming the file and, where one is at fault, the tensor) when the file
  is too short, its header is not valid, or a tensor's bytes lie outside the file or do not match
  its dtype and shape.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    with open(self.path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 8:
        raise CheckpointError(
            f"{self.path}: {size} bytes, too short for a safetensors file (it starts with an "
            f"8-byte header length); the file is truncated or not safetensors: {_FIX}")
      n = _struct.unpack("<Q", f.read(8))[0]
      if n > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"{self.path}: the header length field says {n} bytes, but the file has "
            f"{size - 8} bytes after it (and safetensors headers are at most "
            f"{MAX_HEADER_BYTES} bytes); the file is truncated or corrupted: {_FIX}")
      raw = f.read(n)
    try:
      header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{self.path}: the safetensors header is not valid JSON ({e}); the "
                            f"file is corrupted: {_FIX}") from e
    if not isinstance(header, dict):
      raise CheckpointError(f"{self.path}: the safetensors header is a JSON "
                            f"{type(header).__name__}, not an object; the file is corrupted: "
                            f"{_FIX}")
    metadata = header.pop("__metadata__", {})
    self.metadata = metadata if isinstance(metadata, dict) else {}
    self._offset = 8 + n
    for name, info in header.items():
      self._check_entry(name, info, size - self._offset)
    self._header = header
    # np.memmap cannot map an empty file region; a header-only file has no tensors to map.
    self._mmap = (np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._offset
                  else np.zeros(size, np.uint8))

  def _check_entry(self, name: str, info, data_size: int) -> None:
    """Validates one header entry against the dtype table and the data region's size."""
    where = f"{self.path}: tensor {name!r}"
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
          and isinstance(info.get("shape"), list)
          and all(type(s) is int and s >= 0 for s in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(type(o) is int for o in info["data_offsets"]))
    if not ok:
      raise CheckpointError(f"{where} has a malformed header entry {info!r} (expected dtype, "
                            f"shape and two data_offsets); the file is corrupted: {_FIX}")
    begin, end = info["data_offsets"]
    if not 0 <= begin <= end:
      raise CheckpointError(f"{where} has invalid data_offsets {[begin, end]}; the file is "
                            f"corrupted: {_FIX}")
    if end > data_size:
      raise CheckpointError(
          f"{where} ends at byte {self._offset + end} but the file has only "
          f"{self._offset + data_size} bytes; the file is truncated (an interrupted download or "
          f"save): {_FIX}")
    dtype = _DTYPES.get(info["dtype"])
    if dtype is not None:
      want = math.prod(info["shape"]) * dtype.itemsize
      if end - begin != want:
        raise CheckpointError(
            f"{where}: shape {tuple(info['shape'])} of dtype {info['dtype']} needs {want} bytes, "
            f"but its data_offsets span {end - begin}; the file is corrupted: {_FIX}")

  def names(self) -> list[str]:
    return list(self._header)

  def __contains__(self, name: str) -> bool:
    return name in self._header

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    info = self._header[name]
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
      raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype "
                            f"{info['dtype']} (supported: {sorted(_DTYPES)}); re-save the "
                            "checkpoint in float32, bfloat16 or float16")
    begin, end = info["data_offsets"]
    raw = self._mmap[self._offset + begin:self._offset + end]
    return raw.view(dtype).reshape(info["shape"])


def _blocks(arr: np.ndarray, n: int):
  """Views of `arr` (any strides) of at most `n` values each, together covering it once."""
  if arr.ndim == 0:
    yield arr.reshape(1)
  elif arr.size <= n:
    yield arr
  elif arr.ndim == 1:
    for i in range(0, arr.shape[0], n):
      yield arr[i:i + n]
  elif arr[0].size > n:
    for row in arr:
      yield from _blocks(row, n)
  else:
    k = n // arr[0].size
    for i in range(0, arr.shape[0], k):
      yield arr[i:i + k]


def all_finite(arr: np.ndarray, chunk_elems: int = 1 << 22) -> bool:
  """Whether every value of a float array is finite (True for non-float dtypes).

  Streams over `arr` (a memory-mapped view is fine) in blocks of at most `chunk_elems` values, so
  the temporary memory is bounded whatever the array's size.
  """
  if np.dtype(arr.dtype) not in FLOAT_DTYPES:
    return True
  return all(bool(np.isfinite(b).all()) for b in _blocks(arr, chunk_elems))


def count_nonfinite(arr: np.ndarray, chunk_elems: int = 1 << 22) -> tuple[int, int]:
  """(number of NaN, number of +-Inf) values of `arr`, counted in bounded blocks."""
  if np.dtype(arr.dtype) not in FLOAT_DTYPES:
    return 0, 0
  nan = inf = 0
  for b in _blocks(arr, chunk_elems):
    nan += int(np.isnan(b).sum())
    inf += int(np.isinf(b).sum())
  return nan, inf


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
