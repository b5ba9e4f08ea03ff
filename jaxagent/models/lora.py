"""Low-rank adapters (LoRA) on the decoder's projections, kept apart from the frozen base.

    lcfg = LoraConfig(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    lcfg.check(model_cfg)                             # rank vs the matrices: ValueError
    adapters = init_adapters(model_cfg, lcfg, key)    # the only trainable tree
    logits, _ = decoder.apply(model_cfg, attach(base, adapters, lcfg), tokens)

The adapted projection of input x is  x @ W + (alpha / r) * (dropout(x) @ A) @ B  with W the
frozen base matrix [*in, *out], A [*in, r] and B [r, *out] (PEFT's convention: A kaiming-uniform
with bound 1/sqrt(fan_in), B zero, so step 0 equals the base exactly). Adapters are a separate
pure dict, `{name: {"a": [layers, *in, r], "b": [layers, r, *out]}}`, stacked on the layers
axis like the base and carrying the base matrices' logical axes plus an unsharded `lora_rank`
axis, so they shard like their base and the decoder's scan slices them with the layers.

`attach` joins them to the base as `params["layers"]["lora"]` (a shallow dict join: no array is
copied) as `Adapter` nodes that carry the static scale and dropout; `decoder._layer` adds the
delta (`project`). The CPU-kernel decode path (`decoder.for_decode`) instead merges them into
the weights once per rollout (`merge`, W + scale * A @ B), exact up to float rounding.

Why hand-written rather than `flax.nnx.LoRA` or `qwix`: both adapt modules (nnx.LoRA wraps a 2-D
linear layer; qwix intercepts the ops of a Flax model's modules), while our hot path is the pure
function `decoder.apply` on a dict of stacked [layers, *in, *out] tensors; a delta of two einsums
in that function keeps the scan, the shardings and the frozen base as they are.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.models.config import ModelConfig
from jaxagent.models.quant import BASE_DTYPES

# Projection names, as in the decoder's params and in PEFT's `target_modules`.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
RANK_AXIS = "lora_rank"          # no sharding rule: replicated


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Adapters' hyper-parameters (hashable: a static jit argument). rank 0 = no adapters."""
  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0             # on the adapter's input, training forwards only
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
  # How the frozen base is held: "float" (as loaded), "int8" (`jaxagent.models.quant`: int8
  # matrices with per-output-channel scales, dequantised per product inside the forward) or
  # "gguf" (a .gguf file's matrices in its own block formats: `jaxagent.models.gguf_base`).
  base_dtype: str = "float"

  def __post_init__(self):
    key = "config.model.lora"
    if type(self.rank) is not int or self.rank < 0:
      raise ValueError(f"{key}.rank must be 0 (off) or a positive int, got {self.rank!r}")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or (self.rank and not self.targets) or len(set(self.targets)) < len(self.targets):
      raise ValueError(f"{key}.targets={','.join(self.targets)!r}: "
                       + (f"unknown {unknown}; " if unknown else "give each once and at least "
                          "one; ") + f"valid names: {', '.join(TARGETS)}")
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"{key}.alpha must be > 0 (the delta is scaled by alpha / rank), got "
                       f"{self.alpha}")
    if not 0 <= self.dropout < 1:
      raise ValueError(f"{key}.dropout must be in [0, 1), got {self.dropout}")
    if self.base_dtype not in BASE_DTYPES:
      raise ValueError(f"{key}.base_dtype={self.base_dtype!r}: use one of {BASE_DTYPES}")
    if self.base_dtype != "float" and not self.rank:
      raise ValueError(f"{key}.base_dtype={self.base_dtype!r} needs adapters (a frozen base): "
                       f"set {key}.rank > 0, or {key}.base_dtype='float'")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def int8_base(self) -> bool:
    return self.enabled and self.base_dtype == "int8"

  @property
  def gguf_base(self) -> bool:
    return self.enabled and self.base_dtype == "gguf"

  @property
  def quantized_base(self) -> bool:
    """The base is held quantised (int8 or GGUF blocks), dequantised per product."""
    return self.int8_base or self.gguf_base

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def check(self, cfg: ModelConfig) -> None:
    """ValueError naming config.model.lora.rank if the rank exceeds a target matrix's smaller
    side (its input or output size)."""
    for name in self.targets:
      ins, outs = _dims(cfg, name)
      bound = min(math.prod(ins), math.prod(outs))
      if self.rank > bound:
        raise ValueError(f"config.model.lora.rank={self.rank} is larger than {name}'s matrix "
                         f"({math.prod(ins)} x {math.prod(outs)}); use a rank in 1..{bound}")


def _dims(cfg: ModelConfig, name: str):
  """(input sizes, output sizes) of projection `name`."""
  return tuple(tuple(s for s, _ in side) for side in _sides(cfg, name))


def _sides(cfg: ModelConfig, name: str):
  """(input, output) of projection `name`, each a tuple of (size, logical axis) per dim."""
  emb, mlp = ((cfg.hidden_size, "embed"),), ((cfg.intermediate_size, "mlp"),)
  q = ((cfg.num_heads, "heads"), (cfg.head_dim, "head_dim"))
  kv = ((cfg.num_kv_heads, "kv_heads"), (cfg.head_dim, "head_dim"))
  return {"q_proj": (emb, q), "k_proj": (emb, kv), "v_proj": (emb, kv), "o_proj": (q, emb),
          "gate_proj": (emb, mlp), "up_proj": (emb, mlp), "down_proj": (mlp, emb)}[name]


