"""Policy losses on cases worked out by hand: PPO clip boundaries, KL k1/k3, entropy of a known
distribution, token vs sequence aggregation, and the registry."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxagent.learners import aggregate, policy_loss
from jaxagent.learners import losses as loss_lib
from jaxagent.models import decoder
from jaxagent.models.scoring import token_logprobs, token_logprobs_and_entropy


# The knobs policy_loss requires, neutral (no KL, no entropy bonus) unless a test sets them.
KNOBS = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3",
             entropy_coef=0.0)


def _loss(**kw):
  return jax.jit(policy_loss, static_argnames=("loss", "aggregation", "kl_estimator"))(
      **{**KNOBS, **kw})


def test_ppo_clip_boundary_gradients():
  # Clip range [1 - 0.2, 1 + 0.28]. One episode per row so each row's advantage is its own.
  # ratio:      1.27 (in)  1.29 (out)  0.81 (in)  0.79 (out)
  ratio = np.array([1.27, 1.29, 0.81, 0.79], np.float32)
  old = np.full((1, 4), -1.0, np.float32)
  logp = (old + np.log(ratio)[None]).astype(np.float32)
  mask = np.ones((1, 4), np.float32)

  def grads(a):
    f = lambda lp: policy_loss(lp, old, jnp.array([a], jnp.float32), mask, loss="ppo_clip",
                               aggregation="token", **{**KNOBS, "clip_eps_high": 0.28})[0]
    return np.asarray(jax.jit(jax.grad(f))(jnp.asarray(logp)))[0]

  # l = -min(rho A, clip(rho) A) / 4 tokens; unclipped: dl/dlogp = -A rho / 4; clipped: 0.
  # A = +1: clipped above 1.28 only (1.29); below 0.8 the unclipped branch (0.79) is the min.
  np.testing.assert_allclose(grads(1.0), -np.array([1.27, 0.0, 0.81, 0.79]) / 4, rtol=1e-5)
  # A = -1: clipped below 0.8 only (0.79); above 1.28 the unclipped -1.29 is the min.
  np.testing.assert_allclose(grads(-1.0), np.array([1.27, 1.29, 0.81, 0.0]) / 4, rtol=1e-5)

  for a, clipped_value in ((1.0, 1.28), (-1.0, -0.8)):
    loss, m = _loss(logp=logp, behaviour_logp=old, advantages=np.float32([a]), loss_mask=mask,
                    loss="ppo_clip", aggregation="token", clip_eps_low=0.2, clip_eps_high=0.28)
    surr = ratio * a
    surr[1 if a > 0 else 3] = clipped_value
    np.testing.assert_allclose(loss, -surr.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["pg_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(m["clip_fraction"], 0.25)
    np.testing.assert_allclose(m["ratio_mean"], ratio.mean(), rtol=1e-5)
    # approx_kl = mean(rho - 1 - log rho)
    np.testing.assert_allclose(m["approx_kl"], np.mean(ratio - 1 - np.log(ratio)), rtol=1e-3)


def test_reinforce_loss_and_gradient():
  logp = np.log(np.array([[0.5, 0.25, 0.1]], np.float32))
  mask = np.array([[1, 1, 0]], np.float32)
  loss, m = _loss(logp=logp, behaviour_logp=np.zeros_like(logp), advantages=np.float32([2.0]),
                  loss_mask=mask, loss="reinforce", aggregation="token")
  # -A * mean(logp over the 2 agent tokens) = -2 * (log .5 + log .25) / 2 = 3 log 2
  np.testing.assert_allclose(loss, 3 * np.log(2), rtol=1e-6)
  g = jax.grad(lambda lp: policy_loss(lp, jnp.zeros_like(lp), jnp.float32([2.0]), mask,
                                      loss="reinforce", aggregation="token", **KNOBS)[0])(logp)
  np.testing.assert_allclose(g, [[-1.0, -1.0, 0.0]])
  assert float(m["clip_fraction"]) == 0.0


def test_kl_k1_k3_by_hand():
  logp = np.log(np.float32([[0.5, 0.5]]))
  ref = np.log(np.float32([[0.25, 0.5]]))
  mask = np.float32([[1, 1]])
  common = dict(logp=logp, behaviour_logp=logp, advantages=np.float32([0.0]), loss_mask=mask,
                loss="ppo_clip", aggregation="token", ref_logp=ref, kl_coef=0.5)
  # token 0: k1 = log .5 - log .25 = log 2; k3 = exp(log .25 - log .5) - (log .25 - log .5) - 1
  #          = 0.5 + log 2 - 1 = 0.19314718.  token 1: both 0.  Mean over the 2 tokens.
  loss, m = _loss(kl_estimator="k1", **common)
  np.testing.assert_allclose(m["kl"], np.log(2) / 2, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.5 * np.log(2) / 2, rtol=1e-6)   # pg = 0 (A = 0)
  loss, m = _loss(kl_estimator="k3", **common)
  np.testing.assert_allclose(m["kl"], (0.5 + np.log(2) - 1) / 2, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.5 * (0.5 + np.log(2) - 1) / 2, rtol=1e-6)
  # gradient of k3 wrt logp: 1 - exp(ref - logp) = 1 - 0.5 on token 0
  g = jax.grad(lambda lp: policy_loss(lp, logp, jnp.float32([0.0]), mask, loss="ppo_clip",
                                      aggregation="token", ref_logp=ref,
                                      **{**KNOBS, "kl_coef": 1.0})[0])(jnp.asarray(logp))
  np.testing.assert_allclose(g, [[0.5 / 2, 0.0]], atol=1e-6)


def test_entropy_bonus_enters_the_loss():
  logp = np.zeros((1, 2), np.float32)
  ent = np.float32([[1.0, 3.0]])
  loss, m = _loss(logp=logp, behaviour_logp=logp, advantages=np.float32([0.0]),
                  loss_mask=np.float32([[1, 1]]), loss="reinforce", aggregation="token",
                  entropy=ent, entropy_coef=0.1)
  np.testing.assert_allclose(m["entropy"], 2.0)
  np.testing.assert_allclose(loss, -0.2, rtol=1e-6)


def test_token_vs_sequence_aggregation_by_hand():
  x = np.float32([[1, 2, 3, 0], [10, 0, 0, 0], [7, 7, 7, 7]])
  m = np.float32([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])   # episode 2: no agent token
  agg = jax.jit(aggregate, static_argnames="aggregation")
  # token: (1 + 2 + 3 + 10) / 4 = 4;  sequence: (mean(1, 2, 3) + 10) / 2 = 6 (episode 2 excluded)
  np.testing.assert_allclose(agg(x, m, None, aggregation="token"), 4.0)
  np.testing.assert_allclose(agg(x, m, None, aggregation="sequence"), 6.0)
  w = np.float32([1, 0, 1])                                        # the group filter drops ep. 1
  np.testing.assert_allclose(agg(x, m, w, aggregation="token"), 2.0)
  np.testing.assert_allclose(agg(x, m, w, aggregation="sequence"), 2.0)
  # nothing left: 0, not NaN
  np.testing.assert_allclose(agg(x, m, np.zeros(3, np.float32), aggregation="token"), 0.0)
  np.testing.assert_allclose(agg(x, m, np.zeros(3, np.float32), aggregation="sequence"), 0.0)
  # the policy loss uses the same aggregation
  loss, _ = _loss(logp=x, behaviour_logp=x, advantages=np.float32([-1, -1, -1]), loss_mask=m,
                  loss="reinforce", aggregation="sequence")
  np.testing.assert_allclose(loss, 6.0)


def test_unknown_names():
  z = np.zeros((1, 2), np.float32)
  with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*ppo_clip, reinforce"):
    policy_loss(z, z, np.zeros(1, np.float32), z, loss="ppo", aggregation="token", **KNOBS)
  with pytest.raises(ValueError, match="unknown KL estimator 'k2'.*k1, k3"):
    policy_loss(z, z, np.zeros(1, np.float32), z, loss="reinforce", aggregation="token",
                ref_logp=z, **{**KNOBS, "kl_estimator": "k2"})
  with pytest.raises(ValueError, match="unknown aggregation 'episode'.*token, sequence"):
    policy_loss(z, z, np.zeros(1, np.float32), z, loss="reinforce", aggregation="episode",
                **KNOBS)
  with pytest.raises(ValueError, match="already registered"):
    loss_lib.register_policy_loss("reinforce")(loss_lib.reinforce_loss)


def test_entropy_of_a_known_distribution(small_model):
  # A decoder whose output is known in closed form: every layer's output projections are 0, so
  # the residual stream is the embedding; the next-token logits after token t are
  # rmsnorm(E[t]) . E[v] (tied). With E[t] = c * u_t for unit vectors u_t in 2-D:
  # rmsnorm(c u) = sqrt(2) u, so logits_v = sqrt(2) c (u_t . u_v).
  cfg = dataclasses.replace(small_model, vocab_size=4, hidden_size=2, intermediate_size=2,
                            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)
  params = jax.tree.map(jnp.zeros_like, decoder.init_params(cfg, 0))
  params["layers"]["attn_norm"] = jnp.ones_like(params["layers"]["attn_norm"])
  params["layers"]["mlp_norm"] = jnp.ones_like(params["layers"]["mlp_norm"])
  params["final_norm"] = jnp.ones_like(params["final_norm"])
  c = 1.5
  u = np.float32([[1, 0], [0, 1], [-1, 0], [0, -1]])
  params["embed"] = jnp.asarray(c * u)
  tokens = np.int32([[0, 1, 2, 3, 0, 0]])
  length = np.int32([5])
  temperature = 0.7
  fn = jax.jit(token_logprobs_and_entropy, static_argnames=("cfg", "chunk"))
  lp, ent = fn(cfg, params, tokens, length, temperature, chunk=2)   # chunks: 5 = 2 + 2 + 1 (pad)

  expected_lp, expected_ent = np.zeros((1, 6)), np.zeros((1, 6))
  for i in range(1, 5):
    logits = np.sqrt(2) * c * (u @ u[tokens[0, i - 1]]) / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    expected_lp[0, i] = np.log(p[tokens[0, i]])
    expected_ent[0, i] = -(p * np.log(p)).sum()
  np.testing.assert_allclose(lp, expected_lp, atol=1e-5)
  np.testing.assert_allclose(ent, expected_ent, atol=1e-5)
  # identical log-probs to token_logprobs (same chunked pass)
  np.testing.assert_array_equal(lp, jax.jit(token_logprobs, static_argnames=("cfg", "chunk"))(
      cfg, params, tokens, length, temperature, chunk=2))
  # all-zero embeddings: uniform over V = 4, entropy log 4 at every scored position
  params["embed"] = jnp.zeros_like(params["embed"])
  lp, ent = fn(cfg, params, tokens, length, temperature, chunk=2)
  np.testing.assert_allclose(ent[0, 1:5], np.log(4), rtol=1e-6)
  np.testing.assert_allclose(lp[0, 1:5], -np.log(4), rtol=1e-6)
  assert float(ent[0, 0]) == 0.0 and float(ent[0, 5]) == 0.0
