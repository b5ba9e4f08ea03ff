"""Turn-level credit (jaxagent.learners.credit): per-turn and process rewards, returns, anchor
groups, the gigpo and per_turn estimators against plain loop implementations, token mapping, and
the update wired to them."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxagent.learners import credit
from jaxagent.learners.rewards import episode_rewards
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import decoder
from jaxagent.models.scoring import token_logprobs


def _random_turns(seed, b=12, t=5, states=3, groups=3):
  rng = np.random.default_rng(seed)
  num_turns = rng.integers(1, t + 1, (b,))
  acted = np.arange(t)[None, :] < num_turns[:, None]
  r = np.where(acted, rng.normal(size=(b, t)).round(1), 0.0).astype(np.float32)
  state_id = rng.integers(0, states, (b, t, 2)).astype(np.uint32)
  state_id[..., 1] = state_id[..., 0] * 7          # two words, one state
  group = np.repeat(np.arange(groups), b // groups).astype(np.int32)
  return r, acted, state_id, group


def _returns(r, gamma):
  g = np.zeros_like(r, dtype=np.float64)
  for b in range(r.shape[0]):
    acc = 0.0
    for t in reversed(range(r.shape[1])):
      acc = r[b, t] + gamma * acc
      g[b, t] = acc
  return g


def _normalise(values, normalize_std, eps):
  """A list of (key, value): each value minus its key's mean (/ std + eps); 0 alone."""
  out = []
  for k, v in values:
    same = np.array([x for kk, x in values if kk == k])
    if len(same) < 2:
      out.append(0.0)
      continue
    d = v - same.mean()
    out.append(d / (same.std() + eps) if normalize_std else d)
  return out


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_returns_to_go(gamma):
  r, _, _, _ = _random_turns(0)
  np.testing.assert_allclose(credit.returns_to_go(jnp.asarray(r), gamma), _returns(r, gamma),
                             rtol=1e-5, atol=1e-6)


def test_anchor_groups_share_an_id_iff_same_group_and_state():
  r, acted, state_id, group = _random_turns(1, b=16, t=6, states=2, groups=4)
  seg = np.asarray(credit.anchor_groups(jnp.asarray(group), jnp.asarray(state_id),
                                        jnp.asarray(acted)))
  b, t = acted.shape
  flat_g = np.repeat(group, t)
  flat_s = state_id.reshape(-1, 2)
  flat_a = acted.reshape(-1)
  n = b * t
  want = np.eye(n, dtype=bool) | (flat_a[:, None] & flat_a[None, :]
                                  & (flat_g[:, None] == flat_g[None, :])
                                  & (flat_s[:, None] == flat_s[None, :]).all(-1))
  np.testing.assert_array_equal(seg[:, None] == seg[None, :], want)
  assert (want & ~np.eye(n, dtype=bool)).any()     # some steps do share a state
  assert seg.min() >= 0 and seg.max() < n


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gigpo_matches_a_loop_implementation(normalize_std, gamma):
  eps, w = 1e-6, 0.7
  r, acted, state_id, group = _random_turns(2, states=12)
  adv, metrics = credit.compute_turn_advantages(
      "gigpo", r, acted, state_id, group, num_groups=len(group), normalize_std=normalize_std,
      eps=eps, gamma=gamma, step_weight=w)
  g = _returns(r, gamma)
  b, t = acted.shape
  ep = _normalise([(group[i], g[i, 0]) for i in range(b)], normalize_std, eps)
  steps = [(i, j) for i in range(b) for j in range(t) if acted[i, j]]
  keyed = [((group[i], tuple(state_id[i, j])), g[i, j]) for i, j in steps]
  st = dict(zip(steps, _normalise(keyed, normalize_std, eps)))
  want = np.zeros((b, t))
  for (i, j), v in st.items():
    want[i, j] = ep[i] + w * v
  np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)
  sizes = [sum(1 for k2, _ in keyed if k2 == k) for k, _ in keyed]
  assert float(metrics["anchor_group_size"]) == pytest.approx(np.mean(sizes), rel=1e-6)
  assert float(metrics["anchor_shared_fraction"]) == pytest.approx(np.mean(np.array(sizes) > 1))
  assert 0 < float(metrics["anchor_shared_fraction"]) < 1


@pytest.mark.parametrize("normalize_std", [True, False])
def test_per_turn_matches_a_loop_implementation(normalize_std):
  eps, gamma = 1e-6, 0.9
  r, acted, state_id, group = _random_turns(3)
  adv, _ = credit.compute_turn_advantages("per_turn", r, acted, state_id, group,
                                          num_groups=len(group), normalize_std=normalize_std,
                                          eps=eps, gamma=gamma)
  g = _returns(r, gamma)
  b, t = acted.shape
  steps = [(i, j) for i in range(b) for j in range(t) if acted[i, j]]
  vals = _normalise([((group[i], j), g[i, j]) for i, j in steps], normalize_std, eps)
  want = np.zeros((b, t))
  for (i, j), v in zip(steps, vals):
    want[i, j] = v
  np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)


def test_per_turn_by_hand():
  """Two episodes of one task: rewards [1, 0] and [0, 1], both acted twice, gamma 0.5.
  Returns: [1, 0] and [0.5, 1]. Turn 0: 1 vs 0.5 -> +0.25, -0.25; turn 1: 0 vs 1 -> -0.5, +0.5."""
  r = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  acted = np.ones((2, 2), bool)
  adv, _ = credit.compute_turn_advantages("per_turn", r, acted, np.zeros((2, 2, 2), np.uint32),
                                          np.zeros((2,), np.int32), num_groups=2,
                                          normalize_std=False, gamma=0.5)
  np.testing.assert_allclose(adv, [[0.25, -0.5], [-0.25, 0.5]])


