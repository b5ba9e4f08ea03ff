"""Attention paths of the decoder, and the one switch that picks among them.

`ModelConfig.attention` ("auto", "xla" or "kernel"; its default comes from
JAXAGENT_CACHE_ATTENTION) is a static field, so it is part of the key of every compiled program:
switching it builds a new program and never reuses one traced for the other path.

* XLA's paths run on every backend: over a KV cache `cache_attention` reads the valid slots in
  blocks (an online softmax, as in flash decoding) or in one masked product; without a cache
  `causal_attention` runs query blocks with a written-out, flash-style gradient.
* The CPU kernel (`jaxagent.kernels.cpu`, float32 on XLA:CPU) reads each row's valid slots in
  place: decode steps and prefill chunks over the cache (`write_attention` also writes the
  chunk's keys and values), and the keys before each query block of the no-cache forward.

`kernel_enabled(impl)` decides: "xla" never takes the kernel; "kernel" takes it on CPU wherever
it applies and fails if it cannot be built; "auto" takes it only on one CPU device, and only
where a short measurement at first use (a decode step's layer both ways, `_measure_auto`) found
it faster than XLA on this machine. The verdict is cached beside the kernel's build, which is
per source, jaxlib, flags and CPU, so each machine measures once.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.kernels import cpu

# Cache slots per block of the blocked attention over a KV cache (see `cache_attention`).
CACHE_BLOCK = 128
# Queries per block of the causal attention without a cache (see `causal_attention`).
QUERY_BLOCK = 128
_NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free
_AUTO: dict = {}   # the process's verdicts once known: {"kernel": bool, "small_matmul": bool}


def kernel_enabled(impl: str) -> bool:
  """Whether float32 attention of a model whose `ModelConfig.attention` is `impl` takes the CPU
  kernel (`use_kernel` adds the shapes it applies to)."""
  if impl in ("xla", "dot_product") or jax.default_backend() != "cpu":
    return False
  if impl == "kernel":
    cpu.load()                        # raises KernelUnavailable, saying why
    return True
  if impl != "auto":
    raise ValueError(f"attention {impl!r}: use auto, xla, kernel or dot_product")
  return jax.device_count() == 1 and cpu.available() and _auto_takes_kernel()


def use_kernel(impl: str, q, k_all, v_all, chunk: bool = False) -> bool:
  """q [B, K, G, L, hd]: one-query steps at every head size; chunks (L > 1, or `chunk`) only
  at the head sizes of the kernel's tiled path."""
  shape_ok = (q.shape[3] == 1 and not chunk) or q.shape[4] in cpu.TILED_HEAD_SIZES
  return shape_ok and all(a.dtype == jnp.float32 for a in (q, k_all, v_all)) and \
      kernel_enabled(impl)


def _measured_choice(flag: str, read, measure, describe) -> bool:
  """verdict[flag] of a choice measured once per machine: read from the kernel's cached verdict
  file, else measured now (eagerly: this may run inside a trace) and cached; logged once per
  process with describe(verdict)."""
  if flag not in _AUTO:
    verdict = read()
    if verdict is None:
      with jax.ensure_compile_time_eval():
        verdict = measure()
      cpu.write_verdict(verdict)
    logging.info("jaxagent: %s (cached in %s)", describe(verdict), cpu.verdict_path())
    _AUTO[flag] = bool(verdict[flag])
  return _AUTO[flag]


def _auto_takes_kernel() -> bool:
  return _measured_choice(
      "kernel", cpu.read_verdict, lambda: _measure_auto(),
      lambda v: (f"attention auto takes {'the kernel' if v['kernel'] else 'XLA'} on this CPU "
                 f"(one layer's turn: kernel {v['kernel_ms']:.2f} ms, XLA {v['xla_ms']:.2f} ms)"))


