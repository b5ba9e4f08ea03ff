"""The CPU cache-attention kernel: its softmax partials against float64 numpy (ragged, empty and
full rows, every compiled head size and the generic one; on x86-64 both the host's build and the
build without AVX-512, so each vector code path is checked on any machine), the decoder's kernel
path against its XLA paths, rollouts that are token for token the XLA path's on all four
environments, and how the path is chosen and what a missing compiler does."""

from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import platform
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.kernels import cpu
from jaxagent.models import attention, decoder, from_pretrained
from jaxagent.models.config import ATTENTION_ENV
from jaxagent.models.scoring import score, token_logprobs
from jaxagent.rollout import rollout


_NO_AVX512 = ("jaxagent_test_noavx512_attention", "jaxagent_test_noavx512_write",
              "jaxagent_test_noavx512_matmul")


def _builds():
  """The kernel's builds whose results the float64 checks compare: the host's (-march=native),
  and on x86-64 also the one without AVX-512 (-mno-avx512f), the 8-float-vector code path that
  AVX2-only hosts (AMD Zen 3) compile, so an AVX-512 machine's run checks both paths (on an
  AVX2 host the two are the same build)."""
  return ["native", "no-avx512"] if platform.machine().lower() in ("x86_64", "amd64") else \
      ["native"]


@pytest.fixture(params=_builds())
def build(request, monkeypatch, tmp_path_factory):
  """Points cpu's custom calls at the named build of the kernel for this test (traced calls read
  the target names; each test jits a fresh closure, so no trace of another build is reused)."""
  cpu.load()
  if request.param == "no-avx512":
    if not _REGISTERED_OTHER:
      out = tmp_path_factory.mktemp("kernel") / "no_avx512.so"
      res = subprocess.run(["g++", *cpu._FLAGS, "-mno-avx512f", f"-I{jax.ffi.include_dir()}",
                            str(cpu._SOURCE), "-o", str(out)], capture_output=True, text=True)
      assert res.returncode == 0, res.stderr[-2000:]
      lib = ctypes.cdll.LoadLibrary(str(out))
      for name, fn in zip(_NO_AVX512, (lib.JaxagentCacheAttention,
                                       lib.JaxagentCacheAttentionWrite, lib.JaxagentSmallMatmul)):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
      _REGISTERED_OTHER.append(lib)
    for attr, name in zip(("_TARGET", "_WRITE_TARGET", "_MATMUL_TARGET"), _NO_AVX512):
      monkeypatch.setattr(cpu, attr, name)
  return request.param


_REGISTERED_OTHER: list = []    # the no-AVX-512 library, once registered in this process


