"""Evaluation restores adapter (LoRA) checkpoints like full ones: base + adapters, the base read
lazily, another base refused (jaxagent.runs.adapters.restore_policy, Evaluator.restore)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from jaxagent.checkpoint import Checkpointer, IncompatibleCheckpointError
from jaxagent.models import decoder, lora
from jaxagent.runs import adapters, layout, setup

LCFG = lora.LoraConfig(rank=2, alpha=8.0, targets=("q_proj", "down_proj"))


def _save(workdir, phase, step, params, meta):
  with Checkpointer(layout.checkpoint_dir(workdir, phase), max_to_keep=None,
                    save_interval_steps=1) as ckpt:
    ckpt.save(step, {"params": params, "step": jnp.int32(step)}, meta=meta)


@pytest.mark.parametrize("devices", [1, 8])
def test_restore_policy_full_and_adapter_checkpoints(tmp_path, devices):
  config = get_config("smoke")
  config.num_devices = devices
  policy = setup.load_policy(config)
  cfg, base = policy.config, policy.params
  ad = adapters.init_adapters(cfg, LCFG, jax.random.key(0), policy.mesh)
  ad = jax.tree.map(lambda x: x + 0.01, ad)                     # B != 0: not the base
  fp = adapters.base_fingerprint(base)
  _save(tmp_path, "rl", 3, ad, adapters.checkpoint_meta(LCFG, fp))
  _save(tmp_path, "sft", 1, base, {})
  abstract = layout.abstract_params(base)
  loads = []
  loader = adapters.BaseLoader(lambda: loads.append(1) or base)
  # A full checkpoint: its params, the base never read.
  full = adapters.restore_policy(tmp_path, "sft", 1, abstract, cfg, loader, policy.mesh)
  assert not loads and not lora.adapted(full["layers"])
  got = adapters.restore_policy(tmp_path, "rl", 3, abstract, cfg, loader, policy.mesh)
  assert loads == [1]
  # The adapters land with their base matrices' shardings (over fsdp on 8 devices).
  want = adapters.abstract_adapters(cfg, LCFG, policy.mesh)
  for name, ab in got["layers"]["lora"].items():
    assert ab.a.sharding == want[name]["a"].sharding and ab.b.sharding == want[name]["b"].sharding
  tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]
  want_logits, _ = decoder.apply(cfg, lora.attach(base, ad, LCFG), tokens)
  got_logits, _ = decoder.apply(cfg, got, tokens)
  np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
  base_logits, _ = decoder.apply(cfg, base, tokens)
  assert np.max(np.abs(np.asarray(got_logits) - np.asarray(base_logits))) > 1e-4
  # Adapters of another base: refused, naming both fingerprints.
  other = adapters.BaseLoader(lambda: jax.tree.map(lambda x: x * 2, base))
  with pytest.raises(IncompatibleCheckpointError, match=rf"{fp}.*{other.fingerprint}"):
    adapters.restore_policy(tmp_path, "rl", 3, abstract, cfg, other, policy.mesh)
