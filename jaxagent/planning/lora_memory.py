"""What LoRA changes in the memory plan: the adapters, their optimizer state, and an int8 base.

    base_bytes(cfg, mesh, lcfg)      # the frozen base in its storage dtype (int8 + scales, or p)
    base_bytes(cfg, mesh, lcfg, formats=gguf_base.formats(path, cfg))   # GGUF blocks
    adapter_bytes(cfg, lcfg, mesh)   # float32 adapters (= their gradients)
    adapter_optimizer_bytes(...)     # AdamW's state of the adapters only
    dequant_bytes(cfg, mesh)         # the int8 base's dequantised matrices alive at once

Per device, with the project's sharding rules (`sharding.mesh.local_elements`), from the same
trees the trainer builds: `lora.adapter_shapes` / `lora.logical_axes` for the adapters, the
decoder's parameter tree and axes for the base, with `quant`'s layout for an int8 base (each quantised
matrix: 1 byte per element + a float32 scale per output channel, the scale sharded like the
matrix on its output dims). A GGUF block base (base_dtype "gguf") counts each matrix in the
format `gguf_base.formats` reads from the file's header: its block type's bytes per weight
(`blocks.BLOCK_BYTES`: 34/32 Q8_0, 18/32 Q4_0, 20/32 Q4_1), or int8 + scales where it falls
back; its matrices are whole on every device (`gguf_base` places them unsharded).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxagent.learners.update import make_optimizer
from jaxagent.models import blocks, decoder, lora, quant
from jaxagent.models.config import ModelConfig
from jaxagent.sharding.mesh import local_elements


def _quantised_input_axes(path: tuple[str, ...]):
  """The input dims of the param at `path` if an int8 base quantises it, else None."""
  if len(path) == 2 and path[0] == "layers":
    return quant.LAYER_INPUT_AXES.get(path[1])
  if len(path) == 1:
    return quant.TOP_INPUT_AXES.get(path[0])
  return None


def base_bytes(cfg: ModelConfig, mesh, lcfg: lora.LoraConfig | None,
               formats: dict | None = None) -> int:
  """Per-device bytes of the frozen base as it is held: int8 matrices + float32 scales (and the
  rest in the param dtype) with lcfg.base_dtype "int8"; with "gguf" each matrix in its format of
  `formats` ({param path: "Q8_0" / "Q4_0" / "Q4_1" / "int8"}, `gguf_base.formats`); else every
  param in the param dtype."""
  state, shapes = decoder.abstract_params(cfg)
  axes_tree = decoder.logical_axes(cfg)
  int8 = lcfg is not None and lcfg.int8_base
  gguf = lcfg is not None and lcfg.gguf_base
  if gguf and formats is None:
    raise ValueError("a plan of config.model.lora.base_dtype='gguf' needs the file's matrix "
                     "formats: pass base_formats=jaxagent.models.gguf_base.formats(path, cfg) "
                     "(plan_for_config reads them from config.model.path)")
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    keys = tuple(k.key for k in path)
    axes = axes_tree
    for k in keys:
      axes = axes[k]
    kind = formats.get(keys) if gguf else None
    if kind in blocks.FORMATS:                 # whole on each device (`gguf_base`)
      total += blocks.block_bytes(kind, math.prod(leaf.shape))
      continue
    if kind is not None:                       # the int8 fallback, whole on each device
      axes = (None,) * len(leaf.shape)
    ins = _quantised_input_axes(keys) if int8 or kind is not None else None
    if ins is None:
      total += local_elements(axes, leaf.shape, mesh) * jnp.dtype(leaf.dtype).itemsize
      continue
    scale_shape = tuple(1 if i in ins else s for i, s in enumerate(leaf.shape))
    scale_axes = tuple(None if i in ins else a for i, a in enumerate(axes))
    total += (local_elements(axes, leaf.shape, mesh)
              + 4 * local_elements(scale_axes, scale_shape, mesh))
  return total


def _adapter_tree(cfg: ModelConfig, lcfg: lora.LoraConfig):
  is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)
  shapes = jax.tree.map(lambda sa: jax.ShapeDtypeStruct(sa[0], jnp.float32),
                        lora.adapter_shapes(cfg, lcfg), is_leaf=is_pair)
  return shapes, lora.logical_axes(cfg, lcfg)


def adapter_bytes(cfg: ModelConfig, lcfg: lora.LoraConfig, mesh) -> int:
  """Per-device bytes of the float32 adapters (`lora.init_adapters`), sharded like their base."""
  shapes, axes = _adapter_tree(cfg, lcfg)
  leaves = jax.tree.leaves(shapes)
  axes_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  return sum(local_elements(a, s.shape, mesh) * 4 for s, a in zip(leaves, axes_leaves))


def adapter_optimizer_bytes(cfg: ModelConfig, lcfg: lora.LoraConfig, mesh) -> int:
  """Per-device bytes of `make_optimizer(...).init(adapters)`: each moment sharded like its
  adapter (matched by the key path's tail), the step counters replicated scalars."""
  shapes, axes = _adapter_tree(cfg, lcfg)
  adamw = make_optimizer(learning_rate=1e-5, schedule="constant", warmup_steps=0, total_steps=0,
                         end_lr_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0, b1=0.9,
                         b2=0.999, eps=1e-8)
  state = jax.eval_shape(adamw.init, shapes)
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    hit = axes.get(keys[-2], {}).get(keys[-1]) if len(keys) >= 2 else None
    leaf_axes = hit if hit is not None and len(hit) == leaf.ndim else (None,) * leaf.ndim
    total += local_elements(leaf_axes, leaf.shape, mesh) * jnp.dtype(leaf.dtype).itemsize
  return total


def dequant_bytes(cfg: ModelConfig, mesh) -> int:
  """An int8 (or GGUF block) base's dequantised matrices alive at once, in the compute dtype: the unembedding
  [V, D] (XLA:CPU materialised it; it measured the whole difference from a float base in the
  update's compiled memory on builtin:micro/tiny) + one layer's largest matrix [D, F] (fused
  into its product on CPU; counted as the bound where a backend does not fuse it)."""
  c = cfg.jnp_dtype.itemsize
  unembed = local_elements(("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size), mesh)
  layer = local_elements(("embed", "mlp"), (cfg.hidden_size, cfg.intermediate_size), mesh)
  return c * (unembed + layer)


def unsaved_bytes(cfg: ModelConfig, mesh, lcfg: lora.LoraConfig, minibatch: int, seq_len: int,
                  remat: bool, layer: int) -> int:
  """What full fine-tuning's activations (`memory.activation_bytes`) hold that the LoRA update's
  do not, as XLA's compiled memory showed on builtin micro/tiny (S = 64-256): without an adapter
  on any MLP projection the backward computes no MLP weight gradient and holds one layer (of
  `layer` bytes) less; without one on o_proj no layer keeps its attention output (the input of
  o_proj's weight gradient), c * loc(M, S, H, hd) per saved layer."""
  if remat:                                 # an estimate already: left as full fine-tuning's
    return 0
  mlp = any(t in lora.MLP_TARGETS for t in lcfg.targets)
  saved_layers = cfg.num_layers + (1 if mlp else 0)
  out = 0 if mlp else layer
  if "o_proj" not in lcfg.targets:
    heads = local_elements(("batch", None, "heads", "head_dim"),
                           (minibatch, seq_len, cfg.num_heads, cfg.head_dim), mesh)
    out += saved_layers * cfg.jnp_dtype.itemsize * heads
  return out
