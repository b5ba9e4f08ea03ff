"""Pass@(K,T): the vectorised estimator against brute-force enumeration of K-subsets."""

import itertools

import numpy as np
import pytest

from jaxagent.eval import pass_at_kt as pk


def _brute(success_turn, k, t):
  """Mean over tasks of the fraction of K-subsets of episodes with one solved within T."""
  vals = []
  for row in success_turn:
    subsets = list(itertools.combinations(range(len(row)), k))
    vals.append(np.mean([any(row[i] <= t for i in s) for s in subsets]))
  return float(np.mean(vals))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_grid_equals_enumeration(seed):
  rng = np.random.default_rng(seed)
  tasks, n, t_max = 5, 6, 4
  st = rng.integers(1, t_max + 2, size=(tasks, n))     # t_max + 1 = never solved
  grid = pk.pass_grid_truncation(st, t_max, num_bootstrap=200)
  assert grid["mean"].shape == (n, t_max)
  for k in range(1, n + 1):
    for t in range(1, t_max + 1):
      assert grid["mean"][k - 1, t - 1] == pytest.approx(_brute(st, k, t), abs=1e-12)
  assert np.all(grid["lo"] <= grid["mean"]) and np.all(grid["mean"] <= grid["hi"])
  # Monotone in K and in T.
  assert np.all(np.diff(grid["mean"], axis=0) >= -1e-12)
  assert np.all(np.diff(grid["mean"], axis=1) >= -1e-12)


def test_rerun_mode_counts_each_budget_run():
  # Run T=1 solves nothing, run T=2 solves episode 0 at turn 2, run T=3 solves all at turn 1.
  st = np.array([[[2, 2]], [[2, 3]], [[1, 1]]])        # [T, tasks=1, n=2]
  counts = pk.solved_counts_rerun(st)
  np.testing.assert_array_equal(counts, [[0, 1, 2]])
  grid = pk.pass_grid_rerun(st, num_bootstrap=10)
  np.testing.assert_allclose(grid["mean"][0], [0.0, 0.5, 1.0])
  np.testing.assert_allclose(grid["mean"][1], [0.0, 1.0, 1.0])


def test_hand_values_and_interval_width():
  # One task, n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2.
  p = pk.per_task_pass(np.array([[1]]), 4)
  np.testing.assert_allclose(p[0, :, 0], [0.25, 0.5, 0.75, 1.0])
  # Identical tasks: the bootstrap interval collapses to the point estimate.
  grid = pk.pass_at_kt(np.full((10, 1), 2), 4, num_bootstrap=50)
  np.testing.assert_allclose(grid["lo"], grid["mean"])
  np.testing.assert_allclose(grid["hi"], grid["mean"])
  # Different tasks: a real interval around the mean.
  grid = pk.pass_at_kt(np.arange(5)[:, None], 4, num_bootstrap=500)
  assert grid["lo"][0, 0] < grid["mean"][0, 0] < grid["hi"][0, 0]
