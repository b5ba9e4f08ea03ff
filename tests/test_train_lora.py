"""The training loop with LoRA (config.model.lora.rank > 0): adapters only in the train state and
checkpoints, the frozen base untouched, SFT -> RL hand-over, exact resume, another base refused."""

import json

import jax
import numpy as np
import pytest

from configs.default import get_config
from jaxagent import train
from jaxagent.checkpoint import Checkpointer, IncompatibleCheckpointError
from jaxagent.models import decoder, lora, quant
from jaxagent.models.lora_io import BASE_FINGERPRINT_KEY, base_fingerprint
from jaxagent.runs import adapters, layout, setup
from jaxagent.runs.programs import programs_for

RANK = 4


def _config(sft_steps, rl_steps, data, **over):
  c = get_config("smoke")
  c.sft.steps, c.rl.steps = sft_steps, rl_steps
  c.checkpoint_every = 1
  c.num_devices = 1
  c.data.dir = str(data)
  c.model.lora.rank = RANK
  c.update_from_flattened_dict(over)
  return c


def _adapters(workdir, phase, config, policy):
  """The newest checkpoint's params of `phase`, restored as adapters (fails on a full one)."""
  ckpt = Checkpointer.reader(layout.checkpoint_dir(workdir, phase))
  step = ckpt.latest_step()
  meta = ckpt.restore_meta(step)
  ckpt.close()
  lcfg = adapters.config_from_meta(meta)
  abstract = adapters.abstract_adapters(policy.config, lcfg, policy.mesh)
  return jax.tree.map(np.asarray, layout.restore_params(workdir, phase, step, abstract)), meta


def test_lora_train_loop_hands_over_and_resumes_exactly(tmp_path, metrics_lines):
  data = tmp_path / "data"
  full, split = tmp_path / "full", tmp_path / "split"
  one_mb = {"rl.learner.minibatches": 1}
  config = _config(2, 2, data, **one_mb)
  # kl_coef > 0 (the smoke default): RL's reference is the base with the SFT adapters.
  assert config.rl.learner.kl_coef > 0
  policy = setup.load_policy(config)
  base_before = jax.tree.map(np.asarray, policy.params)
  programs = programs_for(config, policy.config, policy.tokenizer)
  done = train.run(config, full, programs=programs)
  assert done["lora_rank"] == RANK and done["base_fingerprint"] == base_fingerprint(policy.params)
  # Stopped after RL step 1 (a checkpoint), resumed with the full length: the same run.
  train.run(_config(2, 1, data, **one_mb), split, programs=programs)
  train.run(_config(2, 2, data, **one_mb), split, programs=programs)
  a, b = metrics_lines(full), metrics_lines(split)
  assert [(l["phase"], l["step"]) for l in a] == [("sft", 1), ("sft", 2), ("rl", 1), ("rl", 2)]
  assert a == b
  sft_ad, sft_meta = _adapters(full, "sft", config, policy)
  rl_ad, meta = _adapters(full, "rl", config, policy)
  jax.tree.map(np.testing.assert_array_equal, rl_ad, _adapters(split, "rl", config, policy)[0])
  # Checkpoints hold adapters only, with the base's fingerprint and the adapters' settings.
  assert sorted(rl_ad) == sorted(lora.LoraConfig(rank=RANK).targets)
  assert meta[BASE_FINGERPRINT_KEY] == sft_meta[BASE_FINGERPRINT_KEY] == done["base_fingerprint"]
  assert meta[adapters.LORA_KEY]["rank"] == RANK
  # SFT trained the adapters (B moved off zero), RL continued them, the base never moved.
  assert all(np.any(ab["b"] != 0) for ab in sft_ad.values())
  assert any(np.any(rl_ad[k]["b"] != sft_ad[k]["b"]) for k in rl_ad)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, policy.params),
               base_before)
  # The RL reference was the SFT policy (base + SFT adapters), not the bare base: the first
  # update (one minibatch) scores the KL at the starting params, exactly 0 (against the bare
  # base it would be > 0: SFT moved every B above).
  rl = [l for l in a if l["phase"] == "rl"]
  assert rl[0]["kl"] == 0.0
  # The optimizer state is adapter-sized: every array leaf of a checkpoint's state is no larger
  # than the largest adapter.
  ckpt = Checkpointer.reader(layout.checkpoint_dir(full, "rl"))
  saved = ckpt._saved_state_tree(ckpt.latest_step())
  ckpt.close()
  biggest = max(x.size for x in jax.tree.leaves(rl_ad))
  shapes = [getattr(x, "shape", None) for x in jax.tree.leaves(saved)]
  assert all(int(np.prod(s)) <= biggest for s in shapes if s is not None)


