"""The int8 frozen base (QLoRA-style, `jaxagent.models.quant`): logits close to float32's (the
bound stated below), ~1/4 of float32's bytes, step 0 with adapters equal to the int8 base,
gradients for the adapters only with no dequantised matrix kept for the backward pass, the KL
reference the int8 base with adapters off, shardings kept on a mesh, decoding on both attention
paths, and merged export refused naming the fix."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals   # what autodiff keeps for the backward

from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import decoder, from_pretrained, lora, lora_io, quant
from jaxagent.models.policy import param_shardings
from jaxagent.models.sampler import SamplingConfig, generate
from jaxagent.models.scoring import token_logprobs
from jaxagent.sharding.mesh import make_mesh

LCFG = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS, base_dtype="int8")
# The stated tolerance: max |log-prob difference| (nats, over the whole vocabulary at every
# position) of the int8 base against the float32 model. Measured on the built-in models
# (random weights, std 0.02; float32 compute): micro 0.015, tiny 0.029.
LOGPROB_TOL = 0.05
apply = jax.jit(decoder.apply, static_argnums=0)


@pytest.fixture(scope="module", params=["micro", "tiny"])
def model(request):
  policy = from_pretrained(f"builtin:{request.param}")
  return policy.config, policy.params, quant.quantize_params(policy.params)


def _tokens(cfg, shape=(2, 40), seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size)


def _trained(cfg, lcfg, seed=1):
  ad = lora.init_adapters(cfg, lcfg, jax.random.key(seed))
  rng = np.random.RandomState(seed)
  return {n: {"a": t["a"], "b": jnp.asarray(rng.normal(size=t["b"].shape) * 0.05, jnp.float32)}
          for n, t in ad.items()}


def test_int8_logits_within_the_stated_tolerance(model):
  cfg, params, q8 = model
  tokens = _tokens(cfg)
  want, got = apply(cfg, params, tokens)[0], apply(cfg, q8, tokens)[0]
  gap = np.abs(np.asarray(jax.nn.log_softmax(want) - jax.nn.log_softmax(got))).max()
  assert 1e-4 < gap < LOGPROB_TOL, gap          # rounded (not exact), and close
  # The int8 weights dequantise to within half a step of the float ones, per output channel.
  w, qw = params["layers"]["gate_proj"], q8["layers"]["gate_proj"]
  err = np.abs(np.asarray(qw.dequantize() - w))
  assert np.all(err <= np.asarray(qw.scale) / 2 + 1e-7)


def test_int8_base_is_a_quarter_of_float32(model):
  cfg, params, q8 = model
  names = [*quant.LAYER_INPUT_AXES]
  f32 = sum(params["layers"][n].nbytes for n in names) + params["embed"].nbytes
  i8 = quant.nbytes([q8["layers"][n] for n in names] + [q8["embed"]])
  assert 0.25 < i8 / f32 < 0.27, i8 / f32                    # int8 values + float32 scales
  assert q8["layers"]["q_proj"].q.dtype == jnp.int8
  assert q8["layers"]["attn_norm"] is params["layers"]["attn_norm"]      # norms as they are
  assert quant.quantize_params(q8) is q8


def test_step_zero_with_adapters_equals_the_int8_base(model):
  cfg, _, q8 = model
  tokens = _tokens(cfg)
  ad = lora.init_adapters(cfg, LCFG, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(apply(cfg, lora.attach(q8, ad, LCFG), tokens)[0]),
                                np.asarray(apply(cfg, q8, tokens)[0]))
  # Trained adapters on the int8 base equal them on its dequantised copy.
  ad = _trained(cfg, LCFG)
  deq = quant.dequantize_params(q8)
  np.testing.assert_allclose(np.asarray(apply(cfg, lora.attach(q8, ad, LCFG), tokens)[0]),
                             np.asarray(apply(cfg, lora.attach(deq, ad, LCFG), tokens)[0]),
                             atol=2e-5, rtol=0)


def test_gradients_only_for_adapters_and_no_dequantised_residuals(model):
  cfg, params, q8 = model
  tokens = _tokens(cfg, (2, 24))
  ad = _trained(cfg, LCFG)
  loss = lambda a, base: jnp.mean(
      token_logprobs(cfg, lora.attach(base, a, LCFG), tokens, jnp.full((2,), 24, jnp.int32)))
  g = jax.jit(jax.grad(loss))(ad, q8)
  assert jax.tree.structure(g) == jax.tree.structure(ad)
  # The same gradient as on the dequantised copy (whose weights autodiff handles itself).
  g_deq = jax.jit(jax.grad(loss))(ad, quant.dequantize_params(q8))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6,
                                                       rtol=2e-4), g, g_deq)
  # What the backward pass keeps: the int8 matrices as they are, never a float copy of a layer
  # matrix (a stacked float residual of a weight's shape would be the whole float base).
  shapes = {params["layers"][n].shape for n in quant.LAYER_INPUT_AXES} | {
      params["embed"].shape}
  kept = saved_residuals(loss, ad, q8)
  float_weights = [(a.shape, why) for a, why in kept
                   if a.shape in shapes and jnp.issubdtype(a.dtype, jnp.floating)]
  assert not float_weights, float_weights
  assert any(a.dtype == jnp.int8 for a, _ in kept)


def test_rl_update_trains_adapters_with_the_int8_base_as_reference(model):
  """KL reference = the int8 base with adapters off: at fresh adapters (B = 0) the first
  minibatch's KL is exactly 0, and the base is not touched."""
  cfg, _, q8 = model
  from tests.planning.test_memory import _random_trajectory
  lcfg = LearnerConfig(minibatches=1, kl_coef=0.1, learning_rate=1e-3)
  opt = lcfg.make_optimizer()
  update = make_update_fn(lcfg, cfg, opt, LCFG)
  ad = lora.init_adapters(cfg, LCFG, jax.random.key(0))
  state = init_train_state(ad, opt, jax.random.key(0))
  traj = _random_trajectory(np.random.default_rng(0), 4, 24, cfg.vocab_size)
  # Behaviour log-probs from the int8 base itself (the rollout's policy at step 0).
  traj = traj.replace(behaviour_logprobs=token_logprobs(cfg, q8, traj.tokens, traj.length))
  before = jax.tree.map(np.asarray, q8)
  state, m = update(state, traj, base=q8)
  assert float(m["kl"]) == 0.0 and np.isfinite(float(m["loss"]))
  assert any(np.abs(np.asarray(state.params[n]["b"])).max() > 0 for n in lora.TARGETS)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, q8), before)


