"""Error recovery: exact rates by error kind on hand-built trajectories, and the controlled error
states rebuilt by replaying hand-written actions through the lookup environment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.envs.lookup import ENTITY_NAMES, RELATION_NAMES
from jaxagent.eval import recovery
from jaxagent.rollout.replay import make_replay_fn
from jaxagent.rollout.trajectory import Trajectory

K = ErrorKind


def trajectory(acted, error_kind, valid, oracle, *, tokens=None, turn_start=None,
               action_tokens=None, action_len=None, budget=None) -> Trajectory:
  """A Trajectory from per-turn arrays [B, T]; the other fields get consistent fillers."""
  acted = np.asarray(acted, bool)
  b, t = acted.shape
  tokens = np.zeros((b, 64), np.int32) if tokens is None else np.asarray(tokens, np.int32)
  l = tokens.shape[1]
  solved = np.zeros((b, t), bool)
  return Trajectory(
      tokens=tokens, positions=np.tile(np.arange(l, dtype=np.int32), (b, 1)),
      loss_mask=np.zeros((b, l), np.float32), behaviour_logprobs=np.zeros((b, l), np.float32),
      turn_of_token=np.full((b, l), -1, np.int32), length=np.full((b,), l, np.int32),
      acted=acted, valid_call=np.asarray(valid, bool), error_kind=np.asarray(error_kind, np.int32),
      oracle_match=np.asarray(oracle, bool), reward=np.zeros((b, t), np.float32), solved=solved,
      action_length=np.zeros((b, t), np.int32),
      turn_start=np.zeros((b, t), np.int32) if turn_start is None else np.asarray(turn_start, np.int32),
      action_tokens=(np.zeros((b, t, 4), np.int32) if action_tokens is None
                     else np.asarray(action_tokens, np.int32)),
      action_tokens_len=(np.zeros((b, t), np.int32) if action_len is None
                         else np.asarray(action_len, np.int32)),
      state_id=np.zeros((b, t, 2), np.uint32), obs_truncated=np.zeros((b, t), bool),
      success_turn=np.full((b,), t + 1, np.int32), num_turns=acted.sum(1).astype(np.int32),
      budget=np.full((b,), t, np.int32) if budget is None else np.asarray(budget, np.int32),
      task_id=np.arange(b, dtype=np.int32), group_id=np.arange(b, dtype=np.int32),
      status=np.zeros((b,), np.int32), optimal_turns=np.full((b,), 3, np.int32))


# Three rows, four turns. Error states (t >= 1, previous acted turn failed):
#   row 0: t=1 after parse_error (valid, oracle); t=3 after tool_failure (valid, not oracle)
#   row 1: t=1 after unknown_tool (invalid); t=2 after parse_error (valid, oracle)
#   row 2: t=1 after bad_arguments is not acted -> not an error state; its t=0 is no error state
HAND = dict(
    acted=[[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]],
    error_kind=[[K.PARSE_ERROR, 0, K.TOOL_FAILURE, 0], [K.UNKNOWN_TOOL, K.PARSE_ERROR, 0, 0],
                [K.BAD_ARGUMENTS, 0, 0, 0]],
    valid=[[0, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0]],
    oracle=[[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])


def test_on_policy_recovery_by_kind_exact():
  traj = trajectory(**HAND)
  o = recovery.on_policy_outcomes(traj)
  np.testing.assert_array_equal(o["row"], [0, 0, 1, 1])
  np.testing.assert_array_equal(o["turn"], [1, 3, 1, 2])
  np.testing.assert_array_equal(o["kind"], [K.PARSE_ERROR, K.TOOL_FAILURE, K.UNKNOWN_TOOL,
                                            K.PARSE_ERROR])
  counts = recovery.recovery_counts(o["kind"], o["valid"], o["oracle"])
  # One entry per ErrorKind, irreversible (7) included.
  np.testing.assert_array_equal(counts["n"], [0, 2, 1, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(counts["valid"], [0, 2, 0, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(counts["oracle"], [0, 2, 0, 0, 0, 0, 0, 0])
  r = recovery.on_policy_recovery(traj, num_bootstrap=200, confidence=0.9, seed=0)
  assert set(r) == {"all", "action", "format", "parse_error", "unknown_tool", "tool_failure"}
  assert r["action"]["valid"]["n"] == 1 and r["format"]["valid"]["n"] == 3
  assert r["format"]["valid"]["rate"] == pytest.approx(2 / 3)
  assert (r["all"]["valid"]["rate"], r["all"]["valid"]["n"]) == (0.75, 4)
  assert r["all"]["oracle"]["rate"] == 0.5
  assert r["parse_error"]["valid"]["rate"] == 1.0 and r["parse_error"]["oracle"]["rate"] == 1.0
  assert r["unknown_tool"]["valid"]["rate"] == 0.0 and r["unknown_tool"]["valid"]["n"] == 1
  assert r["tool_failure"]["valid"]["rate"] == 1.0 and r["tool_failure"]["oracle"]["rate"] == 0.0
  # Intervals resample tasks, not states: rows 0 and 1 are two tasks, so the pooled rate takes
  # three values (row 0 only: 1.0; row 1 only: 0.5; both: 0.75) ...
  a = r["all"]["valid"]
  assert a["lo"] == 0.5 and a["hi"] == 1.0 and a["tasks"] == 2
  # ... and with every row in one task, the one task always comes back: no uncertainty is seen
  # (a state bootstrap would give a wide interval here).
  one = traj.replace(task_id=np.zeros_like(traj.task_id))
  a = recovery.on_policy_recovery(one, num_bootstrap=200, confidence=0.9, seed=0)["all"]["valid"]
  assert a["lo"] == a["hi"] == 0.75 and a["tasks"] == 1


def test_recovery_matches_rollout_stats_pooled_rate():
  """The pooled on-policy rate equals `trajectory_stats`' recovery rate (one definition)."""
  from jaxagent.rollout.stats import trajectory_stats
  traj = trajectory(**HAND)
  r = recovery.on_policy_recovery(traj, num_bootstrap=10, confidence=0.9, seed=0)
  s = jax.device_get(trajectory_stats(traj))
  assert r["all"]["valid"]["rate"] == pytest.approx(float(s["recovery_rate"]))
  assert r["all"]["oracle"]["rate"] == pytest.approx(float(s["recovery_oracle_rate"]))


