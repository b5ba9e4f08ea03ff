"""Damaged checkpoint directories: each raises `CheckpointError` naming the file, the tensor and the
fix (truncated or corrupted safetensors, a config.json that does not match the weights, NaN/Inf
weights), and NaN/Inf weights load with a warning under `allow_nonfinite=True`."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from jaxagent.models import CheckpointError, from_pretrained
from jaxagent.models import hf_io
from jaxagent.models.safetensors_io import SafetensorsFile, all_finite, count_nonfinite, save_file
from jaxagent.sharding import make_mesh

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path) -> pathlib.Path:
  """A private copy of a valid transformers-saved checkpoint (qwen2, tied, 2 layers)."""
  return pathlib.Path(shutil.copytree(hf_checkpoint("qwen2_tied").path, tmp_path / "ckpt"))


def _weights(path: pathlib.Path) -> pathlib.Path:
  return path / hf_io.SINGLE_FILE


def _header(f: pathlib.Path) -> tuple[int, dict]:
  """(offset of the data region, header dict) read straight from the bytes."""
  raw = f.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  return 8 + n, json.loads(raw[8:8 + n])


def _tensors(f: pathlib.Path) -> dict[str, np.ndarray]:
  st = SafetensorsFile(f)
  return {n: np.array(st.get(n)) for n in st.names()}


def _edit_config(path: pathlib.Path, **changes) -> None:
  cfg_file = path / "config.json"
  cfg = json.loads(cfg_file.read_text())
  cfg.update(changes)
  cfg_file.write_text(json.dumps(cfg))


def _load_error(path, **kw) -> str:
  with pytest.raises(CheckpointError) as info:
    from_pretrained(path, **kw)
  return str(info.value)


def _write_value(f: pathlib.Path, name: str, flat_index: int, value) -> None:
  """Overwrites one element of tensor `name` in place, at the offset its header gives."""
  data, header = _header(f)
  info = header[name]
  dtype = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}[info["dtype"]]
  blob = np.asarray([value], dtype).tobytes()
  at = data + info["data_offsets"][0] + flat_index * len(blob)
  with open(f, "r+b") as fh:
    fh.seek(at)
    fh.write(blob)


def test_truncated_safetensors(ckpt):
  f = _weights(ckpt)
  data, header = _header(f)
  last = max(header, key=lambda n: header[n]["data_offsets"][1] if n != "__metadata__" else -1)
  f.write_bytes(f.read_bytes()[:-100])
  msg = _load_error(ckpt)
  assert str(f) in msg and repr(last) in msg and "truncated" in msg and "re-download" in msg


def test_corrupted_header_json(ckpt):
  f = _weights(ckpt)
  raw = bytearray(f.read_bytes())
  raw[8:16] = b"\xff{,]\x00]]"
  f.write_bytes(bytes(raw))
  msg = _load_error(ckpt)
  assert str(f) in msg and "header is not valid JSON" in msg and "re-download" in msg


def test_file_shorter_than_header_length(ckpt):
  f = _weights(ckpt)
  f.write_bytes(b"abc")
  msg = _load_error(ckpt)
  assert str(f) in msg and "3 bytes" in msg and "truncated" in msg


def test_absurd_header_length(ckpt):
  f = _weights(ckpt)
  raw = f.read_bytes()
  f.write_bytes(struct.pack("<Q", 2 ** 62) + raw[8:])
  msg = _load_error(ckpt)
  assert str(f) in msg and str(2 ** 62) in msg and f"{len(raw) - 8} bytes after it" in msg


def test_header_shape_disagrees_with_bytes(ckpt):
  f = _weights(ckpt)
  data, header = _header(f)
  header[Q_PROJ]["shape"] = [64, 65]
  blob = json.dumps(header).encode()
  f.write_bytes(struct.pack("<Q", len(blob)) + blob + f.read_bytes()[data:])
  msg = _load_error(ckpt)
  assert str(f) in msg and repr(Q_PROJ) in msg and "(64, 65)" in msg and "data_offsets" in msg


def test_misshaped_tensor(ckpt):
  f = _weights(ckpt)
  tensors = _tensors(f)
  tensors[Q_PROJ] = np.zeros((64, 32), np.float32)
  save_file(tensors, f)
  msg = _load_error(ckpt)
  assert str(f) in msg and repr(Q_PROJ) in msg and "(64, 32)" in msg and "(64, 64)" in msg
  assert "use the config.json that was saved with these weights" in msg


@pytest.mark.parametrize("text", ["[1, 2]", "not json"])
def test_config_json_not_an_object(ckpt, text):
  (ckpt / "config.json").write_text(text)
  msg = _load_error(ckpt)
  assert str(ckpt / "config.json") in msg and "repair" in msg


def test_config_field_of_wrong_type(ckpt):
  _edit_config(ckpt, num_attention_heads="4")
  msg = _load_error(ckpt)
  assert "config.json" in msg and "num_attention_heads is '4'" in msg and "positive integer" in msg


def test_fewer_layers_in_config_than_weights(ckpt):
  cfg = json.loads((ckpt / "config.json").read_text())
  changes = dict(num_hidden_layers=1)
  if "layer_types" in cfg:   # transformers' own config validation checks its length
    changes["layer_types"] = cfg["layer_types"][:1]
  _edit_config(ckpt, **changes)
  msg = _load_error(ckpt)
  assert str(_weights(ckpt)) in msg and "'model.layers.1." in msg
  assert "num_hidden_layers=1" in msg and "the weights have 2 layers" in msg
  assert "set num_hidden_layers to 2" in msg


def test_unused_tensor(ckpt):
  f = _weights(ckpt)
  tensors = _tensors(f)
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  save_file(tensors, f)
  msg = _load_error(ckpt)
  assert str(f) in msg and "'model.layers.0.self_attn.o_proj.bias'" in msg
  assert "not used" in msg and "attention_bias" in msg


def test_legitimately_skipped_tensors_load(ckpt):
  """Rotary inv_freq buffers, and lm_head.weight equal to the embedding when tied."""
  f = _weights(ckpt)
  tensors = _tensors(f)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, f)
  assert from_pretrained(ckpt).config.tie_word_embeddings


def test_untied_lm_head_with_tied_config(ckpt):
  f = _weights(ckpt)
  tensors = _tensors(f)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
  save_file(tensors, f)
  msg = _load_error(ckpt)
  assert str(f) in msg and "'lm_head.weight'" in msg and "tie_word_embeddings to false" in msg


def test_nan_weight_refused(ckpt):
  f = _weights(ckpt)
  _write_value(f, Q_PROJ, 17, np.nan)
  msg = _load_error(ckpt)
  assert str(f) in msg and repr(Q_PROJ) in msg and "1 NaN and 0 Inf" in msg
  assert "allow_nonfinite=True" in msg


def test_nan_weight_allowed_with_warning(ckpt, caplog):
  f = _weights(ckpt)
  _write_value(f, Q_PROJ, 17, np.nan)
  _write_value(f, "model.norm.weight", 3, -np.inf)
  with caplog.at_level(logging.WARNING):
    policy = from_pretrained(ckpt, allow_nonfinite=True)
  assert np.isnan(np.asarray(policy.params["layers"]["q_proj"][1])).sum() == 1
  assert np.isinf(np.asarray(policy.params["final_norm"])).sum() == 1
  warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
  assert "allow_nonfinite=True" in warned and repr(Q_PROJ) in warned
  assert "'model.norm.weight'" in warned and str(f) in warned


def test_inf_in_bfloat16_weights_on_a_mesh(ckpt):
  """bf16 files, each device reading its own shard: the tensor is named whichever shard holds it."""
  f = _weights(ckpt)
  tensors = {n: x.astype(ml_dtypes.bfloat16) for n, x in _tensors(f).items()}
  save_file(tensors, f)
  name = "model.layers.0.mlp.down_proj.weight"
  _write_value(f, name, tensors[name].size - 1, np.inf)
  msg = _load_error(ckpt, dtype="bfloat16", mesh=make_mesh({"fsdp": 2, "tensor": 4}))
  assert str(f) in msg and repr(name) in msg and "0 NaN and 1 Inf" in msg


def test_float16_overflow_named(ckpt):
  f = _weights(ckpt)
  _write_value(f, Q_PROJ, 0, 1e6)
  msg = _load_error(ckpt, dtype="float16")
  assert str(f) in msg and repr(Q_PROJ) in msg and "beyond the range of float16" in msg
  assert "param_dtype float32" in msg


def test_corrupted_index(hf_checkpoint, tmp_path):
  src = hf_checkpoint("llama3_untied", max_shard_size="100KB").path
  path = pathlib.Path(shutil.copytree(src, tmp_path / "sharded"))
  (path / hf_io.INDEX_FILE).write_text('{"metadata": {}}')
  msg = _load_error(path)
  assert str(path / hf_io.INDEX_FILE) in msg and "weight_map" in msg


def test_finiteness_helpers_stream_any_layout():
  x = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
  for arr in (x, x.T, x[:, ::2], x.astype(ml_dtypes.bfloat16)):
    assert all_finite(arr, chunk_elems=7) and count_nonfinite(arr, chunk_elems=7) == (0, 0)
  y = x.copy()
  y[3, 4, 5], y[0, 1, 2] = np.nan, -np.inf
  for arr in (y, y.T, y.astype(ml_dtypes.bfloat16)):
    assert not all_finite(arr, chunk_elems=7) and count_nonfinite(arr, chunk_elems=7) == (1, 1)
  assert all_finite(np.array([1, 2], np.int32))
