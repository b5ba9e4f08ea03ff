"""Hugging Face checkpoint import and export.

Import reads a local HF directory (config.json, `model.safetensors` or sharded safetensors with
`model.safetensors.index.json`, tokenizer files) tensor by tensor: each parameter is created with
`jax.make_array_from_callback`, whose callback reads, from the memory-mapped files, only the slice
that one device holds. No full host copy of the model ever exists, and on a multi-host mesh each
host reads only its own shards.

Export writes a directory that `transformers` loads (`AutoModelForCausalLM.from_pretrained`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models import decoder
from jaxagent.models.config import CheckpointError, ModelConfig
from jaxagent.models.safetensors_io import SafetensorsFile, save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class _Entry:
  """How one of our parameters maps to HF tensors."""
  path: tuple[str, ...]                  # key path in our params dict
  hf_name: str                           # HF tensor name; "{i}" is the layer index if stacked
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  stacked: bool
  hf_shape: tuple[int, ...]              # shape of the HF tensor (one layer's, if stacked)


def _entries(cfg: ModelConfig) -> list[_Entry]:
  d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ident = lambda x: x
  tr = lambda x: x.T
  lp = "model.layers.{i}."

  def proj_in(n):   # HF [n*hd, d] -> ours [d, n, hd]
    return (lambda x: x.T.reshape(d, n, hd)), (lambda x: x.reshape(d, n * hd).T)

  def bias(n):      # HF [n*hd] -> ours [n, hd]
    return (lambda x: x.reshape(n, hd)), (lambda x: x.reshape(n * hd))

  v, f = cfg.vocab_size, cfg.intermediate_size
  out = [
      _Entry(("embed",), "model.embed_tokens.weight", ident, ident, False, (v, d)),
      _Entry(("final_norm",), "model.norm.weight", ident, ident, False, (d,)),
      _Entry(("layers", "attn_norm"), lp + "input_layernorm.weight", ident, ident, True, (d,)),
      _Entry(("layers", "mlp_norm"), lp + "post_attention_layernorm.weight", ident, ident, True, (d,)),
      _Entry(("layers", "q_proj"), lp + "self_attn.q_proj.weight", *proj_in(h), True, (h * hd, d)),
      _Entry(("layers", "k_proj"), lp + "self_attn.k_proj.weight", *proj_in(k), True, (k * hd, d)),
      _Entry(("layers", "v_proj"), lp + "self_attn.v_proj.weight", *proj_in(k), True, (k * hd, d)),
      _Entry(("layers", "o_proj"), lp + "self_attn.o_proj.weight",
             lambda x: x.T.reshape(h, hd, d), lambda x: x.reshape(h * hd, d).T, True, (d, h * hd)),
      _Entry(("layers", "gate_proj"), lp + "mlp.gate_proj.weight", tr, tr, True, (f, d)),
      _Entry(("layers", "up_proj"), lp + "mlp.up_proj.weight", tr, tr, True, (f, d)),
      _Entry(("layers", "down_proj"), lp + "mlp.down_proj.weight", tr, tr, True, (d, f)),
  ]
  if cfg.qkv_bias:
    out += [_Entry(("layers", "q_bias"), lp + "self_attn.q_proj.bias", *bias(h), True, (h * hd,)),
            _Entry(("layers", "k_bias"), lp + "self_attn.k_proj.bias", *bias(k), True, (k * hd,)),
            _Entry(("layers", "v_bias"), lp + "self_attn.v_proj.bias", *bias(k), True, (k * hd,))]
  if cfg.qk_norm:
    out += [_Entry(("layers", "q_norm"), lp + "self_attn.q_norm.weight", ident, ident, True, (hd,)),
            _Entry(("layers", "k_norm"), lp + "self_attn.k_norm.weight", ident, ident, True, (hd,))]
  if not cfg.tie_word_embeddings:
    out.append(_Entry(("lm_head",), "lm_head.weight", tr, tr, False, (v, d)))
  return out


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def read_config(path: pathlib.Path, dtype: str | None, param_dtype: str | None = None) -> ModelConfig:
  cfg_file = path / "config.json"
  if not path.is_dir():
    raise CheckpointError(f"{path}: not a directory; pass a local Hugging Face checkpoint "
                          "directory (config.json, *.safetensors, tokenizer files) or 'builtin:tiny'")
  if not cfg_file.exists():
    raise CheckpointError(f"{cfg_file}: missing; a Hugging Face checkpoint directory needs "
                          "config.json (download the full repository, not only the weights)")
  try:
    hf = json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_file}: not valid JSON ({e}); re-download or repair it") from e
  return ModelConfig.from_hf(hf, source=str(cfg_file), dtype=dtype, param_dtype=param_dtype)


def check_tokenizer_files(path: pathlib.Path) -> None:
  if not any((path / f).exists() for f in TOKENIZER_FILES):
    raise CheckpointError(f"{path}: no tokenizer files (expected one of {TOKENIZER_FILES} and "
                          "tokenizer_config.json); copy the tokenizer files of the base model "
                          "into this directory")


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """HF tensor name -> file holding it."""
  index = path / INDEX_FILE
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = {f: path / f for f in set(weight_map.values())}
    for f, p in files.items():
      if not p.exists():
        raise CheckpointError(f"{p}: missing, but {index} lists it; download every shard named "
                              "in the index")
    return {name: files[f] for name, f in weight_map.items()}
  single = path / SINGLE_FILE
  if single.exists():
    return {name: single for name in SafetensorsFile(single).names()}
  if list(path.glob("*.bin")) or list(path.glob("*.pth")):
    raise CheckpointError(f"{path}: only PyTorch .bin/.pth weights found; jaxagent reads "
                          "safetensors. Convert with transformers: model.save_pretrained(dir, "
                          "safe_serialization=True)")
  raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; download the safetensors "
                        "weights into this directory")


def load_params(path: pathlib.Path, cfg: ModelConfig, shardings=None) -> dict:
  """Reads params from safetensors, each placed with its sharding as it is read.

  Args:
    shardings: pytree like the params of `jax.sharding.Sharding` (default: first device).
  """
  where = _weight_files(path)
  files: dict[pathlib.Path, SafetensorsFile] = {}

  def tensor(name: str) -> np.ndarray:
    if name not in where:
      raise CheckpointError(f"{path}: tensor {name!r} is missing from the weights; the "
                            "checkpoint does not match config.json (wrong model_type, "
                            "num_hidden_layers or tie_word_embeddings?)")
    f = where[name]
    if f not in files:
      files[f] = SafetensorsFile(f)
    return files[f].get(name)

  _, shapes = decoder.abstract_params(cfg)
  dtype = cfg.jnp_param_dtype
  params: dict = {}
  for e in _entries(cfg):
    want = _get(shapes, e.path).shape
    n_layers = cfg.num_layers if e.stacked else None
    names = [e.hf_name.format(i=i) for i in range(n_layers)] if e.stacked else [e.hf_name]
    for name in names:   # validate every shape before any compute
      x = tensor(name)
      if tuple(x.shape) != e.hf_shape:
        raise CheckpointError(
            f"{where[name]}: tensor {name!r} has shape {tuple(x.shape)}, but config.json implies "
            f"{e.hf_shape}; the config and the weights come from different models (use the "
            "config.json that was saved with these weights)")
    sharding = (_get(shardings, e.path) if shardings is not None
                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    def read(index, e=e, names=names):
      if e.stacked:
        layers = range(len(names))[index[0]]
        parts = [e.to_ours(tensor(names[i]))[index[1:]] for i in layers]
        return np.stack(parts).astype(dtype)
      return np.asarray(e.to_ours(tensor(names[0]))[index]).astype(dtype)

    _set(params, e.path, jax.make_array_from_callback(want, sharding, read))
  return params


def export(path: str | os.PathLike, cfg: ModelConfig, params: dict, tokenizer=None,
           max_shard_bytes: int = 2 << 30, dtype: str | None = None) -> None:
  """Writes an HF directory: config.json, safetensors shards (+ index), tokenizer files."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  out_dtype = jnp.dtype(dtype or cfg.param_dtype)
  hf_cfg = cfg.to_hf()
  hf_cfg["torch_dtype"] = str(out_dtype)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for e in _entries(cfg):
    leaf = _get(params, e.path)
    for i in range(cfg.num_layers) if e.stacked else [None]:
      x = np.asarray(jax.device_get(leaf[i] if e.stacked else leaf)).astype(out_dtype)
      x = np.ascontiguousarray(e.to_hf(x))
      if size and size + x.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][e.hf_name.format(i=i)] = x
      size += x.nbytes
  if len(shards) == 1:
    save_file(shards[0], path / SINGLE_FILE)
  else:
    n = len(shards)
    weight_map = {}
    for j, shard in enumerate(shards):
      fname = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
      save_file(shard, path / fname)
      weight_map.update({k: fname for k in shard})
    total = sum(x.nbytes for s in shards for x in s.values())
    _atomic_write(path / INDEX_FILE, json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  _atomic_write(path / "config.json", json.dumps(hf_cfg, indent=2))
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))


def _atomic_write(path: pathlib.Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)
