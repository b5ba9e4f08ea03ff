"""Tests of the `arithmetic` environment (envs/arithmetic.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxagent.envs as envs
from jaxagent.envs.arithmetic import ADD, MUL, SUB, ArithmeticTask
from jaxagent.envs.base import ErrorKind

K = ErrorKind
ACTION_LEN = 48
SYSTEM = (
    "You compute the value of an arithmetic expression with a calculator, one tool call per turn.\n"
    "Tools:\n"
    "add(a, b): returns a + b.\n"
    "sub(a, b): returns a - b.\n"
    "mul(a, b): returns a * b.\n"
    "answer(n): gives your final answer and ends the episode.\n"
    "Numbers are whole numbers from 0 to 999.")


@pytest.fixture(scope="module")
def ar(any_tokenizer, kit):
  env = envs.make("arithmetic", any_tokenizer, num_ops=3, max_operand=20, max_value=999,
                  max_action_len=ACTION_LEN)
  return kit.jitted(env)


def hand_task():
  """((3 * 4) + 12) - 7 = 17."""
  return ArithmeticTask(ops=jnp.asarray([MUL, ADD, SUB], jnp.int32),
                        operands=jnp.asarray([4, 12, 7], jnp.int32),
                        values=jnp.asarray([3, 12, 24, 17], jnp.int32))


@pytest.mark.parametrize("tokenizer,num_ops,max_operand,max_value", [
    ("builtin", 1, 9, 99), ("large", 4, 1000, 999_999_999)])   # one compile each
def test_oracle_solves_every_task_in_optimal_turns(request, kit, tokenizer, num_ops, max_operand, max_value):
  tok = request.getfixturevalue(f"{tokenizer}_tokenizer")
  env = envs.make("arithmetic", tok, num_ops=num_ops, max_operand=max_operand, max_value=max_value)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 256))
  values = np.asarray(tasks.values)
  assert values.min() >= 0 and values.max() <= max_value
  assert np.all(np.asarray(tasks.operands) <= max_operand)
  infos, state = kit.run_oracle(env, batch=256, budget=np.where(np.arange(256) % 2, -1, num_ops + 1))
  assert len(infos) == num_ops + 1
  for t, info in enumerate(infos):
    assert np.all(info.error_kind == K.NONE) and np.all(info.oracle_match) and np.all(info.valid_call)
    last = t == num_ops
    assert np.all(info.solved == last) and np.all(info.done == last) and np.all(info.reward == float(last))
  assert np.all(np.asarray(state.progress) == num_ops)


def test_prompt_is_chatml_for_the_builtin_tokenizer(builtin_tokenizer):
  env = envs.make("arithmetic", builtin_tokenizer, num_ops=3, max_operand=20, max_value=999)
  _, obs = jax.jit(env.reset)(jax.random.key(0), hand_task(), 20)
  assert env.codec.decode(obs) == (
      "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n"
      "Compute ((3 * 4) + 12) - 7.\nYou have 20 turns.<|im_end|>\n<|im_start|>assistant\n")


def test_observations_and_error_kinds_exact(ar, kit):
  codec, step = ar.codec, ar.step
  chat = codec.chat_text()
  state, obs = ar.reset(jax.random.key(0), hand_task(), 20)
  assert codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] +
                               "Compute ((3 * 4) + 12) - 7.\nYou have 20 turns." + chat["user_to_assistant"])
  script = [
      ("add 3 4", K.PARSE_ERROR, "Error: could not parse the action. Reply with one tool call, e.g. add(2, 3).", 0),
      ("div(3, 4)", K.UNKNOWN_TOOL, "Error: unknown tool. The tools are add, sub, mul and answer.", 0),
      ("mul(3)", K.BAD_ARGUMENTS, "Error: add, sub and mul take two numbers, e.g. add(2, 3).", 0),
      ("mul(three, 4)", K.BAD_ARGUMENTS, "Error: arguments must be whole numbers written with digits.", 0),
      ("mul(-3, 4)", K.BAD_ARGUMENTS, "Error: arguments must be whole numbers written with digits.", 0),
      ("mul(3, 1000)", K.BAD_ARGUMENTS, "Error: arguments must be at most 999.", 0),
      ("mul(3, 12345678901)", K.BAD_ARGUMENTS, "Error: arguments must be at most 999.", 0),
      ("sub(3, 4)", K.TOOL_FAILURE, "Error: the result would be negative.", 0),
      ("mul(999, 2)", K.TOOL_FAILURE, "Error: the result would be larger than 999.", 0),
      ("mul(4, 3)", K.NONE, "4 * 3 = 12.", 1),           # commuted: still the oracle's operation
      ("add(5, 5)", K.NONE, "5 + 5 = 10.", 0),           # valid, but not the oracle's
      ("add( 12 ,'12')", K.NONE, "12 + 12 = 24.", 1),
      ("sub(7, 24)", K.TOOL_FAILURE, "Error: the result would be negative.", 0),  # sub does not commute
      ("sub(24, 7)", K.NONE, "24 - 7 = 17.", 1),
      ("answer(x)", K.BAD_ARGUMENTS, "Error: arguments must be whole numbers written with digits.", 0),
      ("answer(1, 2)", K.BAD_ARGUMENTS, "Error: answer takes one number: answer(n).", 0),
      ("answer(16)", K.WRONG_ANSWER, "Wrong answer.", 0),
  ]
  for t, (text, kind, body, om) in enumerate(script):
    state, obs, info = step(state, kit.action(codec, text, ACTION_LEN))
    assert codec.decode(obs) == (
        chat["pre_obs"] + f"{body}\nTurns left: {19 - t}." + chat["obs_to_assistant"]), text
    assert int(info.error_kind) == kind, text
    assert bool(info.oracle_match) == bool(om), text
    assert bool(info.done) == (kind == K.WRONG_ANSWER), text
  assert int(state.progress) == 3 and bool(state.done)


def test_oracle_actions_and_correct_answer(ar):
  codec = ar.codec
  state, obs = ar.reset(jax.random.key(0), hand_task(), -1)
  assert "You have" not in codec.decode(obs)
  seen = []
  for _ in range(4):
    action = ar.oracle(state)
    seen.append(codec.decode(action))
    state, obs, info = ar.step(state, action)
  assert seen == ["mul(3, 4)", "add(12, 12)", "sub(24, 7)", "answer(17)"]
  assert bool(info.solved) and float(info.reward) == 1.0 and codec.decode(obs).count("Correct.") == 1
  assert "Turns left" not in codec.decode(obs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_tokens_never_break_the_env(ar, kit, data):
  _, new, _, _ = kit.arbitrary_step(ar, data, budgets=[-1, 1, 4])
  assert int(new.progress) in (0, 1)


_nums = st.integers(0, 2000).map(str) | st.sampled_from(("007", "1e3", "x", "", "12345678901"))
_calls = st.builds(
    lambda tool, args, sp: tool + "(" + ",".join(sp + a + sp for a in args) + ")",
    st.sampled_from(("add", "sub", "mul", "answer", "div")), st.lists(_nums, max_size=3),
    st.sampled_from(("", " ", "  ")))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=(_calls | st.text(alphabet="addsubmul(), 0123456789", max_size=ACTION_LEN)).filter(
    lambda t: len(t) <= ACTION_LEN))   # one token per character must fit the action buffer
def test_tokenisation_does_not_change_parsing(ar, kit, text):
  state, _ = ar.reset(jax.random.key(0), hand_task(), 5)
  kit.assert_splits_act_alike(ar, state, text)
