"""GGUF checkpoint import (llama.cpp's single-file format): llama, qwen2 and qwen3 architectures.

A `.gguf` file holds the model settings as metadata (`llama.block_count`, `llama.rope.freq_base`,
...), the tokenizer and chat template (`tokenizer.ggml.*`, `tokenizer.chat_template`) and the
tensors, each in its own type (F32, F16, BF16, or block-quantised: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
the K-quants Q2_K..Q6_K and the others `gguf.quants` can dequantise). Import maps

    metadata  -> a Hugging Face config dict -> `ModelConfig.from_hf`
    tensors   -> Hugging Face names (`blk.{i}.attn_q.weight` -> `model.layers.{i}.self_attn.
                 q_proj.weight`, ...) -> our params through `hf_io._entries`

Tensor shapes: GGUF lists dims innermost first (ggml `ne`), so a GGUF tensor of shape [in, out]
is the HF matrix [out, in]; `gguf.quants.dequantize` returns the HF (numpy) layout, float32.

llama.cpp's converter permutes the rows of the llama architecture's Q and K projections (weights
and biases) from HF's rotate-half RoPE layout to the interleaved one it computes with: for n heads
of head_dim hd (n = the KV heads for K),

    gguf = hf.reshape(n, 2, hd // 2, ...).swapaxes(1, 2).reshape(hf.shape)

which import undoes (`_unpermute`: reshape(n, hd // 2, 2, ...).swapaxes(1, 2)). Qwen2/Qwen3 files
are not permuted.

Parameters are placed by the mechanism the safetensors path uses (`hf_io.place_params`): each
device reads only its shard, and every piece is checked to be finite as it is converted to the
parameter dtype (`hf_io.FiniteCheck`). Each tensor is dequantised once (float32, HF layout) and
kept while its parameter's shards are read, so at most one parameter is ever whole on the host.

Everything but the values is validated first (architecture, metadata, every tensor's presence,
type and shape, no unused tensors); errors are `CheckpointError`s naming the file and the fix.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from jaxagent.models import hf_io
from jaxagent.models.config import CheckpointError, ModelConfig

GGUF_SUFFIX = ".gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
INSTALL_GGUF = "pip install gguf  (or: pip install 'jaxagent[smollm2]')"

# GGUF tensor name -> HF tensor name ("{i}": layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def is_gguf(path: pathlib.Path) -> bool:
  return path.suffix.lower() == GGUF_SUFFIX


def _gguf():
  """The optional `gguf` package (imported here: only GGUF loading needs it)."""
  try:
    import gguf   # noqa: PLC0415 (optional dependency)
  except ImportError as e:
    raise CheckpointError(f"loading .gguf files needs the gguf package: {INSTALL_GGUF}") from e
  return gguf


def hf_tensor_name(name: str) -> str | None:
  """HF name of a GGUF tensor name, or None if it has none (`blk.3.attn_q.weight` ->
  `model.layers.3.self_attn.q_proj.weight`)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES \
      and parts[3] in ("weight", "bias"):
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  return None


def gguf_tensor_name(hf_name: str) -> str:
  """GGUF name of an HF tensor name (the inverse of `hf_tensor_name`)."""
  for g, h in _GLOBAL_NAMES.items():
    if h == hf_name:
      return g
  parts = hf_name.split(".")   # model.layers.{i}.<module path>.{weight,bias}
  module = ".".join(parts[3:-1])
  short = next((g for g, h in _LAYER_NAMES.items() if h == module), module)
  return f"blk.{parts[2]}.{short}.{parts[-1]}"


class GGUFFile:
  """A memory-mapped .gguf file: metadata values and tensors by HF name."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    if not path.is_file():
      raise CheckpointError(f"{path}: no such file; pass an existing .gguf file, a Hugging Face "
                            "checkpoint directory or 'builtin:tiny'")
    gguf = _gguf()
    try:
      self.reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:   # the reader raises ValueError/struct errors on damaged files
      raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                            "re-download it") from e
    self.fields = self.reader.fields
    self.tensors = {t.name: t for t in self.reader.tensors}

  def value(self, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value."""
    f = self.fields.get(key)
    if f is None or not f.types:
      return default
    part = f.parts[f.data[0]] if f.data and f.data[0] >= 0 else f.parts[-1]
    if f.types[0].name == "STRING":
      return bytes(part).decode("utf-8")
    if f.types[0].name == "ARRAY":
      return default
    if f.types[0].name == "FLOAT32":   # the shortest decimal that is this float32: 1e-05, not
      return float(str(part[0]))       # 9.999999747378752e-06 (what config.json said)
    return part.tolist()[0]

  def _array(self, key: str):
    """The metadata field `key` if it is an array, else None."""
    f = self.fields.get(key)
    return f if f is not None and f.types and f.types[0].name == "ARRAY" else None

  def array_len(self, key: str) -> int | None:
    f = self._array(key)
    return None if f is None else len(f.data)

  def strings(self, key: str) -> list[str] | None:
    """A string-array metadata value (e.g. tokenizer.ggml.tokens), or None."""
    f = self._array(key)
    return None if f is None else [bytes(f.parts[i]).decode("utf-8") for i in f.data]

  def ints(self, key: str) -> list[int] | None:
    """An integer-array metadata value (e.g. tokenizer.ggml.token_type), or None."""
    f = self._array(key)
    return None if f is None else [int(f.parts[i][0]) for i in f.data]

  @property
  def architecture(self) -> str | None:
    return self.value("general.architecture")

  def hf_shape(self, t) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(t.shape))   # ggml lists dims innermost first


