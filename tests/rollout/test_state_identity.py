"""State identity for turn-level credit: fingerprints computed on device from the state pytree
separate exactly the identical states, and the rollout records the fingerprint of the state each
turn acted in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.envs.base import identity_words, state_fingerprint
from jaxagent.models import from_pretrained
from jaxagent.rollout import replay, rollout

TASKS, GROUP, TURNS = 3, 4, 6


def _episodes(env, seed):
  """States [B, T] (before each turn) of B = TASKS x GROUP episodes: each turn every row takes the
  oracle's action or a malformed one (which leaves the state unchanged but for the turn count),
  at random, so rows of one task meet identical states by different paths and at different
  turns, and also part ways."""
  key = jax.random.key(seed)
  k_task, k_pick = jax.random.split(key)
  tasks = jax.vmap(env.sample_task)(jax.random.split(k_task, TASKS))
  tasks = jax.tree.map(lambda x: jnp.repeat(x, GROUP, axis=0), tasks)
  b = TASKS * GROUP
  state, _ = jax.vmap(env.reset)(jax.random.split(key, b), tasks, jnp.full((b,), -1))
  garbage = envs.TokenBuffer(tokens=jnp.zeros((b, env.max_action_len), jnp.int32)
                             .at[:, 0].set(env.codec.end_of_turn_id),
                             length=jnp.ones((b,), jnp.int32))
  step, oracle = jax.jit(jax.vmap(env.step)), jax.jit(jax.vmap(env.oracle_action))
  out = []
  for t in range(TURNS):
    out.append(state)
    good = oracle(state)
    pick = jax.random.bernoulli(jax.random.fold_in(k_pick, t), 0.6, (b,))
    action = jax.tree.map(lambda g, x: jnp.where(pick.reshape((b,) + (1,) * (g.ndim - 1)), g, x),
                          good, garbage)
    state, _, _ = step(state, action)
  return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *out)              # [B, T]


@pytest.mark.parametrize("name", envs.jax_names())
def test_fingerprints_separate_exactly_the_identical_states(name, builtin_tokenizer):
  env = envs.make(name, builtin_tokenizer)
  states = _episodes(env, seed=len(name))
  words = np.asarray(jax.vmap(jax.vmap(identity_words))(states))            # [B, T, S]
  fp = np.asarray(jax.vmap(jax.vmap(state_fingerprint))(states))            # [B, T, 2]
  n = TASKS * GROUP * TURNS
  words, fp = words.reshape(n, -1), fp.reshape(n, 2)
  same_state = (words[:, None, :] == words[None, :, :]).all(-1)
  same_fp = (fp[:, None, :] == fp[None, :, :]).all(-1)
  np.testing.assert_array_equal(same_fp, same_state)
  # Not vacuous: within one task, distinct steps share a state (other rows, other turns) and
  # others do not; states of different tasks differ.
  task = np.repeat(np.arange(TASKS), GROUP * TURNS)
  same_task = task[:, None] == task[None, :]
  off = ~np.eye(n, dtype=bool)
  assert (same_state & same_task & off).any() and (~same_state & same_task).any()
  assert not (same_state & ~same_task).any()
  # The turn counter and the budget are not part of the identity.
  moved = states.replace(turn=states.turn + 3, budget=states.budget + 5)
  np.testing.assert_array_equal(np.asarray(jax.vmap(jax.vmap(state_fingerprint))(moved)),
                                fp.reshape(TASKS * GROUP, TURNS, 2))


def test_rollout_records_the_fingerprint_of_the_state_each_turn_acted_in():
  policy = from_pretrained("builtin:tiny")
  env = envs.make("lookup", policy.tokenizer, hops=2)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(5), 4))
  traj = rollout(policy, env, jax.random.key(6), tasks, 2, budgets=[1, 3, 2, 3], max_turns=3,
                 temperature=1.0)
  rep_tasks = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), tasks)
  states = replay.make_replay_fn(env, False)(rep_tasks, traj.budget, traj.action_tokens,
                                             traj.action_tokens_len, traj.acted)
  want = np.asarray(jax.vmap(jax.vmap(state_fingerprint))(states))
  acted = np.asarray(traj.acted)
  assert acted.sum() > 4
  np.testing.assert_array_equal(np.asarray(traj.state_id)[acted], want[acted])
  assert np.all(np.asarray(traj.state_id)[~acted] == 0)
