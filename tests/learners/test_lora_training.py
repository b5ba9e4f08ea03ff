"""Training only the adapters (SFT and the RL update): the base is bit-for-bit unchanged, the
gradient and optimizer state exist for the adapters alone, the gradient at B = 0 is the base
gradient projected (dL/dB = scale A^T dL/dW, dL/dA = 0), and the KL reference with adapters off
is the base model itself."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.learners import sft as sft_lib
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import decoder, lora
from jaxagent.models.scoring import token_logprobs

LORA = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS)


def _copy(tree):
  return jax.tree.map(np.asarray, tree)


def _only_adapter_moments(opt_state, adapters):
  """The optimizer state's arrays beyond scalars are exactly Adam's two moments per adapter."""
  big = sorted(x.shape for x in jax.tree.leaves(opt_state) if x.ndim > 0)
  assert big == sorted(2 * [x.shape for x in jax.tree.leaves(adapters)])


def test_gradient_at_b_zero_is_the_base_gradient_projected(small_model):
  """At init (B = 0): dL/dA = 0 and dL/dB = scale * A^T dL/dW for every target (W's input dims
  flattened), so the adapters see the base's gradient and nothing else."""
  base = decoder.init_params(small_model, 0)
  ad = lora.init_adapters(small_model, LORA, jax.random.key(1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 64, (2, 12)), jnp.int32)
  length, mask = jnp.asarray([12, 9], jnp.int32), jnp.ones((2, 12), jnp.float32)
  loss = lambda p: sft_lib.sft_loss(small_model, p, tokens, length, mask)[0]
  g_base = jax.grad(loss)(base)["layers"]
  g_ad = jax.grad(lambda a: loss(lora.attach(base, a, LORA)))(ad)
  for name in lora.TARGETS:
    a = np.asarray(ad[name]["a"])                     # [n, *in, r]
    n, r = a.shape[0], a.shape[-1]
    gw = np.asarray(g_base[name]).reshape(n, a[0].size // r, -1)
    want = LORA.scale * np.einsum("nir,nio->nro", a.reshape(n, -1, r), gw)
    np.testing.assert_allclose(np.asarray(g_ad[name]["b"]).reshape(want.shape), want,
                               atol=2e-6, rtol=1e-4)
    assert not np.any(np.asarray(g_ad[name]["a"]))
    assert np.abs(want).max() > 1e-4


def test_sft_trains_only_the_adapters(small_model):
  base = decoder.init_params(small_model, 0)
  before = _copy(base)
  opt = LearnerConfig(learning_rate=1e-2).make_optimizer()
  step = sft_lib.make_sft_step(small_model, opt, dataclasses.replace(LORA, dropout=0.1))
  ad = lora.init_adapters(small_model, LORA, jax.random.key(1))
  state = init_train_state(ad, opt, jax.random.key(0))
  _only_adapter_moments(state.opt_state, ad)
  rng = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(rng.integers(1, 64, (4, 16)), jnp.int32),
           "length": jnp.asarray([16, 12, 10, 16], jnp.int32),
           "loss_mask": jnp.ones((4, 16), jnp.float32)}
  losses = []
  for _ in range(6):
    state, m = step(state, batch, base)
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0] - 0.05, losses
  chex.assert_trees_all_equal(_copy(base), before)            # the base: bit for bit
  assert jax.tree.structure(state.params) == jax.tree.structure(ad)
  _only_adapter_moments(state.opt_state, state.params)
  assert all(np.abs(np.asarray(state.params[n]["b"])).max() > 0 for n in lora.TARGETS)
  with pytest.raises(ValueError, match="LoRA SFT takes the frozen base"):
    step(state, batch)


def test_rl_update_trains_only_the_adapters_with_the_base_as_free_reference(make_batch,
                                                                           small_model):
  cfg = LearnerConfig(kl_coef=0.2, kl_estimator="k3", learning_rate=2e-2)
  opt = cfg.make_optimizer()
  update = make_update_fn(cfg, small_model, opt, LORA)
  base = decoder.init_params(small_model, 0)
  before = _copy(base)
  traj = make_batch(small_model, base, 1, solved_rows=(0, 3, 5))
  runs = {}
  # The free reference (no ref_params: the base, adapters off) against an explicit copy of it.
  for name, ref in (("free", None), ("explicit", jax.tree.map(jnp.copy, base))):
    state = init_train_state(lora.init_adapters(small_model, LORA, jax.random.key(1)), opt,
                             jax.random.key(0))
    ms = []
    for _ in range(3):
      state, m = update(state, traj, ref, base=base)
      ms.append(_copy(m))
    runs[name] = (_copy(state.params), ms)
    _only_adapter_moments(state.opt_state, state.params)
    assert int(state.step) == 3
  chex.assert_trees_all_equal(runs["free"], runs["explicit"])
  ms = runs["free"][1]
  assert abs(ms[0]["kl"]) < 1e-6 and abs(ms[0]["ratio_mean"] - 1) < 1e-5   # B = 0: the base
  assert ms[2]["kl"] > 1e-6                                   # the adapters moved the policy
  chex.assert_trees_all_equal(_copy(base), before)            # the base: bit for bit
  with pytest.raises(ValueError, match="LoRA training takes the frozen base"):
    update(state, traj, None)


def test_reference_with_adapters_off_equals_the_base(small_model):
  base = decoder.init_params(small_model, 0)
  ad = jax.tree.map(lambda x: x + 0.1, lora.init_adapters(small_model, LORA, jax.random.key(1)))
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(1, 64, (3, 14)), jnp.int32)
  length = jnp.asarray([14, 8, 11], jnp.int32)
  full = lora.attach(base, ad, LORA)
  ref = token_logprobs(small_model, lora.detach(full), tokens, length)
  want = token_logprobs(small_model, base, tokens, length)
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
  adapted = token_logprobs(small_model, full, tokens, length)
  assert np.abs(np.asarray(adapted) - np.asarray(want)).max() > 1e-3


def test_full_fine_tuning_takes_no_base(make_batch, small_model):
  cfg = LearnerConfig()
  opt = cfg.make_optimizer()
  base = decoder.init_params(small_model, 0)
  traj = make_batch(small_model, base, 0, solved_rows=(0,))
  state = init_train_state(decoder.init_params(small_model, 0), opt, jax.random.key(0))
  with pytest.raises(ValueError, match="full fine-tuning takes no base"):
    make_update_fn(cfg, small_model, opt)(state, traj, None, base=base)
