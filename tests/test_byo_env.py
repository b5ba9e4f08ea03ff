"""Bring your own environment: config.env.name resolves registered and importable environments,
and a host environment runs the whole pipeline like its JAX twin (host_lookup vs lookup: the same
demonstrations, rollouts, oracle rollouts, replayed states and next actions), through
`launch.train`'s library entry point."""

import dataclasses

import jax
import numpy as np
import pytest

import jaxagent.envs as envs
from configs.default import get_config
from jaxagent import train
from jaxagent.envs import demos, host_demos
from jaxagent.envs.host import HostLookupEnv
from jaxagent.eval import recovery, step_quality
from jaxagent.models import from_pretrained
from jaxagent.rollout import Rollouts
from jaxagent.rollout.replay import make_next_action_fn, make_replay_fn
from jaxagent.runs.config import ConfigError, run_config

KNOBS = dict(hops=2, distractor_entities=3)


@pytest.fixture(scope="module")
def policy():
  return from_pretrained("builtin:tiny")


@pytest.fixture(scope="module")
def pair(policy):
  host = HostLookupEnv(envs.codec_for(policy.tokenizer), **KNOBS)
  return host.jax_env, host


def test_env_names_resolve_registered_or_importable_with_errors_naming_the_fix():
  assert envs.resolve("host_lookup") is HostLookupEnv
  assert envs.resolve("jaxagent.envs.host:HostLookupEnv") is HostLookupEnv
  assert "host_lookup" in envs.names()
  for name, match in [("chess", "registered name .* or an importable class as "
                                "'package.module:Class'"),
                      ("no_such_pkg.mod:Env", "cannot import module 'no_such_pkg.mod'.*PYTHONPATH"),
                      ("jaxagent.envs.host:Nope", "has no class 'Nope'; its classes: .*HostEnv"),
                      ("jaxagent.envs.host:a:b", "one colon")]:
    with pytest.raises(ValueError, match=match):
      envs.resolve(name)
  c = get_config("smoke")
  c.env.name = "no_such_pkg.mod:Env"
  with pytest.raises(ConfigError, match="config.env.name='no_such_pkg.mod:Env' is not an "
                     "environment: .*cannot import module"):
    run_config(c)
  c.env.name = "jaxagent.envs.host:HostLookupEnv"
  assert run_config(c).env.name == "jaxagent.envs.host:HostLookupEnv"


def test_host_demonstrations_equal_the_jax_twins(pair):
  env, host = pair
  b = 32
  tasks = host.sample_tasks(jax.random.key(1), b)
  keys = jax.random.split(jax.random.key(3), b)
  budget = np.asarray([-1, 2, 5, 3] * (b // 4), np.int32)
  params = demos.noisy_oracle_params(0.5, 0.5)
  jax_run = demos.make_episode_runner(env, demos.noisy_oracle_policy(env, 0.0, 1.0),
                                      max_turns=6, max_len=384)
  host_run = host_demos.make_host_episode_runner(host, max_turns=6, max_len=384)
  a, h = jax_run(keys, tasks, budget, params), host_run(keys, tasks, budget, params)
  for f in dataclasses.fields(a):
    np.testing.assert_array_equal(np.asarray(getattr(h, f.name)), np.asarray(getattr(a, f.name)),
                                  err_msg=f.name)
  # The comparison saw injected errors of every generic kind, recoveries and cut transcripts.
  assert np.asarray(a.injected).sum() > 10 and np.asarray(a.solved).any()
  assert set(np.unique(np.asarray(a.error_kind))) >= {1, 2, 3}


def test_host_oracle_rollouts_and_next_actions_equal_the_jax_twins(policy, pair):
  """(Sampled rollouts: tests/rollout/test_engine.py::test_host_env_gives_the_same_trajectory.)"""
  env, host = pair
  tasks = host.sample_tasks(jax.random.key(5), 4)
  kw = dict(max_turns=3, temperature=1.0)
  forced = {}
  for name, e in (("jax", env), ("host", host)):
    oracle = lambda s, k, e=e: e.oracle_action(s)
    forced[name] = jax.device_get(Rollouts(policy.config, e)(
        policy.params, jax.random.key(7), tasks, 1, 3, forced_action=oracle, **kw))
  for name in forced["jax"].__dataclass_fields__:
    if name != "state_id":
      np.testing.assert_allclose(np.asarray(getattr(forced["host"], name)),
                                 np.asarray(getattr(forced["jax"], name)), atol=1e-5,
                                 err_msg=name)
  assert np.asarray(forced["jax"].solved).any(axis=1).all()      # the oracle solved them all
  # Step quality and controlled recovery: the same states replayed (the base policy's reference
  # and error states), the same next actions.
  base = jax.device_get(Rollouts(policy.config, env)(policy.params, jax.random.key(6), tasks, 2,
                                                     3, **kw))
  row_tasks = jax.tree.map(lambda x: np.repeat(np.asarray(x), 2, axis=0), tasks)
  out = {}
  for name, e in (("jax", env), ("host", host)):
    replay = make_replay_fn(e, False)
    refs = step_quality.concat_states([
        step_quality.reference_states(replay, row_tasks, base, base.acted, source="base",
                                      row_batch=4),
        recovery.controlled_error_states(replay, row_tasks, base, row_batch=4)])
    fn = make_next_action_fn(policy.config, e, e.max_action_len)
    out[name] = (refs, step_quality.next_actions(fn, policy.params, refs,
                                                 jax.random.key(8), 1.0, 8))
  assert len(out["jax"][0]) == len(out["host"][0]) > 8
  assert (out["jax"][0].prev_error_kind > 0).sum() > 0           # error states among them
  for k, v in out["jax"][1].items():
    np.testing.assert_array_equal(out["host"][1][k], v, err_msg=k)


def test_a_tiny_train_runs_on_a_host_environment(tmp_path, metrics_lines):
  c = get_config("smoke")
  c.num_devices = 1
  c.env.name = "host_lookup"
  c.sft.steps, c.rl.steps = 2, 1
  summary = train.run(c, tmp_path)
  assert summary["sft_steps"] == 2 and summary["rl_steps"] == 1
  lines = metrics_lines(tmp_path)
  assert [(l["phase"], l["step"]) for l in lines] == [("sft", 1), ("sft", 2), ("rl", 1)]
  assert lines[-1]["sampled_tokens"] > 0
