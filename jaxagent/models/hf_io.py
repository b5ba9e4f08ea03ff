"""Hugging Face checkpoint import and export.

Import reads a local HF directory (config.json, `model.safetensors` or sharded safetensors with
`model.safetensors.index.json`, tokenizer files) tensor by tensor: each parameter is created with
`jax.make_array_from_callback`, whose callback reads, from the memory-mapped files, only the slice
that one device holds. No full host copy of the model ever exists, and on a multi-host mesh each
host reads only its own shards.

Import validates what it reads and raises `CheckpointError` naming the file (and the tensor) and
the fix: headers against file sizes, every tensor's presence and shape against config.json, tensors
the model would not use (e.g. more layers than num_hidden_layers), and non-finite values (checked
on each shard as it is read, so the check streams with the read).

Export writes a directory that `transformers` loads (`AutoModelForCausalLM.from_pretrained`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxagent.models import decoder
from jaxagent.models.config import CheckpointError, ModelConfig
from jaxagent.models.safetensors_io import SafetensorsFile, all_finite, count_nonfinite, save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Tensors HF checkpoints may carry that the model legitimately does not read: rotary inverse
# frequencies (older Llama files save the buffer; we compute it from config.json).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHOW = 4   # how many tensor names an error lists


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
  if not isinstance(hf, dict):
    raise CheckpointError(f"{cfg_file}: holds a JSON {type(hf).__name__}, not an object of "
                          "model settings; re-download or repair it (it must be the model's "
                          "Hugging Face config.json)")
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
    try:
      weight_map = json.loads(index.read_text())
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{index}: not valid JSON ({e}); re-download it") from e
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) for f in weight_map.values()):
      raise CheckpointError(f"{index}: no \"weight_map\" object of tensor name -> shard file; "
                            "re-download it")
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


def _natural(name: str):
  """Sort key that orders model.layers.10 after model.layers.9."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _listing(names: list[str]) -> str:
  """'tensor 'a' is' or 'tensors 'a', 'b' and 3 more are'."""
  more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
  shown = ", ".join(repr(n) for n in names[:_SHOW]) + more
  return f"tensor {shown} is" if len(names) == 1 else f"tensors {shown} are"


def _check_unused(path: pathlib.Path, cfg: ModelConfig, where: dict[str, pathlib.Path],
                  used: set[str]) -> None:
  """Raises if the files hold tensors the model of config.json would not read (O(names))."""
  skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
  unused = sorted((n for n in where if n not in used and n not in skip
                   and not n.endswith(_IGNORED_SUFFIXES)), key=_natural)
  if not unused:
    return
  layers = [int(m.group(1)) for m in map(_LAYER.match, where) if m]
  n_layers = max(layers) + 1 if layers else 0
  if n_layers > cfg.num_layers:
    extra = [n for n in unused if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_layers]
    raise CheckpointError(
        f"{where[extra[0]]}: {_listing(extra)} not used: {path / 'config.json'} has "
        f"num_hidden_layers={cfg.num_layers} but the weights have {n_layers} layers "
        f"(model.layers.0 to model.layers.{n_layers - 1}); set num_hidden_layers to {n_layers} "
        "if these weights are right, or use the config.json that was saved with them")
  raise CheckpointError(
      f"{where[unused[0]]}: {_listing(unused)} not used by the {cfg.model_type} "
      f"model that {path / 'config.json'} describes; the config and the weights come from "
      "different models or variants (check model_type, attention_bias, mlp_bias and "
      "tie_word_embeddings), or the weights hold parameters jaxagent does not support; use the "
      "config.json that was saved with these weights")