def test_no_error_states_reports_none_not_zero():
  traj = trajectory(acted=[[1, 1]], error_kind=[[0, 0]], valid=[[1, 1]], oracle=[[1, 1]])
  r = recovery.on_policy_recovery(traj, num_bootstrap=10, confidence=0.9, seed=0)
  none = {"rate": None, "lo": None, "hi": None, "n": 0, "tasks": 0}
  assert r == {k: {"valid": none, "oracle": none} for k in ("all", "action", "format")}


@pytest.fixture(scope="module")
def env(builtin_tokenizer):
  return envs.make("lookup", builtin_tokenizer, hops=2, distractor_entities=2)


_JIT: dict = {}


def _jitted(env):
  """(reset, step, vmapped step, vmapped oracle_action), jitted once per environment."""
  if id(env) not in _JIT:
    _JIT[id(env)] = (jax.jit(env.reset), jax.jit(env.step), jax.jit(jax.vmap(env.step)),
                     jax.jit(jax.vmap(env.oracle_action)))
  return _JIT[id(env)]


def _hand_episodes(env, task, actions: list[list[str]]):
  """Steps `env` through hand-written action texts per row (same task), recording the Trajectory
  the rollout engine would: per-turn records and the received action tokens."""
  reset, step, _, _ = _jitted(env)
  b, t, a = len(actions), len(actions[0]), env.max_action_len
  toks = np.zeros((b, t, a), np.int32)
  lens = np.zeros((b, t), np.int32)
  rec = {k: np.zeros((b, t), np.int32) for k in ("kind", "valid", "oracle")}
  for i, row in enumerate(actions):
    state, _ = reset(jax.random.key(0), task, -1)
    for j, text in enumerate(row):
      ids = env.codec.encode(text)
      toks[i, j, :len(ids)] = ids
      lens[i, j] = len(ids)
      state, _, info = step(state, TokenBuffer(jnp.asarray(toks[i, j]), jnp.int32(len(ids))))
      rec["kind"][i, j], rec["valid"][i, j] = int(info.error_kind), int(info.valid_call)
      rec["oracle"][i, j] = int(info.oracle_match)
  tokens = np.arange(b * 64, dtype=np.int32).reshape(b, 64) % 500 + 1
  turn_start = np.tile(np.array([10, 20, 30, 40], np.int32)[:t], (b, 1))
  return trajectory(np.ones((b, t), bool), rec["kind"], rec["valid"], rec["oracle"],
                    tokens=tokens, turn_start=turn_start, action_tokens=toks, action_len=lens)