def adapter_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> dict:
  """{name: {"a": (shape, axes), "b": (shape, axes)}} of every target's stacked adapters."""
  n, r, out = cfg.num_layers, lcfg.rank, {}
  for name in lcfg.targets:
    ins, outs = _sides(cfg, name)
    out[name] = {
        "a": ((n, *(s for s, _ in ins), r), ("layers", *(a for _, a in ins), RANK_AXIS)),
        "b": ((n, r, *(s for s, _ in outs)), ("layers", RANK_AXIS, *(a for _, a in outs)))}
  return out


def logical_axes(cfg: ModelConfig, lcfg: LoraConfig) -> dict:
  """The adapters' logical axis names, same structure as `init_adapters`' tree."""
  return jax.tree.map(lambda sa: sa[1], adapter_shapes(cfg, lcfg),
                      is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                      and isinstance(x[0], tuple))


def init_adapters(cfg: ModelConfig, lcfg: LoraConfig, key: jax.Array) -> dict:
  """Fresh float32 adapters: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's kaiming-uniform
  with a=sqrt(5)), B = 0. Float32 whatever the base's dtype: the trained values stay exact."""
  lcfg.check(cfg)
  out = {}
  for i, (name, ab) in enumerate(sorted(adapter_shapes(cfg, lcfg).items())):
    (a_shape, _), (b_shape, _) = ab["a"], ab["b"]
    bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
    a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
    out[name] = {"a": a, "b": jnp.zeros(b_shape, jnp.float32)}
  return out


@struct.dataclass
class Adapter:
  """One projection's adapter as the decoder reads it (stacked or one layer's slice)."""
  a: jax.Array                    # [(layers,) *in, r]
  b: jax.Array                    # [(layers,) r, *out]
  key: jax.Array | None           # dropout key per layer [(layers,)] or None (no dropout)
  scale: float = struct.field(pytree_node=False)
  dropout: float = struct.field(pytree_node=False)


def attach(params: dict, adapters: dict, lcfg: LoraConfig, dropout_key=None) -> dict:
  """The base `params` with `adapters` joined for `decoder.apply` (no array copied). With a
  `dropout_key` and lcfg.dropout > 0 the adapters' inputs are dropped out (training)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    raise ValueError("attach adapters to stacked params, before decoder.for_decode")
  n = jax.tree.leaves(layers)[0].shape[0]
  drop = dropout_key is not None and lcfg.dropout > 0
  lora = {}
  for i, (name, ab) in enumerate(sorted(adapters.items())):
    key = jax.random.split(jax.random.fold_in(dropout_key, i), n) if drop else None
    lora[name] = Adapter(ab["a"], ab["b"], key, lcfg.scale, lcfg.dropout if drop else 0.0)
  return {**params, "layers": {**layers, "lora": lora}}


def detach(params: dict) -> dict:
  """`params` without adapters (the base, which is the KL reference of LoRA training)."""
  layers = params["layers"]
  return {**params, "layers": {k: v for k, v in layers.items() if k != "lora"}}


def adapted(p: dict, names=TARGETS) -> bool:
  """Whether layer params `p` carry an adapter on any of `names`."""
  return any(n in p.get("lora", {}) for n in names)


def project(p: dict, name: str, x, n_in: int, base_out):
  """base_out + scale * (dropout(x) @ A) @ B for layer params `p` (one layer's slice), x
  [..., *in] contracted over its last n_in dims; base_out unchanged without an adapter."""
  ad = p.get("lora", {}).get(name)
  if ad is None:
    return base_out
  dt = base_out.dtype
  if ad.key is not None and ad.dropout > 0:
    keep = jax.random.bernoulli(ad.key, 1.0 - ad.dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - ad.dropout), 0).astype(x.dtype)
  xa = jnp.tensordot(x, ad.a.astype(dt), axes=n_in) * jnp.asarray(ad.scale, dt)   # [..., r]
  return base_out + jnp.tensordot(xa, ad.b.astype(dt), axes=1)


def merge(params: dict) -> dict:
  """The attached `params` with each adapter folded into its base matrix, W + scale * A @ B
  (in float32, cast to W's dtype), and no adapters left: the adapted model as plain weights."""
  layers = params["layers"]
  if "lora" not in layers:
    return params
  out = {k: v for k, v in layers.items() if k != "lora"}
  for name, ad in layers["lora"].items():
    w = layers[name]
    if not hasattr(w, "dtype"):   # a `quant.QTensor` or GGUF `blocks.BlockTensor`: not float
      kind = "GGUF block" if hasattr(w, "kind") else "int8"
      dtype = "gguf" if hasattr(w, "kind") else "int8"
      raise ValueError(
          f"cannot merge adapters into the {kind} base's {name} (config.model.lora.base_dtype="
          f"'{dtype}' holds no full-precision copy): merge onto the original weights (load "
          "config.model.path again, e.g. jaxagent.models.from_pretrained(path).params, and pass "
          f"them as the base), or dequantise the {kind} base first "
          "(jaxagent.models.quant.dequantize_params: the model exactly as trained)")
    a = ad.a.astype(jnp.float32).reshape(ad.a.shape[0], -1, ad.a.shape[-1])   # [n, in, r]
    b = ad.b.astype(jnp.float32).reshape(ad.b.shape[0], ad.b.shape[1], -1)    # [n, r, out]
    delta = jnp.einsum("nir,nro->nio", a, b) * ad.scale
    out[name] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
  return {**params, "layers": out}
