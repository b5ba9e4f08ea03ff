"""The multi-turn rollout engine: transcript layout, masks, log-probs, budgets, no recompiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.models import from_pretrained
from jaxagent.models.scoring import score
from jaxagent.rollout import RolloutConfig, Rollouts, Status, make_rollout_fn, rollout
from jaxagent.envs.base import TokenBuffer
from jaxagent.rollout.engine import step_obs_len
from jaxagent.models.sampler import SamplingConfig

NUM_TASKS, GROUP = 4, 2


@pytest.fixture(scope="module")
def policy():
  return from_pretrained("builtin:tiny")


@pytest.fixture(scope="module")
def env(policy):
  return envs.make("lookup", policy.tokenizer, hops=2)


def _oracle(env):
  return lambda state, key: env.oracle_action(state)


_JITTED = {}


def _jitted(env):
  if id(env) not in _JITTED:
    _JITTED[id(env)] = (jax.jit(env.reset), jax.jit(env.step))
  return _JITTED[id(env)]


def _replay(env, tasks, traj, b):
  """Re-runs row b's episode outside the engine, feeding it the actions the transcript holds.

  Returns the expected transcript tokens and per-turn records; the actions are read back from
  the transcript as the tokens with loss_mask 1 (minus the trailing end-of-turn token).
  """
  eot = env.codec.end_of_turn_id
  task = jax.tree.map(lambda x: x[b], tasks)
  budget = -1
  reset, step = _jitted(env)
  state, obs = reset(jax.random.key(0), task, budget)
  tokens = list(np.asarray(obs.tokens)[:int(obs.length)])
  tok = np.asarray(traj.tokens[b])
  mask = np.asarray(traj.loss_mask[b])
  turn = np.asarray(traj.turn_of_token[b])
  records = []
  for t in range(int(traj.num_turns[b])):
    sampled = tok[(turn == t) & (mask == 1)].tolist()
    action = sampled[:-1] if sampled and sampled[-1] == eot else sampled
    buf = np.zeros((env.max_action_len,), np.int32)
    buf[:len(action)] = action
    state, obs, info = step(state, envs.TokenBuffer(jnp.asarray(buf), jnp.int32(len(action))))
    tokens += action + [eot] + list(np.asarray(obs.tokens)[:int(obs.length)])
    records.append(info)
  return tokens, records


def test_oracle_forced_solves_everything_and_records_match(policy, env):
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(1), NUM_TASKS))
  traj = rollout(policy, env, jax.random.key(2), tasks, GROUP, budgets=6,
                 forced_action=_oracle(env))
  b = NUM_TASKS * GROUP
  assert traj.tokens.shape[0] == b
  assert np.all(np.asarray(traj.status) == Status.SOLVED)
  np.testing.assert_array_equal(traj.success_turn, traj.optimal_turns)
  np.testing.assert_array_equal(traj.num_turns, traj.optimal_turns)
  rep_tasks = jax.tree.map(lambda x: jnp.repeat(x, GROUP, axis=0), tasks)
  for row in range(b):
    tokens, records = _replay(env, rep_tasks, traj, row)
    n = int(traj.length[row])
    assert np.asarray(traj.tokens[row, :n]).tolist() == tokens
    for t, info in enumerate(records):
      assert bool(traj.valid_call[row, t]) == bool(info.valid_call)
      assert int(traj.error_kind[row, t]) == int(info.error_kind)
      assert bool(traj.solved[row, t]) == bool(info.solved)
      assert float(traj.reward[row, t]) == float(info.reward)
      assert bool(traj.oracle_match[row, t])
  # Forced tokens carry the policy's log-probs, like sampled ones.
  lp = np.asarray(score(policy, traj)) * np.asarray(traj.loss_mask)
  np.testing.assert_allclose(lp, traj.behaviour_logprobs, atol=1e-4)


def test_sampled_transcript_masks_and_logprobs(policy, env):
  traj = rollout(policy, env, jax.random.key(3), NUM_TASKS, GROUP, budgets=[1, 2, 3, 4],
                 max_turns=4, temperature=1.0)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.split(jax.random.key(3))[0],
                                                     NUM_TASKS))
  rep_tasks = jax.tree.map(lambda x: jnp.repeat(x, GROUP, axis=0), tasks)
  mask = np.asarray(traj.loss_mask)
  turn = np.asarray(traj.turn_of_token)
  for row in range(NUM_TASKS * GROUP):
    # The transcript is exactly prompt + (action <eot> observation)* as the env produced them.
    tokens, records = _replay(env, rep_tasks, traj, row)
    n = int(traj.length[row])
    assert np.asarray(traj.tokens[row, :n]).tolist() == tokens
    for t, info in enumerate(records):
      assert int(traj.error_kind[row, t]) == int(info.error_kind)
      # The recorded action is what the environment got; turn_start is the prefix before it.
      k = int(traj.action_tokens_len[row, t])
      sampled = np.asarray(traj.tokens[row])[(turn[row] == t) & (mask[row] == 1)].tolist()
      assert np.asarray(traj.action_tokens[row, t, :k]).tolist() == sampled[:k]
      assert int(traj.turn_start[row, t]) == int(np.argmax(turn[row] == t))
    # loss_mask is 1 only on sampled tokens: their count per turn is the action length.
    for t in range(int(traj.num_turns[row])):
      assert mask[row][turn[row] == t].sum() == int(traj.action_length[row, t])
    assert mask[row, n:].sum() == 0
    assert np.all(turn[row, n:] == -1)
  lp = np.asarray(score(policy, traj)) * mask
  np.testing.assert_allclose(lp, traj.behaviour_logprobs, atol=1e-4)
  assert np.all(np.asarray(traj.behaviour_logprobs)[mask == 0] == 0)


def test_rollout_and_scoring_agree_in_bfloat16(env):
  """bfloat16 compute and KV cache over float32 master weights: the rollout's behaviour log-probs
  (cached decode) against the update's scoring (one forward) of the same transcript. Stated
  tolerance: at most 0.02 nats per token and 0.005 on average (builtin:tiny measured ~3e-3 and
  ~6e-4; float32 agrees to 1e-4, above). The update recomputes its old log-probs in bfloat16
  (`LearnerConfig.behaviour_logprobs`), so this gap never enters the PPO ratio."""
  bf16 = from_pretrained("builtin:tiny", dtype="bfloat16", param_dtype="float32")
  assert {x.dtype for x in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.float32)}
  traj = rollout(bf16, env, jax.random.key(3), NUM_TASKS, GROUP, budgets=3, max_turns=3)
  mask = np.asarray(traj.loss_mask) > 0
  assert mask.sum() > 50
  gap = np.abs(np.asarray(score(bf16, traj)) - np.asarray(traj.behaviour_logprobs))[mask]
  assert gap.max() <= 0.02 and gap.mean() <= 0.005, (gap.max(), gap.mean())
  assert gap.max() > 0                                   # bfloat16 did round differently


def test_budgets_per_row_and_no_recompilation(policy, env):
  rollouts = Rollouts(policy.config, env)
  budgets = np.array([1, 3, 0, 5] * 2, np.int32)
  traj = rollouts(policy.params, jax.random.key(4), NUM_TASKS, GROUP, budgets=budgets,
                  max_turns=5)
  num = np.asarray(traj.num_turns)
  assert np.all(num <= budgets)
  acted = np.asarray(traj.acted)
  np.testing.assert_array_equal(acted.sum(1), num)
  status = np.asarray(traj.status)
  assert np.all(status[num == budgets] != Status.RUNNING)
  assert np.all((status == Status.BUDGET_SPENT) <= (num == budgets))
  assert num[2] == 0 and num[6] == 0          # budget 0: no turn at all
  assert (rollouts.compiles, rollouts.traces) == (1, 1)
  # New budgets, new tasks, new key, new sampling knobs: same compiled program, no new trace.
  rollouts(policy.params, jax.random.key(5), NUM_TASKS, GROUP, budgets=budgets[::-1].copy(),
           max_turns=5, temperature=0.7, top_k=5)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(9), NUM_TASKS))
  rollouts(policy.params, jax.random.key(6), tasks, GROUP, budgets=[2, 2, 5, 1], max_turns=5)
  assert (rollouts.compiles, rollouts.traces) == (1, 1)
  # Another T_max is another program.
  rollouts(policy.params, jax.random.key(6), tasks, GROUP, budgets=2, max_turns=2)
  assert (rollouts.compiles, rollouts.traces) == (2, 2)


def test_the_one_off_rollout_compiles_once_in_a_loop(policy, env):
  """`rollout(...)` keeps its owner on the policy: a loop over it with new keys, tasks and
  budgets traces one program; another environment or model config gets its own owner."""
  user = dataclasses.replace(policy)                 # a fresh policy: no owners yet
  for i in range(3):
    traj = rollout(user, env, jax.random.key(i), NUM_TASKS, GROUP, budgets=[1, 2, 3, 2],
                   max_turns=3)
    assert np.asarray(traj.num_turns).max() <= 3
  (owner,) = user.programs.values()
  assert (owner.compiles, owner.traces) == (1, 1)
  other_env = envs.make("lookup", policy.tokenizer, hops=2)
  rollout(user, other_env, jax.random.key(0), NUM_TASKS, GROUP, budgets=2, max_turns=3)
  assert len(user.programs) == 2 and (owner.compiles, owner.traces) == (1, 1)
  assert dataclasses.replace(user).programs == {}    # a copy starts with none
  # Flipping the attention switch: a second program, the same tokens.
  paths = {}
  for mode in ("xla", "kernel"):
    user.config = dataclasses.replace(user.config, attention=mode)
    paths[mode] = rollout(user, env, jax.random.key(7), NUM_TASKS, GROUP, budgets=3, max_turns=3)
  assert len(user.programs) == 4 and all(o.compiles == 1 for o in user.programs.values())
  np.testing.assert_array_equal(np.asarray(paths["xla"].tokens),
                                np.asarray(paths["kernel"].tokens))


@pytest.mark.parametrize("visible", [False, True])
def test_a_spent_budget_is_budget_spent_visible_or_not(policy, env, visible):
  """The engine alone ends an episode whose budget is spent: an agent that never answers
  (forced "nope()", an unknown tool) stops at its budget with BUDGET_SPENT, whether the budget
  is shown to it or not (the environment only shows it)."""
  ids = env.codec.encode("nope()")
  nope = TokenBuffer(tokens=jnp.asarray(np.pad(ids, (0, env.max_action_len - len(ids))),
                                        jnp.int32), length=jnp.int32(len(ids)))
  budgets = np.array([1, 2, 3, 4], np.int32)
  traj = Rollouts(policy.config, env)(
      policy.params, jax.random.key(4), NUM_TASKS, GROUP, budgets=budgets, max_turns=4,
      budget_visible=visible, forced_action=lambda state, key: nope)
  num, status = np.asarray(traj.num_turns), np.asarray(traj.status)
  np.testing.assert_array_equal(num, np.repeat(budgets, GROUP))
  assert np.all(status == Status.BUDGET_SPENT), status
  assert not np.asarray(traj.valid_call).any()


def test_context_full_stops_rows(policy, env):
  a = env.max_action_len
  ctx = env.max_obs_len + 2 * (a + 1 + step_obs_len(env))      # room for two turns only
  fn = make_rollout_fn(policy.config, env,
                       RolloutConfig(max_turns=5, max_action_tokens=a, context_len=ctx))
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(7), 2))
  traj = fn(policy.params, jax.random.key(8), tasks, jnp.array([5, 5]), jnp.arange(2),
            jnp.arange(2), SamplingConfig.make())
  # Rows stop when the next turn might not fit (worst case: longest action and observation).
  assert np.all(np.asarray(traj.status) == Status.CONTEXT_FULL)
  length = np.asarray(traj.length)
  assert np.all(length <= ctx)
  assert np.all(length + a + 1 + step_obs_len(env) > ctx)
  assert np.all((2 <= np.asarray(traj.num_turns)) & (np.asarray(traj.num_turns) < 5))


def test_host_env_gives_the_same_trajectory(policy, env):
  from jaxagent.envs.host import HostLookupEnv
  host = HostLookupEnv(env.codec, hops=2)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(11), NUM_TASKS))
  kw = dict(budgets=[1, 3, 2, 3], max_turns=3, temperature=1.0, budget_visible=True)
  jt = rollout(policy, env, jax.random.key(12), tasks, GROUP, **kw)
  ht = rollout(policy, host, jax.random.key(12), tasks, GROUP, **kw)
  for name in jt.__dataclass_fields__:
    if name == "state_id":
      continue
    np.testing.assert_allclose(np.asarray(getattr(ht, name)), np.asarray(getattr(jt, name)),
                               atol=1e-5, err_msg=name)
  # A host environment without `state_fingerprint` gets an id unique to each (row, turn): no two
  # steps share an anchor state.
  ids = np.asarray(ht.state_id)[np.asarray(ht.acted)]
  assert len({tuple(x) for x in ids.tolist()}) == len(ids)
  # Episodes really ran turns (the comparison is not between two empty batches).
  assert int(np.asarray(jt.num_turns).sum()) > 0