def _reference(q, k, v, length):
  """float64 partials over slots [0, length) of each row: q [B,K,R,hd], k [B,K,hd,S],
  v [B,K,S,hd]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, kh, r, hd = q.shape
  sc = np.einsum("bkrd,bkds->bkrs", q, k) * hd ** -0.5
  ok = np.arange(k.shape[-1])[None, :] < np.asarray(length)[:, None]
  sc = np.where(ok[:, None, None, :], sc, -np.inf)
  m = sc.max(-1)
  p = np.where(ok[:, None, None, :], np.exp(sc - np.where(np.isinf(m), 0, m)[..., None]), 0)
  return np.where(np.isinf(m), -1e30, m), p.sum(-1), np.einsum("bkrs,bksd->bkrd", p, v)


# Head sizes 32, 64 and 128 take the register-tiled path (r = 64: a 32-query chunk of 2 query
# heads; 13 and 7 leave remainders of every register block size); 24 the generic one.
@pytest.mark.parametrize("hd, r", [(32, 2), (64, 5), (128, 1), (24, 3), (32, 64), (64, 13),
                                   (128, 7), (24, 9)])
def test_partials_equal_float64_reference(hd, r, build):
  rng = np.random.default_rng(hd + r)
  layers, b, kh, s = 3, 9, 2, 77          # S not a multiple of the 64-slot (or 32-slot) tiles
  q = rng.normal(size=(b, kh, r, hd)).astype(np.float32)
  k_all = rng.normal(size=(layers, b, kh, hd, s)).astype(np.float32)
  v_all = rng.normal(size=(layers, b, kh, s, hd)).astype(np.float32)
  # Empty, tiny, the tiles' edges, and full (its last tile runs past the capacity).
  length = np.array([0, 1, 31, 32, 63, 64, 65, 76, s], np.int32)
  for layer in (0, 2):
    m, den, acc = jax.jit(lambda *a: cpu.cache_attention_partials(*a))(q, k_all, v_all, layer,
                                                                         length)
    rm, rden, racc = _reference(q, k_all[layer], v_all[layer], length)
    np.testing.assert_allclose(np.asarray(m), rm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(den), rden, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(acc), racc, rtol=1e-4, atol=1e-4)
  # The empty row is exactly the identity of the softmax merge.
  assert np.all(np.asarray(m)[0] == -1e30) and np.all(np.asarray(den)[0] == 0)
  assert np.all(np.asarray(acc)[0] == 0)


def test_partials_under_vmap_equal_each_call():
  rng = np.random.default_rng(1)
  q = rng.normal(size=(3, 2, 2, 1, 32)).astype(np.float32)       # a leading axis of 3
  k = rng.normal(size=(3, 1, 2, 2, 32, 16)).astype(np.float32)
  v = rng.normal(size=(3, 1, 2, 2, 16, 32)).astype(np.float32)
  length = np.array([[5, 16], [0, 3], [16, 1]], np.int32)
  got = jax.vmap(lambda *a: cpu.cache_attention_partials(*a[:3], 0, a[3]))(q, k, v, length)
  for i in range(3):
    want = cpu.cache_attention_partials(q[i], k[i], v[i], 0, length[i])
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))


def test_partials_reject_mismatched_shapes():
  q = jnp.zeros((2, 2, 1, 32))
  with pytest.raises(ValueError, match="cache_attention_partials"):
    cpu.cache_attention_partials(q, jnp.zeros((1, 2, 2, 16, 8)), jnp.zeros((1, 2, 2, 8, 32)), 0,
                                 jnp.zeros((2,), jnp.int32))


def _causal_reference(q, k, v, length, l):
  """float64 (m, den, acc) of q [B,K,R,hd] (R = G x L, chunk position r % L) over the written
  cache k [B,K,hd,S], v [B,K,S,hd]: query r sees slots [0, min(length + r % L + 1, S))."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, kh, r, hd = q.shape
  sc = np.einsum("bkrd,bkds->bkrs", q, k) * hd ** -0.5
  seen = np.minimum(np.asarray(length)[:, None] + np.arange(r)[None, :] % l + 1, k.shape[-1])
  ok = np.arange(k.shape[-1])[None, None, :] < seen[:, :, None]            # [B, R, S]
  sc = np.where(ok[:, None], sc, -np.inf)
  m = sc.max(-1)
  p = np.exp(sc - m[..., None])
  return m, p.sum(-1), np.einsum("bkrs,bksd->bkrd", p, v)


# Tiled head sizes (32, 64, 128) and the generic one (24, one query per row only); chunks of 1
# to 70 positions, crossing the 64-slot tiles, with 1 to 3 query heads per kv head.
@pytest.mark.parametrize("hd, g, l", [(32, 2, 3), (64, 1, 70), (128, 3, 5), (32, 2, 1),
                                      (24, 2, 1), (32, 1, 25)])
