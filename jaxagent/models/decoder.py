"""The policy network: one Flax NNX decoder for the Qwen2/Qwen2.5, Qwen3 and Llama 3.x families.

GQA attention with RoPE (default, linear or llama3 scaling), RMSNorm, SwiGLU MLP, optional qkv
bias (Qwen2) and q/k RMSNorm (Qwen3), tied or untied embeddings. Layer parameters are stacked on
a leading `layers` axis and the forward pass is a `lax.scan` over layers, so compile time does not
grow with depth (except in CPU-kernel decode loops, whose layers `for_decode` unstacks: there each
step reads the weights in place instead of copying them out of the stack). Every parameter
carries `logical_axes` metadata (embed, mlp, heads, kv_heads, head_dim, vocab, layers) that
`jaxagent.sharding` maps onto a mesh.

The hot path is the pure function `apply(cfg, params, tokens, positions, ...)` on a nested dict of
arrays; the NNX module defines the parameters and their metadata.

KV cache (`KVCache`): slots are filled per row, compactly: row b's valid entries are slots
[0, length[b]). A chunk of L right-padded tokens with `chunk_lens[b]` real tokens is written at
slots length[b] .. length[b]+L-1; query l attends slots <= length[b]+l; then length[b] +=
chunk_lens[b], so the padding is overwritten by the next chunk. Rows of different lengths share a
batch with no wasted attention over padding and no recompilation. Attention reads the cache in
blocks up to the longest row's length, so a decode step costs the context in use, not the cache's
capacity (on the default rollout, T=8, it made the rollout 4.8x faster than attending the whole
cache; `python -m launch.benchmark` measures decode against the memory-bandwidth bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from jaxagent.kernels import cpu
from jaxagent.models import attention, lora, quant
from jaxagent.models.attention import CACHE_BLOCK, QUERY_BLOCK
from jaxagent.models.config import ModelConfig
from jaxagent.sharding.mesh import constrain_batch



@struct.dataclass
class KVCache:
  # Heads before slots: attention contracts [B, kv_heads] batches with no transpose of the cache
  # (a [B, S, kv_heads, ...] layout made XLA copy it every step). Keys are stored transposed,
  # slots last, so that q.k runs along contiguous slots ([G, hd] x [hd, S] per batch entry): the
  # decode attention's batched products over [S, hd] keys ran at ~half the speed (measured
  # 2026-12-06 on the 2-core CPU; `python -m launch.benchmark` profiles a decode step).
  k: jax.Array       # [layers, B, kv_heads, head_dim, S] compute dtype
  v: jax.Array       # [layers, B, kv_heads, S, head_dim]
  length: jax.Array  # [B] int32: number of valid slots per row

  @property
  def capacity(self) -> int:
    return self.v.shape[3]


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
  n, k, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  return KVCache(k=jnp.zeros((n, batch, k, hd, capacity), cfg.jnp_dtype),
                 v=jnp.zeros((n, batch, k, capacity, hd), cfg.jnp_dtype),
                 length=jnp.zeros((batch,), jnp.int32))


def _param(key, shape, axes, dtype, std=0.02):
  return nnx.Param(std * jax.random.normal(key, shape, dtype), logical_axes=axes)


def _const(value, shape, axes, dtype):
  return nnx.Param(jnp.full(shape, value, dtype), logical_axes=axes)


class DecoderLayers(nnx.Module):
  """All transformer blocks, each parameter stacked on a leading `layers` axis."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    n, d, f, h, k, hd = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim)
    dt = cfg.jnp_param_dtype
    self.attn_norm = _const(1.0, (n, d), ("layers", "embed"), dt)
    self.q_proj = _param(rngs.params(), (n, d, h, hd), ("layers", "embed", "heads", "head_dim"), dt)
    self.k_proj = _param(rngs.params(), (n, d, k, hd), ("layers", "embed", "kv_heads", "head_dim"), dt)
    self.v_proj = _param(rngs.params(), (n, d, k, hd), ("layers", "embed", "kv_heads", "head_dim"), dt)
    self.o_proj = _param(rngs.params(), (n, h, hd, d), ("layers", "heads", "head_dim", "embed"), dt)
    if cfg.qkv_bias:
      self.q_bias = _const(0.0, (n, h, hd), ("layers", "heads", "head_dim"), dt)
      self.k_bias = _const(0.0, (n, k, hd), ("layers", "kv_heads", "head_dim"), dt)
      self.v_bias = _const(0.0, (n, k, hd), ("layers", "kv_heads", "head_dim"), dt)
    if cfg.qk_norm:
      self.q_norm = _const(1.0, (n, hd), ("layers", "head_dim"), dt)
      self.k_norm = _const(1.0, (n, hd), ("layers", "head_dim"), dt)
    self.mlp_norm = _const(1.0, (n, d), ("layers", "embed"), dt)
    self.gate_proj = _param(rngs.params(), (n, d, f), ("layers", "embed", "mlp"), dt)
    self.up_proj = _param(rngs.params(), (n, d, f), ("layers", "embed", "mlp"), dt)
    self.down_proj = _param(rngs.params(), (n, f, d), ("layers", "mlp", "embed"), dt)


