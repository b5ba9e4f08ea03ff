"""The jitted RL update: structure, finiteness, optimizer-step counts, no retracing, determinism,
learning progress on a repeated batch, the KL reference and the group filter; the config and the
optimizer."""

import dataclasses

import chex
import ml_collections
import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest

from jaxagent.learners import update as update_lib
from jaxagent.learners.update import (LearnerConfig, current_learning_rate, init_train_state,
                                      make_optimizer, make_update_fn)
from jaxagent.models import decoder
from jaxagent.models.scoring import token_logprobs

B, L, T = 8, 16, 2
METRICS = {"pg_loss", "kl", "entropy", "clip_fraction", "approx_kl", "ratio_mean", "loss",
           "grad_norm", "learning_rate", "reward_mean", "reward_std", "advantage_mean",
           "advantage_abs_mean", "kept_fraction"}


def _params(cfg):
  return decoder.init_params(cfg, 0)     # fresh buffers each time: the update donates its state


def _finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.slow   # compiles the decoder's gradient (most of the time)
def test_update_structure_steps_no_retrace_determinism_and_progress(make_batch, small_model,
                                                                    monkeypatch):
  """One compiled update (compiling is the slow part on CPU) checked on every count."""
  # Counts traces of the update: episode_rewards is called exactly once per trace.
  monkeypatch.setattr(update_lib, "episode_rewards",
                      chex.assert_max_traces(update_lib.episode_rewards, n=1))
  cfg = LearnerConfig(epochs=2, minibatches=2, learning_rate=1e-2, warmup_steps=8,
                      clip_eps_high=0.28)
  opt = cfg.make_optimizer()
  update = make_update_fn(cfg, small_model, opt)
  params = _params(small_model)
  # groups {0,1} {4,5} mixed, {2,3} both solved, {6,7} both failed: rewards mean 1/2, GRPO
  # advantages +-0.5 / (0.5 + eps) in the mixed groups and 0 in the others -> mean |A| = 1/2
  traj1 = make_batch(small_model, params, 0, solved_rows=(0, 2, 3, 4))
  traj2 = make_batch(small_model, params, 1, solved_rows=(1, 2, 5, 7))
  state = init_train_state(params, opt, jax.random.key(0))
  structure = jax.tree.structure(state)
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)

  state, m = update(state, traj1, None)
  assert jax.tree.structure(state) == structure
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
  assert set(m) == METRICS and all(v.shape == () for v in m.values())
  assert _finite(state) and _finite(m)
  # 2 epochs x 2 minibatches = 4 optimizer steps; every optax counter agrees
  assert int(state.step) == 4 and state.step.dtype == jnp.int32
  counts = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
  assert len(counts) >= 2 and all(int(c) == 4 for _, c in counts)
  # warmup over 8 steps: the last of steps 0..3 ran at lr * 4 / 8
  np.testing.assert_allclose(m["learning_rate"], 1e-2 * 4 / 8, rtol=1e-6)
  np.testing.assert_allclose(m["reward_mean"], 0.5)
  np.testing.assert_allclose(m["advantage_abs_mean"], 0.5 * 0.5 / (0.5 + 1e-6), rtol=1e-5)
  np.testing.assert_allclose(m["advantage_mean"], 0.0, atol=1e-6)
  np.testing.assert_allclose(m["kept_fraction"], 1.0)
  assert float(m["grad_norm"]) > 0 and float(m["kl"]) == 0.0      # no reference: kl reads 0

  state, m = update(state, traj2, None)                           # new values, same shapes
  assert int(state.step) == 8
  assert all(int(c) == 8 for _, c in optax.tree_utils.tree_get_all_with_path(state.opt_state,
                                                                             "count"))
  np.testing.assert_allclose(m["learning_rate"], 1e-2, rtol=1e-6)
  np.testing.assert_allclose(current_learning_rate(state.opt_state), 1e-2, rtol=1e-6)
  assert _finite(state) and _finite(m)

  # Deterministic given the key; another key draws other minibatches.
  def first(seed):
    return update(init_train_state(_params(small_model), opt, jax.random.key(seed)), traj1,
                  None)[0]
  s_a, s_b, s_c = first(0), first(0), first(1)
  chex.assert_trees_all_equal(s_a.params, s_b.params)
  assert not all(bool(jnp.array_equal(a, b))
                 for a, b in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_c.params)))

  # On a repeated batch the surrogate loss goes down (each call's loss is a mean over random
  # minibatches, hence the average of the last three), and the policy moves towards the
  # successes: the log-probs of the agent's tokens rise in the solved episodes of the mixed groups
  # (rows 0, 4: A > 0) and fall in the failed ones (rows 1, 5: A < 0).
  state = init_train_state(_params(small_model), opt, jax.random.key(2))
  losses = []
  for _ in range(6):
    state, m = update(state, traj1, None)
    losses.append(float(m["loss"]))
  assert np.mean(losses[3:]) < losses[0] - 0.02, losses
  assert int(state.step) == 24
  assert update._cache_size() == 1                                # one compiled program
  new_lp = np.asarray(token_logprobs(small_model, state.params, traj1.tokens, traj1.length))
  mask = np.asarray(traj1.loss_mask)
  delta = ((new_lp - np.asarray(traj1.behaviour_logprobs)) * mask).sum(1) / mask.sum(1)
  assert delta[0] > 0.05 and delta[4] > 0.05, delta
  assert delta[1] < -0.05 and delta[5] < -0.05, delta