def test_lora_resume_on_another_base_or_kind_is_refused(tmp_path, monkeypatch):
  data = tmp_path / "data"
  work = tmp_path / "w"
  train.run(_config(0, 1, data), work)
  ours = json.loads((work / "DONE").read_text())["base_fingerprint"]
  monkeypatch.setattr(adapters, "base_fingerprint", lambda params: "0123456789abcdef")
  with pytest.raises(IncompatibleCheckpointError, match=rf"{ours}.*0123456789abcdef"):
    train.run(_config(0, 2, data), work)
  monkeypatch.undo()
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"LoRA adapter checkpoints .*lora\.rank=0"):
    train.run(_config(0, 2, data, **{"model.lora.rank": 0}), work, allow_config_change=True)
  # Full fine-tuning from an adapter workdir: refused, naming the keys that continue them.
  with pytest.raises(ValueError, match=r"holds LoRA adapters .*config\.model\.lora\.rank=4"):
    train.run(_config(0, 1, data, **{"model.lora.rank": 0, "model.init_from": str(work)}),
              tmp_path / "full")


def test_lora_on_an_int8_base_trains_and_evaluates(tmp_path):
  """config.model.lora.base_dtype="int8": the run holds the base in int8 (its fingerprint is the
  int8 weights'), trains SFT then RL, and evaluation restores base + adapters in int8 again; the
  float base's fingerprint is refused for those adapters' config the other way round."""
  data = tmp_path / "data"
  work = tmp_path / "w"
  config = _config(2, 1, data, **{"model.lora.base_dtype": "int8"})
  policy = setup.load_policy(config)
  float_base = policy.params
  int8_base = quant.quantize_params(float_base)
  done = train.run(config, work)
  assert done["base_fingerprint"] == base_fingerprint(int8_base) != base_fingerprint(float_base)
  ad, meta = _adapters(work, "rl", config, policy)
  assert meta[adapters.LORA_KEY]["base_dtype"] == "int8"
  loader = adapters.BaseLoader(lambda: float_base)
  got = adapters.restore_policy(work, "rl", 1, layout.abstract_params(float_base),
                                policy.config, loader, policy.mesh)
  assert quant.is_quantized(got["layers"]["q_proj"])
  tokens = jax.numpy.arange(1, 9, dtype=jax.numpy.int32)[None]
  want = decoder.apply(policy.config, lora.attach(int8_base, ad, adapters.config_from_meta(meta)),
                       tokens)[0]
  np.testing.assert_array_equal(np.asarray(decoder.apply(policy.config, got, tokens)[0]),
                                np.asarray(want))
  # Continuing these adapters with a float base: refused, naming the key.
  with pytest.raises(ValueError, match=r"config\.model\.lora\.base_dtype='int8'"):
    train.run(_config(0, 1, data, **{"model.init_from": str(work)}), tmp_path / "next")


def test_lora_on_a_gguf_block_base_trains_and_evaluates(tmp_path):
  """config.model.lora.base_dtype="gguf" on a .gguf model: the run holds the file's blocks (its
  fingerprint is theirs), trains SFT then RL, and evaluation restores the block base with the
  adapters; a float base for those adapters is refused naming the fix."""
  from jaxagent.models import gguf_base, gguf_io
  from tests.models.test_gguf_base import KEPT, _write
  data = tmp_path / "data"
  path = _write(tmp_path / "qwen2.gguf", "qwen2", KEPT, context=2048)
  config = _config(2, 1, data, **{"model.path": str(path), "model.lora.base_dtype": "gguf"})
  policy = setup.load_policy(config)
  assert gguf_base.is_block_base(policy.params)
  done = train.run(config, tmp_path / "w")
  assert done["base_fingerprint"] == base_fingerprint(policy.params)
  ad, meta = _adapters(tmp_path / "w", "rl", config, policy)
  assert meta[adapters.LORA_KEY]["base_dtype"] == "gguf"
  assert any(np.any(ab["b"] != 0) for ab in ad.values())
  floats = gguf_io.load_params(path, policy.config)
  got = adapters.restore_policy(tmp_path / "w", "rl", 1, layout.abstract_params(floats),
                                policy.config, adapters.BaseLoader(lambda: policy.params),
                                policy.mesh)
  tokens = jax.numpy.arange(1, 9, dtype=jax.numpy.int32)[None]
  want = decoder.apply(policy.config, lora.attach(floats, ad, adapters.config_from_meta(meta)),
                       tokens)[0]
  np.testing.assert_allclose(np.asarray(decoder.apply(policy.config, got, tokens)[0]),
                             np.asarray(want), rtol=0, atol=5e-5)
  with pytest.raises(ValueError, match=r"base_dtype='gguf'.*not float weights"):
    adapters.restore_policy(tmp_path / "w", "rl", 1, layout.abstract_params(floats),
                            policy.config, adapters.BaseLoader(lambda: floats), policy.mesh)