def test_write_puts_the_chunk_in_place_then_reads_causally(hd, g, l, build):
  """`cache_attention_write`: the chunk's keys and values at slots [length, length + L) of the
  one layer, dropped past the capacity, every other slot and layer as it was; then each query's
  partials over the written cache up to its own slot, against float64."""
  rng = np.random.default_rng(hd + g + l)
  layers, b, kh, s = 2, 6, 2, 150
  q = rng.normal(size=(b, kh, g * l, hd)).astype(np.float32)
  k_all = rng.normal(size=(layers, b, kh, hd, s)).astype(np.float32)
  v_all = rng.normal(size=(layers, b, kh, s, hd)).astype(np.float32)
  k_new = rng.normal(size=(b, kh, l, hd)).astype(np.float32)
  v_new = rng.normal(size=(b, kh, l, hd)).astype(np.float32)
  # Empty, a tile's edge, mid-tile, and rows whose chunk overruns the capacity.
  length = np.array([0, 63, 100, s - l, s - 1, s], np.int32)
  got = jax.jit(lambda *a: cpu.cache_attention_write(*a))(q, k_all, v_all, 1, length, k_new,
                                                        v_new)
  k_ref, v_ref = k_all.copy(), v_all.copy()
  for i, n in enumerate(length):
    for j in range(min(l, s - n)):
      k_ref[1, i, :, :, n + j] = k_new[i, :, j]
      v_ref[1, i, :, n + j] = v_new[i, :, j]
  np.testing.assert_array_equal(np.asarray(got[3]), k_ref)
  np.testing.assert_array_equal(np.asarray(got[4]), v_ref)
  rm, rden, racc = _causal_reference(q, k_ref[1], v_ref[1], length, l)
  np.testing.assert_allclose(np.asarray(got[0]), rm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[1]), rden, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(got[2]), racc, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="cache_attention_write: k_new"):
    cpu.cache_attention_write(q, k_all, v_all, 1, length, k_new[:, :, :, :16], v_new)


# Rows 1 to 17 (past one 16-row register block; 12: an 8-row and a 4-row block of the AVX2 path),
# K not a multiple of the 8-row groups or split evenly over the threads, N with and without a
# tail past the 16- (8-) column vectors.
@pytest.mark.parametrize("m, k, n", [(1, 100, 48), (3, 40, 37), (8, 768, 256), (16, 130, 17),
                                     (17, 64, 160), (5, 7, 5), (12, 96, 44)])
def test_small_matmul_equals_float64_product(m, k, n, build):
  rng = np.random.default_rng(m * k + n)
  x = rng.normal(size=(m, k)).astype(np.float32)
  w = rng.normal(size=(k, n)).astype(np.float32)
  got = np.asarray(jax.jit(lambda *a: cpu.small_matmul(*a))(x, w))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4 * np.sqrt(k))
  with pytest.raises(ValueError, match="small_matmul"):
    cpu.small_matmul(x, w[:-1])


@pytest.fixture
def micro():
  return from_pretrained("builtin:micro")


def _at(policy, mode: str):
  """`policy` with its attention switch (`ModelConfig.attention`) at `mode`."""
  return dataclasses.replace(policy, config=dataclasses.replace(policy.config, attention=mode))


def _logits_after_prompt(policy, mode, monkeypatch, block, prompt_lens, chunk_lens, cap):
  """Logits of a ragged chunk (one token per row: a decode step; more: observation prefill)
  appended to a cache that holds a ragged prompt; positions past a row's chunk are zeroed."""
  policy = _at(policy, mode)
  cfg, params = policy.config, policy.params
  b, width = len(prompt_lens), max(chunk_lens)
  rng = np.random.default_rng(0)
  cache = decoder.init_cache(cfg, b, cap)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(b, max(prompt_lens))), jnp.int32)
  _, cache = decoder.apply(cfg, params, prompt, cache=cache,
                           chunk_lens=jnp.asarray(prompt_lens, jnp.int32), cache_block=block)
  chunk = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(b, width)), jnp.int32)
  lens = jnp.asarray(chunk_lens, jnp.int32)
  step = jax.jit(lambda p, t, c: decoder.apply(cfg, p, t, cache=c, chunk_lens=lens,
                                               cache_block=block))
  out, cache = step(params, chunk, cache)
  out = np.where((np.arange(width)[None, :] < np.asarray(lens)[:, None])[..., None], out, 0.0)
  return out, _valid_slots(cache)


def _valid_slots(cache):
  """The cache's keys and values with every slot past a row's length zeroed."""
  ok = np.arange(cache.k.shape[-1])[None, :] < np.asarray(cache.length)[:, None]     # [B, S]
  return (np.where(ok[None, :, None, None, :], cache.k, 0.0),
          np.where(ok[None, :, None, :, None], cache.v, 0.0))