@pytest.mark.slow   # compiles the decoder's gradient (most of the time)
def test_kl_reference_and_group_filter(make_batch, small_model):
  cfg = LearnerConfig(loss="reinforce", aggregation="sequence", kl_coef=0.1, kl_estimator="k3",
                      filter_equal_groups=True, entropy_coef=0.01, learning_rate=1e-2,
                      schedule="cosine", warmup_steps=1, end_lr_ratio=0.1)
  opt = cfg.make_optimizer(total_steps=3)
  update = make_update_fn(cfg, small_model, opt)
  ref = _params(small_model)
  state = init_train_state(_params(small_model), opt, jax.random.key(0))
  before = jax.tree.map(np.asarray, state.params)

  # every group all-solved or all-failed: nothing to learn, everything filtered, params unchanged
  flat = make_batch(small_model, ref, 0, solved_rows=(0, 1, 6, 7))
  state, m = update(state, flat, ref)
  assert float(m["kept_fraction"]) == 0.0 and float(m["loss"]) == 0.0
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state.params), before)
  np.testing.assert_allclose(m["learning_rate"], 1e-2 * 1 / 1)   # warmup step 0: lr * 1/1

  mixed = make_batch(small_model, ref, 1, solved_rows=(0, 3, 5))
  state, m = update(state, mixed, ref)
  # groups 0, 1, 2 mixed; group 3 (rows 6, 7) all failed -> 3/4 kept
  np.testing.assert_allclose(m["kept_fraction"], 0.75)
  np.testing.assert_allclose(m["kl"], 0.0, atol=1e-6)           # params still equal the reference
  assert float(m["entropy"]) > 0
  # cosine step 1 of 3 (warmup 1): p = 0 -> lr
  np.testing.assert_allclose(m["learning_rate"], 1e-2, rtol=1e-6)
  state, m = update(state, mixed, ref)
  assert float(m["kl"]) > 1e-6                                  # moved away from the reference
  # step 2: p = 1/2 -> lr * (0.1 + 0.9 * 0.5)
  np.testing.assert_allclose(m["learning_rate"], 1e-2 * 0.55, rtol=1e-5)
  assert _finite(state) and _finite(m)


def test_reference_offloaded_to_host_gives_the_same_update(make_batch, small_model):
  """rl.reference_on_host: the frozen reference lives in pinned host memory between updates;
  the update moves it to the device for its reference pass and computes exactly the same."""
  cfg = LearnerConfig(kl_coef=0.2, kl_estimator="k3", learning_rate=1e-2)
  opt = cfg.make_optimizer(total_steps=4)
  update = make_update_fn(cfg, small_model, opt)
  ref = _params(small_model)
  host_ref = update_lib.offload_to_host(_params(small_model))
  assert update_lib.on_host(host_ref) and not update_lib.on_host(ref)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(host_ref)} == {"pinned_host"}
  batch = make_batch(small_model, ref, 1, solved_rows=(0, 3, 5))
  out = {}
  for name, r in (("device", ref), ("host", host_ref)):
    state = init_train_state(_params(small_model), opt, jax.random.key(0))
    for _ in range(2):                                   # the second step has kl > 0
      state, m = update(state, batch, r)
    out[name] = (jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, m))
  assert float(out["host"][1]["kl"]) > 1e-6
  chex.assert_trees_all_close(out["host"], out["device"], rtol=1e-6, atol=1e-7)
  assert update_lib.on_host(host_ref)                    # still on the host after the updates


