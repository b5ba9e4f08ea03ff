"""An int8 frozen base for LoRA (QLoRA-style): matrices held in 8 bits, dequantised per matmul.

    base = quantize_params(params)        # every projection, the embedding and lm_head -> QTensor
    logits, _ = decoder.apply(cfg, lora.attach(base, adapters, lcfg), tokens)

Each weight matrix W [*in, *out] becomes a `QTensor`: int8 values q and float32 scales s, one
per output channel (symmetric: s = max |W| over the input dims / 127, q = round(W / s) in
[-127, 127]), so W ~= q * s. The stacked layer matrices are quantised one layer at a time
(`lax.map`), so quantising never holds a float32 copy of more than one layer's matrix.

Inside the forward every product with a QTensor goes through `qeinsum`: the layer's slice of q
is dequantised to the compute dtype right before its einsum, and its gradient (with respect to
the activations only: the base is frozen) dequantises it again instead of saving the
dequantised matrix as a residual. Without that custom gradient the layer scan would keep every
layer's dequantised matrix for the backward pass, i.e. the whole full-precision base. Norms and
biases stay in their float dtype (they are ~0.1% of the weights).

What the base costs: 1 byte per weight + 4 bytes per output channel per matrix, ~1/4 of
float32 (~1/2 of bfloat16). What the adapted model computes: logits within a few 1e-3 of the
float32 base's on the built-in models (tests/models/test_quant.py states the bound).

A GGUF file's own block formats (base_dtype "gguf": `blocks.BlockTensor`, loaded by `gguf_base`)
go through the same entry points here (`is_quantized`, `einsum`, `take_rows`,
`dequantize_params`), so the decoder treats both quantised bases alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.models import blocks

# config.model.lora.base_dtype: as loaded, int8 (per output channel), or a GGUF file's blocks
BASE_DTYPES = ("float", "int8", "gguf")
_QMAX = 127.0
# The input dims of each quantised matrix, in its stacked [layers, *in, *out] layout; the scale
# has size 1 there (per output channel everywhere else).
LAYER_INPUT_AXES = {"q_proj": (1,), "k_proj": (1,), "v_proj": (1,), "o_proj": (1, 2),
                    "gate_proj": (1,), "up_proj": (1,), "down_proj": (1,)}
# The embedding [V, D] is quantised per row (a lookup reads rows; the tied unembedding's output
# channel is the row); lm_head [D, V] per column.
TOP_INPUT_AXES = {"embed": (1,), "lm_head": (0,)}


@struct.dataclass
class QTensor:
  """A matrix held as int8 values and float32 per-output-channel scales: W ~= q * scale."""
  q: jax.Array          # int8, the matrix's shape
  scale: jax.Array      # float32, the matrix's shape with size 1 on its input dims

  @property
  def shape(self):
    return self.q.shape

  @property
  def ndim(self):
    return self.q.ndim

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The matrix in `dtype` (the whole of it: for export, tests and one-off use)."""
    return _dequant(self.q, self.scale, jnp.dtype(dtype))

  def astype(self, dtype) -> jax.Array:
    return self.dequantize(dtype)


def _dequant(q, scale, dtype):
  return q.astype(dtype) * scale.astype(dtype)


def is_quantized(x) -> bool:
  """Whether `x` is a quantised matrix: an int8 QTensor or a GGUF `blocks.BlockTensor`."""
  return isinstance(x, (QTensor, blocks.BlockTensor))


def quantized(params: dict) -> bool:
  """Whether any matrix of `params` is held quantised (QTensor or BlockTensor)."""
  return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def _quantize(w, in_axes: tuple[int, ...]) -> QTensor:
  wf = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(wf), axis=in_axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  q = jnp.clip(jnp.round(wf / scale), -_QMAX, _QMAX).astype(jnp.int8)
  return QTensor(q, scale)


