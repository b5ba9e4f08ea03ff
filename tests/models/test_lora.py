"""LoRA adapters on the decoder: step 0 equals the base, the adapted forward equals the merged
weights, decoding (CPU kernel and XLA) with adapters equals decoding the merged model, the
adapters' shardings follow their base matrices, and bad settings are refused naming the key."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import decoder, lora
from jaxagent.models.config import ModelConfig
from jaxagent.models.sampler import SamplingConfig, generate
from jaxagent.sharding.mesh import make_mesh, tree_shardings

# qkv bias, q/k norm, GQA, untied head: every branch of `_layer` the adapters touch.
CFG = ModelConfig(
    model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=True, qk_norm=True, max_position_embeddings=128,
    attention="xla")
ALL = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS)
apply = jax.jit(decoder.apply, static_argnums=0)


def trained_adapters(cfg, lcfg, seed=1):
  """Adapters as after training: A from init, B random (at init B = 0 and the delta vanishes)."""
  ad = lora.init_adapters(cfg, lcfg, jax.random.key(seed))
  rng = np.random.RandomState(seed)
  return {n: {"a": t["a"], "b": jnp.asarray(rng.normal(size=t["b"].shape) * 0.2, jnp.float32)}
          for n, t in ad.items()}


@pytest.fixture(scope="module")
def base():
  return decoder.init_params(CFG, 0)


def _tokens(seed=0, shape=(2, 9)):
  return jnp.asarray(np.random.RandomState(seed).randint(0, 64, size=shape), jnp.int32)


def test_adapter_shapes_and_axes_follow_the_base():
  ad = lora.init_adapters(CFG, ALL, jax.random.key(0))
  axes = lora.logical_axes(CFG, ALL)
  base_axes = decoder.logical_axes(CFG)["layers"]
  assert sorted(ad) == sorted(lora.TARGETS)
  assert ad["q_proj"]["a"].shape == (2, 32, 4) and ad["q_proj"]["b"].shape == (2, 4, 4, 8)
  assert ad["o_proj"]["a"].shape == (2, 4, 8, 4) and ad["o_proj"]["b"].shape == (2, 4, 32)
  for name in lora.TARGETS:
    n_in = len(ad[name]["a"].shape) - 2
    assert axes[name]["a"] == base_axes[name][:1 + n_in] + ("lora_rank",)
    assert axes[name]["b"] == ("layers", "lora_rank") + base_axes[name][1 + n_in:]
    assert not np.any(np.asarray(ad[name]["b"]))                     # B = 0
    bound = 1 / np.sqrt(np.prod(ad[name]["a"].shape[1:-1]))
    a = np.asarray(ad[name]["a"])
    assert np.abs(a).max() <= bound and a.std() > bound / 3          # kaiming-uniform


def test_adapters_shard_like_their_base_matrices():
  mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  shapes = jax.tree.map(jnp.shape, lora.init_adapters(CFG, ALL, jax.random.key(0)))
  sh = tree_shardings(lora.logical_axes(CFG, ALL),
                      jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                                   is_leaf=lambda x: isinstance(x, tuple)), mesh)
  spec = lambda name, ab: tuple(sh[name][ab].spec)
  assert spec("q_proj", "a") == (None, "fsdp", None)            # embed over fsdp, rank whole
  assert spec("q_proj", "b") == (None, None, "tensor", None)    # heads over tensor
  assert spec("down_proj", "a") == (None, "tensor", None)       # mlp over tensor
  assert spec("down_proj", "b") == (None, None, "fsdp")


def test_step_zero_equals_the_base(base):
  tokens = _tokens()
  want, _ = apply(CFG, base, tokens)
  got, _ = apply(CFG, lora.attach(base, lora.init_adapters(CFG, ALL, jax.random.key(3)), ALL),
                 tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("targets", [lora.TARGETS, ("v_proj",), ("o_proj", "down_proj")])
def test_adapted_forward_equals_merged_weights(base, targets):
  lcfg = dataclasses.replace(ALL, targets=targets)
  ad = trained_adapters(CFG, lcfg)
  full = lora.attach(base, ad, lcfg)
  merged = lora.merge(full)
  assert "lora" not in merged["layers"]
  for name in targets:                    # W + (alpha / r) A @ B by hand, layer 1
    a = np.asarray(ad[name]["a"][1]).reshape(-1, 4)
    b = np.asarray(ad[name]["b"][1]).reshape(4, -1)
    w = np.asarray(base["layers"][name][1])
    np.testing.assert_allclose(np.asarray(merged["layers"][name][1]),
                               w + 2.0 * (a @ b).reshape(w.shape), atol=1e-6)
  tokens = _tokens(1)
  got, _ = apply(CFG, full, tokens)
  want, _ = apply(CFG, merged, tokens)
  plain, _ = apply(CFG, base, tokens)
  assert np.abs(np.asarray(want) - np.asarray(plain)).max() > 1e-2      # the adapters matter
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("attention", ["xla", "kernel"])
def test_rollout_with_adapters_equals_rollout_of_merged_weights(base, attention):
  """Sampled tokens and their log-probs (prefill + decode loop; `for_decode` merges the adapters
  on the kernel path, XLA's path adds the deltas) equal those of the merged model's."""
  cfg = dataclasses.replace(CFG, attention=attention)
  ad = trained_adapters(cfg, ALL)
  full = lora.attach(base, ad, ALL)
  prompt = _tokens(2, (3, 6))
  lens = jnp.asarray([6, 3, 5], jnp.int32)
  args = (prompt, lens, jax.random.key(7), SamplingConfig.make(1.0),
          jnp.full((3,), 8, jnp.int32), jnp.full((3, 1), -1, jnp.int32))
  got = generate(cfg, full, *args, max_new_tokens=8)
  want = generate(cfg, lora.merge(full), *args, max_new_tokens=8)
  base_out = generate(cfg, base, *args, max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-4)
  assert not np.allclose(np.asarray(got.logprobs), np.asarray(base_out.logprobs), atol=1e-3)


def test_dropout_only_with_a_key(base):
  lcfg = dataclasses.replace(ALL, dropout=0.5)
  ad = trained_adapters(CFG, lcfg)
  tokens = _tokens(4)
  plain, _ = apply(CFG, lora.attach(base, ad, lcfg), tokens)
  same, _ = apply(CFG, lora.attach(base, ad, ALL), tokens)
  k1, _ = apply(CFG, lora.attach(base, ad, lcfg, jax.random.key(1)), tokens)
  k1b, _ = apply(CFG, lora.attach(base, ad, lcfg, jax.random.key(1)), tokens)
  k2, _ = apply(CFG, lora.attach(base, ad, lcfg, jax.random.key(2)), tokens)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(same))   # no key: no dropout
  np.testing.assert_array_equal(np.asarray(k1), np.asarray(k1b))       # seeded
  assert np.abs(np.asarray(k1) - np.asarray(plain)).max() > 1e-3
  assert np.abs(np.asarray(k1) - np.asarray(k2)).max() > 1e-3


@pytest.mark.parametrize("kwargs, words", [
    (dict(rank=-1), "config.model.lora.rank must be 0 (off) or a positive int"),
    (dict(rank=4, targets=("q_proj", "qkv")), "unknown ['qkv']; valid names: q_proj, k_proj"),
    (dict(rank=4, targets=()), "at least one"),
    (dict(rank=4, alpha=0.0), "config.model.lora.alpha must be > 0"),
    (dict(rank=4, dropout=1.0), "config.model.lora.dropout must be in [0, 1)"),
])
def test_bad_settings_name_the_key(kwargs, words):
  with pytest.raises(ValueError) as e:
    lora.LoraConfig(**kwargs)
  assert words in str(e.value)


def test_rank_larger_than_a_matrix_is_refused():
  lcfg = lora.LoraConfig(rank=33, targets=("q_proj",))        # q_proj is 32 x 32
  with pytest.raises(ValueError, match=r"rank=33 is larger than q_proj's matrix \(32 x 32\); "
                     r"use a rank in 1..32"):
    lora.init_adapters(CFG, lcfg, jax.random.key(0))
  lora.LoraConfig(rank=32, targets=("q_proj",)).check(CFG)
  with pytest.raises(ValueError, match="k_proj's matrix"):    # k_proj: 32 x 16
    lora.LoraConfig(rank=17, targets=("q_proj", "k_proj")).check(CFG)
