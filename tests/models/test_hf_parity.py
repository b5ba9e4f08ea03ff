"""Parity with the transformers PyTorch implementation: logits (with left/right padding), sharded
checkpoints, greedy generation, and the `save_pretrained` round trip (float32, sharded, bf16)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxagent.models import from_pretrained
from jaxagent.models import hf_io

FAMILY_NAMES = ["qwen2_tied", "qwen3_untied", "llama3_untied"]   # see conftest.FAMILIES
TOL_F32 = 1e-4


def _torch_logits(model, tokens, attention_mask=None, position_ids=None) -> np.ndarray:
  import torch
  as_long = lambda x: None if x is None else torch.tensor(np.asarray(x), dtype=torch.long)
  with torch.no_grad():
    return model(as_long(tokens), attention_mask=as_long(attention_mask),
                 position_ids=as_long(position_ids)).logits.float().numpy()


def _padded_batch(seed: int = 0):
  """tokens [3, 12], mask [3, 12]: row 0 unpadded, row 1 left-padded by 4, row 2 right-padded
  by 5 (padding token ids are random: masked tokens must not matter)."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(3, 720, size=(3, 12)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, :4] = 0
  mask[2, 7:] = 0
  return tokens, mask


def _reference_rowwise(model, tokens, mask) -> list[np.ndarray]:
  """transformers logits of each row's real tokens alone (no padding anywhere)."""
  return [_torch_logits(model, tokens[b][mask[b] == 1][None])[0] for b in range(tokens.shape[0])]


def _max_diff_real(ours, refs, mask) -> float:
  return max(float(np.abs(np.asarray(ours)[b][mask[b] == 1] - refs[b]).max())
             for b in range(len(refs)))


def _torch_state(model) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_logits_match_transformers_with_left_and_right_padding(name, hf_checkpoint, loaded_policy):
  ckpt = hf_checkpoint(name)
  policy = loaded_policy(name)
  tokens, mask = _padded_batch()
  ours = policy.forward(tokens, mask)
  assert ours.shape == (3, 12, 720) and ours.dtype == np.float32
  refs = _reference_rowwise(ckpt.model, tokens, mask)
  assert _max_diff_real(ours, refs, mask) < TOL_F32
  # Padded batch through transformers too (explicit positions counting real tokens only).
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  ref_batch = _torch_logits(ckpt.model, tokens, attention_mask=mask, position_ids=pos)
  assert np.abs((np.asarray(ours) - ref_batch)[mask == 1]).max() < TOL_F32
  # Without a mask every token is real: row 0 (unpadded) is unchanged.
  unmasked = np.asarray(policy.forward(tokens))
  assert np.abs(unmasked[0] - refs[0]).max() < TOL_F32


def test_family_specific_config_is_read(loaded_policy):
  """The families really exercise their special features (guards against a silent fallback)."""
  q2, q3, ll = (loaded_policy(n).config for n in FAMILY_NAMES)
  assert q2.qkv_bias and not q2.qk_norm and q2.tie_word_embeddings
  assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32 and not q3.tie_word_embeddings
  assert ll.rope_type == "llama3" and ll.rope_theta == 500000.0 and not ll.qkv_bias
  assert dict(ll.rope_scaling)["factor"] == 8.0
  assert all(c.num_kv_heads == 2 and c.num_heads == 4 for c in (q2, q3, ll))


def test_sharded_transformers_checkpoint_loads(hf_checkpoint, loaded_policy):
  name = "llama3_untied"
  ckpt = hf_checkpoint(name, max_shard_size="100KB")
  shards = sorted(ckpt.path.glob("model-*.safetensors"))
  assert (ckpt.path / hf_io.INDEX_FILE).exists() and len(shards) > 2
  assert not (ckpt.path / hf_io.SINGLE_FILE).exists()
  policy = from_pretrained(ckpt.path)
  single = loaded_policy(name)
  jax.tree.map(np.testing.assert_array_equal, policy.params, single.params)
  tokens, mask = _padded_batch(1)
  refs = _reference_rowwise(ckpt.model, tokens, mask)
  assert _max_diff_real(policy.forward(tokens, mask), refs, mask) < TOL_F32


def _hf_greedy(model, prompt, max_new_tokens):
  import torch
  from transformers import GenerationConfig
  gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):]
  assert len(out) == max_new_tokens
  return out.tolist()


