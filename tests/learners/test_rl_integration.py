"""End to end: BudgetMix budgets -> multi-turn rollouts on `lookup` with the built-in model ->
the jitted update, for a few RL steps (8 episodes, at most 2 turns)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jaxagent.envs as envs
from jaxagent.learners import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import from_pretrained
from jaxagent.rollout import Rollouts
from jaxagent.rollout.budget import Budget

NUM_TASKS, GROUP, STEPS = 4, 2, 3


@pytest.mark.slow
def test_rl_steps_end_to_end():
  policy = from_pretrained("builtin:tiny")
  env = envs.make("lookup", policy.tokenizer, hops=1)
  sampler = Budget.parse("mix:1,2", per="group")
  # entropy_coef > 0: a nonzero gradient even if every group's rewards happen to tie.
  cfg = LearnerConfig(minibatches=2, kl_coef=0.01, entropy_coef=0.01, learning_rate=1e-3,
                      clip_eps_high=0.28, invalid_call_penalty=0.1)
  optimizer = cfg.make_optimizer()
  update = make_update_fn(cfg, policy.config, optimizer)
  ref_params = policy.params
  # The update donates its state: train a copy, keep the policy's own params as the reference.
  state = init_train_state(jax.tree.map(jnp.copy, policy.params), optimizer, jax.random.key(0))
  key = jax.random.key(1)
  rollouts = Rollouts(policy.config, env)
  for step in range(STEPS):
    k_budget, k_roll = jax.random.split(jax.random.fold_in(key, step))
    budgets = np.asarray(sampler.sample(step, k_budget, NUM_TASKS))                # [tasks]
    traj = rollouts(state.params, k_roll, NUM_TASKS, GROUP, budgets,
                    max_turns=sampler.max_turns, max_action_tokens=12)
    np.testing.assert_array_equal(traj.budget, np.repeat(budgets, GROUP))
    assert np.all(np.asarray(traj.num_turns) <= np.asarray(traj.budget))
    state, metrics = update(state, traj, ref_params)
    metrics = jax.device_get(metrics)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert int(state.step) == (step + 1) * cfg.minibatches
    # rewards: success in {0, 1} minus 0.1 per invalid call (at most 2 turns)
    assert -0.2 - 1e-6 <= metrics["reward_mean"] <= 1.0
    assert metrics["kl"] >= 0.0 and metrics["grad_norm"] > 0.0
    assert 0.0 <= metrics["clip_fraction"] <= 1.0
  assert update._cache_size() == 1          # new budgets, trajectories and params: one program
  assert (rollouts.compiles, rollouts.traces) == (1, 1)   # and one rollout program
  moved = [float(jnp.max(jnp.abs(a - b)))
           for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params))]
  assert max(moved) > 0.0