# The measured layers: (rows, kv heads, query groups, head size, capacity, hidden, mlp), a
# builtin:micro-sized and a SmolLM2-135M-sized one. Each is timed over a turn's work: decode
# steps and an observation's prefill chunk.
_AUTO_SHAPES = ((64, 2, 2, 32, 816, 128, 384), (16, 3, 3, 64, 512, 576, 1536))
_AUTO_TURN = ((1, 16), (25, 1))       # (tokens per call, calls): 16 decode steps, one chunk


def _measure_auto(rounds: int = 5) -> dict:
  """Best-of-`rounds` time of one turn of one layer (projections, attention over ~80% full
  caches, the cache write, the MLP; `_AUTO_TURN`) through XLA's path and the kernel's,
  alternating, summed over `_AUTO_SHAPES`: {"kernel": faster?, "kernel_ms", "xla_ms"}."""
  total = {True: 0.0, False: 0.0}
  for b, kh, g, hd, s, d, f in _AUTO_SHAPES:
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.05)
    ws = dict(qkv=arr(d, (g + 2) * kh * hd), o=arr(g * kh * hd, d), up=arr(d, 2 * f),
              down=arr(f, d))
    cache = (arr(1, b, kh, hd, s), arr(1, b, kh, s, hd))
    length = jnp.asarray(rng.integers(s * 3 // 4, s * 4 // 5, b), jnp.int32)
    for c, calls in _AUTO_TURN:
      x = arr(b, c, d)
      fns = {kernel: _probe_layer(kernel, calls, (b, c, kh, g, hd)) for kernel in (True, False)}
      best: dict = {}
      for _ in range(rounds):
        for kernel, fn in fns.items():
          fn(x, ws, cache, length)[0].block_until_ready()         # compiled on the first round
          t = time.perf_counter()
          fn(x, ws, cache, length)[0].block_until_ready()
          best[kernel] = min(best.get(kernel, np.inf), time.perf_counter() - t)
      for kernel in (True, False):
        total[kernel] += best[kernel] * 1e3
  return {"kernel": total[True] < total[False], "kernel_ms": total[True], "xla_ms": total[False]}


# The few-row products a kernel decode step would hand to `cpu.small_matmul`: (rows, [(in, out)]
# per layer), SmolLM2-135M's layer (fused q/k/v, o, gate/up, down) at 16 rows, over
# `_SMALL_LAYERS` layers of distinct weights (~113 MB: read from memory, as in a decode step,
# not from cache).
_SMALL_SHAPES = (16, ((576, 960), (576, 576), (576, 3072), (1536, 576)))
_SMALL_LAYERS = 8


def small_products() -> bool:
  """Whether a kernel decode step's few-row weight products (`decoder.SMALL_MATMUL_ROWS`) take
  `cpu.small_matmul`: only on 16-lane (AVX-512) builds, and only where a measurement at first
  use (`_measure_small`) found it faster than XLA's products on this machine (cached beside the
  kernel's build with the attention verdict). On the AMD EPYC benchmark machine (AVX-512,
  2026-12-08) XLA's products were ~2x faster and SmolLM2's decode step fell from ~160 to ~100
  ms; on 8-lane builds XLA's measured 2-3x faster."""
  if cpu.vector_lanes() < 16:
    return False
  return _measured_choice(
      "small_matmul", cpu.read_small_verdict, lambda: _measure_small(),
      lambda v: (f"a kernel decode step's few-row products take "
                 f"{'small_matmul' if v['small_matmul'] else 'XLA'} on this CPU (small_matmul "
                 f"{v['small_matmul_ms']:.2f} ms, XLA {v['xla_matmul_ms']:.2f} ms)"))


def _measure_small(rounds: int = 5) -> dict:
  """Best-of-`rounds` time of `_SMALL_SHAPES`' products over `_SMALL_LAYERS` layers through
  `cpu.small_matmul` and through XLA, alternating: {"small_matmul": faster?, "small_matmul_ms",
  "xla_matmul_ms"}."""
  rows, shapes = _SMALL_SHAPES
  rng = np.random.default_rng(0)
  ws = [[jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05) for k, n in shapes]
        for _ in range(_SMALL_LAYERS)]
  xs = [jnp.asarray(rng.standard_normal((rows, k), np.float32)) for k, _ in shapes]

  def chain(product):
    def run(ws, xs):
      return sum(jnp.sum(product(x, w)) for layer in ws for x, w in zip(xs, layer))
    return jax.jit(run)

  fns = {True: chain(cpu.small_matmul), False: chain(jnp.matmul)}
  best: dict = {}
  for _ in range(rounds):
    for small, fn in fns.items():
      fn(ws, xs).block_until_ready()                  # compiled on the first round
      t = time.perf_counter()
      fn(ws, xs).block_until_ready()
      best[small] = min(best.get(small, np.inf), time.perf_counter() - t)
  return {"small_matmul": bool(best[True] < best[False]), "small_matmul_ms": best[True] * 1e3,
          "xla_matmul_ms": best[False] * 1e3}


def _probe_layer(kernel: bool, calls: int, dims: tuple):
  """`calls` chunks of one layer of `_measure_auto` through one path, jitted; x [B, C, D]."""
  b, c, kh, g, hd = dims
  nq, nk = g * kh * hd, kh * hd
  small = kernel and b * c <= 16 and small_products()
  proj = lambda a, w: (cpu.small_matmul(a.reshape(-1, w.shape[0]), w).reshape(b, c, -1)
                       if small else a @ w)
  causal = jnp.tril(jnp.ones((c, c), bool))[None].repeat(b, 0)

  def run(x, ws, cache, length):
    def call(_, carry):
      x, (k_all, v_all) = carry
      qkv = proj(x, ws["qkv"])
      q = qkv[..., :nq].reshape(b, c, kh, g, hd).transpose(0, 2, 3, 1, 4)
      k, v = (qkv[..., nq + i * nk:nq + (i + 1) * nk].reshape(b, c, kh, hd).transpose(0, 2, 1, 3)
              for i in (0, 1))
      if kernel:
        attn, k_all, v_all = write_attention(q, k_all, v_all, 0, length, k, v)
      else:
        scores = block_scores(q, k, causal, 0, c)
        attn = cache_attention("xla", q, k_all, v_all, 0, length, scores, v, CACHE_BLOCK)
        rows, slots = jnp.arange(b)[:, None], length[:, None] + jnp.arange(c)[None]
        k_all = k_all.at[0, rows, :, :, slots].set(k.transpose(0, 2, 1, 3), mode="drop")
        v_all = v_all.at[0, rows, :, slots, :].set(v.transpose(0, 2, 1, 3), mode="drop")
      x = x + proj(attn.transpose(0, 3, 1, 2, 4).reshape(b, c, nq), ws["o"])
      gate, up = jnp.split(proj(x, ws["up"]), 2, axis=-1)
      return 0.5 * (x + proj(jax.nn.silu(gate) * up, ws["down"])), (k_all, v_all)

    return jax.lax.fori_loop(0, calls, call, (x, cache))

  return jax.jit(run)


def cache_attention(impl: str, q, k_all, v_all, layer, length, scores, v, block: int):
  """Attention of a chunk's queries over the cache's valid slots plus the chunk itself.

  q [B, K, G, L, hd] (compute dtype); k_all [layers, B, K, hd, S] and v_all [layers, B, K, S, hd],
  read at `layer`; length [B] valid slots per row; scores [B, K, G, L, L] float32, the chunk's
  masked self-scores, and v [B, K, L, hd] its values. Three paths, the same result:

  * blocked (block < S): the cache is read in blocks of `block` slots up to the longest row (an
    online softmax, as in flash decoding), so a step costs the context actually used, not the
    cache's capacity, and no layer's cache is ever copied whole;
  * dense (block >= S): one masked product over the whole cache (no loop; cheaper when the
    capacity is about the context in use);
  * kernel (`use_kernel(impl, ...)`): a compiled custom call reads each row's valid slots in
    place (`jaxagent.kernels.cpu`), merged here with the chunk's own scores.
  """
  if use_kernel(impl, q, k_all, v_all):
    return _kernel_block(q, k_all, v_all, layer, length, scores, v)[0].astype(q.dtype)
  s = v_all.shape[3]
  if block >= s:
    return _dense_cache_attention(q, k_all, v_all, layer, length, scores, v)
  return _blocked_cache_attention(q, k_all, v_all, layer, length, scores, v, block)


def write_attention(q, k_all, v_all, layer, length, k, v):
  """A cache-mode chunk's attention (causal over the cache's valid slots and the chunk) in one
  kernel call that first writes the chunk's keys and values k, v [B, K, L, hd] into the cache at
  slots [length, length + L): (out [B, K, G, L, hd], k_all, v_all). No scores go through XLA
  (for a 112-token prompt chunk its own [L, L] products were ~27 GFLOP/s there)."""
  b, kh, g, l, hd = q.shape
  _, den, acc, k_all, v_all = cpu.cache_attention_write(q.reshape(b, kh, g * l, hd), k_all,
                                                        v_all, layer, length, k, v)
  out = acc / den[..., None]
  return out.reshape(b, kh, g, l, hd).astype(q.dtype), k_all, v_all


def _kernel_block(q, k_all, v_all, layer, length, scores, v):
  """(out float32, m, den) [B, K, G, L, hd | 1]: the kernel's partials over slots [0, length)
  merged with the chunk's own masked scores [B, K, G, L, L] and values v; m and den are the
  softmax's max and sum over every key the queries see."""
  b, kh, g, l, hd = q.shape
  mc, dc, ac = cpu.cache_attention_partials(q.reshape(b, kh, g * l, hd), k_all, v_all, layer,
                                            length)
  mc, dc = mc.reshape(b, kh, g, l, 1), dc.reshape(b, kh, g, l, 1)
  m = jnp.maximum(mc, jnp.max(scores, axis=-1, keepdims=True))
  p, fix = jnp.exp(scores - m), jnp.exp(mc - m)
  den = dc * fix + jnp.sum(p, axis=-1, keepdims=True)
  acc = ac.reshape(b, kh, g, l, hd) * fix + jnp.einsum(
      "bkgls,bksd->bkgld", p, v, preferred_element_type=jnp.float32)
  return acc / den, m, den


def _dense_cache_attention(q, k_all, v_all, layer, length, scores, v):
  dt = q.dtype
  hd, s = k_all.shape[3], k_all.shape[4]
  sc = jnp.einsum("bkgld,bkds->bkgls", q, k_all[layer].astype(dt),
                  preferred_element_type=jnp.float32) * hd ** -0.5
  ok = jnp.arange(s)[None, :] < length[:, None]
  sc = jnp.where(ok[:, None, None, None, :], sc, _NEG)
  m = jnp.maximum(jnp.max(sc, axis=-1, keepdims=True), jnp.max(scores, axis=-1, keepdims=True))
  pc, p = jnp.exp(sc - m), jnp.exp(scores - m)
  den = jnp.sum(pc, axis=-1, keepdims=True) + jnp.sum(p, axis=-1, keepdims=True)
  acc = jnp.einsum("bkgls,bksd->bkgld", pc.astype(dt), v_all[layer].astype(dt),
                   preferred_element_type=jnp.float32)
  acc = acc + jnp.einsum("bkgls,bksd->bkgld", p.astype(dt), v, preferred_element_type=jnp.float32)
  return (acc / den).astype(dt)


def _blocked_cache_attention(q, k_all, v_all, layer, length, scores, v, block: int):
  dt = q.dtype
  _, b, kh, s, hd = v_all.shape
  m = jnp.max(scores, axis=-1, keepdims=True)            # finite: a query always sees itself
  p = jnp.exp(scores - m)
  den = jnp.sum(p, axis=-1, keepdims=True)
  acc = jnp.einsum("bkgls,bksd->bkgld", p.astype(dt), v, preferred_element_type=jnp.float32)
  num_blocks = (jnp.max(length) + block - 1) // block
  scale = hd ** -0.5

  def body(j, carry):
    m, den, acc = carry
    start = jnp.minimum(j * block, s - block)            # the last block may overlap the previous
    kb = jax.lax.dynamic_slice(k_all, (layer, 0, 0, 0, start), (1, b, kh, hd, block))[0]
    vb = jax.lax.dynamic_slice(v_all, (layer, 0, 0, start, 0), (1, b, kh, block, hd))[0]
    slot = start + jnp.arange(block)
    ok = (slot[None, :] >= j * block) & (slot[None, :] < length[:, None])     # [B, block]
    sc = jnp.einsum("bkgld,bkds->bkgls", q, kb.astype(dt),
                    preferred_element_type=jnp.float32) * scale
    sc = jnp.where(ok[:, None, None, None, :], sc, _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1, keepdims=True))
    pb = jnp.exp(sc - m_new)
    fix = jnp.exp(m - m_new)
    den = den * fix + jnp.sum(pb, axis=-1, keepdims=True)
    acc = acc * fix + jnp.einsum("bkgls,bksd->bkgld", pb.astype(dt), vb.astype(dt),
                                 preferred_element_type=jnp.float32)
    return m_new, den, acc

  _, den, acc = jax.lax.fori_loop(0, num_blocks, body, (m, den, acc))
  return (acc / den).astype(dt)


