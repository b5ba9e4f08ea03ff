"""Model configuration: one decoder config covering Qwen2/Qwen2.5, Qwen3 and Llama 3.x.

Built from a Hugging Face `config.json` (`ModelConfig.from_hf`) and written back (`to_hf`), so a
checkpoint round-trips through `save_pretrained` into a directory `transformers` loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

# HF `model_type` -> family behaviour.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be loaded; the message names the file and the fix."""


# How attention reads keys and values (`jaxagent.models.attention`): "xla" (XLA's own ops on
# every backend), "kernel" (the CPU kernel wherever it applies: float32 on CPU; an error if it
# cannot be built), "auto" (the kernel only on one CPU device and only where it measured
# faster than XLA on this machine: `attention.kernel_enabled`) or "dot_product" (XLA's paths,
# but the causal attention without a cache, the update's, through
# `jax.nn.dot_product_attention`: cuDNN's fused attention on NVIDIA GPUs where its dtypes and
# shapes allow, XLA's one masked product elsewhere).
ATTENTIONS = ("auto", "xla", "kernel", "dot_product")
# Sets the default of `ModelConfig.attention` for configs made while it is set; the field, not
# the variable, is what every compiled program is keyed by.
ATTENTION_ENV = "JAXAGENT_CACHE_ATTENTION"


def default_attention() -> str:
  """ATTENTION_ENV's value (default "auto"); a value outside ATTENTIONS raises naming the fix."""
  value = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
  if value not in ATTENTIONS:
    raise ValueError(f"{ATTENTION_ENV}={value!r} is not an attention path; set it to one of "
                     f"{ATTENTIONS} or unset it")
  return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters (hashable, so it can be a static jit argument)."""
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  rms_norm_eps: float
  tie_word_embeddings: bool
  qkv_bias: bool                 # Qwen2/2.5: biases on q, k, v projections
  qk_norm: bool                  # Qwen3: RMSNorm on q and k per head
  max_position_embeddings: int
  # RoPE scaling as a sorted tuple of (key, value) pairs, e.g. llama3's factor and frequencies.
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  param_dtype: str = "float32"
  dtype: str = "float32"         # compute dtype (activations, KV cache); logits are float32
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  init_seed: int | None = None   # built-in models: weights are initialised from this seed
  # The attention path (ATTENTIONS). Static like every field, so programs traced for one path
  # are never reused for another; `dataclasses.replace(cfg, attention="xla")` switches it.
  attention: str = dataclasses.field(default_factory=default_attention)

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}: use one of {ATTENTIONS}")

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def rope_type(self) -> str:
    return dict(self.rope_scaling).get("rope_type", "default")

  def num_params(self) -> int:
    d, f, h, k, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                      self.num_kv_heads, self.head_dim)
    attn = d * h * hd * 2 + d * k * hd * 2 + (h * hd + 2 * k * hd if self.qkv_bias else 0)
    layer = attn + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0)
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + emb + d

  def rope_inv_freq(self) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], with llama3 / linear scaling applied."""
    inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
    sc = dict(self.rope_scaling)
    if self.rope_type == "linear":
      inv = inv / sc["factor"]
    elif self.rope_type == "llama3":
      factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
      old_ctx = sc["original_max_position_embeddings"]
      low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
      smooth = (old_ctx / wavelen - lo) / (hi - lo)
      smoothed = (1 - smooth) * scaled / factor + smooth * scaled
      medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)

  @classmethod
  def from_hf(cls, hf: dict, *, source: str = "config.json", dtype: str | None = None,
              param_dtype: str | None = None) -> "ModelConfig":
    """Reads a Hugging Face config dict. Raises `CheckpointError` naming the fix."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
      raise CheckpointError(
          f"{source}: model_type {mt!r} is not supported; jaxagent loads {SUPPORTED_MODEL_TYPES} "
          "(Qwen2/Qwen2.5, Qwen3, Llama 3.x). Convert the checkpoint to one of these families.")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
      raise CheckpointError(f"{source}: missing keys {missing}; is this a causal-LM config.json?")
    for k in required + ("num_key_value_heads", "head_dim"):
      v = hf.get(k)
      if v is not None and (type(v) is not int or v <= 0):
        raise CheckpointError(f"{source}: {k} is {v!r}, but it must be a positive integer; "
                              "repair config.json or use the one saved with the weights")
    if hf.get("use_sliding_window", False):
      raise CheckpointError(f"{source}: use_sliding_window=true is not supported; set it to false "
                            "(Qwen2.5 checkpoints ship with it false).")
    if hf.get("hidden_act", "silu") != "silu":
      raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only).")
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` and
    # `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.update(rope)
    if "type" in scaling and "rope_type" not in scaling:
      scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise CheckpointError(f"{source}: rope_type {rope_type!r} is not supported "
                            f"({SUPPORTED_ROPE_TYPES}); remove rope_scaling for short contexts.")
    if rope_type == "default":
      scaling = {}
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return cls(
        model_type=mt,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=(mt == "qwen2") or bool(hf.get("attention_bias", False)),
        qk_norm=(mt == "qwen3"),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_scaling=tuple(sorted(scaling.items())),
        param_dtype=param_dtype or dtype or str(torch_dtype),
        dtype=dtype or str(torch_dtype),
        eos_token_ids=eos,
        pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        init_seed=hf.get("jaxagent_init_seed"),
    )

  def to_hf(self) -> dict:
    """A `config.json` dict that `transformers` loads into the matching *ForCausalLM."""
    out = {
        "architectures": [_ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "max_position_embeddings": self.max_position_embeddings,
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": self.param_dtype,
        "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        "pad_token_id": self.pad_token_id,
        "bos_token_id": self.bos_token_id,
    }
    if self.rope_scaling:
      out["rope_scaling"] = dict(self.rope_scaling)
    if self.model_type == "llama":
      out["attention_bias"] = self.qkv_bias
      out["mlp_bias"] = False
    if self.model_type in ("qwen2", "qwen3"):
      out["use_sliding_window"] = False
    return out
