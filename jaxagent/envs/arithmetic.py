"""`arithmetic`: evaluate an expression with calculator tools, one operation per turn.

A task is a left-nested expression of `num_ops` operations on whole numbers,

    Compute ((3 + 12) * 4) - 7.

The agent calls `add(a, b)`, `sub(a, b)` or `mul(a, b)` once per operation and ends with
`answer(n)`; optimal_turns = num_ops + 1. Every intermediate value stays in [0, max_value].

Texts (exact; [..] only with a visible budget, see `common.py`):
  system: SYSTEM_TEXT with max_value filled in
  user:   "Compute {expression}." ["\\nYou have N turns."]
  step bodies ([..] = "\\nTurns left: k." with a visible budget):
    calculator success   "{a} + {b} = {c}."   (" - ", " * " for sub, mul)
    correct answer       "Correct."
    wrong answer         "Wrong answer."                        (wrong_answer; ends the episode)
    otherwise            "Error: " + one of the messages below

Error kinds: parse_error, unknown_tool, bad_arguments (wrong arity, an argument that is not a whole
number, or one above max_value), tool_failure (sub below zero, a result above max_value),
wrong_answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.envs import common
from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import TextCodec, byte_table, concat, mask_piece

TOOLS = ("add", "sub", "mul", "answer")
ADD, SUB, MUL, ANSWER = range(4)
OP_TEXT = (" + ", " - ", " * ")

SYSTEM_TEXT = (
    "You compute the value of an arithmetic expression with a calculator, one tool call per turn.\n"
    "Tools:\n"
    "add(a, b): returns a + b.\n"
    "sub(a, b): returns a - b.\n"
    "mul(a, b): returns a * b.\n"
    "answer(n): gives your final answer and ends the episode.\n"
    "Numbers are whole numbers from 0 to {max_value}.")
CORRECT, WRONG, PARSE, UNKNOWN_TOOL, OP_ARITY, ANSWER_ARITY, NOT_A_NUMBER, OUT_OF_RANGE, NEGATIVE, TOO_LARGE = range(10)
RESULT = 10
MESSAGES = (
    "Correct.",
    "Wrong answer.",
    "could not parse the action. Reply with one tool call, e.g. add(2, 3).",
    "unknown tool. The tools are add, sub, mul and answer.",
    "add, sub and mul take two numbers, e.g. add(2, 3).",
    "answer takes one number: answer(n).",
    "arguments must be whole numbers written with digits.",
    "arguments must be at most {max_value}.",
    "the result would be negative.",
    "the result would be larger than {max_value}.",
)
ERROR_OF_MESSAGE = (ErrorKind.NONE, ErrorKind.WRONG_ANSWER, ErrorKind.PARSE_ERROR,
                    ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS, ErrorKind.BAD_ARGUMENTS,
                    ErrorKind.BAD_ARGUMENTS, ErrorKind.BAD_ARGUMENTS, ErrorKind.TOOL_FAILURE,
                    ErrorKind.TOOL_FAILURE, ErrorKind.NONE)


@struct.dataclass
class ArithmeticTask:
  """values[0] = first operand; values[i+1] = ops[i](values[i], operands[i])."""
  ops: jax.Array       # [K] int32 in {ADD, SUB, MUL}
  operands: jax.Array  # [K] int32
  values: jax.Array    # [K+1] int32: the running value; values[K] is the answer


@struct.dataclass
class ArithmeticState:
  task: ArithmeticTask
  progress: jax.Array  # [] int32: operations of the expression computed so far (in order)
  turn: jax.Array      # [] int32
  budget: jax.Array    # [] int32: -1 hidden
  done: jax.Array      # [] bool


class ArithmeticEnv:
  """Calculator task. Knobs: num_ops (>= 1, turns = num_ops + 1), max_operand (operands of the
  expression are drawn from [0, max_operand]), max_value (the calculator's range, <= 999999999);
  max_action_len (tokens) and max_action_bytes bound an action."""
  name = "arithmetic"

  def __init__(self, codec: TextCodec, num_ops: int = 3, max_operand: int = 20,
               max_value: int = 999_999, max_action_len: int = 32, max_action_bytes: int = 128):
    if num_ops < 1 or max_operand < 1:
      raise ValueError(f"need num_ops >= 1 and max_operand >= 1, got {num_ops}, {max_operand}")
    if not max_operand <= max_value <= 999_999_999:
      raise ValueError(f"need max_operand <= max_value <= 999999999, got {max_operand}, {max_value}")
    self.codec = codec
    self.num_ops, self.max_operand, self.max_value = num_ops, max_operand, max_value
    self.digits, self.operand_digits = len(str(max_value)), len(str(max_operand))
    self.max_action_len, self.max_action_bytes = max_action_len, max_action_bytes
    self.tool_table = byte_table(TOOLS)
    self.messages = codec.fragment_table([m.format(max_value=max_value) for m in MESSAGES])
    self.ops_text = codec.fragment_table(OP_TEXT)
    self.tool_open = codec.fragment_table([t + "(" for t in TOOLS])
    self.frag = {s: codec.fragment(s) for s in ("Compute ", "(", ")", ".", " = ", ", ")}
    self.system = codec.fragment(SYSTEM_TEXT.format(max_value=max_value))
    task = jax.eval_shape(self.sample_task, jax.random.key(0))
    zero = jnp.zeros((), jnp.int32)
    n_prompt = jax.eval_shape(lambda t: concat(self._prompt_pieces(t, zero)).tokens, task).shape[0]
    n_step = jax.eval_shape(lambda: concat(self._step_pieces(zero, zero, zero, zero, zero, zero, zero)).tokens).shape[0]
    self.max_obs_len = -(-max(n_prompt, n_step) // 8) * 8
    # Observations after the first fit in this many tokens (the rollout reserves only that).
    self.max_step_obs_len = -(-n_step // 8) * 8

  # ---- tasks ----------------------------------------------------------------------------------

  def sample_task(self, key: jax.Array) -> ArithmeticTask:
    """A random expression whose running value stays in [0, max_value] (pure; vmappable).

    The first operand is in [1, max_operand]; each later operand in [1, max_operand] ([2, ..] for
    mul) as far as the range allows; a subtraction from 0 becomes an addition.
    """
    k = self.num_ops
    u = jax.random.uniform(key, (1 + 2 * k,))   # one PRNG call keeps the compiled program small

    def randint(x, lo, hi):   # uniform integer in [lo, hi] from a uniform x in [0, 1)
      return jnp.minimum(lo + (x * (hi - lo + 1)).astype(jnp.int32), hi)

    start = randint(u[0], 1, self.max_operand)
    ops = jnp.minimum((u[1:1 + k] * 3).astype(jnp.int32), 2)

    def one(v, xs):
      op, x = xs
      op = jnp.where((op == SUB) & (v == 0), ADD, op)   # keep subtractions meaningful
      hi = jnp.select([op == ADD, op == SUB],
                      [self.max_value - v, v], jax.lax.div(jnp.int32(self.max_value), jnp.maximum(v, 1)))
      hi = jnp.minimum(hi, self.max_operand)
      lo = jnp.minimum(jnp.where(op == MUL, 2, 1), hi)  # no +0, -0, *0, *1 unless forced
      b = randint(x, lo, hi)
      nv = jnp.select([op == ADD, op == SUB], [v + b, v - b], v * b)
      return nv, (op, b, nv)

    _, (ops, operands, values) = jax.lax.scan(one, start, (ops, u[1 + k:]))
    return ArithmeticTask(ops=ops, operands=operands, values=jnp.concatenate([start[None], values]))

  def optimal_turns(self, task: ArithmeticTask) -> jax.Array:
    del task
    return jnp.int32(self.num_ops + 1)

  # ---- rendering ------------------------------------------------------------------------------

  def _int(self, v, digits=None):
    return self.codec.int_pieces(v, digits or self.digits)

  def _prompt_pieces(self, task: ArithmeticTask, budget: jax.Array) -> list:
    fr = self.frag
    d = self.operand_digits   # the expression's numbers are <= max_operand
    user = [fr["Compute "]] + [fr["("]] * (self.num_ops - 1) + self._int(task.values[0], d)
    for i in range(self.num_ops):
      user += [self.ops_text.row(task.ops[i]), *self._int(task.operands[i], d)]
      if i < self.num_ops - 1:
        user.append(fr[")"])
    user += [fr["."], *common.budget_intro(self.codec, budget)]
    return self.codec.prompt([self.system], user)

  def _step_pieces(self, msg, op, a, b, c, budget, turns_taken) -> list:
    is_result = msg == RESULT
    is_error = (msg >= PARSE) & ~is_result
    body = [mask_piece(common.error_prefix(self.codec), is_error),
            mask_piece(self.messages.row(jnp.minimum(msg, len(MESSAGES) - 1)), ~is_result),
            *[mask_piece(p, is_result) for p in self._int(a)],
            mask_piece(self.ops_text.row(jnp.clip(op, 0, 2)), is_result),
            *[mask_piece(p, is_result) for p in self._int(b)],
            mask_piece(self.frag[" = "], is_result),
            *[mask_piece(p, is_result) for p in self._int(c)],
            mask_piece(self.frag["."], is_result),
            *common.budget_suffix(self.codec, budget, turns_taken)]
    return self.codec.observation(body)

  # ---- contract -------------------------------------------------------------------------------

  def reset(self, key: jax.Array, task: ArithmeticTask | None = None,
            budget: jax.Array | int = -1) -> tuple[ArithmeticState, TokenBuffer]:
    """Starts an episode (a sampled task if `task` is None). Returns (state, prompt [max_obs_len])."""
    if task is None:
      task = self.sample_task(key)
    budget = jnp.asarray(budget, jnp.int32)
    state = ArithmeticState(task=task, progress=jnp.int32(0), turn=jnp.int32(0), budget=budget,
                            done=jnp.zeros((), bool))
    return state, common.render(self.codec, self._prompt_pieces(task, budget), self.max_obs_len)

  def step(self, state: ArithmeticState, action: TokenBuffer):
    """Parses and executes one action. Jittable and vmappable; a no-op after done."""
    task, p, mv = state.task, state.progress, self.max_value
    call = common.parse_action(self.codec, action, self.tool_table, 2, self.max_action_bytes)
    a, a_ok = common.arg_uint(call, 0)
    b, b_ok = common.arg_uint(call, 1)
    digits_a, digits_b = common.arg_is_digits(call, 0), common.arg_is_digits(call, 1)
    is_op = (call.tool >= 0) & (call.tool < ANSWER)
    is_answer = call.tool == ANSWER
    # Overflow-free checks in int32: a, b <= max_value <= 999999999, so a + b < 2**31.
    too_large = jnp.select([call.tool == ADD, call.tool == MUL],
                           [a + b > mv, (b > 0) & (a > jax.lax.div(jnp.int32(mv), jnp.maximum(b, 1)))], False)
    result = jnp.select([call.tool == ADD, call.tool == SUB], [a + b, a - b],
                        jnp.where(too_large, 0, a * b))
    msg = jnp.select(
        [~call.syntax_ok, call.tool < 0,
         is_op & (call.num_args != 2), is_op & ~(digits_a & digits_b),
         is_op & (~(a_ok & b_ok) | (a > mv) | (b > mv)),
         is_op & (result < 0), is_op & too_large, is_op,
         call.num_args != 1, ~digits_a, a_ok & (a == task.values[-1])],
        [PARSE, UNKNOWN_TOOL, OP_ARITY, NOT_A_NUMBER, OUT_OF_RANGE, NEGATIVE, TOO_LARGE, RESULT,
         ANSWER_ARITY, NOT_A_NUMBER, CORRECT], WRONG)
    error_kind = jnp.asarray([int(k) for k in ERROR_OF_MESSAGE], jnp.int32)[msg]
    pc = jnp.minimum(p, self.num_ops - 1)
    want_op, want_a, want_b = task.ops[pc], task.values[pc], task.operands[pc]
    commutes = want_op != SUB
    same_args = ((a == want_a) & (b == want_b)) | (commutes & (a == want_b) & (b == want_a))
    on_chain = (msg == RESULT) & (p < self.num_ops) & (call.tool == want_op) & same_args
    final = is_answer & ((msg == CORRECT) | (msg == WRONG))
    solved = msg == CORRECT
    new_state = state.replace(progress=p + on_chain.astype(jnp.int32), done=final)
    obs = common.render(self.codec, self._step_pieces(msg, call.tool, a, b, result, state.budget,
                                                      state.turn + 1), self.max_obs_len)
    info = StepInfo(reward=solved.astype(jnp.float32), done=final, solved=solved, final_answer=final,
                    valid_call=common.is_valid_call(error_kind), error_kind=error_kind,
                    oracle_match=jnp.where(p < self.num_ops, on_chain, solved),
                    optimal_turns=self.optimal_turns(task))
    return common.finish_step(state, new_state, obs, info)

  def oracle_action(self, state: ArithmeticState) -> TokenBuffer:
    """The expert's next action: the next operation on the running value, then answer(value)."""
    task, p = state.task, state.progress
    ask = p < self.num_ops
    pc = jnp.minimum(p, self.num_ops - 1)
    pieces = [self.tool_open.row(jnp.where(ask, task.ops[pc], ANSWER)),
              *self._int(task.values[jnp.minimum(p, self.num_ops)]),
              mask_piece(self.frag[", "], ask),
              *[mask_piece(x, ask) for x in self._int(task.operands[pc], self.operand_digits)],
              self.frag[")"]]
    return concat(pieces, self.max_action_len, self.codec.pad_id)