# Two families keep the suite fast; the KV-cache path of every feature (q/k norm, qkv bias,
# llama3 rope) is checked against full recomputation in test_decoder.py.
@pytest.mark.parametrize("name", ["qwen2_tied", "llama3_untied"])
def test_greedy_generation_matches_transformers(name, hf_checkpoint, loaded_policy):
  ckpt = hf_checkpoint(name)
  policy = loaded_policy(name)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(3, 720, size=n).tolist() for n in (3, 12, 7)]
  n_new = 8
  want = [_hf_greedy(ckpt.model, p, n_new) for p in prompts]
  got = policy.generate(prompts, n_new, temperature=0.0)
  assert got == want

  # A stop token ends a row early (stop included); rows without it run to max_new_tokens.
  stop = want[0][3]
  got_stop = policy.generate(prompts, n_new, temperature=0.0, stop_tokens=(stop,))
  expected = [w[:w.index(stop) + 1] if stop in w else w for w in want]
  assert got_stop == expected
  assert len(got_stop[0]) <= 4


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_save_pretrained_round_trip(name, hf_checkpoint, loaded_policy, tmp_path):
  from transformers import AutoModelForCausalLM, AutoTokenizer
  ckpt = hf_checkpoint(name)
  policy = loaded_policy(name)
  out = tmp_path / "export"
  policy.save_pretrained(out)
  assert (out / hf_io.SINGLE_FILE).exists() and (out / "tokenizer.json").exists()
  reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert type(reloaded) is type(ckpt.model)
  want, got = _torch_state(ckpt.model), _torch_state(reloaded)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # Same logits too, so the exported config.json (rope theta/scaling, head_dim, eps, tying) is
  # read by transformers as the original was.
  tokens, _ = _padded_batch(4)
  np.testing.assert_array_equal(_torch_logits(reloaded, tokens), _torch_logits(ckpt.model, tokens))
  tok = AutoTokenizer.from_pretrained(str(out))
  assert tok("hello world")["input_ids"] == policy.tokenizer("hello world")["input_ids"]
  # And back into jaxagent: identical parameters.
  again = from_pretrained(out)
  assert again.config == policy.config
  jax.tree.map(np.testing.assert_array_equal, again.params, policy.params)


def test_sharded_export_round_trip(hf_checkpoint, loaded_policy, tmp_path):
  from transformers import AutoModelForCausalLM
  name = "qwen3_untied"
  policy = loaded_policy(name)
  out = tmp_path / "sharded"
  policy.save_pretrained(out, max_shard_bytes=60_000)
  index = json.loads((out / hf_io.INDEX_FILE).read_text())
  files = sorted(out.glob("model-*.safetensors"))
  assert len(files) > 2 and not (out / hf_io.SINGLE_FILE).exists()
  assert set(index["weight_map"].values()) == {f.name for f in files}
  reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
  want, got = _torch_state(hf_checkpoint(name).model), _torch_state(reloaded)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  tokens, _ = _padded_batch(5)
  np.testing.assert_array_equal(_torch_logits(reloaded, tokens),
                                _torch_logits(hf_checkpoint(name).model, tokens))
  again = from_pretrained(out)
  jax.tree.map(np.testing.assert_array_equal, again.params, policy.params)


def test_bfloat16_export_and_import(hf_checkpoint, loaded_policy, tmp_path):
  import torch
  from transformers import AutoModelForCausalLM
  name = "qwen2_tied"
  ckpt = hf_checkpoint(name)
  policy = loaded_policy(name)
  out = tmp_path / "bf16"
  policy.save_pretrained(out, dtype="bfloat16")
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

  # transformers reads it as bf16, and the weights are the float32 ones rounded to bf16.
  hf_bf16 = AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert next(hf_bf16.parameters()).dtype == torch.bfloat16
  rounded = {k: v.to(torch.bfloat16).float().numpy() for k, v in ckpt.model.state_dict().items()}
  got = _torch_state(hf_bf16)
  for k in rounded:
    np.testing.assert_array_equal(got[k], rounded[k], err_msg=k)

  # Imported with float32 compute: exact parity with transformers on the same (rounded) weights.
  tokens, mask = _padded_batch(3)
  ours32 = from_pretrained(out, dtype="float32")
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(ours32.params))
  hf_f32 = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  refs_rounded = _reference_rowwise(hf_f32, tokens, mask)
  assert _max_diff_real(ours32.forward(tokens, mask), refs_rounded, mask) < TOL_F32

  # Imported as bf16 (params and compute): close to the float32 model at bf16 precision.
  ours16 = from_pretrained(out, dtype="bfloat16")
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(ours16.params))
  logits16 = ours16.forward(tokens, mask)
  assert logits16.dtype == np.float32
  refs = _reference_rowwise(ckpt.model, tokens, mask)
  scale = max(float(np.abs(r).max()) for r in refs)
  assert _max_diff_real(logits16, refs, mask) < 0.05 * scale
