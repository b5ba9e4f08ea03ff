"""A GGUF block-quantised frozen base: matrices held in the file's own blocks, dequantised per
product inside the forward (config.model.lora.base_dtype="gguf"; loaded by `gguf_base`).

A GGUF matrix (HF layout [out, in]) of a block type is, per row, in / 32 blocks of 32 weights
along the input dimension. `BlockTensor` keeps them as they are in the file, split into arrays:

    Q8_0   qs int8  [..., out, nb, 32]   d float16 [..., out, nb]             w = d * q
    Q4_0   qs uint8 [..., out, nb, 16]   d float16 [..., out, nb]             w = d * (q - 8)
    Q4_1   qs uint8 [..., out, nb, 16]   d, m float16 [..., out, nb]          w = d * q + m

(Q4: weight j of a block is the low nibble of byte j, weight 16 + j its high nibble: ggml's
layout.) Bytes per weight: 34/32 (Q8_0), 18/32 (Q4_0), 20/32 (Q4_1). `dequantize` computes
exactly what `gguf.quants.dequantize` computes, in float32 (the same products and sums of the
same float32 values; tests/models/test_gguf_base.py checks bit equality), then reshapes the
[out, in] matrix into our layout [*in, *out] (or [*out, *in] for the embedding, whose rows are
read) and casts to the compute dtype.

In the forward every product with a BlockTensor goes through `einsum` (one layer's matrix
dequantised right before its product, inside the layer scan), whose gradient (for the
activations only: the base is frozen) dequantises it again instead of saving the float matrix,
as `quant.einsum` does for the int8 base.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

BLOCK = 32                                   # weights per block, along the input dimension
# Kept types: bytes per block (ggml's) and the arrays a block splits into.
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FORMATS = tuple(BLOCK_BYTES)


def bytes_per_weight(kind: str) -> float:
  return BLOCK_BYTES[kind] / BLOCK


@struct.dataclass
class BlockTensor:
  """A matrix in a GGUF block format (module docstring); `shape` is our layout's."""
  qs: jax.Array                 # int8 [..., out, nb, 32] (Q8_0) or uint8 [..., out, nb, 16] (Q4)
  d: jax.Array                  # float16 [..., out, nb]: the block scales
  m: jax.Array | None           # float16 [..., out, nb]: the block minimums (Q4_1), else None
  kind: str = struct.field(pytree_node=False)           # "Q8_0", "Q4_0" or "Q4_1"
  ins: tuple = struct.field(pytree_node=False)          # our input dims (product = nb * 32)
  outs: tuple = struct.field(pytree_node=False)         # our output dims (product = out)
  rows: bool = struct.field(pytree_node=False, default=False)   # ours [*outs, *ins] (embedding)

  @property
  def lead(self) -> tuple:
    return tuple(self.qs.shape[:-3])

  @property
  def shape(self) -> tuple:
    return self.lead + ((*self.outs, *self.ins) if self.rows else (*self.ins, *self.outs))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def dequantize(self, dtype=jnp.float32, file_order: bool = False) -> jax.Array:
    """The matrix in our layout in `dtype` (all of it: per layer inside the scan, whole for
    export and tests); with `file_order` as [..., *outs, *ins] (the file's, untransposed)."""
    w = dequant_rows(self.kind, self.qs, self.d, self.m)             # [..., out, in] float32
    lead = self.lead
    w = w.reshape(*lead, *self.outs, *self.ins)
    if not self.rows and not file_order:
      n, o, i = len(lead), len(self.outs), len(self.ins)
      w = w.transpose(*range(n), *range(n + o, n + o + i), *range(n, n + o))
    return w.astype(dtype)

  def astype(self, dtype) -> jax.Array:
    return self.dequantize(dtype)