def test_quantised_on_a_mesh_keeps_shardings():
  mesh = make_mesh((2, 2, 2))
  policy = from_pretrained("builtin:micro", mesh=mesh)
  q8 = quant.quantize_params(policy.params)
  want = param_shardings(policy.config, mesh)
  for name in quant.LAYER_INPUT_AXES:
    assert q8["layers"][name].q.sharding == want["layers"][name]
  single = quant.quantize_params(from_pretrained("builtin:micro").params)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), q8,
               single)


@pytest.mark.parametrize("attention", ["xla", "kernel"])
def test_decoding_on_the_int8_base_equals_its_dequantised_copy(attention):
  """The rollout's decode loop (prefill + steps) on the int8 base with adapters: the CPU kernel's
  path keeps it stacked and unmerged (`decoder.for_decode`), XLA's adds the deltas."""
  policy = from_pretrained("builtin:micro")
  cfg = dataclasses.replace(policy.config, attention=attention)
  q8 = quant.quantize_params(policy.params)
  ad = _trained(cfg, LCFG)
  args = (_tokens(cfg, (3, 6), 2), jnp.asarray([6, 3, 5], jnp.int32), jax.random.key(7),
          SamplingConfig.make(1.0), jnp.full((3,), 8, jnp.int32), jnp.full((3, 1), -1, jnp.int32))
  got = generate(cfg, lora.attach(q8, ad, LCFG), *args, max_new_tokens=8)
  want = generate(cfg, lora.merge(lora.attach(quant.dequantize_params(q8), ad, LCFG)), *args,
                  max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-4)


def test_export_with_an_int8_base(tmp_path):
  policy = from_pretrained("builtin:micro")
  cfg, q8 = policy.config, quant.quantize_params(policy.params)
  ad = _trained(cfg, LCFG)
  lora_io.export_peft(tmp_path / "peft", cfg, LCFG, ad)        # adapters alone: fine
  assert (tmp_path / "peft" / lora_io.ADAPTER_WEIGHTS).exists()
  with pytest.raises(ValueError, match=r"int8 base.*config.model.path.*dequantize_params"):
    lora_io.export_merged(tmp_path / "merged", cfg, q8, ad, LCFG)
  lora_io.export_merged(tmp_path / "merged", cfg, policy.params, ad, LCFG)  # the float base


def test_bad_base_dtype_is_refused():
  with pytest.raises(ValueError, match=r"base_dtype='int4'.*\('float', 'int8', 'gguf'\)"):
    lora.LoraConfig(rank=4, base_dtype="int4")
  with pytest.raises(ValueError, match=r"needs adapters.*rank > 0"):
    lora.LoraConfig(rank=0, base_dtype="int8")
