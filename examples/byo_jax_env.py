"""A JAX environment brought to jaxagent: guess a secret number (docs/guides/environments.md).

    python -m launch.train --config=examples/byo_config.py:guess --workdir=/tmp/guess

The tool answers "Higher.", "Lower." or "Correct."; the oracle bisects, so a secret in
0..size-1 is found in at most size.bit_length() turns. Everything is pure JAX, so the whole
multi-turn rollout compiles to one program.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.envs import common
from jaxagent.envs.base import ErrorKind, StepInfo
from jaxagent.envs.codec import byte_table, concat, mask_piece

MESSAGES = ("Higher.", "Lower.", "Correct.", "could not parse the action.",
            "unknown tool.", "guess takes one whole number in range.")
HIGHER, LOWER, CORRECT, PARSE, UNKNOWN, BAD_ARGS = range(6)
ERROR_OF = (ErrorKind.NONE, ErrorKind.NONE, ErrorKind.NONE, ErrorKind.PARSE_ERROR,
            ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS)


@struct.dataclass
class GuessState:          # finish_step needs turn, budget and done
  secret: jax.Array        # [] int32
  low: jax.Array           # [] int32: the oracle's lower bound
  high: jax.Array          # [] int32: the oracle's upper bound
  turn: jax.Array
  budget: jax.Array
  done: jax.Array


class GuessEnv:
  """`config.env.name = "examples.byo_jax_env:GuessEnv"`. Knob: size (secrets 0..size-1)."""
  name = "guess"

  def __init__(self, codec, size: int = 100, max_action_len: int = 16,
               max_action_bytes: int = 32):
    self.codec, self.size = codec, size
    self.max_action_len, self.max_action_bytes = max_action_len, max_action_bytes
    self.tools = byte_table(["guess"])
    self.system = codec.fragment(
        f"Guess the secret number between 0 and {size - 1}, one call per turn.\n"
        "Tools:\nguess(n): says whether the secret is higher, lower, or n.")
    self.question = codec.fragment("Find the number.")
    self.messages = codec.fragment_table(MESSAGES)
    self.numbers = codec.fragment_table([str(i) for i in range(size)])
    self.open, self.close = codec.fragment("guess("), codec.fragment(")")
    zero = jnp.zeros((), jnp.int32)
    n = max(concat(self._prompt(zero)).tokens.shape[0],
            concat(self._body(zero, zero, zero)).tokens.shape[0])
    self.max_obs_len = self.max_step_obs_len = -(-n // 8) * 8

  def sample_task(self, key):                    # a task: the secret, an int32 scalar
    return jax.random.randint(key, (), 0, self.size, jnp.int32)

  def _prompt(self, budget):
    return self.codec.prompt([self.system],
                             [self.question, *common.budget_intro(self.codec, budget)])

  def _body(self, msg, budget, turns_taken):
    return self.codec.observation([
        mask_piece(common.error_prefix(self.codec), msg >= PARSE), self.messages.row(msg),
        *common.budget_suffix(self.codec, budget, turns_taken)])

  def reset(self, key, task=None, budget=-1):
    secret = self.sample_task(key) if task is None else task
    budget = jnp.asarray(budget, jnp.int32)
    state = GuessState(secret=secret, low=jnp.int32(0), high=jnp.int32(self.size - 1),
                       turn=jnp.int32(0), budget=budget, done=jnp.zeros((), bool))
    return state, common.render(self.codec, self._prompt(budget), self.max_obs_len)

  def step(self, state, action):
    call = common.parse_action(self.codec, action, self.tools, 1, self.max_action_bytes)
    n, ok = common.arg_uint(call, 0)
    msg = jnp.select([~call.syntax_ok, call.tool < 0,
                      ~ok | (call.num_args != 1) | (n >= self.size),
                      n < state.secret, n > state.secret],
                     [PARSE, UNKNOWN, BAD_ARGS, HIGHER, LOWER], CORRECT)
    error_kind = jnp.asarray([int(k) for k in ERROR_OF], jnp.int32)[msg]
    solved = msg == CORRECT
    oracle = (state.low + state.high) // 2
    new_state = state.replace(
        low=jnp.where(msg == HIGHER, jnp.maximum(state.low, n + 1), state.low),
        high=jnp.where(msg == LOWER, jnp.minimum(state.high, n - 1), state.high), done=solved)
    obs = common.render(self.codec, self._body(msg, state.budget, state.turn + 1),
                        self.max_obs_len)
    info = StepInfo(reward=solved.astype(jnp.float32), done=solved, solved=solved,
                    final_answer=solved, valid_call=common.is_valid_call(error_kind),
                    error_kind=error_kind, oracle_match=(msg < PARSE) & (n == oracle),
                    optimal_turns=jnp.int32(self.size.bit_length()))
    return common.finish_step(state, new_state, obs, info)

  def oracle_action(self, state):
    return concat([self.open, self.numbers.row((state.low + state.high) // 2), self.close],
                  self.max_action_len, self.codec.pad_id)