def _assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _decode_logits(policy, mode, monkeypatch, block):
  # Ragged prompts, one row with no context; a one-token step on every row.
  return _logits_after_prompt(policy, mode, monkeypatch, block, [0, 1, 7, 24, 24], [1] * 5, 40)


def test_decoder_kernel_path_equals_blocked_and_dense(micro, monkeypatch):
  """Logits and the written cache (the kernel writes it in the same call that reads it)."""
  kernel = _decode_logits(micro, "kernel", monkeypatch, 16)
  for block in (16, 40):                                     # blocked (overlapping tail), dense
    _assert_close(kernel, _decode_logits(micro, "xla", monkeypatch, block))


def _chunk_logits(policy, mode, monkeypatch, block):
  # A ragged 9-token chunk (one row empty) after ragged prompts: observation prefill.
  return _logits_after_prompt(policy, mode, monkeypatch, block, [0, 3, 17, 30, 30],
                              [9, 0, 4, 9, 1], 48)


def test_decoder_kernel_chunks_equal_blocked_and_dense(micro, monkeypatch):
  kernel = _chunk_logits(micro, "kernel", monkeypatch, 16)
  for block in (16, 48):
    _assert_close(kernel, _chunk_logits(micro, "xla", monkeypatch, block))


def _decode_loop(policy, params, steps: int = 4):
  """A jitted loop of one-token steps after a ragged prompt (the cache donated, as a rollout
  carries it): (its logits, the cache's valid slots, the compiled program's text)."""
  cfg, b = policy.config, 3

  def run(params, cache):
    p = decoder.for_decode(cfg, params)
    _, cache = decoder.apply(cfg, p, jnp.full((b, 5), 7, jnp.int32), cache=cache,
                             chunk_lens=jnp.array([5, 2, 0], jnp.int32))

    def body(i, carry):
      c, acc = carry
      logits, c = decoder.apply(cfg, p, jnp.full((b, 1), i + 3, jnp.int32), cache=c)
      return c, acc + logits[:, 0]
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((b, cfg.vocab_size))))

  fn = jax.jit(run, donate_argnums=1)
  cache = decoder.init_cache(cfg, b, 16)
  text = fn.lower(params, cache).compile().as_text()
  cache, acc = fn(params, cache)
  return np.asarray(acc), _valid_slots(cache), text


def test_decode_loop_with_the_kernel_writes_the_cache_in_place(micro, monkeypatch):
  """With the kernel, the layers are unstacked (q/k/v and gate/up fused) once before the loop,
  each layer's call writes its keys and values in place, and the compiled loop copies neither
  the cache nor a weight; the result is XLA's (its scan over the stacked layers with one scatter
  per step)."""
  xla, micro = _at(micro, "xla"), _at(micro, "kernel")
  assert decoder.for_decode(xla.config, xla.params) is xla.params
  want = _decode_loop(xla, xla.params)
  unstacked = decoder.for_decode(micro.config, micro.params)
  assert len(unstacked["layers"]) == micro.config.num_layers
  assert {"qkv_proj", "gate_up_proj"} <= set(unstacked["layers"][0])       # fused products
  assert "q_proj" not in unstacked["layers"][0]
  cfg, w = micro.config, micro.params["layers"]["gate_proj"]
  cache_k = f"f32[{cfg.num_layers},3,{cfg.num_kv_heads},{cfg.head_dim},16]"
  weight = "f32[{},{}]".format(*w.shape[1:])
  for params in (micro.params, unstacked):                   # either form of the layers
    got = _decode_loop(micro, params)
    _assert_close(got[:2], want[:2])
    assert "jaxagent_cache_attention_write" in got[2] and "scatter" not in got[2]
    assert not _made_in_loop(got[2], cache_k) and not _made_in_loop(got[2], weight)
  # The check sees copies: XLA's loop slices each layer's weights out of the stack every step.
  assert _made_in_loop(want[2], weight)