def causal_attention(q, k, v, mask_bls, block: int, key_lengths=None, impl: str = "xla"):
  """Softmax attention of q [B, K, G, L, hd] over k, v [B, K, L, hd] under a causal `mask_bls`
  [B, L, L] (query l may see key j only if j <= l), in blocks of `block` queries (static; 0 or
  >= L: one product, differentiated by autodiff).

  key_lengths [B] (optional) says the mask is exactly `causal & (key j < key_lengths[b])` (right
  padding). Then, where the CPU kernel applies (`use_kernel(impl, ...)`), each query block's forward reads
  the keys before the block in place with the kernel and only the block's own [block, block]
  scores go through XLA (`_kernel_block`); the gradient is the same written-out one.

  Query block i attends only the keys [0, end of block i): the causal mask hides the rest, so the
  blocks skip about half of the L x L scores, and the [B, K, G, L, L] scores and probabilities
  never exist at once. The gradient is written out (`_blocked_attention_bwd`, flash-attention
  style): it keeps only each query's softmax max and sum and recomputes a block's probabilities,
  so the backward pass neither stores nor reloads per-layer probabilities. In the RL update these L^2
  tensors were the largest costs (profiled 2026-12-06 on the default config at L = 896).
  A query that sees no key at all (padding) gets a finite, meaningless output whose value
  depends on the path (the mean of the keys its block reads); the model never reads it.
  """
  l = q.shape[3]
  if impl == "dot_product":
    return _dot_product_attention(q, k, v, mask_bls, key_lengths)
  if block <= 0 or block >= l:
    probs = jax.nn.softmax(block_scores(q, k, mask_bls, 0, l), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgls,bksd->bkgld", probs, v)
  if key_lengths is None or not use_kernel(impl, q, k, v, chunk=True):
    key_lengths = None
  return _blocked_attention(q, k, v, mask_bls, key_lengths, block)


def _dot_product_attention(q, k, v, mask_bls, key_lengths):
  """`causal_attention` through `jax.nn.dot_product_attention` (autodiff gradient): right-padded
  rows (`key_lengths`) as `is_causal` with key lengths, which cuDNN's fused attention takes;
  any other mask as a mask (XLA's path)."""
  b, kh, g, l, hd = q.shape
  qt = q.transpose(0, 3, 1, 2, 4).reshape(b, l, kh * g, hd)     # query head n = kv head n // G
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)      # [B, L, K, hd]
  if key_lengths is not None:
    out = jax.nn.dot_product_attention(qt, kt, vt, is_causal=True,
                                       key_value_seq_lengths=key_lengths.astype(jnp.int32))
  else:
    out = jax.nn.dot_product_attention(qt, kt, vt, mask=mask_bls[:, None])
  return out.reshape(b, l, kh, g, hd).transpose(0, 2, 3, 1, 4)


