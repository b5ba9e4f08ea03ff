"""Tests of the `grid` environment (envs/grid.py)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxagent.envs as envs
from jaxagent.envs.base import ERROR_KIND_NAMES, ErrorKind
from jaxagent.envs import grid
from jaxagent.envs.grid import UNREACHABLE, GridTask

K = ErrorKind
SYSTEM = (
    "You are an agent in a grid world. Reach the goal by calling tools, one call per turn.\n"
    "Tools:\n"
    "- move(direction): move one cell; direction is up, down, left or right. "
    "Moving into a wall or off the grid fails.\n"
    "- look(): describe the four cells around you.\n"
    "Reply with the call only, for example move(up).")


def hand_task():
  """A.#.      A start (0, 0), G goal (2, 3), # walls, T a trap. Shortest path: 5 moves
     .#T.      (down, down, right, right, right); (0, 1) is 6 moves away.
     ...G
     #...  """
  walls = np.zeros((4, 4), bool)
  walls[0, 2] = walls[1, 1] = walls[3, 0] = True
  traps = np.zeros((4, 4), bool)
  traps[1, 2] = True
  return GridTask(walls=jnp.asarray(walls), traps=jnp.asarray(traps),
                  start=jnp.asarray([0, 0], jnp.int32), goal=jnp.asarray([2, 3], jnp.int32))


HAND_USER = ("Map, 4 rows by 4 columns; row 0 is the top, column 0 the left:\n"
             "A.#.\n.#T.\n...G\n#...\n"
             "# is a wall, . is free, T is a trap (stepping on one ends the episode), A is you, "
             "G is the goal.\n"
             "You are at (0, 0). Reach the goal at (2, 3).")


@pytest.fixture(scope="module")
def gr(any_tokenizer, kit):
  env = envs.make("grid", any_tokenizer, size=4, num_traps=1)
  return kit.jitted(env)


def _bfs(walls, traps, goal):
  """Reference BFS in Python: distance of every cell to goal (None if unreachable)."""
  s = walls.shape[0]
  dist = {tuple(goal): 0}
  queue = collections.deque([tuple(goal)])
  while queue:
    r, c = queue.popleft()
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
      n = (r + dr, c + dc)
      if 0 <= n[0] < s and 0 <= n[1] < s and not walls[n] and not traps[n] and n not in dist:
        dist[n] = dist[(r, c)] + 1
        queue.append(n)
  return dist


@pytest.mark.parametrize("tokenizer,knobs", [
    ("builtin", dict(size=7, wall_density=0.3, num_traps=4)),
    ("large", dict(size=5, wall_density=0.2, num_traps=2))])
def test_oracle_solves_every_task_in_optimal_turns(request, kit, tokenizer, knobs):
  env = envs.make("grid", request.getfixturevalue(f"{tokenizer}_tokenizer"), **knobs)
  b = 256
  keys = jax.random.split(jax.random.key(0), b)   # the keys kit.run_oracle resets with
  opt = np.asarray(jax.jit(jax.vmap(lambda k: env.optimal_turns(env.sample_task(k))))(keys))
  assert np.all((opt >= 1) & (opt < UNREACHABLE))
  # Half the rows see a budget of exactly their optimal turns: solving on the last turn counts.
  budget = np.where(np.arange(b) % 2 == 0, -1, opt).astype(np.int32)
  infos, state = kit.run_oracle(env, batch=b, budget=budget)
  assert len(infos) == opt.max()
  for t, info in enumerate(infos):
    live, last = t < opt, t == opt - 1
    assert np.all(info.error_kind[live] == K.NONE) and np.all(info.valid_call[live])
    assert np.all(info.oracle_match[live]) and np.all(info.optimal_turns == opt)
    np.testing.assert_array_equal(info.solved, last)
    np.testing.assert_array_equal(info.reward, last.astype(np.float32))
    assert np.all(info.done[t >= opt - 1]) and not np.any(info.done[~(t >= opt - 1)])
    assert np.all(info.valid_call[~live] == False)   # noqa: E712  after done: no-ops
  assert np.all(np.asarray(state.solved)) and np.all(np.asarray(state.turn) == opt)


