"""Advantage estimators on groups worked out by hand, the registry, and a loop reference."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from jaxagent.learners import advantages as adv_lib
from jaxagent.learners import compute_advantages

# Group 0 = episodes {0, 2, 3, 5} with rewards [1, 0, 0, 0]; group 1 = {1, 4} with [2, 2]
# (interleaved ids, and num_groups an upper bound with empty groups, on purpose).
REWARDS = np.array([1., 2., 0., 0., 2., 0.], np.float32)
GROUPS = np.array([0, 1, 0, 0, 1, 0], np.int32)


def test_grpo_group_by_hand():
  # group 0: mean 1/4; population std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875) = 0.4330127
  # -> A = 0.75 / 0.4330127 = 1.7320508 (= sqrt 3) and -0.25 / 0.4330127 = -0.5773503 (= -1/sqrt 3)
  # group 1: equal rewards -> 0 / (0 + eps) = 0
  fn = jax.jit(compute_advantages, static_argnames=("name", "num_groups", "normalize_std"))
  a = fn("grpo", REWARDS, GROUPS, num_groups=6)
  s3 = np.sqrt(3.0)
  np.testing.assert_allclose(a, [s3, 0, -1 / s3, -1 / s3, 0, -1 / s3], rtol=1e-5, atol=1e-6)
  a = fn("grpo", REWARDS, GROUPS, num_groups=6, normalize_std=False)
  np.testing.assert_allclose(a, [0.75, 0, -0.25, -0.25, 0, -0.25], atol=1e-7)


def test_rloo_by_hand():
  # group 0 [1, 0, 0, 0]: A_0 = 1 - (0+0+0)/3 = 1; A_i = 0 - (1+0+0)/3 = -1/3.
  # group 1 [3, 1]: A = 3 - 1 = 2, 1 - 3 = -2.  group 2 [5] alone: no baseline -> 0.
  r = np.array([1., 3., 0., 0., 1., 0., 5.], np.float32)
  g = np.array([0, 1, 0, 0, 1, 0, 2], np.int32)
  a = jax.jit(compute_advantages, static_argnames=("name", "num_groups"))("rloo", r, g, num_groups=3)
  np.testing.assert_allclose(a, [1, 2, -1 / 3, -1 / 3, -2, -1 / 3, 0], rtol=1e-6, atol=1e-7)
  # normalize_std does not apply to rloo
  a2 = compute_advantages("rloo", r, g, num_groups=3, normalize_std=False)
  np.testing.assert_allclose(a, a2)


def test_reinforce_batch_baseline_by_hand():
  # mean 1 -> A = r - 1 = [0, -1, -1, 2]; std = sqrt((0 + 1 + 1 + 4) / 4) = sqrt(1.5); groups ignored.
  r = np.array([1., 0., 0., 3.], np.float32)
  g = np.array([0, 0, 1, 1], np.int32)
  a = compute_advantages("reinforce", r, g, num_groups=2, normalize_std=False)
  np.testing.assert_allclose(a, [0, -1, -1, 2], atol=1e-7)
  a = compute_advantages("reinforce", r, g, num_groups=2)
  np.testing.assert_allclose(a, np.array([0, -1, -1, 2]) / np.sqrt(1.5), rtol=1e-5)


def test_unknown_name_lists_registered():
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, reinforce, rloo"):
    compute_advantages("ppo", REWARDS, GROUPS, num_groups=2)


def test_register_custom_estimator():
  @adv_lib.register_advantage("test_raw")
  def raw(rewards, group_id, *, num_groups, normalize_std, eps):
    return rewards * 2
  try:
    np.testing.assert_allclose(compute_advantages("test_raw", REWARDS, GROUPS, num_groups=2),
                               2 * REWARDS)
    with pytest.raises(ValueError, match="already registered"):
      adv_lib.register_advantage("test_raw")(raw)
  finally:
    del adv_lib.ADVANTAGE_ESTIMATORS["test_raw"]


def _loop_reference(name, r, g, normalize_std, eps=1e-6):
  out = np.zeros_like(r)
  for i in range(len(r)):
    grp = r[g == g[i]]
    if name == "grpo":
      out[i] = (r[i] - grp.mean()) / ((grp.std() + eps) if normalize_std else 1.0)
    else:
      out[i] = 0.0 if len(grp) == 1 else r[i] - (grp.sum() - r[i]) / (len(grp) - 1)
  return out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=8, max_size=8),
       st.lists(st.integers(0, 4), min_size=8, max_size=8),
       st.sampled_from(["grpo", "rloo"]), st.booleans())
def test_matches_loop_reference(rewards, groups, name, normalize_std):
  r = np.asarray(rewards, np.float32)
  g = np.asarray(groups, np.int32)
  a = compute_advantages(name, jnp.asarray(r), jnp.asarray(g), num_groups=8,
                         normalize_std=normalize_std)
  np.testing.assert_allclose(a, _loop_reference(name, r, g, normalize_std), rtol=1e-4, atol=1e-5)
  # a group baseline: advantages sum to zero within each group
  for gid in np.unique(g):
    assert abs(float(np.sum(np.asarray(a)[g == gid]))) < 1e-3