def load_params(path: pathlib.Path, cfg: ModelConfig, shardings=None,
                allow_nonfinite: bool = False) -> dict:
  """Reads params from safetensors, each placed with its sharding as it is read.

  Everything but the values is validated first, from the headers alone: every tensor the config
  needs is present with its shape, and no tensor is left unused. Values are checked to be finite
  on each shard as it is read.

  Args:
    shardings: pytree like the params of `jax.sharding.Sharding` (default: first device).
    allow_nonfinite: load NaN/Inf weights with a warning naming them, instead of raising.
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
    if name not in files[f]:
      raise CheckpointError(f"{f}: tensor {name!r} is not in this file, but {path / INDEX_FILE} "
                            "says it is; the index and the shards come from different saves "
                            "(re-download the checkpoint)")
    return files[f].get(name)

  entries = named_entries(cfg)
  for e, names in entries:   # validate every name and shape before any compute
    for name in names:
      x = tensor(name)
      if tuple(x.shape) != e.hf_shape:
        raise CheckpointError(
            f"{where[name]}: tensor {name!r} has shape {tuple(x.shape)}, but config.json implies "
            f"{e.hf_shape}; the config and the weights come from different models (use the "
            "config.json that was saved with these weights)")
  _check_unused(path, cfg, where, {n for _, names in entries for n in names})
  if cfg.tie_word_embeddings and "lm_head.weight" in where:
    _check_tied(where, tensor("model.embed_tokens.weight"), tensor("lm_head.weight"))
  check = FiniteCheck(cfg, tensor, lambda name: f"{where[name]}: tensor {name!r}",
                      allow_nonfinite, fix="re-export or re-download them")
  params = place_params(cfg, shardings, entries, tensor, check)
  check.warn(path)
  return params


def named_entries(cfg: ModelConfig) -> list[tuple[_Entry, list[str]]]:
  """Every params entry with the HF tensor names it is read from (one per layer if stacked)."""
  return [(e, [e.hf_name.format(i=i) for i in range(cfg.num_layers)] if e.stacked
           else [e.hf_name]) for e in _entries(cfg)]


class FiniteCheck:
  """Checks each piece of a tensor as it is converted to the param dtype (so the check streams
  with the read): non-finite values in the source raise `CheckpointError` naming the tensor
  (or, with allow_nonfinite, are collected for one warning), and so do finite values the
  conversion overflows.

  tensor(name): the whole source tensor (HF layout), for counting NaN/Inf; describe(name): the
  file and tensor as an error names them; fix: what to do about corrupted weights."""

  def __init__(self, cfg: ModelConfig, tensor: Callable[[str], np.ndarray],
               describe: Callable[[str], str], allow_nonfinite: bool, fix: str):
    self.dtype, self.tensor, self.describe = cfg.jnp_param_dtype, tensor, describe
    self.allow, self.fix = allow_nonfinite, fix
    self.nonfinite: dict[str, str] = {}   # tensor name -> what is wrong (allow_nonfinite=True)

  def __call__(self, name: str, src: np.ndarray, out: np.ndarray) -> None:
    """`out` is `src` (part of tensor `name`) converted to the param dtype."""
    if all_finite(out) or name in self.nonfinite:
      return
    if all_finite(src):
      problem = (f"has values beyond the range of {np.dtype(self.dtype).name} (max |x| = "
                 f"{float(np.abs(src.astype(np.float32)).max()):.4g}), which become Inf when "
                 "converted")
      fix = "load it with param_dtype float32 or bfloat16"
    else:
      whole = self.tensor(name)
      nan, inf = count_nonfinite(whole)
      problem = f"holds {nan} NaN and {inf} Inf values (of {whole.size})"
      fix = f"the weights are corrupted (a diverged training run or a damaged file): {self.fix}"
    if not self.allow:
      raise CheckpointError(f"{self.describe(name)} {problem}; {fix}, or pass "
                            "allow_nonfinite=True to from_pretrained to load them anyway")
    self.nonfinite[name] = f"{self.describe(name)} {problem}"

  def warn(self, path) -> None:
    """One warning naming the non-finite tensors loaded (allow_nonfinite=True)."""
    if not self.nonfinite:
      return
    shown = [self.nonfinite[n] for n in sorted(self.nonfinite, key=_natural)]
    more = f"; and {len(shown) - _SHOW} more tensors" if len(shown) > _SHOW else ""
    logging.warning("%s: loaded %d tensors with non-finite values because allow_nonfinite=True "
                    "(rollouts and updates on them will produce NaN/Inf): %s%s", path,
                    len(shown), "; ".join(shown[:_SHOW]), more)


def place_params(cfg: ModelConfig, shardings, entries, tensor: Callable[[str], np.ndarray],
                 check: FiniteCheck) -> dict:
  """The params tree: each entry's array assembled from `tensor(hf_name)` (HF layout; the entry's
  `to_ours` maps it) and placed with its sharding (default: the first device), each device
  reading only its own shard (`make_array_from_callback`); `check` sees every piece as it is
  converted to the param dtype."""
  _, shapes = decoder.abstract_params(cfg)
  dtype = cfg.jnp_param_dtype
  params: dict = {}
  for e, names in entries:
    want = _get(shapes, e.path).shape
    sharding = (_get(shardings, e.path) if shardings is not None
                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    @np.errstate(over="ignore")   # a cast's overflow is reported by check
    def read(index, e=e, names=names):
      if not e.stacked:
        src = e.to_ours(tensor(names[0]))[index]
        out = np.asarray(src).astype(dtype)
        check(names[0], src, out)
        return out
      layers, out = range(len(names))[index[0]], None
      for j, i in enumerate(layers):   # filled layer by layer: one copy, checked as it is made
        src = e.to_ours(tensor(names[i]))[index[1:]]
        if out is None:
          out = np.empty((len(layers),) + src.shape, dtype)
        out[j] = src
        check(names[i], src, out[j])
      return out

    _set(params, e.path, jax.make_array_from_callback(want, sharding, read))
  return params


def _check_tied(where: dict[str, pathlib.Path], embed: np.ndarray, lm_head: np.ndarray) -> None:
  """With tied embeddings, an lm_head.weight in the files must be the embedding (checked on a
  few rows: O(1)); a different one means the weights are untied and config.json is wrong."""
  if lm_head.shape != embed.shape or not np.array_equal(lm_head[:4], embed[:4]):
    raise CheckpointError(
        f"{where['lm_head.weight']}: tensor 'lm_head.weight' differs from "
        "'model.embed_tokens.weight', but config.json has tie_word_embeddings=true, which would "
        "ignore it; set tie_word_embeddings to false if these weights are right, or use the "
        "config.json that was saved with them")


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
