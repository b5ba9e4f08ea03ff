"""Adapters on disk: the base fingerprint their checkpoints carry, PEFT export, merged export.
(Refusing a checkpoint of another base is `jaxagent.runs.adapters.check_base`: checkpoints sit
above models in the layering.)

    meta[BASE_FINGERPRINT_KEY] = base_fingerprint(base)   # saved with each adapter checkpoint
    export_peft(out_dir, model_cfg, lcfg, adapters)       # adapter_config.json + safetensors
    export_merged(out_dir, model_cfg, base, adapters, lcfg)   # full HF checkpoint, W + s A @ B

PEFT's layout for Qwen2/Qwen3/Llama (`peft.PeftModel.from_pretrained(model, out_dir)`): per layer
i and target module m, `base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r], with delta_y = (alpha / r) x A^T B^T. Ours, a [*in, r]
and b [r, *out], flatten row-major exactly as `hf_io` flattens the base matrices, so
A = a.reshape(in, r).T and B = b.reshape(r, out).T.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import jax
import numpy as np

from jaxagent.models import hf_io, lora
from jaxagent.models.config import ModelConfig
from jaxagent.models.safetensors_io import save_file

# Meta key of an adapter checkpoint: `base_fingerprint` of the base its adapters belong to.
BASE_FINGERPRINT_KEY = "lora_base_fingerprint"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_SAMPLE = 1 << 16          # elements hashed per base tensor (strided over the whole tensor)


def base_fingerprint(params: dict) -> str:
  """A short hex hash of the base weights' values: every tensor's path, shape, dtype and a
  strided sample of at most 65,536 of its elements spanning the whole tensor (any training step
  changes nearly every element; a full hash of a 7B base would read 14 GB per run)."""
  h = hashlib.sha256()
  for path, x in sorted(jax.tree_util.tree_flatten_with_path(lora.detach(params))[0],
                        key=lambda kv: jax.tree_util.keystr(kv[0])):
    flat = x.reshape(-1)
    sample = np.asarray(jax.device_get(flat[::max(1, flat.size // _SAMPLE)]))
    h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{x.dtype}|".encode())
    h.update(np.ascontiguousarray(sample).tobytes())
  return h.hexdigest()[:16]


def _module(name: str) -> str:
  return ("mlp." if name in lora.MLP_TARGETS else "self_attn.") + name


def peft_tensors(cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
  """{PEFT tensor name: float32 array} of every layer's adapters."""
  out = {}
  for name, ab in adapters.items():
    a, b = np.asarray(jax.device_get(ab["a"]), np.float32), np.asarray(jax.device_get(ab["b"]),
                                                                       np.float32)
    r = a.shape[-1]
    for i in range(cfg.num_layers):
      prefix = f"base_model.model.model.layers.{i}.{_module(name)}"
      out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
      out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
  return out


def export_peft(path: str | os.PathLike, cfg: ModelConfig, lcfg: lora.LoraConfig, adapters: dict,
                base_model_name_or_path: str = "") -> pathlib.Path:
  """Writes a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) that
  `peft.PeftModel.from_pretrained(transformers_model, path)` loads. Float32 tensors."""
  if not lcfg.enabled:
    raise ValueError("export_peft needs adapters: config.model.lora.rank is 0")
  if sorted(adapters) != sorted(lcfg.targets):
    raise ValueError(f"adapters on {sorted(adapters)} do not match config.model.lora.targets "
                     f"{sorted(lcfg.targets)}")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(peft_tensors(cfg, adapters), path / ADAPTER_WEIGHTS)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
      "lora_dropout": lcfg.dropout, "target_modules": sorted(lcfg.targets), "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
      "init_lora_weights": True, "modules_to_save": None,
      "base_model_name_or_path": base_model_name_or_path or None,
  }
  tmp = path / (ADAPTER_CONFIG + ".tmp")
  tmp.write_text(json.dumps(config, indent=2))
  os.replace(tmp, path / ADAPTER_CONFIG)
  return path


def export_merged(path: str | os.PathLike, cfg: ModelConfig, base: dict, adapters: dict,
                  lcfg: lora.LoraConfig, tokenizer=None, dtype: str | None = None) -> None:
  """Writes the adapted model as a full Hugging Face checkpoint (`hf_io.export` of the merged
  weights W + (alpha / r) A @ B), loadable without peft."""
  hf_io.export(path, cfg, lora.merge(lora.attach(base, adapters, lcfg)), tokenizer, dtype=dtype)
