"""A rollout and a full RL update on a 2x2x2 (data, fsdp, tensor) mesh of 8 fake CPU devices give
the single-device results: same sampled tokens, log-probs and parameters after the update within
float32 rounding (sharded matmuls sum in another order), with the episodes really split over
(data, fsdp) on the mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import from_pretrained
from jaxagent.rollout import rollout
from jaxagent.rollout.api import place_batch
from jaxagent.rollout.trajectory import Trajectory, trim
from jaxagent.sharding import make_mesh

MESH = (2, 2, 2)
TASKS, GROUP = 4, 2          # 8 episodes: 2 per device over data x fsdp = 4
ROLLOUT = dict(budgets=2, max_turns=2, max_action_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def policies():
  single = from_pretrained("builtin:micro")
  sharded = from_pretrained("builtin:micro", mesh=make_mesh(MESH))
  return single, sharded


@pytest.fixture(scope="module")
def rollouts(policies):
  single, sharded = policies
  env = envs.make("lookup", single.tokenizer, hops=1)
  one = rollout(single, env, jax.random.key(3), TASKS, GROUP, **ROLLOUT)
  many = rollout(sharded, env, jax.random.key(3), TASKS, GROUP, **ROLLOUT)
  return one, many


def _shard_rows(x) -> set[int]:
  return {s.data.shape[0] for s in x.addressable_shards}


def test_same_initial_parameters(policies):
  single, sharded = policies
  jax.tree.map(np.testing.assert_array_equal, sharded.params, single.params)


def test_rollout_on_mesh_equals_single_device(rollouts):
  one, many = rollouts
  b = TASKS * GROUP
  # Split, not replicated: each device holds (and ran) 2 of the 8 episodes.
  assert _shard_rows(many.tokens) == {b // 4}
  assert _shard_rows(many.num_turns) == {b // 4}
  assert float(jnp.sum(one.loss_mask)) > 0 and len({tuple(r) for r in np.asarray(one.tokens)}) > 1
  for f in dataclasses.fields(Trajectory):
    a, m = np.asarray(getattr(one, f.name)), np.asarray(getattr(many, f.name))
    if np.issubdtype(a.dtype, np.floating):
      np.testing.assert_allclose(m, a, atol=2e-5, rtol=0, err_msg=f.name)
    else:
      np.testing.assert_array_equal(m, a, err_msg=f.name)


def test_update_on_mesh_equals_single_device(policies, rollouts):
  """One update (2 minibatches, PPO-clip, KL to a reference, entropy bonus) from the same state
  and trajectory: the trainer's train state on the mesh and the rollout's batch split vs one
  device."""
  single, sharded = policies
  traj = trim(rollouts[0])
  b = traj.batch_size
  # Half of each group solved at turn 1: non-zero GRPO advantages.
  solved = np.zeros(traj.solved.shape, bool)
  solved[::2, 0] = True
  traj = traj.replace(solved=jnp.asarray(solved), acted=traj.acted.at[:, 0].set(True))
  cfg = LearnerConfig(minibatches=2, learning_rate=1e-3, kl_coef=0.05, entropy_coef=0.01,
                      clip_eps_high=0.28)
  optimizer = cfg.make_optimizer()
  update = make_update_fn(cfg, single.config, optimizer)

  state1 = init_train_state(jax.tree.map(jnp.copy, single.params), optimizer, jax.random.key(0))
  state1, m1 = update(state1, traj, single.params)

  mesh = sharded.mesh
  traj_m = place_batch(mesh, traj, b)
  assert _shard_rows(traj_m.tokens) == {b // 4}
  state_m = init_train_state(jax.tree.map(jnp.copy, sharded.params), optimizer,
                             jax.random.key(0), mesh=sharded.mesh)
  state_m, m_m = update(state_m, traj_m, sharded.params)

  # The parameters keep their shardings, moved by the update, to the same values.
  want = sharded.param_shardings()
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(s)),
               state_m.params, want)
  moved = max(float(jnp.max(jnp.abs(a - p))) for a, p in
              zip(jax.tree.leaves(state1.params), jax.tree.leaves(single.params)))
  assert moved > 5e-4
  # Adam divides each gradient by its own magnitude, so an element whose gradient is rounding
  # noise in both runs can move differently (seen: ~1e-5 on 1 element in 1e5, varying between
  # runs): allow 5% of one step (lr = 1e-3) per element, and require all but 1 in 1e4 elements
  # to agree to float32 rounding (a wrong minibatch or gradient would move nearly all).
  off = 0
  for (path, a), m in zip(jax.tree_util.tree_flatten_with_path(state1.params)[0],
                          jax.tree.leaves(state_m.params)):
    a, m = np.asarray(a), np.asarray(m)
    np.testing.assert_allclose(m, a, atol=5e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    off += int(np.sum(np.abs(m - a) > 1e-6))
  assert off < 1e-4 * single.config.num_params(), off
  assert int(state_m.step) == int(state1.step) == 2
  assert set(m_m) == set(m1)
  for k in m1:
    np.testing.assert_allclose(float(m_m[k]), float(m1[k]), rtol=1e-4, atol=1e-6, err_msg=k)
  assert abs(float(m1["advantage_abs_mean"])) > 0.1 and float(m1["grad_norm"]) > 0