def test_path_choice(monkeypatch):
  q = jnp.zeros((2, 2, 2, 1, 32))
  k, v = jnp.zeros((1, 2, 2, 32, 8)), jnp.zeros((1, 2, 2, 8, 32))
  assert attention.use_kernel("kernel", q, k, v)
  assert attention.use_kernel("kernel", jnp.zeros((2, 2, 2, 3, 32)), k, v)   # a tiled head size
  k24, v24 = jnp.zeros((1, 2, 2, 24, 8)), jnp.zeros((1, 2, 2, 8, 24))
  assert attention.use_kernel("kernel", jnp.zeros((2, 2, 2, 1, 24)), k24, v24)   # steps ...
  assert not attention.use_kernel("kernel", jnp.zeros((2, 2, 2, 3, 24)), k24, v24)   # not chunks
  assert not attention.use_kernel("kernel", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                  v.astype(jnp.bfloat16))
  assert not attention.use_kernel("auto", q, k, v)      # this test process has 8 devices
  assert not attention.use_kernel("xla", q, k, v)
  with pytest.raises(ValueError, match="use auto, xla, kernel or dot_product"):
    attention.use_kernel("fast", q, k, v)


def test_the_switch_defaults_from_the_environment_and_rejects_bad_values(micro, monkeypatch):
  monkeypatch.delenv(ATTENTION_ENV, raising=False)
  assert dataclasses.replace(micro.config).attention == "auto"
  monkeypatch.setenv(ATTENTION_ENV, "XLA")
  assert from_pretrained("builtin:micro").config.attention == "xla"
  monkeypatch.setenv(ATTENTION_ENV, "bogus")
  with pytest.raises(ValueError, match="JAXAGENT_CACHE_ATTENTION='bogus'.*unset it"):
    from_pretrained("builtin:micro")
  with pytest.raises(ValueError, match="ModelConfig.attention='fast'"):
    dataclasses.replace(micro.config, attention="fast")


def test_a_missing_compiler_is_reported_and_falls_back(monkeypatch, tmp_path, caplog):
  monkeypatch.setattr(cpu, "_STATE", {})
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path))
  monkeypatch.setenv("CXX", "no-such-compiler-xyz")
  assert not cpu.available()
  assert "no C++ compiler 'no-such-compiler-xyz'" in caplog.text
  with pytest.raises(cpu.KernelUnavailable, match="install g\\+\\+"):
    cpu.load()
  assert list(tmp_path.iterdir()) == []                     # nothing half-written left behind
  with pytest.raises(cpu.KernelUnavailable):
    attention.use_kernel("kernel", jnp.zeros((1, 1, 1, 1, 8)), jnp.zeros((1, 1, 1, 8, 4)),
                         jnp.zeros((1, 1, 1, 4, 8)))


def test_the_library_is_built_once_per_source_and_cpu(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path))
  path = cpu.library_path()
  assert path.parent == tmp_path and not path.exists()
  assert cpu.ensure_built() == path
  assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]
  stamp = path.stat().st_mtime_ns
  assert cpu.ensure_built() == path and path.stat().st_mtime_ns == stamp    # no rebuild
  monkeypatch.setattr(cpu, "_FLAGS", cpu._FLAGS + ["-DJAXAGENT_OTHER"])
  assert cpu.library_path() != path                          # other flags: another library


