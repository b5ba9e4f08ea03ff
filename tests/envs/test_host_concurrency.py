"""HostEnv.step: episodes step concurrently, in episode order; an episode's exception fails the
step with the episode, its action and the cause, never a hang."""

import threading
import time

import numpy as np
import pytest

from jaxagent.envs import codec_for
from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.envs.host import HostEnv, HostEpisodeError, Outcome

SLEEP, B = 0.05, 8


class SlowEpisode:
  """A tool that waits SLEEP seconds per call (a database, a sandbox) and answers its task id."""
  optimal_turns = 1

  def __init__(self, task):
    self.task = int(task)

  def prompt(self):
    return ["Call ping()."], ["Go."]

  def act(self, call):
    time.sleep(SLEEP)
    if call is not None and call.name == "boom":
      raise ZeroDivisionError("the tool divided by zero")
    return Outcome([f"pong {self.task}"], ErrorKind.NONE, solved=True, final_answer=True)

  def oracle(self):
    return ["ping()"]


def _env(policy, threads):
  return HostEnv(codec_for(policy.tokenizer), SlowEpisode, max_obs_len=128, max_action_len=128,
                 max_action_bytes=256, name="slow", num_threads=threads)


@pytest.fixture(scope="module")
def policy():
  from jaxagent.models import from_pretrained
  return from_pretrained("builtin:tiny")


def _actions(env, texts):
  rows = [env.codec.encode_text(t) for t in texts]
  tokens = np.full((len(rows), env.max_action_len), env.codec.pad_id, np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return TokenBuffer(tokens, np.asarray([len(r) for r in rows], np.int32))


def test_slow_episodes_step_concurrently_and_in_order(policy):
  env = _env(policy, threads=B)
  state, _ = env.reset(np.arange(B, dtype=np.int32))
  seen = set()
  original = SlowEpisode.act

  def act(self, call):          # records the threads that ran episodes
    seen.add(threading.get_ident())
    return original(self, call)

  SlowEpisode.act = act
  try:
    t0 = time.perf_counter()
    _, obs, info = env.step(state, _actions(env, ["ping()"] * B))
    secs = time.perf_counter() - t0
  finally:
    SlowEpisode.act = original
  # Serially this takes B x SLEEP = 0.4 s; a generous bound, not a benchmark.
  assert secs < 4 * SLEEP, secs
  assert len(seen) > 1
  for i in range(B):            # row i is episode i's observation
    text = env.codec.decode_bytes(obs.tokens[i, :obs.length[i]]).decode()
    assert f"pong {i}" in text and f"pong {i + 1}" not in text
  assert info.solved.all()
  # One thread: the same rows, one episode after another.
  serial = _env(policy, threads=1)
  s2, _ = serial.reset(np.arange(B, dtype=np.int32))
  _, obs1, _ = serial.step(s2, _actions(serial, ["ping()"] * B))
  np.testing.assert_array_equal(obs1.tokens, obs.tokens)
  with pytest.raises(ValueError, match="num_threads=0"):
    _env(policy, threads=0)


def test_an_episode_that_raises_fails_the_step_naming_it(policy):
  env = _env(policy, threads=4)
  state, _ = env.reset(np.arange(B, dtype=np.int32))
  texts = ["ping()"] * B
  texts[5] = "boom(" + "x" * 100 + ")"
  t0 = time.perf_counter()
  with pytest.raises(HostEpisodeError, match=r"slow: episode 5 raised ZeroDivisionError: the "
                     r"tool divided by zero on the action 'boom\(xxx") as e:
    env.step(state, _actions(env, texts))
  assert time.perf_counter() - t0 < 5                  # failed, did not hang
  assert isinstance(e.value.__cause__, ZeroDivisionError)
  assert "..." in str(e.value) and "x" * 100 not in str(e.value)    # the action text truncated