def hf_config(f: GGUFFile) -> dict:
  """A Hugging Face config dict from the file's metadata (for `ModelConfig.from_hf`)."""
  arch = f.architecture
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
        f"{f.path}: GGUF architecture {arch!r} (general.architecture) is not supported; jaxagent "
        f"loads GGUF files of {SUPPORTED_ARCHITECTURES}")
  if "rope_freqs.weight" in f.tensors:
    raise CheckpointError(
        f"{f.path}: tensor 'rope_freqs.weight' (llama3-style scaled RoPE frequencies) is not "
        "supported from GGUF; load the Hugging Face checkpoint of this model instead")

  def need(key):
    v = f.value(f"{arch}.{key}")
    if v is None:
      raise CheckpointError(f"{f.path}: metadata key {arch}.{key!r} is missing; the GGUF file is "
                            "incomplete (re-convert it with llama.cpp's convert_hf_to_gguf.py)")
    return v

  sizes = _checked_sizes(f, arch, need)
  heads, d, head_dim = sizes["attention.head_count"], sizes["embedding_length"], sizes["head_dim"]
  embd = f.tensors.get("token_embd.weight")
  vocab = (sizes["vocab_size"] or f.array_len("tokenizer.ggml.tokens")
           or (f.hf_shape(embd)[0] if embd is not None else None))
  hf = {
      "model_type": arch,
      "vocab_size": vocab,
      "hidden_size": d,
      "intermediate_size": sizes["feed_forward_length"],
      "num_hidden_layers": sizes["block_count"],
      "num_attention_heads": heads,
      "num_key_value_heads": sizes["attention.head_count_kv"] or heads,
      "head_dim": head_dim,
      "max_position_embeddings": sizes["context_length"] or 4096,
      "rope_theta": float(f.value(f"{arch}.rope.freq_base", 10000.0)),
      "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
      "tie_word_embeddings": "output.weight" not in f.tensors,
      "attention_bias": "blk.0.attn_q.bias" in f.tensors,
      "hidden_act": "silu",
      "torch_dtype": "float32",
      "bos_token_id": f.value("tokenizer.ggml.bos_token_id"),
      "eos_token_id": f.value("tokenizer.ggml.eos_token_id"),
      "pad_token_id": f.value("tokenizer.ggml.padding_token_id"),
  }
  scaling = f.value(f"{arch}.rope.scaling.type")
  if scaling == "linear":
    hf["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
  elif scaling not in (None, "none"):
    raise CheckpointError(f"{f.path}: {arch}.rope.scaling.type {scaling!r} is not supported "
                          "from GGUF (only 'linear'); load the Hugging Face checkpoint instead")
  return hf


# The longest context a header may declare (it sizes position tables, not tensors).
MAX_CONTEXT = 1 << 24


def _checked_sizes(f: GGUFFile, arch: str, need) -> dict:
  """The header's sizes, each checked before it is used in a shape or a division: a positive
  integer, no larger than what the file's tensors hold (`block_count`: exactly the blocks whose
  tensors are present; a dimension: at most the largest tensor dimension), the heads dividing
  the widths. A damaged or hostile header (block_count 2^31-1, head_count 0) is a CheckpointError
  naming the file and the field, before any per-layer name or array is made."""
  dims = [s for t in f.tensors.values() for s in f.hf_shape(t)]
  max_dim = max(dims, default=0)

  def bad(key, v, why):
    return CheckpointError(f"{f.path}: metadata {arch}.{key} is {v!r}, but {why}; the header is "
                           "damaged or does not match the tensors (re-convert the file with "
                           "llama.cpp's convert_hf_to_gguf.py)")

  def size(key, v, bound=None):
    if v is None:
      return None
    bound = max_dim if bound is None else bound
    if type(v) is not int or not 0 < v <= bound:
      raise bad(key, v, f"it must be a positive integer of at most {bound}")
    return v

  blocks = {int(n.split(".")[1]) for n in f.tensors if n.startswith("blk.")
            and n.split(".")[1].isdigit()}
  count = need("block_count")
  if type(count) is not int or count != len(blocks) or blocks != set(range(count)):
    shown = f"blk.0 .. blk.{max(blocks)}" if blocks else "none"
    raise bad("block_count", count, f"the file holds the tensors of {len(blocks)} blocks ({shown})")
  out = {k: size(k, need(k)) for k in ("embedding_length", "feed_forward_length",
                                       "attention.head_count")}
  out["block_count"] = count
  for k in ("attention.head_count_kv", "attention.key_length", "rope.dimension_count",
            "vocab_size"):
    out[k] = size(k, f.value(f"{arch}.{k}"))
  out["context_length"] = size("context_length", f.value(f"{arch}.context_length"), MAX_CONTEXT)
  heads, d = out["attention.head_count"], out["embedding_length"]
  kv = out["attention.head_count_kv"] or heads
  if heads % kv:
    raise bad("attention.head_count_kv", kv, f"it must divide attention.head_count = {heads}")
  source, head_dim = "attention.key_length", out["attention.key_length"]
  if head_dim is None and arch == "llama":
    source, head_dim = "rope.dimension_count", out["rope.dimension_count"]
  if head_dim is None:
    if d % heads:
      raise bad("attention.head_count", heads,
                f"it must divide embedding_length = {d} (the file gives no key_length)")
    source, head_dim = "attention.head_count", d // heads
  if head_dim % 2:
    raise bad(source, heads if source == "attention.head_count" else head_dim,
              "a head dimension must be even (RoPE pairs)")
  out["head_dim"] = head_dim
  return out


def read_config(path: pathlib.Path, dtype: str | None, param_dtype: str | None = None,
                f: GGUFFile | None = None) -> ModelConfig:
  f = f or GGUFFile(path)
  return ModelConfig.from_hf(hf_config(f), source=str(path), dtype=dtype, param_dtype=param_dtype)


# Pre-tokenizer splits of the byte-level vocabularies of the supported families, by the file's
# `tokenizer.ggml.pre` (the regexes those models' own tokenizer.json files use); any other value
# keeps GPT-2's split (ByteLevel's own regex), as transformers' GGUF loader does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types


def load_tokenizer(path: pathlib.Path, f: GGUFFile | None = None):
  """The transformers tokenizer built from the file's metadata, with its chat template.

  Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2/3, SmolLM2) are
  built here from the tokens, merges and token types with the `tokenizers` library, so no torch is
  needed (transformers' own GGUF reader imports torch); tests check the result tokenizes like
  transformers' GGUF tokenizer. Other vocabularies (sentencepiece "llama") go through transformers.
  """
  f = f or GGUFFile(path)
  model = f.value("tokenizer.ggml.model")
  if model == "gpt2":
    tok = _byte_level_tokenizer(f)
  else:
    try:
      tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
      raise CheckpointError(
          f"{path}: transformers could not build a tokenizer from the GGUF metadata "
          f"(tokenizer.ggml.model {model!r}; {type(e).__name__}: {e}); a sentencepiece vocabulary "
          "needs transformers' GGUF reader, which needs torch (pip install torch)") from e
  if getattr(tok, "chat_template", None) is None:
    template = f.value("tokenizer.chat_template")
    if template is not None:
      tok.chat_template = template
  return tok


def _byte_level_tokenizer(f: GGUFFile):
  from tokenizers import AddedToken, Regex, pre_tokenizers   # noqa: PLC0415 (transformers' dep)
  from transformers import GPT2Tokenizer                        # noqa: PLC0415
  from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415
  tokens, merges = f.strings("tokenizer.ggml.tokens"), f.strings("tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise CheckpointError(f"{f.path}: a byte-level (gpt2) tokenizer needs tokenizer.ggml.tokens "
                          "and tokenizer.ggml.merges; the file lacks them (re-convert it)")
  types = f.ints("tokenizer.ggml.token_type") or [1] * len(tokens)
  # Tokens are stored in the byte-level alphabet; a token with any other character (llama.cpp
  # writes some control tokens in plain text) is respelled byte by byte into it.
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
           for i, t in enumerate(tokens)}

  def named(key):
    i = f.value(f"tokenizer.ggml.{key}")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None

  tok = GPT2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                      unk_token=named("unknown_token_id"), bos_token=named("bos_token_id"),
                      eos_token=named("eos_token_id"), pad_token=named("padding_token_id"),
                      add_prefix_space=bool(f.value("tokenizer.ggml.add_space_prefix", False)),
                      add_bos_token=bool(f.value("tokenizer.ggml.add_bos_token", False)),
                      add_eos_token=bool(f.value("tokenizer.ggml.add_eos_token", False)))
  control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
             if k == _CONTROL and set(t) <= alphabet]
  if control:
    tok.add_tokens(control, special_tokens=True)
  user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
          if k == _USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens(user)
  split = _SPLITS.get(f.value("tokenizer.ggml.pre"))
  if split is not None:
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  return tok


