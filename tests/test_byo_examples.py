"""The guide's bring-your-own-environment examples (examples/): the guide holds their code as it
is, the tools behave as documented, and `launch.train`'s loop trains each through config alone
(examples/byo_config.py)."""

import copy
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from examples import byo_config
from examples.byo_host_env import CalcEnv, CalcEpisode, CalcTask
from examples.byo_jax_env import GuessEnv
from jaxagent import train
from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.envs.host import parse_call_text

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _code(path):
  """A file's code after its module docstring."""
  text = (ROOT / path).read_text()
  return text[text.index('"""', 3) + 4:].lstrip("\n")


def test_the_guide_holds_the_examples_code_as_it_is():
  guide = (ROOT / "docs/guides/environments.md").read_text()
  for path in ("examples/byo_host_env.py", "examples/byo_jax_env.py"):
    assert "```python\n" + _code(path) + "```" in guide, path


def _episode(a=12, b=30, c=4):
  return CalcEpisode(CalcTask(numbers=np.asarray([a, b, c], np.int32)))


def _act(ep, text):
  return ep.act(parse_call_text(text.encode(), 64))


def test_calc_tool_gives_every_error_kind_and_its_oracle_solves_in_optimal_turns():
  kinds = {text: _act(_episode(), text).error_kind for text in
           ("calc(12 + 30", "calcs(12 + 30)", "calc(12, 30)", "calc(12 / 0)", "answer(7)",
            "calc(12 + 30)")}
  assert kinds == {"calc(12 + 30": ErrorKind.PARSE_ERROR, "calcs(12 + 30)": ErrorKind.UNKNOWN_TOOL,
                   "calc(12, 30)": ErrorKind.BAD_ARGUMENTS, "calc(12 / 0)": ErrorKind.TOOL_FAILURE,
                   "answer(7)": ErrorKind.WRONG_ANSWER, "calc(12 + 30)": ErrorKind.NONE}
  for numbers in ((12, 30, 4), (5, 6, 1)):
    ep, turns = _episode(*numbers), 0
    while True:
      turns += 1
      # Each plausible mistake of this state makes the kind it says (on a copy of the episode).
      for kind, pieces in ep.error_actions():
        assert _act(copy.deepcopy(ep), "".join(pieces)).error_kind == kind, pieces
      out = _act(ep, "".join(ep.oracle()))
      assert out.oracle_match and out.error_kind == ErrorKind.NONE
      if out.final_answer:
        break
    assert out.solved and turns == ep.optimal_turns == (2 if numbers[2] == 1 else 3)


def test_calc_env_runs_as_a_host_environment(builtin_tokenizer):
  env = envs.make("examples.byo_host_env:CalcEnv", builtin_tokenizer, max_number=9)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 16))
  assert int(tasks.numbers.min()) >= 1 and int(tasks.numbers.max()) <= 9
  state, obs = env.reset(tasks)
  solved = np.zeros((16,), bool)
  for _ in range(3):
    state, obs, info = env.step(state, env.oracle_action(state))
    solved |= info.solved
  assert solved.all() and state.done.all()
  assert (state.turn == np.asarray([ep.optimal_turns for ep in state.episodes])).all()


def test_guess_oracle_solves_the_ten_secrets_as_the_guide_says(builtin_tokenizer):
  env = GuessEnv(envs.codec_for(builtin_tokenizer), size=10)
  secrets = jnp.arange(10, dtype=jnp.int32)
  state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), 10), secrets,
                                 jnp.full((10,), 6))
  step, oracle = jax.jit(jax.vmap(env.step)), jax.jit(jax.vmap(env.oracle_action))
  solved_at = []
  for _ in range(4):
    was_done = state.done
    state, _, info = step(state, oracle(state))
    assert bool(jnp.all(info.valid_call | was_done) & jnp.all(info.oracle_match | was_done))
    solved_at.append(int(jnp.sum(info.solved & ~was_done)))
  assert solved_at == [1, 2, 4, 3]
  # A number out of range is bad arguments.
  row = env.codec.encode_text("guess(10)")
  tokens = np.full((10, env.max_action_len), env.codec.pad_id, np.int32)
  tokens[:, :len(row)] = row
  bad = TokenBuffer(tokens=jnp.asarray(tokens), length=jnp.full((10,), len(row), jnp.int32))
  state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), 10), secrets,
                                 jnp.full((10,), -1))
  _, _, info = step(state, bad)
  assert (np.asarray(info.error_kind) == ErrorKind.BAD_ARGUMENTS).all()


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(byo_config.ENVS))
def test_each_example_trains_through_config_alone(example, tmp_path, metrics_lines):
  c = byo_config.get_config(example)
  c.num_devices = 1
  c.data.num_train, c.data.num_validation, c.data.num_test = 32, 8, 8
  c.sft.steps, c.rl.steps = 2, 1
  assert train.run(c, tmp_path) == {"workdir": str(tmp_path), "sft_steps": 2, "rl_steps": 1}
  assert [(l["phase"], l["step"]) for l in metrics_lines(tmp_path)] == [
      ("sft", 1), ("sft", 2), ("rl", 1)]
  with pytest.raises(ValueError, match="unknown example"):
    byo_config.get_config("chess")
