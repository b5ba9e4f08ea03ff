"""Adapters on disk: the PEFT export loads in `peft` onto the transformers model with our logits
(float32, 1e-5), the merged export is the adapted model (ours and transformers'), adapter
checkpoints resume exactly and refuse another base naming both fingerprints."""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.checkpoint.errors import IncompatibleCheckpointError
from jaxagent.checkpoint.manager import Checkpointer
from jaxagent.learners import sft as sft_lib
from jaxagent.learners.update import LearnerConfig, init_train_state
from jaxagent.models import decoder, from_pretrained, lora, lora_io
from jaxagent.models.config import ModelConfig
from jaxagent.runs import adapters

FAMILY_NAMES = ["qwen2_tied", "qwen3_untied", "llama3_untied"]   # see conftest.FAMILIES
LORA = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS)


def _trained(cfg, lcfg, seed=1):
  """Adapters as after training (B random; at init it is 0 and nothing would be checked)."""
  ad = lora.init_adapters(cfg, lcfg, jax.random.key(seed))
  rng = np.random.RandomState(seed)
  return {n: {"a": t["a"], "b": jnp.asarray(rng.normal(size=t["b"].shape) * 0.1, jnp.float32)}
          for n, t in ad.items()}


def _torch_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def _tokens():
  return jnp.asarray(np.random.RandomState(0).randint(3, 720, size=(2, 11)), jnp.int32)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_peft_loads_our_adapters_with_our_logits(name, hf_checkpoint, loaded_policy, tmp_path):
  import peft
  policy, ckpt = loaded_policy(name), hf_checkpoint(name)
  cfg = policy.config
  ad = _trained(cfg, LORA)
  ours = np.asarray(decoder.apply(cfg, lora.attach(policy.params, ad, LORA), _tokens())[0])
  out = lora_io.export_peft(tmp_path / "adapter", cfg, LORA, ad)
  written = json.loads((out / "adapter_config.json").read_text())
  assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, 8.0, "LORA")
  model = peft.PeftModel.from_pretrained(copy.deepcopy(ckpt.model), str(out)).eval()
  theirs = _torch_logits(model, _tokens())
  plain = _torch_logits(ckpt.model, _tokens())
  assert np.abs(theirs - plain).max() > 1e-2                  # peft applied the adapters
  assert np.abs(ours - theirs).max() < 1e-5


@pytest.mark.parametrize("name", ["qwen2_tied", "llama3_untied"])
def test_merged_export_is_the_adapted_model(name, hf_checkpoint, loaded_policy, tmp_path):
  import transformers
  policy = loaded_policy(name)
  cfg = policy.config
  lcfg = lora.LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj", "down_proj"))
  ad = _trained(cfg, lcfg)
  ours = np.asarray(decoder.apply(cfg, lora.attach(policy.params, ad, lcfg), _tokens())[0])
  lora_io.export_merged(tmp_path / "merged", cfg, policy.params, ad, lcfg,
                        tokenizer=policy.tokenizer)
  reloaded = from_pretrained(tmp_path / "merged")
  again = np.asarray(decoder.apply(cfg, reloaded.params, _tokens())[0])
  assert np.abs(again - ours).max() < 1e-5
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
  assert np.abs(_torch_logits(model, _tokens()) - ours).max() < 1e-4   # parity's float32 bound


def test_export_errors(loaded_policy, tmp_path):
  cfg = loaded_policy("qwen2_tied").config
  with pytest.raises(ValueError, match="rank is 0"):
    lora_io.export_peft(tmp_path, cfg, lora.LoraConfig(), {})
  ad = _trained(cfg, lora.LoraConfig(rank=2, targets=("q_proj",)))
  with pytest.raises(ValueError, match=r"do not match config.model.lora.targets"):
    lora_io.export_peft(tmp_path, cfg, LORA, ad)


def test_adapter_checkpoint_resumes_exactly_and_refuses_another_base(tmp_path):
  cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
                    max_position_embeddings=256)
  base = decoder.init_params(cfg, 0)
  fp = lora_io.base_fingerprint(base)
  assert fp == lora_io.base_fingerprint(jax.tree.map(jnp.copy, base))
  other = jax.tree.map(lambda x: x, base)
  other["layers"] = {**base["layers"], "up_proj": base["layers"]["up_proj"] * 1.001}
  assert lora_io.base_fingerprint(other) != fp
  opt = LearnerConfig(learning_rate=1e-2).make_optimizer()
  step = sft_lib.make_sft_step(cfg, opt, LORA)
  rng = np.random.default_rng(0)
  batches = [{"tokens": jnp.asarray(rng.integers(1, 64, (4, 16)), jnp.int32),
              "length": jnp.asarray([16, 12, 10, 16], jnp.int32),
              "loss_mask": jnp.ones((4, 16), jnp.float32)} for _ in range(3)]
  fresh = lambda: init_train_state(lora.init_adapters(cfg, LORA, jax.random.key(1)), opt,
                                   jax.random.key(0))
  state = fresh()
  for b in batches:
    state, _ = step(state, b, base)
  straight = jax.tree.map(np.asarray, state.params)

  state = fresh()
  state, _ = step(state, batches[0], base)
  as_dict = lambda s: {"params": s.params, "opt_state": s.opt_state, "step": s.step, "key": s.key}
  with Checkpointer(tmp_path / "ck", max_to_keep=2, save_interval_steps=1) as ck:
    ck.save(1, as_dict(state), meta={lora_io.BASE_FINGERPRINT_KEY: fp})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          as_dict(fresh()))
  with Checkpointer(tmp_path / "ck", max_to_keep=2, save_interval_steps=1) as ck:
    adapters.check_base(ck, fp)
    with pytest.raises(IncompatibleCheckpointError) as e:
      adapters.check_base(ck, lora_io.base_fingerprint(other))
    assert fp in str(e.value) and lora_io.base_fingerprint(other) in str(e.value)
    assert "another base model" in str(e.value)
    restored, at = ck.restore_latest(abstract)
  assert at == 1
  state = state.replace(**restored)
  for b in batches[1:]:
    state, _ = step(state, b, base)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), straight)