def _query_blocks(l: int, block: int):
  return [(start, min(start + block, l)) for start in range(0, l, block)]


def block_scores(q, k, mask_bls, start, end):
  """Scaled, masked float32 scores [B, K, G, end - start, end] of query block [start, end) over
  keys [0, end) (start 0, end L: the whole chunk's scores)."""
  hd = q.shape[-1]
  sc = jnp.einsum("bkgld,bksd->bkgls", q[:, :, :, start:end], k[:, :, :end],
                  preferred_element_type=jnp.float32)
  return jnp.where(mask_bls[:, None, None, start:end, :end], sc * (hd ** -0.5), _NEG)


def _blocked_attention_fwd(q, k, v, mask_bls, key_lengths, block):
  outs, maxes, dens = [], [], []
  if key_lengths is not None:        # the kernel's layout: one "layer" of keys slots-last
    k_all, v_all = k.transpose(0, 1, 3, 2)[None], v[None]
  for start, end in _query_blocks(q.shape[3], block):
    if key_lengths is not None and start > 0:
      qb = q[:, :, :, start:end]
      o, m, den = _kernel_block(qb, k_all, v_all, 0, jnp.minimum(key_lengths, start),
                                block_scores(qb, k[:, :, start:end],
                                              mask_bls[:, start:end, start:end], 0, end - start),
                                v[:, :, start:end])
    else:
      sc = block_scores(q, k, mask_bls, start, end)
      m = jnp.max(sc, axis=-1, keepdims=True)
      p = jnp.exp(sc - m)
      den = jnp.sum(p, axis=-1, keepdims=True)
      o = jnp.einsum("bkgls,bksd->bkgld", p.astype(q.dtype), v[:, :, :end],
                     preferred_element_type=jnp.float32) / den
    outs.append(o.astype(q.dtype))
    maxes.append(m)                                                 # [B, K, G, l, 1]
    dens.append(den)
  out = jnp.concatenate(outs, axis=3)
  return out, (q, k, v, mask_bls, out, jnp.concatenate(maxes, axis=3),
               jnp.concatenate(dens, axis=3))


