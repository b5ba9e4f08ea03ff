"""The machine the benchmark runs on: its name, its practical limits, and the clock every section
reads.

The limits are measured, not looked up: the peak is the FLOP/s of a jitted float32 matmul (best
of several runs) and the bandwidth the bytes/s of a jitted sum over a large array (best of
several). Every other section's MFU and decode bound are fractions of these two numbers
(`jaxagent.bench.report.with_limits`); the accounting itself is `jaxagent.planning.flops`'s.

Timing rules, shared by every section: a program runs once untimed first (its compilation), then
`repeats` timed runs whose median is reported (`timed`); the limits take the best run instead
(`best_of`: a limit is what the machine can do, a slow run says only that it was busy).
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from jaxagent.planning.flops import matmul_flops


def once(fn) -> float:
  """Seconds of one call of `fn`."""
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def timed(fn, repeats: int):
  """(median seconds, last output) over `repeats` runs (at least one) after one untimed run (the
  compilation)."""
  out = fn()
  times = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def best_of(fn, repeats: int) -> float:
  """The fastest of `repeats` timed calls of `fn` after one untimed call, in seconds."""
  fn()
  return min(once(fn) for _ in range(max(1, repeats)))


def peak_matmul_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
  """FLOP/s of a jitted n^3 matmul in `dtype` (default float32), best of `repeats` (the
  machine's practical peak)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), dtype)
  b = jax.random.normal(k2, (n, n), dtype)
  f = jax.jit(lambda a, b: a @ b)
  return matmul_flops(n, n, n) / best_of(lambda: f(a, b).block_until_ready(), repeats)


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
  """Bytes/s of a jitted sum over a float32 array of `mib` MiB, best of `repeats`."""
  x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  return mib * 2 ** 20 / best_of(lambda: f(x).block_until_ready(), repeats)


def cpu_name() -> str:
  """The CPU's model name and core count (from /proc/cpuinfo where there is one)."""
  name = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          name = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  return f"{name}, {os.cpu_count()} cores"


def describe() -> dict:
  """The machine in words: CPU, devices, backend and jax version (no measurement)."""
  return {"cpu": cpu_name(), "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
          "backend": jax.default_backend(), "jax": jax.__version__}


def limits(matmul_size: int = 2048, bandwidth_mib: int = 512, repeats: int = 5) -> dict:
  """One measurement of the limits: {"peak_flops": FLOP/s, "bandwidth": bytes/s}."""
  return {"peak_flops": peak_matmul_flops(matmul_size, repeats),
          "bandwidth": read_bandwidth(bandwidth_mib, repeats)}


def machine_section(first: dict, last: dict) -> dict:
  """The machine's section from two measurements of its `limits` (at the start and at the end of
  the run): on a shared or frequency-scaled machine one can come out low, so the best of the two
  is the limit (the MFU and bound fractions are then conservative). GFLOP/s and GB/s, each with
  its two runs."""
  peaks = [first["peak_flops"] / 1e9, last["peak_flops"] / 1e9]
  bws = [first["bandwidth"] / 1e9, last["bandwidth"] / 1e9]
  return {**describe(), "peak_gflops_runs": peaks, "bandwidth_gbs_runs": bws,
          "peak_gflops": max(peaks), "bandwidth_gbs": max(bws)}