def test_controlled_error_states_replay_hand_actions(env):
  task = env.sample_task(jax.random.key(3))
  name = lambda i: ENTITY_NAMES[int(task.entities[i])]
  rel = lambda h: RELATION_NAMES[int(task.relations[int(task.path[h])])]
  hop0, hop1, answer = f"lookup({name(0)}, {rel(0)})", f"lookup({name(1)}, {rel(1)})", f"answer({name(2)})"
  actions = [["hello", hop0, f"lookup({name(1)}, nosuch)", hop0],     # parse, ok, bad args, ok
             [hop0, hop1, "search(x)", answer]]                        # ok, ok, unknown tool, ok
  traj = _hand_episodes(env, task, actions)
  # The premise: the environment judged the hand-written actions as intended.
  np.testing.assert_array_equal(traj.error_kind, [[K.PARSE_ERROR, 0, K.BAD_ARGUMENTS, 0],
                                                  [0, 0, K.UNKNOWN_TOOL, 0]])
  np.testing.assert_array_equal(traj.oracle_match, [[0, 1, 0, 0], [1, 1, 0, 1]])
  tasks = jax.tree.map(lambda x: jnp.stack([x, x]), task)
  errs = recovery.controlled_error_states(make_replay_fn(env, False), tasks, traj)
  np.testing.assert_array_equal(errs.row, [0, 0, 1])
  np.testing.assert_array_equal(errs.turn, [1, 3, 3])
  np.testing.assert_array_equal(errs.prev_error_kind, [K.PARSE_ERROR, K.BAD_ARGUMENTS,
                                                       K.UNKNOWN_TOOL])
  # Replayed env states: turns taken, and chain progress (failed actions do not advance it).
  np.testing.assert_array_equal(errs.env_state.turn, [1, 3, 3])
  np.testing.assert_array_equal(errs.env_state.progress, [0, 1, 2])
  _, _, vstep, voracle = _jitted(env)
  oracle = voracle(errs.env_state)
  texts = [env.codec.decode(np.asarray(oracle.tokens[i])[:int(oracle.length[i])])
           for i in range(3)]
  assert texts == [hop0, hop1, answer]
  # The prefix is the transcript before the turn's action.
  np.testing.assert_array_equal(errs.prefix_len, [20, 40, 40])
  for i, (r, n) in enumerate(zip(errs.row, errs.prefix_len)):
    np.testing.assert_array_equal(errs.prefix[i, :n], traj.tokens[r, :n])
    assert not errs.prefix[i, n:].any()
  # Stepping each replayed state with the recorded action reproduces the recorded outcome.
  acts = TokenBuffer(jnp.asarray(traj.action_tokens[errs.row, errs.turn]),
                     jnp.asarray(traj.action_tokens_len[errs.row, errs.turn]))
  _, _, info = vstep(errs.env_state, acts)
  np.testing.assert_array_equal(info.valid_call, traj.valid_call[errs.row, errs.turn])
  np.testing.assert_array_equal(info.oracle_match, traj.oracle_match[errs.row, errs.turn])
  # Outcomes of those actions, by the kind of the failure before them.
  r = recovery.recovery_rates(errs.prev_error_kind, np.asarray(info.valid_call),
                              np.asarray(info.oracle_match), errs.task, num_bootstrap=50,
                              confidence=0.9, seed=0)
  assert r["all"]["valid"]["rate"] == 1.0 and r["all"]["oracle"]["rate"] == pytest.approx(2 / 3)
  assert r["bad_arguments"]["oracle"]["rate"] == 0.0 and r["parse_error"]["oracle"]["rate"] == 1.0


def test_subset_is_seeded_and_ordered(env):
  task = env.sample_task(jax.random.key(4))
  traj = _hand_episodes(env, task, [["x", "y", "z", "w"]] * 2)     # every turn a parse error
  tasks = jax.tree.map(lambda x: jnp.stack([x, x]), task)
  replay_fn = make_replay_fn(env, False)
  a = recovery.controlled_error_states(replay_fn, tasks, traj, max_states=4, seed=1)
  b = recovery.controlled_error_states(replay_fn, tasks, traj, max_states=4, seed=1)
  assert len(a) == 4
  np.testing.assert_array_equal(a.row * 10 + a.turn, b.row * 10 + b.turn)
  assert np.all(np.diff(a.row * 10 + a.turn) > 0)
  assert set(zip(a.row.tolist(), a.turn.tolist())) <= {(r, t) for r in (0, 1) for t in (1, 2, 3)}