def test_a_damaged_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path, caplog):
  """A library cut short (a full disk during the build or a copy) kills the process that loads
  it with a bus error: its checksum is checked first and it is rebuilt, with a warning."""
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path))
  path = cpu.ensure_built()
  whole = path.read_bytes()
  path.write_bytes(whole[:len(whole) // 3])
  assert cpu.ensure_built() == path and path.read_bytes() == whole
  assert f"{path} does not match its checksum" in caplog.text
  (tmp_path / (path.name + ".sha256")).unlink()              # no checksum (an older build)
  caplog.clear()
  assert cpu.ensure_built() == path and "rebuilding it" in caplog.text
  assert cpu._intact(path)


def test_the_auto_verdict_is_cached_beside_the_library(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path))
  assert cpu.read_verdict() is None
  cpu.write_verdict({"kernel": False, "kernel_ms": 2.5, "xla_ms": 1.5})
  assert cpu.verdict_path().parent == tmp_path
  assert cpu.read_verdict()["kernel"] is False
  cpu.verdict_path().write_text("{not json")               # damaged: measured again
  assert cpu.read_verdict() is None
  monkeypatch.setattr(cpu, "_FLAGS", cpu._FLAGS + ["-DJAXAGENT_OTHER"])
  assert cpu.read_verdict() is None                          # another build: its own verdict


def test_the_small_product_verdict_is_kept_beside_the_attention_verdict(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path))
  assert cpu.read_small_verdict() is None
  cpu.write_verdict({"small_matmul": True, "small_matmul_ms": 1.0, "xla_matmul_ms": 2.0})
  assert cpu.read_verdict() is None                   # no attention verdict yet: measured then
  cpu.write_verdict({"kernel": False, "kernel_ms": 2.5, "xla_ms": 1.5})
  assert cpu.read_verdict()["kernel"] is False
  assert cpu.read_small_verdict() == {"small_matmul": True, "small_matmul_ms": 1.0,
                                      "xla_matmul_ms": 2.0}
  cpu.write_verdict({"small_matmul": False, "small_matmul_ms": 3.0, "xla_matmul_ms": 2.0})
  assert cpu.read_small_verdict()["small_matmul"] is False
  assert cpu.read_verdict()["kernel_ms"] == 2.5


def test_small_products_follow_the_cached_measurement_on_16_lane_builds(monkeypatch):
  for lanes, faster, want in ((16, True, True), (16, False, False), (8, True, False)):
    monkeypatch.setattr(attention, "_AUTO", {})
    monkeypatch.setattr(cpu, "vector_lanes", lambda lanes=lanes: lanes)
    monkeypatch.setattr(cpu, "read_small_verdict", lambda f=faster: {
        "small_matmul": f, "small_matmul_ms": 1.0, "xla_matmul_ms": 1.0})
    assert attention.small_products() is want


def test_the_small_product_measurement_times_both(monkeypatch):
  monkeypatch.setattr(attention, "_SMALL_LAYERS", 1)
  verdict = attention._measure_small(rounds=1)
  assert verdict["small_matmul_ms"] > 0 and verdict["xla_matmul_ms"] > 0
  assert verdict["small_matmul"] == (verdict["small_matmul_ms"] < verdict["xla_matmul_ms"])


def test_auto_takes_the_kernel_only_where_it_measured_faster(monkeypatch):
  """On one CPU device "auto" follows the cached measurement (this test process has 8 devices,
  where "auto" is always XLA's path, so the device count is faked here)."""
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  q = jnp.zeros((2, 2, 2, 1, 32))
  k, v = jnp.zeros((1, 2, 2, 32, 8)), jnp.zeros((1, 2, 2, 8, 32))
  for faster in (True, False):
    monkeypatch.setattr(attention, "_AUTO", {})
    monkeypatch.setattr(cpu, "read_verdict", lambda f=faster: {"kernel": f, "kernel_ms": 1.0,
                                                                "xla_ms": 1.0})
    assert attention.use_kernel("auto", q, k, v) is faster


def test_the_auto_measurement_times_both_paths():
  verdict = attention._measure_auto(rounds=1)
  assert verdict["kernel_ms"] > 0 and verdict["xla_ms"] > 0
  assert verdict["kernel"] == (verdict["kernel_ms"] < verdict["xla_ms"])


@pytest.mark.parametrize("name", envs.jax_names())
def test_rollout_with_the_kernel_equals_xla(name, micro, monkeypatch):
  env = envs.make(name, micro.tokenizer)
  out = {}
  for mode in ("xla", "kernel"):
    out[mode] = rollout(_at(micro, mode), env, jax.random.key(3), 3, 2, budgets=3, max_turns=3,
                        max_action_tokens=8, temperature=1.0)
  a, b = out["xla"], out["kernel"]
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.behaviour_logprobs), np.asarray(b.behaviour_logprobs),
                             atol=1e-5)
  mask = np.asarray(b.loss_mask) > 0
  assert mask.sum() > 20
  rescored = np.asarray(score(micro, b, temperature=1.0))
  np.testing.assert_allclose(rescored[mask], np.asarray(b.behaviour_logprobs)[mask], atol=1e-5)


