"""Episode rewards from a hand-built Trajectory, and the equal-reward group filter."""

import numpy as np
import jax
import pytest

from jaxagent.learners import episode_rewards, equal_group_mask


def test_episode_rewards_by_hand(make_trajectory):
  T = [True, True, True]
  traj = make_trajectory(
      tokens=np.zeros((3, 8)), length=[8, 8, 4], loss_mask=np.zeros((3, 8)),
      #      episode 0: solved at turn 2 after one invalid call; 2 turns
      #      episode 1: unsolved, 2 invalid calls in 3 turns
      #      episode 2: never acted (budget 0): the False valid_call flags must not count
      acted=[[True, True, False], T, [False] * 3],
      valid_call=[[False, True, False], [False, False, True], [False] * 3],
      solved=[[False, True, False], [False] * 3, [False] * 3],
      num_turns=[2, 3, 0], group_id=[0, 0, 1])
  fn = jax.jit(episode_rewards, static_argnames=("success_reward", "invalid_call_penalty",
                                                  "turn_cost"))
  r = fn(traj, success_reward=1.0, invalid_call_penalty=0.1, turn_cost=0.05)
  # 1 - 0.1 * 1 - 0.05 * 2 = 0.8;  0 - 0.1 * 2 - 0.05 * 3 = -0.35;  0
  np.testing.assert_allclose(r, [0.8, -0.35, 0.0], atol=1e-6)
  assert r.dtype == np.float32 and r.shape == (3,)
  r = fn(traj, success_reward=2.0, invalid_call_penalty=0.0, turn_cost=0.0)
  np.testing.assert_allclose(r, [2.0, 0.0, 0.0])


@pytest.mark.parametrize("rewards, groups, expected", [
    # group 0 mixed, group 1 all equal, group 2 a single episode (trivially all equal)
    ([1., 2., 0., 2., 5.], [0, 1, 0, 1, 2], [1, 0, 1, 0, 0]),
    ([0., 0., 0., 0.], [0, 0, 1, 1], [0, 0, 0, 0]),
    ([0., 1., 1., 1.], [0, 0, 0, 0], [1, 1, 1, 1]),
])
def test_equal_group_mask(rewards, groups, expected):
  m = jax.jit(equal_group_mask, static_argnums=2)(np.float32(rewards), np.int32(groups), 4)
  np.testing.assert_array_equal(m, np.float32(expected))
  assert m.dtype == np.float32
