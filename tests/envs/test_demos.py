"""Tests of the noisy oracle and the scripted-episode runner (envs/demos.py)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.envs import demos
from jaxagent.envs.base import ErrorKind
from jaxagent.envs.grid import GridTask

K = ErrorKind
B = 64           # one batch shape per runner: every call reuses one compiled program
MAX_TURNS = 20


def grid_hand_task():
  """A.#.   start (0, 0), goal (2, 3); oracle: down, down, right, right, right.
     .#T.
     ...G
     #...  """
  walls = np.zeros((4, 4), bool)
  walls[0, 2] = walls[1, 1] = walls[3, 0] = True
  traps = np.zeros((4, 4), bool)
  traps[1, 2] = True
  return GridTask(walls=jnp.asarray(walls), traps=jnp.asarray(traps),
                  start=jnp.asarray([0, 0], jnp.int32), goal=jnp.asarray([2, 3], jnp.int32))


def tile(task, b=B):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), task)


def keys(seed, b=B):
  return jax.random.split(jax.random.key(seed), b)


@pytest.fixture(scope="module")
def grid(builtin_tokenizer):
  env = envs.make("grid", builtin_tokenizer, size=4, num_traps=1)
  run = demos.make_episode_runner(env, demos.noisy_oracle_policy(env, 0.0, 1.0),
                                  max_turns=MAX_TURNS, max_len=768)
  tasks = jax.jit(jax.vmap(env.sample_task))(keys(123))
  return types.SimpleNamespace(env=env, codec=env.codec, run=run, tasks=tasks)


def np_tree(x):
  return jax.tree.map(np.asarray, x)


def test_oracle_transcript_decodes_to_the_expected_text(grid):
  codec = grid.codec
  chat, eot = codec.chat_text(), codec.decode([codec.end_of_turn_id])
  tr = np_tree(grid.run(keys(0), tile(grid_hand_task()), 30))
  _, obs0 = jax.jit(grid.env.reset)(jax.random.key(0), grid_hand_task(), 30)
  plan = ["move(down)", "move(down)", "move(right)", "move(right)", "move(right)"]
  bodies = ["You move down. You are at (1, 0).", "You move down. You are at (2, 0).",
            "You move right. You are at (2, 1).", "You move right. You are at (2, 2).",
            "You move right and reach the goal at (2, 3). Task solved."]
  expected = codec.decode(obs0) + "".join(
      a + eot + chat["pre_obs"] + f"{body}\nTurns left: {29 - t}." + chat["obs_to_assistant"]
      for t, (a, body) in enumerate(zip(plan, bodies)))
  assert expected.startswith("<|im_start|>system\nYou are an agent in a grid world.")
  for b in (0, B - 1):
    assert codec.decode(tr.tokens[b, :tr.length[b]]) == expected
    assert np.all(tr.tokens[b, tr.length[b]:] == codec.pad_id)
    # The loss mask covers exactly the actions and their end-of-turn tokens.
    mask = tr.loss_mask[b].astype(bool)
    assert codec.decode(tr.tokens[b][mask]) == "".join(a + eot for a in plan)
    assert mask.sum() == tr.action_length[b].sum() == sum(len(codec.encode(a)) + 1 for a in plan)
    assert not mask[:int(obs0.length)].any() and not mask[tr.length[b]:].any()
    assert np.all(tr.turn_of_token[b, :int(obs0.length)] == -1)
    assert np.all(tr.turn_of_token[b, tr.length[b]:] == -1)
    # Each turn's tokens: its action, the end of turn, and the observation that follows.
    for t, (a, body) in enumerate(zip(plan, bodies)):
      text = codec.decode(tr.tokens[b][tr.turn_of_token[b] == t])
      assert text.startswith(a + eot) and body in text
  turn = np.broadcast_to(np.arange(MAX_TURNS), (B, MAX_TURNS))
  np.testing.assert_array_equal(tr.acted, turn < 5)
  np.testing.assert_array_equal(tr.solved, turn == 4)
  assert np.all(tr.oracle_match[:, :5]) and np.all(tr.valid_call[:, :5]) and not tr.injected.any()
  assert np.all(tr.success_turn == 5) and np.all(tr.num_turns == 5) and np.all(tr.optimal_turns == 5)
  assert not tr.truncated.any()


def test_noisy_oracle_injects_every_error_kind_and_recovers(grid):
  params = demos.noisy_oracle_params(0.5, 1.0)     # always recover on the next turn
  tr = np_tree(grid.run(keys(1), grid.tasks, -1, params))
  acted, injected = tr.acted, tr.injected
  assert injected.any()
  # An injected error is reported as an error; every other action is the oracle's.
  assert np.all(tr.error_kind[injected] != K.NONE) and not tr.valid_call[injected].any()
  clean = acted & ~injected
  assert np.all(tr.error_kind[clean] == K.NONE) and np.all(tr.oracle_match[clean])
  # Recovery rate 1: an error is always followed by the oracle's action.
  assert not np.any(injected[:, :-1] & injected[:, 1:])
  kinds = set(np.unique(tr.error_kind[injected]).tolist())
  assert kinds == {K.PARSE_ERROR, K.UNKNOWN_TOOL, K.BAD_ARGUMENTS, K.TOOL_FAILURE}
  # Errors never move the agent in the grid, so each episode takes optimal + errors turns.
  solved = tr.success_turn <= MAX_TURNS
  np.testing.assert_array_equal(tr.success_turn[solved],
                                (tr.optimal_turns + injected.sum(1))[solved])
  assert solved.mean() > 0.9