def test_sampled_tasks_are_solvable_and_match_a_python_bfs(builtin_tokenizer):
  env = envs.make("grid", builtin_tokenizer, size=6, wall_density=0.35, num_traps=3)
  tasks = jax.jit(jax.vmap(env.sample_task))(jax.random.split(jax.random.key(1), 64))
  opt = np.asarray(jax.jit(jax.vmap(env.optimal_turns))(tasks))
  tasks = jax.tree.map(np.asarray, tasks)
  far = 0
  for i in range(64):
    walls, traps = tasks.walls[i], tasks.traps[i]
    start, goal = tuple(tasks.start[i]), tuple(tasks.goal[i])
    assert traps.sum() <= 3 and not np.any(walls & traps)
    assert not walls[start] and not traps[start] and not walls[goal] and not traps[goal]
    dist = _bfs(walls, traps, goal)
    assert start != goal and dist[start] == opt[i]
    # The start is among the farthest cells when the map allows min_distance (= size) or more.
    assert dist[start] >= min(6, max(dist.values()))
    far += dist[start] >= 6
  assert far > 32   # most maps put the start at least `size` moves away


def test_prompt_is_exact(gr):
  chat = gr.codec.chat_text()
  _, obs = gr.reset(jax.random.key(0), hand_task(), 20)
  assert gr.codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] + HAND_USER
                                  + "\nYou have 20 turns." + chat["user_to_assistant"])
  _, obs = gr.reset(jax.random.key(0), hand_task(), -1)
  assert gr.codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] + HAND_USER
                                  + chat["user_to_assistant"])
  assert gr.env.prompt_user_text(hand_task()) == HAND_USER


def test_observations_and_error_kinds_exact(gr, kit):
  codec, step, n = gr.codec, gr.step, gr.env.max_action_len
  chat = codec.chat_text()
  state, _ = gr.reset(jax.random.key(0), hand_task(), 20)
  script = [
      ("move up", K.PARSE_ERROR,
       "Error: the action is not a tool call. Write one call, for example move(up).", False),
      ("jump(up)", K.UNKNOWN_TOOL, "Error: unknown tool. The tools are move(direction) and look().",
       False),
      ("move(north)", K.BAD_ARGUMENTS, "Error: the direction must be up, down, left or right.", False),
      ("move()", K.BAD_ARGUMENTS, "Error: move takes exactly one argument, the direction.", False),
      ("move(up, left)", K.BAD_ARGUMENTS, "Error: move takes exactly one argument, the direction.",
       False),
      ("look(up)", K.BAD_ARGUMENTS, "Error: look takes no arguments.", False),
      ("move(up)", K.TOOL_FAILURE, "Error: the edge of the grid blocks the way up from (0, 0).", False),
      ("look()", K.NONE,
       "Around you at (0, 0): up is the edge, down is free, left is the edge, right is free.", False),
      ("move(right)", K.NONE, "You move right. You are at (0, 1).", False),
      ("move(down)", K.TOOL_FAILURE, "Error: a wall blocks the way down from (0, 1).", False),
      (" move( 'left' ) ", K.NONE, "You move left. You are at (0, 0).", True),
      ("move(down)", K.NONE, "You move down. You are at (1, 0).", True),
      ("move(down)", K.NONE, "You move down. You are at (2, 0).", True),
      ("move(right)", K.NONE, "You move right. You are at (2, 1).", True),
      ("look()", K.NONE,
       "Around you at (2, 1): up is a wall, down is free, left is free, right is free.", False),
      ("move(right)", K.NONE, "You move right. You are at (2, 2).", True),
      ("move(up)", K.NONE, "You move up onto a trap at (1, 2). The episode is over.", False),
  ]
  for t, (text, kind, body, match) in enumerate(script):
    state, obs, info = step(state, kit.action(codec, text, n))
    assert codec.decode(obs) == (
        chat["pre_obs"] + f"{body}\nTurns left: {19 - t}." + chat["obs_to_assistant"]), text
    assert ERROR_KIND_NAMES[int(info.error_kind)] == kind.name.lower(), text
    assert bool(info.valid_call) == (kind == K.NONE), text
    assert bool(info.oracle_match) == match, text
    assert int(info.optimal_turns) == 5
    trap = t == len(script) - 1
    assert bool(info.done) == trap and not bool(info.solved) and float(info.reward) == 0.0, text
  assert bool(state.done) and not bool(state.solved) and state.pos.tolist() == [1, 2]
  # After done: no-ops.
  before = state
  state, obs, info = step(state, kit.action(codec, "move(down)", n))
  jax.tree.map(np.testing.assert_array_equal, before, state)
  assert int(obs.length) == 0 and bool(info.done) and float(info.reward) == 0.0
  assert int(info.error_kind) == K.NONE and not bool(info.solved) and not bool(info.valid_call)