def _blocked_attention_bwd(block, res, d_out):
  q, k, v, mask_bls, out, maxes, dens = res
  dt = q.dtype
  hd = q.shape[-1]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dq_blocks = []
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for start, end in _query_blocks(q.shape[3], block):
    # The forward's max and sum, not their log-sum-exp: a padding query sees no key, its scores
    # are all _NEG, and _NEG + log(sum) rounds back to _NEG in float32.
    p = (jnp.exp(block_scores(q, k, mask_bls, start, end) - maxes[:, :, :, start:end])
         / dens[:, :, :, start:end])
    do = d_out[:, :, :, start:end]
    dv = dv.at[:, :, :end].add(jnp.einsum("bkgls,bkgld->bksd", p.astype(dt), do,
                                          preferred_element_type=jnp.float32))
    dp = jnp.einsum("bkgld,bksd->bkgls", do, v[:, :, :end], preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[:, :, :, start:end]) * (hd ** -0.5)).astype(dt)
    dq_blocks.append(jnp.einsum("bkgls,bksd->bkgld", ds, k[:, :, :end],
                                preferred_element_type=jnp.float32))
    dk = dk.at[:, :, :end].add(jnp.einsum("bkgls,bkgld->bksd", ds, q[:, :, :, start:end],
                                          preferred_element_type=jnp.float32))
  dq = jnp.concatenate(dq_blocks, axis=3)
  return dq.astype(dt), dk.astype(k.dtype), dv.astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blocked_attention(q, k, v, mask_bls, key_lengths, block):
  return _blocked_attention_fwd(q, k, v, mask_bls, key_lengths, block)[0]


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)
