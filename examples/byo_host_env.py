"""A host tool brought to jaxagent: a calculator in plain Python (docs/guides/environments.md).

    python -m launch.train --config=examples/byo_config.py:calc --workdir=/tmp/calc

The task: "What is (a + b) * c?". The tool `calc(x op y)` computes one operation; `answer(n)`
ends the episode. The expert computes a + b, then the sum times c, then answers: 3 turns.
"""

import re

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.envs.base import ErrorKind
from jaxagent.envs.host import HostEnv, Outcome

SYSTEM = ("Answer the question with the calculator, one call per turn.\nTools:\n"
          "calc(x op y): x and y whole numbers, op one of + - * /; returns the result.\n"
          "answer(n): gives your final answer and ends the episode.")
_EXPR = re.compile(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*")


@struct.dataclass
class CalcTask:                        # a pytree of arrays: what the task splits store
  numbers: jax.Array                   # [3] int32: a, b, c


class CalcEpisode:
  """One episode: text in (a parsed call), text out (an `Outcome`)."""

  def __init__(self, task: CalcTask):
    self.a, self.b, self.c = (int(x) for x in task.numbers)
    self.target = (self.a + self.b) * self.c
    self.results: list[int] = []       # what the agent has computed so far
    self.optimal_turns = 2 if self.c == 1 else 3

  def prompt(self):
    return [SYSTEM], [f"What is ({self.a} + {self.b}) * {self.c}?"]

  def act(self, call):
    err = lambda kind, text: Outcome(["Error: ", text], kind)
    if call is None:
      return err(ErrorKind.PARSE_ERROR, "write one call, e.g. calc(2 + 3).")
    if call.name == "answer":
      if len(call.args) != 1 or not re.fullmatch(r"-?\d+", call.args[0]):
        return err(ErrorKind.BAD_ARGUMENTS, "answer takes one whole number.")
      if int(call.args[0]) == self.target:
        return Outcome(["Correct."], solved=True, final_answer=True,
                       oracle_match=self.target in self.results)
      return Outcome(["Wrong answer."], ErrorKind.WRONG_ANSWER, final_answer=True)
    if call.name != "calc":
      return err(ErrorKind.UNKNOWN_TOOL, "the tools are calc and answer.")
    m = _EXPR.fullmatch(call.args[0]) if len(call.args) == 1 else None
    if m is None:
      return err(ErrorKind.BAD_ARGUMENTS, "calc takes one operation: calc(x op y).")
    x, op, y = int(m[1]), m[2], int(m[3])
    if op == "/" and y == 0:
      return err(ErrorKind.TOOL_FAILURE, "division by zero.")
    want = self.oracle()
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else 0}[op]
    self.results.append(value)
    return Outcome([f"{x} {op} {y} = {value}"],
                   oracle_match=f"calc({x} {op} {y})" == "".join(want))

  def oracle(self):
    s = self.a + self.b
    if s not in self.results:
      return [f"calc({self.a} + {self.b})"]
    if self.target not in self.results:
      return [f"calc({s} * {self.c})"]
    return [f"answer({self.target})"]

  def error_actions(self):
    """Plausible mistakes in this state, with the kind each makes (for the demonstrations)."""
    good = "".join(self.oracle())
    name, args = good[:-1].split("(")
    return [(ErrorKind.PARSE_ERROR, [good[:-1]]),
            (ErrorKind.UNKNOWN_TOOL, [f"{name}s({args})"]),
            (ErrorKind.BAD_ARGUMENTS, [f"{name}({args}, {args})"]),
            (ErrorKind.TOOL_FAILURE, [f"calc({self.a} / 0)"])]


class CalcEnv(HostEnv):
  """The calculator as an environment: `config.env.name = "examples.byo_host_env:CalcEnv"`,
  built as CalcEnv(codec, **config.env.difficulty). Knob: max_number (operands 1..max_number)."""

  def __init__(self, codec, max_number: int = 99):
    self.max_number = max_number
    longest = CalcEpisode(CalcTask(numbers=[max_number] * 3))
    system, user = longest.prompt()
    n = sum(len(codec.encode_text(t)) for t in system + user)
    super().__init__(codec, CalcEpisode, max_obs_len=-(-(n + 48) // 8) * 8, max_action_len=32,
                     max_action_bytes=64, name="calc", max_step_obs_len=64)

  def sample_task(self, key) -> CalcTask:   # JAX-traceable: the task splits vmap and jit it
    return CalcTask(numbers=jax.random.randint(key, (3,), 1, self.max_number + 1, jnp.int32))
