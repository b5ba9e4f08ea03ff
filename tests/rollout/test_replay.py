"""The replay / next-action factories: a fresh jitted function per call (no module cache), the
next-action validation, and replay leaving the state unchanged at turns that did not act."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.models.builtin import BUILTIN_DIRS
from jaxagent.models.config import ModelConfig
from jaxagent.rollout import replay


@pytest.fixture(scope="module")
def env(builtin_tokenizer):
  return envs.make("lookup", builtin_tokenizer, hops=2, distractor_entities=2)


def test_next_action_fn_validates_and_is_not_cached(env):
  mcfg = ModelConfig.from_hf(json.loads((BUILTIN_DIRS["tiny"] / "config.json").read_text()))
  for bad in (1, env.max_action_len + 1):
    with pytest.raises(ValueError, match="max_action_tokens"):
      replay.make_next_action_fn(mcfg, env, bad)
  a = replay.make_next_action_fn(mcfg, env, 8)
  assert replay.make_next_action_fn(mcfg, env, 8) is not a
  assert replay.make_replay_fn(env, False) is not replay.make_replay_fn(env, False)


def test_replay_skips_turns_that_did_not_act(env):
  b, t = 2, 3
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), b))
  actions = jnp.zeros((b, t, env.max_action_len), jnp.int32)
  length = jnp.zeros((b, t), jnp.int32)
  acted = jnp.array([[True, True, True], [True, False, False]])
  fn = replay.make_replay_fn(env, True)
  states = fn(tasks, jnp.array([5, 7], jnp.int32), actions, length, acted)
  # states[b, t] is the state before turn t: turn counts up only while the row acts.
  np.testing.assert_array_equal(np.asarray(states.turn), [[0, 1, 2], [0, 1, 1]])
  np.testing.assert_array_equal(np.asarray(states.budget), [[5] * 3, [7] * 3])