def test_update_errors(make_batch, small_model):
  traj = make_batch(small_model, _params(small_model), 0, solved_rows=(0,))
  cfg = LearnerConfig(minibatches=3)
  opt = cfg.make_optimizer()
  with pytest.raises(ValueError, match="not divisible into 3 minibatches"):
    make_update_fn(cfg, small_model, opt)(init_train_state(_params(small_model), opt,
                                                           jax.random.key(0)), traj, None)
  cfg = LearnerConfig(kl_coef=0.1)
  with pytest.raises(ValueError, match="kl_coef=0.1 needs reference parameters"):
    make_update_fn(cfg, small_model, opt)(init_train_state(_params(small_model), opt,
                                                           jax.random.key(0)), traj, None)


def test_config_from_dict_and_config_dict():
  cfg = LearnerConfig.from_config({"advantage": "rloo", "epochs": 2, "clip_eps_high": 0.28,
                                   "learning_rate": 1})       # an int for a float is fine
  assert cfg.advantage == "rloo" and cfg.epochs == 2 and cfg.learning_rate == 1.0
  assert cfg == dataclasses.replace(LearnerConfig(), advantage="rloo", epochs=2,
                                    clip_eps_high=0.28, learning_rate=1.0)
  cd = ml_collections.ConfigDict({"loss": "reinforce", "aggregation": "sequence"})
  assert LearnerConfig.from_config(cd).loss == "reinforce"
  hash(cfg)                                                    # usable as a static argument


@pytest.mark.parametrize("bad, message", [
    ({"advantages": "grpo"}, r"unknown keys \['advantages'\]; valid keys: .*advantage"),
    ({"advantage": "gae"}, r"unknown advantage 'gae'; valid: gigpo, grpo, per_turn, reinforce, rloo"),
    ({"loss": "ppo"}, r"unknown loss 'ppo'; valid: ppo_clip, reinforce"),
    ({"kl_estimator": "k2"}, r"unknown kl_estimator 'k2'; valid: k1, k3"),
    ({"aggregation": "episode"}, r"unknown aggregation 'episode'; valid: sequence, token"),
    ({"schedule": "linear"}, r"unknown schedule 'linear'; valid: constant, cosine"),
    ({"epochs": 0}, r"epochs must be >= 1"),
    ({"epochs": 1.5}, r"epochs must be a int"),
    ({"normalize_std": 1}, r"normalize_std must be a bool"),
    ({"clip_eps_low": 1.0}, r"0 <= clip_eps_low < 1"),
])
def test_config_rejects(bad, message):
  with pytest.raises(ValueError, match=message):
    LearnerConfig.from_config(bad)


def test_lr_schedules_by_hand():
  const = update_lib.lr_schedule_fn(1.0, schedule="constant", warmup_steps=4, total_steps=0,
                                    end_lr_ratio=0.0)
  np.testing.assert_allclose([const(t) for t in (0, 1, 3, 10)], [0.25, 0.5, 1.0, 1.0])
  flat = update_lib.lr_schedule_fn(0.3, schedule="constant", warmup_steps=0, total_steps=0,
                                   end_lr_ratio=0.0)
  np.testing.assert_allclose([flat(t) for t in (0, 1, 1000)], [0.3, 0.3, 0.3], rtol=1e-6)
  cos = update_lib.lr_schedule_fn(2.0, schedule="cosine", warmup_steps=2, total_steps=6,
                                  end_lr_ratio=0.1)
  # warmup 1, 2; then p = (t - 2) / 4: t=2 -> 2; t=4 -> 2 (0.1 + 0.9 * 0.5) = 1.1; t>=6 -> 0.2
  np.testing.assert_allclose([cos(t) for t in (0, 1, 2, 4, 6, 50)], [1, 2, 2, 1.1, 0.2, 0.2],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="total_steps > warmup_steps"):
    make_optimizer(learning_rate=1.0, schedule="cosine", warmup_steps=5, total_steps=5,
                   end_lr_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0, b1=0.9, b2=0.999,
                   eps=1e-8)