def test_unknown_turn_estimator_is_named():
  with pytest.raises(ValueError, match="gigpo"):
    credit.compute_turn_advantages("nope", np.zeros((1, 1)), np.ones((1, 1), bool),
                                   np.zeros((1, 1, 2), np.uint32), np.zeros((1,), np.int32),
                                   num_groups=1)
  with pytest.raises(ValueError, match="per_turn"):
    LearnerConfig(advantage="nope")


def test_token_advantages_follow_turn_of_token():
  adv = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  turn = jnp.array([[-1, 0, 0, 1, 2, -1], [-1, -1, 2, 2, 1, 0]])
  np.testing.assert_array_equal(credit.token_advantages(adv, turn),
                                [[0, 1, 1, 2, 3, 0], [0, 0, 6, 6, 5, 4]])


def _trajectory(make_trajectory, cfg, params, seed, b=8, l=16, t=3):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.vocab_size, (b, l)).astype(np.int32)
  length = np.full((b,), l, np.int32)
  turn = np.full((b, l), -1, np.int32)
  mask = np.zeros((b, l), np.float32)
  for j in range(t):                           # turn j: action at 3+4j..4+4j, obs after
    turn[:, 3 + 4 * j:7 + 4 * j] = j
    mask[:, 3 + 4 * j:5 + 4 * j] = 1
  num_turns = rng.integers(1, t + 1, (b,))
  acted = np.arange(t)[None, :] < num_turns[:, None]
  mask *= (turn < num_turns[:, None]) & (turn >= 0)
  turn = np.where(turn < num_turns[:, None], turn, -1)
  valid = rng.random((b, t)) < 0.7
  solved = np.zeros((b, t), bool)
  solved[np.arange(b), num_turns - 1] = rng.random(b) < 0.5
  behaviour = np.asarray(token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(length)))
  return make_trajectory(
      tokens=tokens, length=length, loss_mask=mask, acted=acted, valid_call=valid & acted,
      solved=solved, num_turns=num_turns, group_id=np.repeat(np.arange(b // 4), 4),
      behaviour_logprobs=behaviour * mask, turn_of_token=turn,
      oracle_match=(rng.random((b, t)) < 0.5) & acted,
      state_id=rng.integers(0, 2, (b, t, 2)).astype(np.uint32))


def test_turn_rewards_sum_to_the_episode_reward_plus_process_terms(make_trajectory, small_model):
  params = decoder.init_params(small_model, 0)
  traj = _trajectory(make_trajectory, small_model, params, 0)
  outcome = dict(success_reward=1.0, invalid_call_penalty=0.3, turn_cost=0.05)
  r = credit.turn_rewards(traj, **outcome)
  np.testing.assert_allclose(r.sum(1), episode_rewards(traj, **outcome), rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(r)[~np.asarray(traj.acted)] == 0)
  proc = dict(process_valid_call=0.1, process_oracle_match=0.2, process_error=0.4)
  a = np.asarray(traj.acted)
  want = (0.1 * (a & np.asarray(traj.valid_call)) + 0.2 * (a & np.asarray(traj.oracle_match))
          - 0.4 * (a & (np.asarray(traj.error_kind) != 0))).sum(1)
  np.testing.assert_allclose(credit.process_rewards(traj, **proc), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(credit.turn_rewards(traj, **outcome, **proc).sum(1),
                             episode_rewards(traj, **outcome) + want, rtol=1e-6, atol=1e-6)
  # Zero process weights: the per-episode reward is exactly the outcome's.
  zero = dict(process_valid_call=0.0, process_oracle_match=0.0, process_error=0.0)
  np.testing.assert_array_equal(credit.process_rewards(traj, **zero), np.zeros(8))


@pytest.mark.slow   # compiles the decoder's gradient three times
def test_update_with_turn_level_credit(make_trajectory, small_model):
  """gigpo with step_weight 0 (and gamma 1) is GRPO spread over the turns: the same update as
  grpo's through the per-token path. A nonzero step weight or process rewards change it."""
  traj = _trajectory(make_trajectory, small_model,
                     decoder.init_params(small_model, 0), 1)
  base = dict(loss="ppo_clip", learning_rate=1e-2, minibatches=2, kl_coef=0.0)

  def run(**kw):
    cfg = LearnerConfig(**base, **kw)
    opt = cfg.make_optimizer()
    state = init_train_state(decoder.init_params(small_model, 0), opt, jax.random.key(0))
    return make_update_fn(cfg, small_model, opt)(state, traj)

  s_grpo, m_grpo = run(advantage="grpo")
  s_zero, m_zero = run(advantage="gigpo", step_weight=0.0)
  for a, b in zip(jax.tree.leaves(s_grpo.params), jax.tree.leaves(s_zero.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert float(m_zero["reward_mean"]) == pytest.approx(float(m_grpo["reward_mean"]), abs=1e-7)
  s_step, m_step = run(advantage="gigpo", step_weight=1.0)
  assert 0 < float(m_step["anchor_shared_fraction"]) <= 1
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(s_grpo.params), jax.tree.leaves(s_step.params)))
  assert diff > 1e-5
  _, m_proc = run(advantage="grpo", process_valid_call=0.5)
  a = np.asarray(traj.acted) & np.asarray(traj.valid_call)
  assert float(m_proc["reward_mean"]) == pytest.approx(
      float(m_grpo["reward_mean"]) + 0.5 * a.sum() / a.shape[0], rel=1e-5)