def _unpermute(x: np.ndarray, n: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (see the module docstring) on [n*hd, ...]."""
  return x.reshape(n, x.shape[0] // n // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _supported_types(gguf) -> set:
  q = gguf.GGMLQuantizationType
  return {q.F32, q.F16} | set(getattr(gguf.quants, "_type_traits", {}))


def load_params(path: pathlib.Path, cfg: ModelConfig, shardings=None,
                allow_nonfinite: bool = False, f: GGUFFile | None = None) -> dict:
  """Reads and dequantises params from a .gguf file, each placed with its sharding.

  Args:
    shardings: pytree like the params of `jax.sharding.Sharding` (default: first device).
    allow_nonfinite: load NaN/Inf weights with a warning naming them, instead of raising.
  """
  f = f or GGUFFile(path)
  by_hf, entries = checked_tensors(path, cfg, f)
  # Each tensor is dequantised once; an entry's layers stay cached while its shards are read
  # (at most num_layers tensors: the previous entry's are evicted as the next one's arrive).
  dequantised = functools.lru_cache(maxsize=cfg.num_layers)(
      lambda name: dequantise(f, by_hf[name], name, cfg))
  check = hf_io.FiniteCheck(cfg, dequantised, lambda name: f"{path}: tensor {by_hf[name].name!r}",
                            allow_nonfinite, fix="re-download or re-convert them")
  params = hf_io.place_params(cfg, shardings, entries, dequantised, check)
  dequantised.cache_clear()
  check.warn(path)
  return params


def checked_tensors(path: pathlib.Path, cfg: ModelConfig, f: GGUFFile):
  """(the file's tensors by HF name, `hf_io.named_entries(cfg)`), after validating every name,
  type and shape against the model `cfg` (CheckpointErrors naming the tensor and the fix)."""
  gguf = _gguf()
  supported = _supported_types(gguf)
  by_hf: dict[str, Any] = {}
  unknown = []
  for name, t in f.tensors.items():
    hf = hf_tensor_name(name)
    if hf is None:
      unknown.append(name)
    else:
      by_hf[hf] = t
  if unknown:
    raise CheckpointError(f"{path}: {hf_io._listing(sorted(unknown, key=hf_io._natural))} not "
                          f"used: jaxagent does not know these GGUF tensors of the "
                          f"{f.architecture} architecture")

  entries = hf_io.named_entries(cfg)
  for e, names in entries:   # validate every name, type and shape before any compute
    for name in names:
      t = by_hf.get(name)
      if t is None:
        raise CheckpointError(f"{path}: tensor {gguf_tensor_name(name)!r} ({name!r}) is missing, "
                              f"but the {cfg.model_type} model its metadata describes needs it; "
                              "the file is incomplete or of an unsupported variant")
      if t.tensor_type not in supported:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which jaxagent cannot "
            f"dequantise (supported: {sorted(s.name for s in supported)}); re-quantise the model "
            "to one of these (e.g. llama.cpp's llama-quantize ... Q8_0)")
      if f.hf_shape(t) != e.hf_shape:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has shape {f.hf_shape(t)} (as {name!r}), but the "
            f"metadata implies {e.hf_shape}; the file's metadata and tensors disagree "
            "(re-convert it)")
  used = {n for _, names in entries for n in names}
  extra = sorted((by_hf[n].name for n in by_hf if n not in used), key=hf_io._natural)
  if extra:
    raise CheckpointError(
        f"{path}: {hf_io._listing(extra)} not used by the {cfg.model_type} model that the "
        f"metadata describes ({cfg.num_layers} layers, attention bias {cfg.qkv_bias}, "
        f"tied embeddings {cfg.tie_word_embeddings}); the file is damaged or of an unsupported "
        "variant")
  return by_hf, entries


def row_permutation(name: str, cfg: ModelConfig) -> int | None:
  """The head count n whose Q/K row permutation HF tensor `name` carries (llama), else None."""
  if cfg.model_type == "llama":
    if ".self_attn.q_proj." in name:
      return cfg.num_heads
    if ".self_attn.k_proj." in name:
      return cfg.num_kv_heads
  return None


def dequantise(f: GGUFFile, t, name: str, cfg: ModelConfig) -> np.ndarray:
  """The HF-layout float32 tensor of reader tensor `t` (HF name `name`), rows un-permuted."""
  x = np.asarray(_gguf().quants.dequantize(t.data, t.tensor_type), np.float32)
  x = x.reshape(f.hf_shape(t))
  n = row_permutation(name, cfg)
  return x if n is None else _unpermute(x, n)