def _scores_and_grads(policy, mode, monkeypatch):
  """Log-probs and their gradient wrt the parameters, three right-padded rows of up to 300
  tokens (query blocks of 128: [0, 128), [128, 256), [256, 300))."""
  policy = _at(policy, mode)
  cfg = policy.config
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(3, 300)), jnp.int32)
  length = jnp.array([300, 170, 5], jnp.int32)

  def loss(params):
    lp = token_logprobs(cfg, params, tokens, length)
    return jnp.sum(lp * jnp.linspace(0.5, 1.5, 300)), lp

  (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(policy.params)
  return np.asarray(lp), grads


def test_scoring_and_its_gradient_with_the_kernel_equal_xla(micro, monkeypatch):
  """The causal attention without a cache (the update's passes) reads the keys before each query
  block with the kernel when rows are right-padded (`apply(lengths=...)`)."""
  lp_k, g_k = _scores_and_grads(micro, "kernel", monkeypatch)
  lp_x, g_x = _scores_and_grads(micro, "xla", monkeypatch)
  np.testing.assert_allclose(lp_k, lp_x, rtol=1e-5, atol=1e-5)
  assert np.all(lp_k[2, 5:] == 0) and np.all(lp_k[1, 170:] == 0)
  for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_kernel_is_in_the_scoring_program(micro, monkeypatch):
  tokens, length = jnp.zeros((2, 300), jnp.int32), jnp.array([300, 9], jnp.int32)
  for mode, calls in (("kernel", True), ("xla", False)):
    cfg = _at(micro, mode).config
    text = jax.jit(lambda p: token_logprobs(cfg, p, tokens, length)).lower(micro.params).as_text()
    assert ("jaxagent_cache_attention" in text) == calls


def _made_in_loop(hlo: str, shape: str) -> list[str]:
  """Instructions of the program's loop bodies that make a new `shape` array (not a view: a
  parameter, tuple element or bitcast)."""
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  made, inside = [], False
  for line in hlo.splitlines():
    head = re.match(r"%([\w.\-]+) ", line)
    if head and line.rstrip().endswith("{"):
      inside = head.group(1) in bodies
    elif inside and re.search(rf"= {re.escape(shape)}\{{[\d,]*\}} (?!parameter|get-tuple-element"
                              r"|bitcast)", line):
      made.append(line.strip()[:120])
  return made


def test_the_build_reports_its_vector_width_and_decode_products_follow_it(build, micro,
                                                                          monkeypatch):
  """16 lanes on AVX-512 builds, 8 on AVX2 ones; kernel decode steps take the few-row product
  only on 16-lane builds where it measured faster than XLA's (on 8-lane ones XLA's products
  measured 2-3x faster)."""
  flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() \
      else ""
  if build == "no-avx512":
    assert _REGISTERED_OTHER[0].JaxagentVectorLanes() == 8
  else:
    assert cpu.vector_lanes() == (16 if " avx512f" in flags else 8)
  cfg = _at(micro, "kernel").config
  params = decoder.for_decode(cfg, micro.params)
  cache = decoder.init_cache(cfg, 2, 16)
  for lanes, faster, small in ((16, True, True), (16, False, False), (8, True, False)):
    monkeypatch.setattr(cpu, "vector_lanes", lambda lanes=lanes: lanes)
    monkeypatch.setattr(attention, "_AUTO", {"small_matmul": faster})   # the measured verdict
    step = lambda p, c: decoder.apply(cfg, p, jnp.ones((2, 1), jnp.int32), cache=c)[0]  # new trace
    text = jax.jit(step).lower(params, cache).as_text()
    assert (cpu._MATMUL_TARGET in text) == small
    assert cpu._WRITE_TARGET in text
