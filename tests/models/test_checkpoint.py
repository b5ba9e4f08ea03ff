"""Checkpoint directories: the errors promised for bad ones, and the built-in model."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from jaxagent.models import CheckpointError, from_pretrained
from jaxagent.models import hf_io
from jaxagent.models.safetensors_io import SafetensorsFile, save_file


@pytest.fixture
def good_dir(hf_checkpoint, tmp_path) -> pathlib.Path:
  """A private copy of a valid single-file checkpoint, free to break."""
  return pathlib.Path(shutil.copytree(hf_checkpoint("qwen2_tied").path, tmp_path / "ckpt"))


@pytest.fixture
def sharded_dir(hf_checkpoint, tmp_path) -> pathlib.Path:
  src = hf_checkpoint("llama3_untied", max_shard_size="100KB").path
  return pathlib.Path(shutil.copytree(src, tmp_path / "sharded"))


def _edit_config(path: pathlib.Path, **changes) -> None:
  cfg_file = path / "config.json"
  cfg = json.loads(cfg_file.read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  cfg_file.write_text(json.dumps(cfg))


def _load_error(path) -> str:
  with pytest.raises(CheckpointError) as info:
    from_pretrained(path)
  return str(info.value)


def test_good_copy_loads(good_dir):
  assert from_pretrained(good_dir).config.model_type == "qwen2"


def test_missing_directory(tmp_path):
  missing = tmp_path / "does_not_exist"
  msg = _load_error(missing)
  assert str(missing) in msg and "not a directory" in msg and "builtin:tiny" in msg


def test_missing_config_json(good_dir):
  (good_dir / "config.json").unlink()
  msg = _load_error(good_dir)
  assert str(good_dir / "config.json") in msg and "missing" in msg
  assert "download the full repository" in msg


def test_invalid_config_json(good_dir):
  (good_dir / "config.json").write_text('{"model_type": "qwen2", ')
  msg = _load_error(good_dir)
  assert str(good_dir / "config.json") in msg and "not valid JSON" in msg and "repair" in msg


def test_unsupported_model_type(good_dir):
  _edit_config(good_dir, model_type="gpt2")
  msg = _load_error(good_dir)
  assert "config.json" in msg and "'gpt2' is not supported" in msg
  assert "qwen2" in msg and "llama" in msg and "Convert the checkpoint" in msg


@pytest.mark.parametrize("changes, needle", [
    (dict(hidden_size=None), "missing keys ['hidden_size']"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
])
def test_unsupported_config_fields(good_dir, changes, needle):
  _edit_config(good_dir, **changes)
  msg = _load_error(good_dir)
  assert "config.json" in msg and needle in msg


def test_unsupported_rope_type(good_dir):
  _edit_config(good_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                          "rope_theta": 10000.0})
  msg = _load_error(good_dir)
  assert "config.json" in msg and "rope_type 'yarn' is not supported" in msg
  assert "remove rope_scaling" in msg


def test_legacy_rope_scaling_key_is_read(good_dir):
  """Older config.json files spell it rope_scaling / type / rope_theta at the top level."""
  _edit_config(good_dir, rope_parameters=None, rope_theta=1234.0,
               rope_scaling={"type": "linear", "factor": 2.0})
  cfg = from_pretrained(good_dir).config
  assert cfg.rope_theta == 1234.0 and cfg.rope_type == "linear"
  assert dict(cfg.rope_scaling)["factor"] == 2.0


def test_only_pytorch_bin_weights(good_dir):
  (good_dir / hf_io.SINGLE_FILE).unlink()
  (good_dir / "pytorch_model.bin").write_bytes(b"not really")
  msg = _load_error(good_dir)
  assert str(good_dir) in msg and ".bin" in msg and "safe_serialization=True" in msg


def test_no_weights_at_all(good_dir):
  (good_dir / hf_io.SINGLE_FILE).unlink()
  msg = _load_error(good_dir)
  assert str(good_dir) in msg and "model.safetensors" in msg
  assert "model.safetensors.index.json" in msg and "download the safetensors" in msg


def test_missing_shard_listed_in_index(sharded_dir):
  shard = sorted(sharded_dir.glob("model-*.safetensors"))[1]
  shard.unlink()
  msg = _load_error(sharded_dir)
  assert str(shard) in msg and hf_io.INDEX_FILE in msg and "download every shard" in msg


def test_missing_tensor(good_dir):
  f = good_dir / hf_io.SINGLE_FILE
  st = SafetensorsFile(f)
  tensors = {n: np.array(st.get(n)) for n in st.names() if n != "model.layers.1.mlp.up_proj.weight"}
  del st
  save_file(tensors, f)
  msg = _load_error(good_dir)
  assert "'model.layers.1.mlp.up_proj.weight' is missing" in msg
  assert str(good_dir) in msg and "does not match config.json" in msg


def test_mismatched_tensor_shape(good_dir):
  _edit_config(good_dir, hidden_size=128)
  msg = _load_error(good_dir)
  assert str(good_dir / hf_io.SINGLE_FILE) in msg and "model.embed_tokens.weight" in msg
  assert "(720, 64)" in msg and "(720, 128)" in msg
  assert "use the config.json that was saved with these weights" in msg


def test_mismatched_layer_count(good_dir):
  # (layer_types is dropped too: transformers' own config validation would reject the edit.)
  _edit_config(good_dir, num_hidden_layers=3, layer_types=None)
  msg = _load_error(good_dir)
  assert "'model.layers.2." in msg and "num_hidden_layers" in msg


def test_missing_tokenizer_files(good_dir):
  (good_dir / "tokenizer.json").unlink()
  msg = _load_error(good_dir)
  assert str(good_dir) in msg and "no tokenizer files" in msg and "tokenizer.json" in msg
  assert "copy the tokenizer files" in msg


def test_tokenizer_larger_than_vocab(good_dir):
  _edit_config(good_dir, vocab_size=500)
  msg = _load_error(good_dir)
  assert str(good_dir) in msg and "720 tokens" in msg and "vocab_size is 500" in msg
  assert "tokenizer belongs to another model" in msg


@pytest.fixture(scope="module")
def builtin_policy():
  return from_pretrained("builtin:tiny")


def test_builtin_tiny_loads_and_generates(builtin_policy):
  policy = builtin_policy
  cfg = policy.config
  assert cfg.model_type == "qwen2" and cfg.vocab_size == 720 and len(policy.tokenizer) <= 720
  assert policy.params["embed"].shape == (720, cfg.hidden_size)
  prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=True)
  if isinstance(prompt, dict) or hasattr(prompt, "keys"):   # BatchEncoding in transformers 5
    prompt = prompt["input_ids"]
  prompts = [list(prompt), list(prompt)[:5]]
  outs = policy.generate(prompts, 6, temperature=1.0, seed=3)
  assert len(outs) == 2 and all(1 <= len(o) <= 6 for o in outs)
  assert all(0 <= t < 720 for o in outs for t in o)
  assert policy.generate(prompts, 6, temperature=1.0, seed=3) == outs        # deterministic


def test_builtin_export_loads_in_transformers(builtin_policy, tmp_path):
  import torch
  from transformers import AutoModelForCausalLM
  policy = builtin_policy
  policy.save_pretrained(tmp_path)
  model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  tokens = np.random.RandomState(0).randint(3, 720, size=(2, 10))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  assert np.abs(np.asarray(policy.forward(tokens)) - ref).max() < 1e-4


def test_unknown_builtin_name():
  with pytest.raises(CheckpointError, match=r"unknown built-in model 'builtin:nope'.*builtin:tiny"):
    from_pretrained("builtin:nope")