def dequant_rows(kind: str, qs, d, m) -> jax.Array:
  """float32 [..., rows, nb * 32] of the blocks qs/d/m [..., rows, nb, ...] (module docstring):
  the values `gguf.quants.dequantize` gives, bit for bit."""
  df = d.astype(jnp.float32)[..., None]
  if kind == "Q8_0":
    w = qs.astype(jnp.float32) * df
  else:
    nib = jnp.concatenate([qs & jnp.uint8(0x0F), qs >> jnp.uint8(4)], axis=-1)   # [..., 32]
    if kind == "Q4_0":
      w = (nib.astype(jnp.int8) - jnp.int8(8)).astype(jnp.float32) * df
    elif kind == "Q4_1":
      w = df * nib.astype(jnp.float32) + m.astype(jnp.float32)[..., None]
    else:
      raise ValueError(f"block format {kind!r} unknown; use one of {FORMATS}")
  return w.reshape(*w.shape[:-2], w.shape[-2] * BLOCK)


def split_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """(qs, d, m) of raw GGUF block bytes uint8 [rows, nb * BLOCK_BYTES] (a reader's tensor data):
  numpy arrays, the values not converted (copies: the file may be memory-mapped)."""
  size = BLOCK_BYTES[kind]
  raw = np.asarray(raw, np.uint8)
  if raw.ndim != 2 or raw.shape[1] % size:
    raise ValueError(f"{kind} data of shape {raw.shape}: rows of whole {size}-byte blocks needed")
  b = raw.reshape(raw.shape[0], raw.shape[1] // size, size)
  d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
  if kind == "Q8_0":
    return np.ascontiguousarray(b[..., 2:]).view(np.int8), d, None
  if kind == "Q4_0":
    return np.ascontiguousarray(b[..., 2:]), d, None
  m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
  return np.ascontiguousarray(b[..., 4:]), d, m


def is_blocks(x) -> bool:
  return isinstance(x, BlockTensor)


def take_rows(w: BlockTensor, tokens, dtype) -> jax.Array:
  """Embedding lookup: rows `tokens` of the block embedding [V, D] in `dtype`."""
  if not w.rows or w.lead:
    raise ValueError("take_rows reads an embedding (rows=True, unstacked) BlockTensor")
  take = lambda a: None if a is None else jnp.take(a, tokens, axis=0)
  x = dequant_rows(w.kind, take(w.qs), take(w.d), take(w.m))          # [..., nb * 32]
  return x.reshape(*x.shape[:-1], *w.ins).astype(dtype)


def einsum(spec: str, a, w: BlockTensor, dtype, out_dtype=None):
  """jnp.einsum(spec, a, W) with W = w dequantised to `dtype` for this product alone, and a
  gradient for `a` only that dequantises W again rather than keeping it (`quant.einsum`'s
  scheme)."""
  return _beinsum(spec, jnp.dtype(dtype), None if out_dtype is None else jnp.dtype(out_dtype),
                  a, w)


def _file_order(spec: str, w: BlockTensor) -> str:
  """`spec` with w's operand letters in the file's order [*outs, *ins] (rows-first already for
  the embedding): the product reads the dequantised [out, in] matrix with no transpose."""
  if w.rows:
    return spec
  operands, out = spec.split("->")
  a, wl = operands.split(",")
  n, k = len(wl) - len(w.ins) - len(w.outs), len(w.ins)
  return f"{a},{wl[:n]}{wl[n + k:]}{wl[n:n + k]}->{out}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _beinsum(spec, dtype, out_dtype, a, w):
  return jnp.einsum(_file_order(spec, w), a, w.dequantize(dtype, file_order=True),
                    preferred_element_type=out_dtype)


def _beinsum_fwd(spec, dtype, out_dtype, a, w):
  return _beinsum(spec, dtype, out_dtype, a, w), (jax.ShapeDtypeStruct(a.shape, a.dtype), w)


def _zero_tangent(x):
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)       # integer blocks: no tangent space


def _beinsum_bwd(spec, dtype, out_dtype, res, g):
  a_aval, w = res
  wd = w.dequantize(dtype, file_order=True)
  lin = lambda a: jnp.einsum(_file_order(spec, w), a, wd, preferred_element_type=out_dtype)
  (da,) = jax.linear_transpose(lin, a_aval)(g)
  return da.astype(a_aval.dtype), jax.tree.map(_zero_tangent, w)


_beinsum.defvjp(_beinsum_fwd, _beinsum_bwd)


def block_bytes(kind: str, elements: int) -> int:
  """Bytes of `elements` weights (whole blocks) held in `kind`."""
  return math.ceil(elements / BLOCK) * BLOCK_BYTES[kind]