def test_error_and_recovery_rates_are_respected(grid):
  tr = np_tree(grid.run(keys(2), grid.tasks, -1, demos.noisy_oracle_params(0.3, 0.6)))
  after_clean = tr.acted[:, 1:] & ~tr.injected[:, :-1]
  after_error = tr.acted[:, 1:] & tr.injected[:, :-1]
  # Each is a binomial frequency: within 4 standard deviations of its rate (seeded, so stable).
  for sample, rate in ((tr.injected[:, 0], 0.3), (tr.injected[:, 1:][after_clean], 0.3),
                       (tr.injected[:, 1:][after_error], 0.4)):
    assert sample.size >= 60
    assert abs(sample.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / sample.size), (rate, sample.mean())


def test_always_erring_never_solves_and_the_transcript_is_cut_at_max_len(grid):
  tr = np_tree(grid.run(keys(3), grid.tasks, -1, demos.noisy_oracle_params(1.0, 0.0)))
  assert tr.injected.all() and tr.acted.all() and not tr.solved.any()
  assert np.all(tr.num_turns == MAX_TURNS) and np.all(tr.success_turn == MAX_TURNS + 1)
  # 20 error turns do not fit in 768 tokens: rows are cut, the mask still marks action tokens.
  assert tr.truncated.all() and np.all(tr.length == 768)
  eot = grid.codec.decode([grid.codec.end_of_turn_id])
  for b in range(B):
    masked = grid.codec.decode(tr.tokens[b][tr.loss_mask[b] > 0]).split(eot)
    assert len(masked) >= 2 and all(a in grid.env.error_texts for a in masked[:-1])
  assert len(grid.run.traces) == 1, "the runner must compile once for every call of this module"


def test_workshop_noisy_oracle_makes_precondition_errors_and_solves(builtin_tokenizer):
  env = envs.make("workshop", builtin_tokenizer, depth=1, num_containers=4, num_items=2)
  run = demos.make_episode_runner(env, demos.noisy_oracle_policy(env, 0.5, 1.0),
                                  max_turns=16, max_len=1536)
  tr = np_tree(run(keys(4)))
  kinds = set(np.unique(tr.error_kind[tr.injected]).tolist())
  assert kinds == {K.PARSE_ERROR, K.UNKNOWN_TOOL, K.BAD_ARGUMENTS, K.TOOL_FAILURE,
                   K.PRECONDITION_FAILED}
  assert np.all(tr.error_kind[tr.injected] != K.NONE)
  clean = tr.acted & ~tr.injected
  assert np.all(tr.oracle_match[clean])
  # Errors never change the workshop state either: solved after optimal + errors turns.
  np.testing.assert_array_equal(tr.success_turn, tr.optimal_turns + tr.injected.sum(1))
  texts = {env.codec.decode(tr.tokens[b][(tr.turn_of_token[b] == t)])
           for b, t in zip(*np.nonzero(tr.injected & (tr.error_kind == K.UNKNOWN_TOOL)))}
  assert all(t.split("(")[0] in ("opne", "tkae", "unlcok", "ptu") for t in texts)


def test_generic_errors_for_an_env_without_error_candidates(builtin_tokenizer):
  env = envs.make("lookup", builtin_tokenizer, hops=2)
  assert not hasattr(env, "error_candidates")
  run = demos.make_episode_runner(env, demos.noisy_oracle_policy(env, 0.5, 1.0),
                                  max_turns=8, max_len=1024)
  tr = np_tree(run(keys(5)))
  kinds = set(np.unique(tr.error_kind[tr.injected]).tolist())
  assert kinds == {K.PARSE_ERROR, K.UNKNOWN_TOOL, K.BAD_ARGUMENTS}
  assert np.all(tr.success_turn == tr.optimal_turns + tr.injected.sum(1))
  codec = env.codec
  for b, t in zip(*np.nonzero(tr.injected)):
    action = codec.decode(tr.tokens[b][(tr.turn_of_token[b] == t) & (tr.loss_mask[b] > 0)])
    action = action[:-len("<|im_end|>")]
    kind = tr.error_kind[b, t]
    if kind == K.PARSE_ERROR:
      assert not action.endswith(")")
    elif kind == K.UNKNOWN_TOOL:
      assert action[0] == action[1] and action.endswith(")")
    else:
      assert action.endswith(", zz)")


def test_generic_errors_need_single_byte_tokens_for_printable_bytes_only(builtin_tokenizer,
                                                                         monkeypatch):
  env = envs.make("lookup", builtin_tokenizer, hops=1)
  table = demos.byte_tokens(env.codec)
  # A vocabulary without single-byte tokens for control and invalid UTF-8 bytes (as SmolLM2's
  # lacks 0x04, 0x06, 0xc0, 0xff, ...) can still spell every corrupted action.
  no_control = table.copy()
  no_control[[4, 6, 192, 255]] = -1
  monkeypatch.setattr(demos, "byte_tokens", lambda codec: no_control)
  demos.make_error_sampler(env)
  no_z = table.copy()
  no_z[ord("z")] = -1
  monkeypatch.setattr(demos, "byte_tokens", lambda codec: no_z)
  with pytest.raises(ValueError, match=r"lookup has no error_candidates\(\).*printable bytes 'z'"):
    demos.make_error_sampler(env)


def test_bad_rates_are_rejected():
  with pytest.raises(ValueError, match="error_rate"):
    demos.noisy_oracle_params(1.5, 0.5)