def test_oracle_path_reaches_the_goal(gr):
  codec = gr.codec
  state, _ = gr.reset(jax.random.key(0), hand_task(), -1)
  moves = []
  for _ in range(5):
    action = gr.oracle(state)
    moves.append(codec.decode(action))
    state, obs, info = gr.step(state, action)
    assert bool(info.oracle_match) and "Turns left" not in codec.decode(obs)
  assert moves == ["move(down)", "move(down)", "move(right)", "move(right)", "move(right)"]
  assert codec.decode(obs) == (codec.chat_text()["pre_obs"]
                               + "You move right and reach the goal at (2, 3). Task solved."
                               + codec.chat_text()["obs_to_assistant"])
  assert bool(info.solved) and bool(info.done) and float(info.reward) == 1.0


def test_spent_budget_is_shown_not_enforced(gr, kit):
  state, _ = gr.reset(jax.random.key(0), hand_task(), 2)
  state, obs, info = gr.step(state, kit.action(gr.codec, "look()", gr.env.max_action_len))
  assert not bool(info.done) and "Turns left: 1." in gr.codec.decode(obs)
  state, obs, info = gr.step(state, kit.action(gr.codec, "move(down)", gr.env.max_action_len))
  # The rollout engine ends an episode whose budget is spent (visible or hidden), not the env.
  assert not bool(info.done) and not bool(info.solved) and "Turns left: 0." in gr.codec.decode(obs)
  assert int(state.turn) == 2 and not bool(state.done)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_tokens_never_break_the_env(gr, kit, data):
  state, new, _, info = kit.arbitrary_step(gr, data, budgets=[-1, 0, 3],
                                           extra_ids=[gr.codec.end_of_turn_id, 0, 1])
  r, c = new.pos.tolist()
  assert 0 <= r < 4 and 0 <= c < 4 and not bool(new.task.walls[r, c])
  if not bool(info.valid_call):
    assert new.pos.tolist() == state.pos.tolist() and int(info.error_kind) != K.NONE


_words = st.sampled_from(("move", "look", "mvoe", "up", "down", "left", "right", "north", "'up'", ""))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tool=_words, args=st.lists(_words, max_size=3), pad=st.sampled_from(["", " ", "  "]))
def test_the_same_text_tokenised_differently_acts_identically(gr, kit, tool, args, pad):
  text = f"{pad}{tool}({pad}{(',' + pad).join(args)})"
  state, _ = gr.reset(jax.random.key(0), hand_task(), 5)
  kit.assert_splits_act_alike(gr, state, text)


def test_hint_follows_every_observation(builtin_tokenizer, kit):
  env = envs.make("grid", builtin_tokenizer, size=4, num_traps=1, hint=True)
  codec, step = env.codec, jax.jit(env.step)
  chat = codec.chat_text()
  state, obs = jax.jit(env.reset)(jax.random.key(0), hand_task(), -1)
  user = HAND_USER + " Goal direction: down, right."
  assert env.prompt_user_text(hand_task()) == user
  assert codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] + user
                               + chat["user_to_assistant"])
  # The hint is of the position the message names: unchanged after an error, new after a move.
  for action, text in [("move(up)", "Error: the edge of the grid blocks the way up from (0, 0)."
                        " Goal direction: down, right."),
                       ("move(down)", "You move down. You are at (1, 0). Goal direction: down, right."),
                       ("move(down)", "You move down. You are at (2, 0). Goal direction: right.")]:
    state, obs, _ = step(state, kit.action(codec, action, env.max_action_len))
    assert codec.decode(obs) == chat["pre_obs"] + text + chat["obs_to_assistant"]
  assert grid.HINT_TEXTS[0] == " Goal direction: up, left." and "here" in grid.HINT_TEXTS[4]
