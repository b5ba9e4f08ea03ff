"""Step-level action quality: exact rates from per-state outcomes, and the next-action program
against the rollout engine (greedy decoding from a replayed prefix takes the action the greedy
rollout took there, and the environment judges it the same way)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.eval import step_quality
from jaxagent.models import from_pretrained
from jaxagent.rollout import replay, rollout

ACTION_TOKENS, MAX_TURNS = 8, 3


def test_quality_rates_exact():
  valid = np.array([1, 1, 0, 0, 1, 0], bool)
  match = np.array([1, 0, 0, 0, 1, 0], bool)
  source = np.array(["oracle"] * 3 + ["base"] * 3)
  env = np.array(["lookup"] * 4 + ["arithmetic"] * 2)
  task = np.array([0, 0, 1, 2, 3, 3])
  q = step_quality.quality_rates(valid, match, task, {"source": source, "env": env},
                                 num_bootstrap=300, confidence=0.9, seed=0)
  assert (q["overall"]["valid"]["rate"], q["overall"]["valid"]["n"]) == (0.5, 6)
  assert q["overall"]["oracle"]["rate"] == pytest.approx(1 / 3)
  assert q["source"]["oracle"]["valid"]["rate"] == pytest.approx(2 / 3)
  assert q["source"]["oracle"]["oracle"]["rate"] == pytest.approx(1 / 3)
  assert q["source"]["base"]["valid"]["rate"] == pytest.approx(1 / 3)
  assert q["env"]["lookup"]["valid"]["rate"] == 0.5 and q["env"]["lookup"]["valid"]["n"] == 4
  assert q["env"]["arithmetic"]["oracle"]["rate"] == 0.5
  # Intervals resample tasks: oracle-source valid outcomes are task 0 (1, 1) and task 1 (0), so
  # a resample's pooled rate is 1, 2/3, 1/2 or 0 (all of task 1) at the extremes.
  r = q["source"]["oracle"]["valid"]
  assert r["tasks"] == 2 and r["lo"] == 0.0 and r["hi"] == 1.0
  # The arithmetic states are one task: its rate never varies under resampling.
  r = q["env"]["arithmetic"]["valid"]
  assert r["tasks"] == 1 and r["lo"] == r["hi"] == r["rate"] == 0.5
  # Same seed, same intervals.
  q2 = step_quality.quality_rates(valid, match, task, {"source": source, "env": env},
                                  num_bootstrap=300, confidence=0.9, seed=0)
  assert q2 == q


@pytest.fixture(scope="module")
def setup():
  policy = from_pretrained("builtin:tiny")
  env = envs.make("lookup", policy.tokenizer, hops=1, distractor_entities=2)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(5), 3))
  traj = jax.device_get(rollout(policy, env, jax.random.key(6), tasks, 2, budgets=MAX_TURNS,
                                max_turns=MAX_TURNS, max_action_tokens=ACTION_TOKENS,
                                temperature=0.0))
  rows = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), tasks)
  return policy, env, rows, traj


def test_greedy_next_action_reproduces_greedy_rollout(setup):
  policy, env, rows, traj = setup
  refs = step_quality.reference_states(replay.make_replay_fn(env, False), rows, traj,
                                       traj.acted, source="rollout", row_batch=4)
  assert len(refs) == int(np.asarray(traj.acted).sum()) > 0
  np.testing.assert_array_equal(np.asarray(refs.env_state.turn), refs.turn)
  fn = replay.make_next_action_fn(policy.config, env, ACTION_TOKENS)
  got = step_quality.next_actions(fn, policy.params, refs, jax.random.key(0), 0.0, batch_size=4)
  r, t = refs.row, refs.turn
  np.testing.assert_array_equal(got["length"], traj.action_tokens_len[r, t])
  for i in range(len(refs)):
    n = got["length"][i]
    np.testing.assert_array_equal(got["tokens"][i, :n], traj.action_tokens[r[i], t[i], :n])
  np.testing.assert_array_equal(got["valid_call"], traj.valid_call[r, t])
  np.testing.assert_array_equal(got["oracle_match"], traj.oracle_match[r, t])
  np.testing.assert_array_equal(got["error_kind"], traj.error_kind[r, t])
  assert len({tuple(x) for x in got["tokens"].tolist()}) > 1   # not one repeated action
  # Sampling, and other parameters, reuse the compiled program.
  other = jax.tree.map(lambda x: x * 1.01, policy.params)
  sampled = step_quality.next_actions(fn, other, refs, jax.random.key(1), 1.0, batch_size=4)
  assert fn.prefill._cache_size() == 1 and fn.act._cache_size() == 1
  assert sampled["valid_call"].shape == (len(refs),)
  assert np.all((sampled["length"] >= 0) & (sampled["length"] <= ACTION_TOKENS))
  # Several decodings from one prefill per batch are each the decoding run alone.
  decodings = [(jax.random.key(0), 0.0), (jax.random.key(1), 1.0), (jax.random.key(1), 0.5)]
  together = step_quality.next_actions_at(fn, other, refs, decodings, batch_size=4)
  alone = [step_quality.next_actions(fn, other, refs, k, t, batch_size=4) for k, t in decodings]
  assert len(together) == 3
  for got_j, want_j in zip(together, alone):
    assert set(got_j) == set(want_j)
    for k in want_j:
      np.testing.assert_allclose(got_j[k], want_j[k], rtol=1e-6, atol=1e-6, err_msg=k)
  np.testing.assert_array_equal(together[1]["tokens"], sampled["tokens"])
  assert fn.prefill._cache_size() == 1 and fn.act._cache_size() == 1


def test_replay_budget_visibility(setup):
  _, env, rows, traj = setup
  hidden = step_quality.replay_env_states(replay.make_replay_fn(env, False), rows, traj)
  shown = step_quality.replay_env_states(replay.make_replay_fn(env, True), rows, traj,
                                         row_batch=4)
  assert np.all(np.asarray(hidden.budget) == -1)
  np.testing.assert_array_equal(np.asarray(shown.budget),
                                np.repeat(traj.budget[:, None], MAX_TURNS, axis=1))
  # Row batching does not change the states.
  np.testing.assert_array_equal(np.asarray(hidden.turn), np.asarray(shown.turn))
  np.testing.assert_array_equal(np.asarray(hidden.turn)[:, :],
                                np.tile(np.arange(MAX_TURNS), (traj.budget.shape[0], 1)))
