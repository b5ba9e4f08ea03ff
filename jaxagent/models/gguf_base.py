"""A GGUF file as a frozen LoRA base in its own block formats (config.model.lora.base_dtype="gguf").

    params = gguf_base.load_params(path, cfg)       # matrices as `blocks.BlockTensor`s
    logits, _ = decoder.apply(cfg, lora.attach(params, adapters, lcfg), tokens)

Each matrix parameter (the seven projections, the embedding, lm_head) whose tensors are all of
one kept block type (`blocks.FORMATS`: Q8_0, Q4_0, Q4_1) is held as the file's blocks, stacked
over the layers, with the llama Q/K row un-permutation applied to the block rows (it permutes
output rows, i.e. whole rows of blocks); nothing is dequantised at load. Every other matrix (a
K-quant, F16/F32, or layers of different types) falls back to the int8 base's format
(`quant.QTensor`, quantised from the file's dequantised values one layer at a time), and norms
and biases are float in the param dtype, as `gguf_io.load_params` reads them; one log line names
which parameters took which path. So loading holds at most one tensor in float32 at a time.

`formats` tells the planner the same choice from the header alone (`planning.lora_memory`).

The kept matrices are placed whole on every device (replicated over a mesh; the block layout
has no sharding rule yet), the float ones with their shardings.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxagent.models import blocks, decoder, gguf_io, hf_io, quant
from jaxagent.models.config import ModelConfig

INT8 = "int8"           # the fallback format of a matrix whose type is not kept


def _input_axes(path: tuple[str, ...]) -> tuple[int, ...] | None:
  """The input dims (in our stacked layout) of matrix parameter `path`, else None."""
  if len(path) == 2 and path[0] == "layers":
    return quant.LAYER_INPUT_AXES.get(path[1])
  return quant.TOP_INPUT_AXES.get(path[0]) if len(path) == 1 else None


def _choose(entries, types) -> dict[tuple[str, ...], str]:
  """{matrix param path: its format} from `types(hf_name)` (the GGUF type's name)."""
  out = {}
  for e, names in entries:
    if _input_axes(e.path) is None:
      continue
    kinds = {types(n) for n in names}
    out[e.path] = kinds.pop() if len(kinds) == 1 and kinds <= set(blocks.FORMATS) else INT8
  return out


def formats(path: pathlib.Path, cfg: ModelConfig, f: gguf_io.GGUFFile | None = None) -> dict:
  """{matrix param path, e.g. ("layers", "q_proj"): "Q4_1" / "Q8_0" / "Q4_0" / "int8"} as
  `load_params` holds the file's matrices (norms and biases: float), read from the header."""
  f = f or gguf_io.GGUFFile(path)
  by_hf = {gguf_io.hf_tensor_name(n): t for n, t in f.tensors.items()}
  return _choose(hf_io.named_entries(cfg), lambda n: by_hf[n].tensor_type.name)


def is_block_base(params) -> bool:
  """Whether `params` hold any matrix as GGUF blocks."""
  return any(blocks.is_blocks(x) for x in jax.tree.leaves(params, is_leaf=blocks.is_blocks))


def _whole(sharding):
  """`sharding`'s placement with nothing split: the whole array on each of its devices."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return sharding


def load_params(path: pathlib.Path, cfg: ModelConfig, shardings=None,
                allow_nonfinite: bool = False, f: gguf_io.GGUFFile | None = None) -> dict:
  """The decoder's params from a .gguf file with its matrices kept quantised (module
  docstring), validated as `gguf_io.load_params` validates them.

  Args:
    shardings: pytree like the params of `jax.sharding.Sharding` (default: first device).
    allow_nonfinite: load NaN/Inf weights with a warning naming them, instead of raising.
  """
  f = f or gguf_io.GGUFFile(path)
  by_hf, entries = gguf_io.checked_tensors(path, cfg, f)
  kinds = _choose(entries, lambda n: by_hf[n].tensor_type.name)
  dequantised = functools.lru_cache(maxsize=2)(
      lambda name: gguf_io.dequantise(f, by_hf[name], name, cfg))
  check = hf_io.FiniteCheck(cfg, dequantised, lambda name: f"{path}: tensor {by_hf[name].name!r}",
                            allow_nonfinite, fix="re-download or re-convert them")
  params = hf_io.place_params(cfg, shardings, [en for en in entries if en[0].path not in kinds],
                              dequantised, check)
  _, shapes = decoder.abstract_params(cfg)
  for e, names in entries:
    kind = kinds.get(e.path)
    if kind is None:
      continue
    sharding = _whole(hf_io._get(shardings, e.path) if shardings is not None
                      else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    shape = hf_io._get(shapes, e.path).shape
    if kind == INT8:
      w = _int8(e, names, dequantised, check, sharding)
    else:
      w = _blocks(cfg, e, names, kind, by_hf, shape, check, dequantised, sharding)
    hf_io._set(params, e.path, w)
  dequantised.cache_clear()
  check.warn(path)
  _log(path, entries, kinds, by_hf)
  return params


def _blocks(cfg, e, names, kind, by_hf, shape, check, dequantised, sharding):
  """The BlockTensor of entry `e` (stacked over the layers if e.stacked), the file's blocks
  copied as they are; non-finite block scales go through `check` (its error or warning)."""
  parts = []
  for name in names:
    qs, d, m = blocks.split_blocks(kind, by_hf[name].data)
    n = gguf_io.row_permutation(name, cfg)
    if n is not None:                     # whole rows of blocks: permute qs, d, m alike
      qs, d, m = (None if a is None else gguf_io._unpermute(a, n) for a in (qs, d, m))
    if not (np.isfinite(d).all() and (m is None or np.isfinite(m).all())):
      x = dequantised(name)
      check(name, x, x)
    parts.append((qs, d, m))
  stack = (lambda *a: np.stack(a)) if e.stacked else (lambda a: a)
  qs, d = stack(*(p[0] for p in parts)), stack(*(p[1] for p in parts))
  m = None if parts[0][2] is None else stack(*(p[2] for p in parts))
  lead = 1 if e.stacked else 0
  axes = _input_axes(e.path)
  ins = tuple(shape[a] for a in axes)
  rows = e.path == ("embed",)
  outs = tuple(s for i, s in enumerate(shape) if i >= lead and i not in axes)
  put = lambda a: None if a is None else jax.device_put(a, sharding)
  return blocks.BlockTensor(put(qs), put(d), put(m), kind, ins, outs, rows)


def _int8(e, names, dequantised, check, sharding):
  """The int8 QTensor of entry `e` (the int8 base's format), quantised one tensor at a time
  from the file's dequantised float32 values."""
  axes = _input_axes(e.path)
  inner = tuple(a - 1 for a in axes) if e.stacked else axes
  qs, scales = [], []
  for name in names:
    x = e.to_ours(dequantised(name))
    check(name, x, x)
    q = quant.quantize(jnp.asarray(x, jnp.float32), inner)
    qs.append(np.asarray(q.q))
    scales.append(np.asarray(q.scale))
  stack = (lambda a: np.stack(a)) if e.stacked else (lambda a: a[0])
  return quant.QTensor(jax.device_put(stack(qs), sharding), jax.device_put(stack(scales),
                                                                             sharding))


def _log(path, entries, kinds, by_hf) -> None:
  """One line: which parameters are kept in which block type, which fell back to int8 (with
  their GGUF types) and which are float."""
  def label(e, names):
    types = sorted({by_hf[n].tensor_type.name for n in names})
    return f"{'.'.join(e.path)} ({'/'.join(types)})"
  kept, int8, floats = [], [], []
  for e, names in entries:
    kind = kinds.get(e.path)
    (floats if kind is None else int8 if kind == INT8 else kept).append(label(e, names))
  logging.info("%s: base_dtype='gguf' keeps %s in the file's blocks; int8 (type not kept: "
               "only %s are): %s; float: %s", path, ", ".join(kept) or "no matrix",
               "/".join(blocks.FORMATS), ", ".join(int8) or "none", ", ".join(floats) or "none")