def _scale_sharding(sharding, in_axes, ndim: int):
  """The scale's sharding: the matrix's, unsharded on its (size-1) input dims."""
  spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  spec = tuple(None if i in in_axes else s for i, s in enumerate(spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def _quantize_any(w, in_axes, stacked: bool):
  if stacked:                    # one layer at a time: no float32 copy of the whole stack
    inner = tuple(a - 1 for a in in_axes)
    return jax.lax.map(lambda x: _quantize(x, inner), w)
  return _quantize(w, in_axes)


@functools.lru_cache(maxsize=64)
def _quantize_jit(out_shardings=None):
  return jax.jit(_quantize_any, static_argnums=(1, 2), out_shardings=out_shardings)


def quantize(w: jax.Array, in_axes: tuple[int, ...], stacked: bool = False) -> QTensor:
  """W (placed on a device or a mesh) as a QTensor with the same placement (the scale
  unsharded on the input dims). `stacked`: W's leading axis is the layers (quantised one by
  one; `in_axes` count that axis)."""
  sharding = getattr(w, "sharding", None)
  out = None
  if isinstance(sharding, jax.sharding.NamedSharding):
    out = QTensor(sharding, _scale_sharding(sharding, in_axes, w.ndim))
  return _quantize_jit(out)(w, in_axes, stacked)


def quantize_params(params: dict) -> dict:
  """The decoder's params with every projection matrix, the embedding and lm_head as QTensors
  (norms and biases as they are). Params already quantised are returned as they are."""
  if quantized(params):
    return params
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    raise ValueError("quantize the stacked params (before decoder.for_decode)")
  out = dict(params)
  for name, axes in TOP_INPUT_AXES.items():
    if name in params:
      out[name] = quantize(params[name], axes)
  out["layers"] = {k: (quantize(v, LAYER_INPUT_AXES[k], stacked=True)
                       if k in LAYER_INPUT_AXES else v) for k, v in layers.items()}
  return out


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
  """`params` with every QTensor and BlockTensor dequantised to `dtype` (a full-precision copy: for export)."""
  return jax.tree.map(lambda x: x.dequantize(dtype) if is_quantized(x) else x, params,
                      is_leaf=is_quantized)


def take_rows(w, tokens, dtype):
  """Embedding lookup: rows `tokens` of w [V, D] (a float array or a QTensor) in `dtype`."""
  if not is_quantized(w):
    return jnp.take(w, tokens, axis=0).astype(dtype)
  if blocks.is_blocks(w):
    return blocks.take_rows(w, tokens, dtype)
  return _dequant(jnp.take(w.q, tokens, axis=0), jnp.take(w.scale, tokens, axis=0), dtype)


def einsum(spec: str, a, w: QTensor, dtype, out_dtype=None):
  """jnp.einsum(spec, a, W) with W = w dequantised to `dtype` (a's compute dtype), holding only
  this product's dequantised matrix, and a gradient for `a` alone (the base is frozen) that
  dequantises again rather than keeping the matrix for the backward pass. A BlockTensor takes
  `blocks.einsum`, the same scheme."""
  if blocks.is_blocks(w):
    return blocks.einsum(spec, a, w, dtype, out_dtype)
  return _qeinsum(spec, jnp.dtype(dtype), None if out_dtype is None else jnp.dtype(out_dtype),
                  a, w.q, w.scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _qeinsum(spec, dtype, out_dtype, a, q, scale):
  return jnp.einsum(spec, a, _dequant(q, scale, dtype), preferred_element_type=out_dtype)


def _qeinsum_fwd(spec, dtype, out_dtype, a, q, scale):
  out = _qeinsum(spec, dtype, out_dtype, a, q, scale)
  return out, (jax.ShapeDtypeStruct(a.shape, a.dtype), q, scale)


def _qeinsum_bwd(spec, dtype, out_dtype, res, g):
  a_aval, q, scale = res
  w = _dequant(q, scale, dtype)
  lin = lambda a: jnp.einsum(spec, a, w, preferred_element_type=out_dtype)
  (da,) = jax.linear_transpose(lin, a_aval)(g)
  zero_q = np.zeros(q.shape, jax.dtypes.float0)     # int8 values: no tangent space
  return da.astype(a_aval.dtype), zero_q, jnp.zeros_like(scale)


_qeinsum.defvjp(_qeinsum_fwd, _qeinsum_bwd)


def nbytes(tree) -> int:
  """Bytes of every array of `tree` (QTensors count their int8 values and scales, BlockTensors
  their blocks)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