def test_optimizer_weight_decay_mask_and_clipping():
  params = {"layers": {"q_proj": jnp.ones((2, 2)), "q_bias": jnp.ones((2,)),
                       "attn_norm": jnp.ones((2,))}, "embed": jnp.ones((3, 2))}
  opt = make_optimizer(learning_rate=0.1, schedule="constant", warmup_steps=0, total_steps=0,
                       end_lr_ratio=0.0, weight_decay=0.5, max_grad_norm=1.0, b1=0.9, b2=0.999,
                       eps=1e-8)
  state = opt.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(opt.update)(zeros, state, params)
  # zero gradients: only the decoupled decay -lr * wd * p = -0.05, not on norms/biases
  np.testing.assert_allclose(updates["layers"]["q_proj"], -0.05)
  np.testing.assert_allclose(updates["embed"], -0.05)
  np.testing.assert_allclose(updates["layers"]["q_bias"], 0.0)
  np.testing.assert_allclose(updates["layers"]["attn_norm"], 0.0)
  # clipping: a gradient of global norm 10 reaches Adam scaled to norm 1 (first-moment check)
  g = jax.tree.map(lambda x: jnp.full_like(x, 10.0 / np.sqrt(12.0)), params)   # 12 entries
  _, state = opt.update(g, opt.init(params), params)
  mu = optax.tree_utils.tree_get(state, "mu")
  np.testing.assert_allclose(optax.tree.norm(mu), 0.1 * 1.0, rtol=1e-5)      # (1 - b1) * 1


def test_bfloat16_ratio_starts_at_one_with_recomputed_old_logprobs(make_batch, small_model):
  """In bfloat16 the rollout's log-probs (here: float32 ones, rounded otherwise) differ from the
  update's own forward; "auto" recomputes the old log-probs there, so the first step's ratio is
  exactly 1 and the gap is reported; "rollout" keeps the rollout's, and its ratio is off 1."""
  bf16 = dataclasses.replace(small_model, dtype="bfloat16")         # float32 master weights
  params = _params(bf16)
  batch = make_batch(small_model, params, 1, solved_rows=(0, 3, 5))
  mask = np.asarray(batch.loss_mask)
  own = np.asarray(token_logprobs(bf16, params, batch.tokens, batch.length))
  want_gap = np.sum(np.abs(own - np.asarray(batch.behaviour_logprobs)) * mask) / mask.sum()
  assert want_gap > 1e-4                                  # the rounding this test is about
  out = {}
  for mode in ("auto", "rollout"):
    cfg = LearnerConfig(learning_rate=1e-3, behaviour_logprobs=mode)
    opt = cfg.make_optimizer(total_steps=1)
    state = init_train_state(_params(bf16), opt, jax.random.key(0))
    _, out[mode] = make_update_fn(cfg, bf16, opt)(state, batch)
  np.testing.assert_allclose(out["auto"]["ratio_mean"], 1.0, atol=1e-6)
  np.testing.assert_allclose(out["auto"]["behaviour_logprob_gap"], want_gap, rtol=1e-4)
  assert abs(float(out["rollout"]["ratio_mean"]) - 1.0) > 1e-5
  assert "behaviour_logprob_gap" not in out["rollout"]
  # float32: "auto" keeps the rollout's log-probs (they agree to ~1e-6).
  cfg = LearnerConfig(learning_rate=1e-3)
  opt = cfg.make_optimizer(total_steps=1)
  _, m = make_update_fn(cfg, small_model, opt)(
      init_train_state(_params(small_model), opt, jax.random.key(0)), batch)
  assert "behaviour_logprob_gap" not in m
  with pytest.raises(ValueError, match="behaviour_logprobs 'sometimes'"):
    LearnerConfig(behaviour_logprobs="sometimes")