class Decoder(nnx.Module):
  """Parameter definition of the decoder (see `apply` for the computation)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dt = cfg.jnp_param_dtype
    self.embed = _param(rngs.params(), (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
    self.layers = DecoderLayers(cfg, rngs)
    self.final_norm = _const(1.0, (cfg.hidden_size,), ("embed",), dt)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs.params(), (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)


def abstract_params(cfg: ModelConfig):
  """(abstract nnx.State with logical-axis metadata, pure dict of ShapeDtypeStructs)."""
  state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  return state, nnx.to_pure_dict(state)


def logical_axes(cfg: ModelConfig) -> dict:
  """Pure dict, same structure as the params, of each parameter's logical axis names."""
  state, _ = abstract_params(cfg)
  out = {}
  for path, var in nnx.to_flat_state(state):
    node = out
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = var.get_metadata()["logical_axes"]
  return out


def init_params(cfg: ModelConfig, seed: int) -> dict:
  """Randomly initialised parameters as a pure nested dict of arrays."""
  return nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(seed))))


def rms_norm(x, w, eps):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (w.astype(jnp.float32) * xf).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions):
  """cos, sin [B, L, head_dim] float32 for positions [B, L] (HF rotate-half layout)."""
  inv = jnp.asarray(cfg.rope_inv_freq())
  freqs = positions.astype(jnp.float32)[..., None] * inv
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_blhd, cos, sin):
  half = x_blhd.shape[-1] // 2
  rot = jnp.concatenate([-x_blhd[..., half:], x_blhd[..., :half]], axis=-1)
  xf = x_blhd.astype(jnp.float32)
  out = xf * cos[:, :, None, :] + rot.astype(jnp.float32) * sin[:, :, None, :]
  return out.astype(x_blhd.dtype)


def _kernel_writes(cfg: ModelConfig, cache: KVCache, l: int) -> bool:
  """Whether an L-token chunk's layers read `cache` through the CPU kernel, which then also
  writes the chunk's keys and values (`_layer`'s `write`)."""
  q = jax.ShapeDtypeStruct((1, 1, 1, l, cfg.head_dim), cfg.jnp_dtype)
  return attention.use_kernel(cfg.attention, q, cache.k, cache.v)


