"""Shared fixtures for the model tests: tiny random `transformers` checkpoints of each family.

`hf_checkpoint(name)` saves (once per session) a tiny randomly initialised PyTorch model of one
family with `save_pretrained` (safetensors) plus the built-in tokenizer, and returns
`HFCheckpoint(path, model)`; `model` is the PyTorch reference in float32 eval mode. Family names:
"qwen2_tied", "qwen3_untied", "llama3_untied" (see FAMILIES). Test modules use the fixtures only
(`import conftest` would depend on which conftest pytest imported last).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest

# vocab_size = 720 = len(builtin tokenizer); GQA everywhere (4 query heads, 2 kv heads); room for
# the smoke rollouts' transcripts (up to 458 tokens: training checks them against the positions).
_COMMON = dict(vocab_size=720, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=2)

# name -> (config class name, extra config kwargs). Covers qkv bias (qwen2), q/k norm with a
# head_dim different from hidden/heads (qwen3), llama3 rope scaling, tied and untied embeddings.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3_untied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "llama3_untied": ("LlamaConfig", dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        # original context 32 so positions in the tests reach the scaled frequencies.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
}


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  path: pathlib.Path
  model: Any   # transformers *ForCausalLM, float32, eval mode


def make_torch_model(name: str, seed: int = 0):
  """A tiny random float32 transformers model of family `name`, with non-trivial norms/biases.

  transformers initialises norms to 1 and biases to 0, which would hide a wrong mapping of those
  tensors; here every weight is random (norm weights around 1).
  """
  import torch
  import transformers
  cls_name, extra = FAMILIES[name]
  cfg = getattr(transformers, cls_name)(**_COMMON, **extra)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
      else:
        p.normal_(0.0, 0.15)
  return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, builtin_tokenizer):
  """Factory: hf_checkpoint(name, max_shard_size=None) -> HFCheckpoint (cached per session)."""
  cache: dict = {}

  def make(name: str, max_shard_size: str | None = None) -> HFCheckpoint:
    key = (name, max_shard_size)
    if key not in cache:
      model = cache[(name, None)].model if (name, None) in cache else make_torch_model(name)
      path = tmp_path_factory.mktemp(f"{name}_{max_shard_size or 'single'}")
      kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
      model.save_pretrained(str(path), **kw)
      builtin_tokenizer.save_pretrained(str(path))
      cache[key] = HFCheckpoint(path, model)
    return cache[key]

  return make


@pytest.fixture(scope="session")
def loaded_policy(hf_checkpoint):
  """Factory: loaded_policy(name) -> jaxagent Policy from the single-file checkpoint (cached)."""
  from jaxagent.models import from_pretrained
  cache: dict = {}

  def load(name: str):
    if name not in cache:
      cache[name] = from_pretrained(hf_checkpoint(name).path)
    return cache[name]

  return load
