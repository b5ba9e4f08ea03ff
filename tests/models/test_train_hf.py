"""Training from a Hugging Face directory through configs/hf.py: a tiny random checkpoint of each
family (saved by transformers, safetensors) takes the real-checkpoint variant's config (bf16,
FSDP over the 8 fake devices, its learning rates) at smoke sizes, and trains SFT then RL."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default, hf
from jaxagent import train
from jaxagent.runs import layout, setup

# A variant of configs/hf.py per family of tests/models/conftest.py. Qwen2 is also the built-in
# model's family, which every trainer test trains.
VARIANT = {"qwen3_untied": "qwen3-1.7b", "llama3_untied": "llama3.2-1b"}
MODEL_TYPE = {"qwen3_untied": "qwen3", "llama3_untied": "llama"}


def _smoke_sized(variant, model_path, data_dir):
  """The variant's config with the model, the sizes of default.py:smoke and one minibatch."""
  c = hf.get_config(variant)
  smoke = default.get_config("smoke")
  for key in ("env", "data", "sft.steps", "sft.batch_size", "sft.warmup_steps", "rl.steps",
              "rl.num_tasks", "rl.group_size", "rl.budget", "checkpoint_every"):
    *path, last = key.split(".")
    dst, src = c, smoke
    for p in path:
      dst, src = dst[p], src[p]
    dst[last] = src[last]
  c.model.path = str(model_path)
  c.data.dir = str(data_dir)
  c.sft.steps, c.rl.steps = 2, 1
  c.rl.learner.minibatches = 1
  c.rl.learner.warmup_steps = 0
  # bf16 steps of 2e-5 barely move bf16 weights of a random model; the assertions below need
  # a visible update.
  c.sft.learning_rate = c.rl.learner.learning_rate = 1e-2
  return c


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(VARIANT))
def test_sft_then_rl_from_a_hf_directory(family, hf_checkpoint, tmp_path):
  ckpt = hf_checkpoint(family)
  config = _smoke_sized(VARIANT[family], ckpt.path, tmp_path / "data")
  train.run(config, tmp_path / "run")

  lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  phases = [(l["phase"], l["step"]) for l in lines]
  assert phases == [("sft", 1), ("sft", 2), ("rl", 1)], phases
  assert all(np.isfinite(l["loss"]) for l in lines)

  policy = setup.load_policy(config)
  assert policy.config.model_type == MODEL_TYPE[family]
  leaves = jax.tree.leaves(policy.params)
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  trained, _, _ = layout.latest_params(tmp_path / "run", layout.abstract_params(policy.params))
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), policy.params, trained)
  assert all(jax.tree.leaves(moved)), "every tensor of the checkpoint should be trained"