def unstack_layers(params: dict) -> dict:
  """`params` with "layers" as a list of per-layer trees instead of one stacked tree.

  For decode loops on the CPU kernel's path: unstacked once before the loop, each step's layers
  read their weights in place, where a scan over the stacked tree copies every layer's weights
  out of the stack every step (a dynamic slice per weight; for a ~100M model 35 of ~80 ms per
  8-row step). `apply` accepts either form; XLA's cache paths and the no-cache forward stack a
  list again (one copy per call, what their scan reads anyway)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]}


def for_decode(cfg: ModelConfig, params: dict) -> dict:
  """`params` for a decode loop: unstacked (`unstack_layers`) where its steps take the CPU
  kernel (which then reads each layer's weights in place), else as they are (XLA's paths scan
  the stacked layers; on accelerators a scan's per-layer slices are cheap)."""
  dt = cfg.jnp_dtype
  cache = jax.ShapeDtypeStruct((1, 1, 1, cfg.head_dim, 1), dt)
  q = jax.ShapeDtypeStruct((1, 1, 1, 1, cfg.head_dim), dt)
  if not attention.use_kernel(cfg.attention, q, cache, cache) or \
      isinstance(params["layers"], (list, tuple)) or quant.quantized(params):
    # An int8 base (`quant`) stays stacked and unmerged: each step dequantises one layer at a
    # time inside the scan, where merging or fusing would build the full-precision base.
    return params
  # Adapters (`lora.attach`) are merged into the weights once here: W + scale * A @ B.
  return unstack_layers({**params, "layers": _fused(lora.merge(params)["layers"])})


def _fused(layers: dict) -> dict:
  """Stacked layers with the q/k/v projections (and biases) as one [D, (H + 2K) hd] product and
  gate/up as one [D, 2F]: a decode step of a small model is bound by its count of small ops."""
  flat = lambda a: a.reshape(*a.shape[:2], -1)                  # [layers, D, ...] -> 2-D each
  out = {k: v for k, v in layers.items() if k not in _FUSED}
  out["qkv_proj"] = jnp.concatenate([flat(layers[k]) for k in ("q_proj", "k_proj", "v_proj")],
                                    axis=-1)
  if "q_bias" in layers:
    out["qkv_bias"] = jnp.concatenate(
        [layers[k].reshape(layers[k].shape[0], -1) for k in ("q_bias", "k_bias", "v_bias")],
        axis=-1)
  out["gate_up_proj"] = jnp.concatenate([layers["gate_proj"], layers["up_proj"]], axis=-1)
  return out


_FUSED = ("q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "gate_proj", "up_proj")


def _stacked(layers):
  if isinstance(layers, (list, tuple)):
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)
  return layers


def _layer(cfg: ModelConfig, x_bld, p, cos, sin, mask_bls, cache=None, layer=None,
           cache_block: int = 0, query_block: int = 0, key_lengths=None, write: bool = False):
  """One block. Returns (x, k, v) with this chunk's keys/values k, v [B, kv_heads, L, hd].

  Queries attend the chunk under `mask_bls` [B, L, L] and, with a `cache`, its valid slots too.
  XLA's paths only read the cache: the caller writes the chunk's k/v into it once, after all
  layers (writing each layer's slice inside the layer loop made XLA copy the cache every decode
  step). With `write` (the CPU kernel, `_kernel_writes`), one kernel call writes this layer's
  k/v into the cache in place and then does the chunk's whole attention over the cache and the
  chunk (`_kernel_write_attention`), and the written cache's (k, v) come back instead.
  """
  dt = cfg.jnp_dtype
  w = lambda name: p[name].astype(dt)
  # a @ W over a's last n dims, plus a LoRA delta where `p` carries one (`lora.attach`).
  proj = lambda a, name, n: lora.project(p, name, a, n, _proj(a, p[name], n, small, dt))
  # A kernel step's few rows (x [B, L, D]) go through the kernel's products too (`_proj`), where
  # they measured faster than XLA's on this machine (`attention.small_products`).
  small = write and x_bld.shape[0] * x_bld.shape[1] <= SMALL_MATMUL_ROWS and \
      attention.small_products()
  h = rms_norm(x_bld, p["attn_norm"], cfg.rms_norm_eps)
  if "qkv_proj" in p:                       # fused (`for_decode`)
    qkv = _proj(h, w("qkv_proj"), 1, small)
    if cfg.qkv_bias:
      qkv = qkv + w("qkv_bias")
    hd, nq, nk = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    lead = qkv.shape[:2]
    q = qkv[..., :nq].reshape(*lead, cfg.num_heads, hd)
    k = qkv[..., nq:nq + nk].reshape(*lead, cfg.num_kv_heads, hd)
    v = qkv[..., nq + nk:].reshape(*lead, cfg.num_kv_heads, hd)
  else:
    q, k, v = proj(h, "q_proj", 1), proj(h, "k_proj", 1), proj(h, "v_proj", 1)
    if cfg.qkv_bias:
      q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  k = k.transpose(0, 2, 1, 3)                                   # [B, kv_heads, L, hd]
  v = v.transpose(0, 2, 1, 3)
  b, l, nh, hd = q.shape
  groups = nh // cfg.num_kv_heads
  q = q.reshape(b, l, cfg.num_kv_heads, groups, hd).transpose(0, 2, 3, 1, 4)   # [B, K, G, L, hd]
  if cache is None:
    attn = attention.causal_attention(q, k, v, mask_bls, query_block, key_lengths,
                                      cfg.attention)
  elif write:          # the cache mode's mask is causal, which the kernel applies itself
    attn, k, v = attention.write_attention(q, cache.k, cache.v, layer, cache.length, k, v)
  else:
    scores = attention.block_scores(q, k, mask_bls, 0, l)
    attn = attention.cache_attention(cfg.attention, q, cache.k, cache.v, layer, cache.length,
                                     scores, v, cache_block)
  attn = attn.transpose(0, 3, 1, 2, 4).reshape(b, l, nh, hd)
  x_bld = x_bld + proj(attn, "o_proj", 2)
  h = rms_norm(x_bld, p["mlp_norm"], cfg.rms_norm_eps)
  if "gate_up_proj" in p:                   # fused (`for_decode`); inference only
    gate, up = jnp.split(_proj(h, w("gate_up_proj"), 1, small), 2, axis=-1)
    x_bld = x_bld + _proj(jax.nn.silu(gate) * up, w("down_proj"), 1, small)
  elif small or lora.adapted(p, lora.MLP_TARGETS) or quant.is_quantized(p["gate_proj"]):
    # swiglu's own gradient has no adapters, and would keep an int8 base's dequantised weights
    x_bld = x_bld + _adapted_mlp(h, proj)
  else:
    x_bld = x_bld + swiglu(h, w("gate_proj"), w("up_proj"), w("down_proj"))
  return x_bld, k, v


def _adapted_mlp(h, proj):
  """The MLP through `proj` (adapters, int8 weights), rematerialised but for gate and up: the
  backward pass keeps h, gate and up per layer, as `swiglu` does, where autodiff kept six
  [tokens, mlp] arrays per layer (silu's terms, their product; 1.6x the update's activations of
  builtin:tiny with adapters on all seven projections) and recomputes the rest (elementwise, and
  the adapters' rank-r products)."""
  def mlp(h):
    gate = checkpoint_name(proj(h, "gate_proj", 1), "mlp_gate")
    up = checkpoint_name(proj(h, "up_proj", 1), "mlp_up")
    return proj(jax.nn.silu(gate) * up, "down_proj", 1)
  return jax.checkpoint(mlp, policy=_SAVE_GATE_UP)(h)


_SAVE_GATE_UP = jax.checkpoint_policies.save_only_these_names("mlp_gate", "mlp_up")


# Rows (batch x chunk) up to which a kernel step's weight products take `cpu.small_matmul` (on
# AVX-512 builds where it measured faster than XLA's: `attention.small_products`; on AVX2 ones
# XLA's products measured 2-3x faster and stay).
SMALL_MATMUL_ROWS = 16


def _proj(a, w, n_in: int, small: bool, dt=None):
  """a [..., *in] @ w [*in, *out] over the last `n_in` dims of a (the first n_in of w): XLA's
  einsum, or with `small` the CPU kernel's product, which reads w at about the machine's
  bandwidth where XLA:CPU's few-row products do not (inference only: it has no gradient).
  w is cast to `dt` (default: as it is); an int8 `quant.QTensor` is dequantised for this product
  alone (`quant.einsum`)."""
  lead, ins, outs = a.shape[:a.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
  a_ix, w_out = "abcd"[:a.ndim - n_in], "wxyz"[:len(outs)]
  ins_ix = "ijkl"[:n_in]
  spec = f"{a_ix}{ins_ix},{ins_ix}{w_out}->{a_ix}{w_out}"
  if quant.is_quantized(w):
    return quant.einsum(spec, a, w, dt or a.dtype)
  if dt is not None:
    w = w.astype(dt)
  if not small:
    return jnp.einsum(spec, a, w)
  k = int(np.prod(ins))
  out = cpu.small_matmul(a.reshape(-1, k), w.reshape(k, -1))
  return out.reshape(*lead, *outs).astype(a.dtype)


@jax.custom_vjp
def swiglu(h, w_gate, w_up, w_down):
  """The MLP: (silu(h @ w_gate) * (h @ w_up)) @ w_down for h [B, L, D].

  Its gradient is written out (`_swiglu_bwd`, equal to autodiff's to float rounding) so that
  each weight gradient is one plain product h^T @ dY over the tokens: autodiff's version fused
  the elementwise backward with a transpose of the [tokens, mlp] gradients, which XLA:CPU ran
  ~3x slower (1.56 s -> 0.49 s for a 2-layer scan at 28,672 tokens; 2026-12-06).
  """
  return _swiglu_fwd(h, w_gate, w_up, w_down)[0]


def _swiglu_fwd(h, w_gate, w_up, w_down):
  gate = jnp.einsum("bld,df->blf", h, w_gate)
  up = jnp.einsum("bld,df->blf", h, w_up)
  out = jnp.einsum("blf,fd->bld", jax.nn.silu(gate) * up, w_down)
  return out, (h, gate, up, w_gate, w_up, w_down)


def _swiglu_bwd(res, g):
  h, gate, up, w_gate, w_up, w_down = res
  sig = jax.nn.sigmoid(gate)
  act = gate * sig                                        # silu(gate)
  d_hidden = jnp.einsum("bld,fd->blf", g, w_down)
  d_up = d_hidden * act
  d_gate = d_hidden * up * (sig * (1 + gate * (1 - sig)))  # silu'(gate)
  flat = lambda x: x.reshape(-1, x.shape[-1])
  h_t = flat(h).T                                         # [D, tokens]
  dw_gate = (h_t @ flat(d_gate)).astype(w_gate.dtype)
  dw_up = (h_t @ flat(d_up)).astype(w_up.dtype)
  dw_down = (flat(act * up).T @ flat(g)).astype(w_down.dtype)
  dh = jnp.einsum("blf,df->bld", d_gate, w_gate) + jnp.einsum("blf,df->bld", d_up, w_up)
  return dh.astype(h.dtype), dw_gate, dw_up, dw_down


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def apply(cfg: ModelConfig, params: dict, tokens, positions=None, *, attention_mask=None,
          lengths=None, cache: KVCache | None = None, chunk_lens=None,
          return_hidden: bool = False, cache_block: int = CACHE_BLOCK,
          query_block: int = QUERY_BLOCK):
  """Runs the decoder.

  Args:
    params: pure nested dict (see `init_params`).
    tokens: [B, L] int32.
    positions: [B, L] int32 RoPE positions. Default: without a cache, the running count of real
      tokens (cumsum(attention_mask) - 1, so left or right padding both work); with a cache,
      cache.length[b] + l.
    attention_mask: [B, L], 1 on real tokens (no-cache mode only).
    lengths: [B] int32, instead of attention_mask for right-padded rows (no-cache mode only):
      the mask is `arange(L) < lengths`, and the attention may read keys in place with the CPU
      kernel (`causal_attention`).
    cache: a `KVCache` to extend; tokens must be right-padded with `chunk_lens[b]` real tokens.
      Slots past the capacity are dropped (the caller keeps length + L <= capacity).
    chunk_lens: [B] int32, real tokens per row in this chunk (cache mode; default L).
    cache_block: cache slots read per block by the attention over the cache (static).
    query_block: queries per block of the causal attention without a cache (static; 0: one
      product over the whole sequence). See `causal_attention`.

  Returns:
    (logits [B, L, V] float32, new cache or None); with return_hidden, the final normed hidden
    states [B, L, D] instead of logits.
  """
  b, l = tokens.shape
  idx = jnp.arange(l)
  causal = idx[None, :, None] >= idx[None, None, :]                          # [1, L(q), L(k)]
  if cache is None:
    if lengths is not None and attention_mask is not None:
      raise ValueError("pass attention_mask or lengths, not both")
    if attention_mask is None:       # right-padded rows (no mask: every row is full)
      lengths = jnp.full((b,), l, jnp.int32) if lengths is None else lengths
      attention_mask = idx[None, :] < lengths[:, None]
    valid = attention_mask.astype(bool)
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
    mask = causal & valid[:, None, :]                                         # [B, L, L]
  else:
    if chunk_lens is None:
      chunk_lens = jnp.full((b,), l, jnp.int32)
    if positions is None:
      positions = cache.length[:, None] + idx[None, :]
    mask = jnp.broadcast_to(causal, (b, l, l))
  cos, sin = rope_tables(cfg, positions)
  x = quant.take_rows(params["embed"], tokens, cfg.jnp_dtype)

  if cache is None:
    def body(x, p):
      x = constrain_batch(x)
      x, _, _ = _layer(cfg, x, p, cos, sin, mask, query_block=query_block,
                       key_lengths=lengths)
      return x, None

    x, _ = jax.lax.scan(body, x, _stacked(params["layers"]))
  else:
    layers = params["layers"]
    if _kernel_writes(cfg, cache, l):
      # Each layer's kernel call writes its k/v into the cache in place, then reads it: the cache
      # is the layer loop's carry, and no scatter follows.
      def body(carry, p):
        x, i, kc, vc = carry
        x, kc, vc = _layer(cfg, constrain_batch(x), p, cos, sin, mask, cache.replace(k=kc, v=vc),
                           i, cache_block, write=True)
        return (x, i + 1, kc, vc), None

      carry = (x, jnp.int32(0), cache.k, cache.v)
      if isinstance(layers, (list, tuple)):              # unstacked: `unstack_layers`
        for p in layers:
          carry, _ = body(carry, p)
      else:
        carry, _ = jax.lax.scan(body, carry, layers)
      x, _, new_k, new_v = carry
    else:
      # The cache is read only inside the layer loop; each layer returns its chunk's k/v, and one
      # scatter after the loop writes them (in place when the cache is a decode loop's carry).
      def body(carry, p):
        x, i = carry
        x = constrain_batch(x)
        x, k, v = _layer(cfg, x, p, cos, sin, mask, cache, i, cache_block)
        return (x, i + 1), (k, v)

      (x, _), (k_new, v_new) = jax.lax.scan(body, (x, jnp.int32(0)), _stacked(layers))
      rows = jnp.arange(b)[:, None]
      slots = cache.length[:, None] + idx[None, :]                           # [B, L]
      # Advanced indices on dims (1, 3) or (1, 4) put [B, L] first: updates are [B, L, layers,
      # kv, hd].
      new_k = cache.k.at[:, rows, :, :, slots].set(
          k_new.transpose(1, 3, 0, 2, 4).astype(cache.k.dtype), mode="drop")
      new_v = cache.v.at[:, rows, :, slots, :].set(
          v_new.transpose(1, 3, 0, 2, 4).astype(cache.v.dtype), mode="drop")
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  new_cache = None
  if cache is not None:
    new_cache = KVCache(k=new_k, v=new_v, length=cache.length + chunk_lens.astype(jnp.int32))
  if return_hidden:
    return x, new_cache
  return unembed(cfg, params, x), new_cache


def unembed(cfg: ModelConfig, params: dict, x_bld):
  """Hidden states [..., D] -> float32 logits [..., V]."""
  spec, w = (("...d,vd->...v", params["embed"]) if cfg.tie_word_embeddings
             else ("...d,dv->...v", params["lm_head"]))
  if quant.is_quantized(w):                                    # an int8 base (`quant`)
    return quant.einsum(spec, x_bld, w, cfg.jnp_dtype, jnp.float32)
  return jnp.einsum(spec, x_bld, w.astype(cfg.jnp_dtype), preferred_element_type=jnp.float32)
