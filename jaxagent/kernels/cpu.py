"""XLA:CPU custom calls (XLA FFI), compiled from the C++ beside this file on first use.

`cache_attention_partials` is the attention of decode steps and prefill chunks over a KV cache.
XLA:CPU runs it as a loop of cache blocks, each a dynamic-slice copy and two tiny batched
products, at ~1/4 of the memory bandwidth; the kernel streams each row's keys and values once, in
place, in register-tiled products, over XLA's intra-op threads (on the 2-core AVX-512 benchmark
machine 3.6x XLA's blocks for one-query steps, 2.8x for 32-query chunks; `python -m
launch.benchmark` compares the paths side by side).

The library is built with the system's C++ compiler (`CXX`, default g++) against jaxlib's FFI
headers into JAXAGENT_KERNEL_DIR (default ~/.cache/jaxagent/kernels), named by a hash of the
source, the jaxlib version, the flags and the CPU, so an upgrade or another machine rebuilds it;
a checksum written beside it at build time is checked before every load, and a damaged library
is rebuilt. Without a compiler, `available()` is False and the decoder keeps XLA's path (one log
line says why). Which models use the kernel is `ModelConfig.attention`
(`jaxagent.models.attention`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = pathlib.Path(__file__).with_name("cache_attention.cc")
_TARGET = "jaxagent_cache_attention"
_WRITE_TARGET = "jaxagent_cache_attention_write"
_MATMUL_TARGET = "jaxagent_small_matmul"
# JAXAGENT_KERNEL_MARCH (default native) builds for another -march, e.g. x86-64-v3 (AVX2 + FMA,
# no AVX-512) to test or time the kernel's AVX2 path on an AVX-512 host; the library's hash
# includes the flags.
_FLAGS = ["-O3", f"-march={os.environ.get('JAXAGENT_KERNEL_MARCH', 'native')}", "-std=c++17",
          "-shared", "-fPIC", "-w"]
if platform.machine().lower() in ("x86_64", "amd64"):
  # GCC's x86 default prefers 256-bit vectors even where AVX-512 exists. The tiled path's explicit
  # vectors are 16 floats with AVX-512 and 8 without (cache_attention.cc) either way; this is for
  # the generic loop's auto-vectorised code (single-threaded on the benchmark machine: 68.5 ->
  # 60.2 ms for 2048 one-query pairs). Without AVX-512 it is a no-op (GCC 12.2, -march=znver3:
  # the same machine code with and without it), so it stays on every x86 host.
  _FLAGS.append("-mprefer-vector-width=512")
# Head sizes with the kernel's register-tiled path; others take a generic loop that is fast
# enough for one query per row but not for query chunks (`decoder._use_kernel`).
TILED_HEAD_SIZES = (32, 64, 128)
_LOCK = threading.Lock()
_STATE: dict = {}        # "lib" once loaded, or "error": why it cannot be
_REGISTERED: list = []   # XLA's registry is per process and refuses a second library


class KernelUnavailable(RuntimeError):
  pass


def _cpu_name() -> str:
  return _cpu_fields().get("model name", "") or platform.processor() or platform.machine()


def _cpu_fields() -> dict:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return {}
  fields: dict = {}
  for line in text.splitlines():
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  return fields


def _cpu_id() -> str:
  fields = _cpu_fields()
  if not fields:
    return platform.processor() or platform.machine()
  return fields.get("model name", "") + fields.get("flags", "")


def library_path() -> pathlib.Path:
  """Where this source, jaxlib, compiler flags and CPU put the built library."""
  import jaxlib
  digest = hashlib.sha256()
  for part in (_SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(_FLAGS).encode(),
               _cpu_id().encode(), os.environ.get("CXX", "g++").encode()):
    digest.update(part)
    digest.update(b"\0")
  root = os.environ.get("JAXAGENT_KERNEL_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxagent", "kernels")
  return pathlib.Path(root) / f"cache_attention-{digest.hexdigest()[:16]}.so"


def _build(out: pathlib.Path) -> None:
  cxx = os.environ.get("CXX", "g++")
  if shutil.which(cxx) is None:
    raise KernelUnavailable(f"no C++ compiler {cxx!r} on PATH (install g++, or set CXX)")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)   # atomic: build aside, then rename
  os.close(fd)
  try:
    res = subprocess.run([cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp],
                         capture_output=True, text=True)
    if res.returncode != 0:
      raise KernelUnavailable(f"{cxx} failed to build {_SOURCE.name}:\n{res.stderr[-2000:]}")
    # The checksum first, then the library: a library is never in place without its checksum.
    tmp_sum = _checksum_path(out).with_suffix(".tmp")
    tmp_sum.write_text(_digest(pathlib.Path(tmp)))
    os.replace(tmp_sum, _checksum_path(out))
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _digest(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksum_path(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(path.name + ".sha256")


def _intact(path: pathlib.Path) -> bool:
  """Whether the built library at `path` is whole: its bytes match the checksum written beside
  it at build time (a library truncated by a full disk or a killed copy does not, and loading
  one kills the process with a bus error)."""
  try:
    return _checksum_path(path).read_text().strip() == _digest(path)
  except OSError:
    return False


def ensure_built() -> pathlib.Path:
  """The library's path, building it first if this source/jaxlib/CPU has none yet, or if the
  cached one is damaged or has no checksum (it is rebuilt, with a warning naming the file)."""
  path = library_path()
  if path.exists() and _intact(path):
    return path
  if path.exists():
    logging.warning("jaxagent: the cached CPU kernel library %s does not match its checksum "
                    "(damaged, e.g. by a full disk, or built before checksums); rebuilding it",
                    path)
  _build(path)
  return path


def verdict_path() -> pathlib.Path:
  """Where `attention`'s "auto" verdict (kernel or XLA, measured once) is cached: beside the
  library, so a new source, jaxlib, flag set or CPU measures again."""
  path = library_path()
  return path.with_name(path.stem + ".auto.json")


def read_verdict() -> dict | None:
  """The cached verdict {"kernel": bool, "kernel_ms": float, "xla_ms": float} (and, once measured,
  the few-row product's {"small_matmul": bool, ...}: `attention.small_products`), or None if no
  attention verdict was measured here yet (or the file is unreadable)."""
  verdict = _read_verdict_file()
  ok = isinstance(verdict, dict) and isinstance(verdict.get("kernel"), bool) and all(
      isinstance(verdict.get(k), (int, float)) for k in ("kernel_ms", "xla_ms"))
  return verdict if ok else None


def _read_verdict_file() -> dict:
  try:
    verdict = json.loads(verdict_path().read_text())
  except (OSError, ValueError):
    return {}
  return verdict if isinstance(verdict, dict) else {}


def write_verdict(verdict: dict) -> None:
  """Caches `verdict` atomically (a temporary file renamed into place), over the entries already
  cached: the attention verdict and the few-row product's are measured apart and kept side by
  side."""
  path = verdict_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  merged = {**_read_verdict_file(), **verdict, "cpu": _cpu_name()}
  fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
  with os.fdopen(fd, "w") as f:
    json.dump(merged, f)
  os.replace(tmp, path)


def read_small_verdict() -> dict | None:
  """The cached few-row product verdict {"small_matmul": bool, "small_ms": float, "xla_ms":
  float} (`attention.small_products`), or None where none was measured for this build."""
  v = _read_verdict_file()
  ok = isinstance(v.get("small_matmul"), bool) and all(
      isinstance(v.get(k), (int, float)) for k in ("small_matmul_ms", "xla_matmul_ms"))
  return {k: v[k] for k in ("small_matmul", "small_matmul_ms", "xla_matmul_ms")} if ok else None


def load() -> None:
  """Builds (once per source/jaxlib/CPU) and registers the kernels (once per process); raises
  KernelUnavailable saying why it cannot."""
  with _LOCK:
    if "error" in _STATE:
      raise KernelUnavailable(_STATE["error"])
    if "lib" in _STATE:
      return
    try:
      lib = ctypes.cdll.LoadLibrary(str(ensure_built()))
      if not _REGISTERED:
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxagentCacheAttention),
                                    platform="cpu")
        for target, fn in ((_WRITE_TARGET, lib.JaxagentCacheAttentionWrite),
                           (_MATMUL_TARGET, lib.JaxagentSmallMatmul)):
          jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
        _REGISTERED.append(_TARGET)
    except (KernelUnavailable, OSError, AttributeError) as e:
      _STATE["error"] = str(e)
      logging.warning("jaxagent: the CPU cache-attention kernel is unavailable, using XLA's path "
                      "(slower decode): %s", e)
      raise KernelUnavailable(str(e)) from None
    _STATE["lib"] = lib


def available() -> bool:
  try:
    load()
  except KernelUnavailable:
    return False
  return True


def _check(q, k_all, v_all, name: str):
  b, kh, _, hd = q.shape
  if k_all.shape[1:4] != (b, kh, hd) or v_all.shape[:3] != k_all.shape[:3] or \
      v_all.shape[3:] != (k_all.shape[4], hd):
    raise ValueError(f"{name}: q {q.shape}, k {k_all.shape}, v {v_all.shape}")


def _partials_out(q):
  b, kh, r, hd = q.shape
  return (jax.ShapeDtypeStruct((b, kh, r), jnp.float32),
          jax.ShapeDtypeStruct((b, kh, r), jnp.float32),
          jax.ShapeDtypeStruct((b, kh, r, hd), jnp.float32))


def cache_attention_partials(q, k_all, v_all, layer, length):
  """Softmax partials of queries over a KV cache's valid slots, read in place.

  q [B, K, R, hd] float32 (the R queries of each kv head); k_all [layers, B, K, hd, S] and
  v_all [layers, B, K, S, hd] float32, read at `layer`; length [B] valid slots per row. Returns
  (m [B, K, R], den [B, K, R], acc [B, K, R, hd]): per query the max scaled score, the sum of
  exp(score - m) and the sum of exp(score - m) * value over slots [0, length). A row with no slot
  gets m = -1e30, den = 0, acc = 0.
  """
  load()
  _check(q, k_all, v_all, "cache_attention_partials")
  call = jax.ffi.ffi_call(_TARGET, _partials_out(q), vmap_method="sequential")
  return call(q.astype(jnp.float32), k_all, v_all, jnp.asarray(layer, jnp.int32),
              length.astype(jnp.int32), scale=np.float32(q.shape[-1] ** -0.5))


def cache_attention_write(q, k_all, v_all, layer, length, k_new, v_new):
  """A chunk's whole attention over the cache and itself, with its keys and values written in.

  First k_new, v_new [B, K, L, hd] go into slots [length, length + L) of `layer` (slots past the
  capacity are dropped), in place: the new cache's buffers are the old ones (XLA aliases them),
  so a decode loop that carries the cache never copies it. Then the softmax partials as
  `cache_attention_partials`', but causal over the chunk: q [B, K, R, hd] holds R = G x L
  queries (G query heads x L chunk positions, position fastest), and the query at chunk position
  i sees slots [0, length + i + 1) (the cache's valid slots, then the chunk up to itself). Every
  query sees at least its own slot, so acc / den is its attention output.

  Returns (m, den, acc, k_all, v_all)."""
  load()
  _check(q, k_all, v_all, "cache_attention_write")
  b, kh, _, hd = q.shape
  if k_new.shape != v_new.shape or k_new.shape[:2] != (b, kh) or k_new.shape[3] != hd:
    raise ValueError(f"cache_attention_write: k_new {k_new.shape}, v_new {v_new.shape} for "
                     f"q {q.shape}: want [B, K, L, hd]")
  out = _partials_out(q) + (jax.ShapeDtypeStruct(k_all.shape, jnp.float32),
                            jax.ShapeDtypeStruct(v_all.shape, jnp.float32))
  call = jax.ffi.ffi_call(_WRITE_TARGET, out, input_output_aliases={1: 3, 2: 4})
  return call(q.astype(jnp.float32), k_all, v_all, jnp.asarray(layer, jnp.int32),
              length.astype(jnp.int32), k_new.astype(jnp.float32), v_new.astype(jnp.float32),
              scale=np.float32(hd ** -0.5))


def vector_lanes() -> int:
  """Floats per vector of the loaded build: 16 on AVX-512 hosts, 8 on AVX2 ones (where XLA's
  few-row products measured 2-3x faster than `small_matmul`, and the decoder keeps them)."""
  load()
  return int(_STATE["lib"].JaxagentVectorLanes())


def small_matmul(x, w):
  """x [M, K] @ w [K, N] in float32 for a few rows (a decode step's batch), reading w once over
  all threads (they split K). XLA:CPU's products run such steps at a fraction of the machine's
  bandwidth."""
  load()
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"small_matmul: x {x.shape}, w {w.shape}: want [M, K] and [K, N]")
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(_MATMUL_TARGET, out)(x.astype(jnp.float32), w.astype(jnp.float32))
