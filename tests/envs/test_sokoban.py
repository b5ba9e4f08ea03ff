"""Tests of the `sokoban` environment (envs/sokoban.py, envs/sokoban_levels.py)."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxagent.envs as envs
from jaxagent.envs import demos, sokoban_levels
from jaxagent.envs.base import ERROR_KIND_NAMES, ErrorKind
from jaxagent.envs.sokoban_levels import UNSOLVABLE

K = ErrorKind
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
SYSTEM = (
    "You are playing Sokoban. Push every box onto a target by calling tools, one call per turn.\n"
    "Tools:\n"
    "- move(direction): walk one cell; direction is up, down, left or right. Walking into a box "
    "pushes it one cell if the cell behind it is free floor. Walls do not move, and you cannot "
    "push two boxes at once.\n"
    "Reply with the call only, for example move(up).")
LEGEND = ("# is a wall, _ is floor, . is a target, $ is a box, * is a box on a target, @ is you, "
          "+ is you on a target.\n")


# ---- a plain Python solver, independent of the environment's code ------------------------------


def py_step(walls, boxes, player, d):
  """One move on (player (r, c), boxes frozenset): the new (player, boxes), or None if blocked."""
  dr, dc = MOVES[d]
  q = (player[0] + dr, player[1] + dc)
  if walls[q]:
    return None
  if q in boxes:
    q2 = (q[0] + dr, q[1] + dc)
    if walls[q2] or q2 in boxes:
      return None
    return q, (boxes - {q}) | {q2}
  return q, boxes


def py_solve(walls, targets, boxes, player):
  """Breadth-first search over (player, boxes): the fewest moves to put every box on a target,
  or None if none does."""
  targets, start = frozenset(targets), (tuple(player), frozenset(map(tuple, boxes)))
  seen = {start: 0}
  queue = collections.deque([start])
  while queue:
    state = queue.popleft()
    if state[1] == targets:
      return seen[state]
    for d in MOVES:
      nxt = py_step(walls, state[1], state[0], d)
      if nxt is not None and nxt not in seen:
        seen[nxt] = seen[state] + 1
        queue.append(nxt)
  return None


def np_task(task, i=None):
  t = jax.tree.map(np.asarray, task)
  if i is not None:
    t = jax.tree.map(lambda x: x[i], t)
  return (t.walls, [tuple(x) for x in t.targets.tolist()], [tuple(x) for x in t.boxes.tolist()],
          tuple(t.player.tolist()))


# ---- fixtures and crafted levels ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sk(any_tokenizer, kit):
  return kit.jitted(envs.make("sokoban", any_tokenizer, size=6, num_boxes=1))


@pytest.fixture(scope="module")
def sk2(builtin_tokenizer, kit):
  return kit.jitted(envs.make("sokoban", builtin_tokenizer, size=6, num_boxes=2))


# Box (2, 2) with a wall (3, 2) below it, the target in the corner (4, 4).
ERRORS_LEVEL = """\
######
#@___#
#_$__#
#_#__#
#___.#
######"""

# Two targets, the player on one, a box on the other: every character but '@' and '.'.
RENDER_LEVEL = """\
######
#+$__#
#_*__#
#____#
#__#_#
######"""

# Pushing the box (2, 2) up to (1, 2) freezes it beside the box (1, 3) against the top wall: no
# box is in a dead square (targets lie along that wall), yet the level is lost.
FREEZE_LEVEL = """\
######
#._$.#
#_$__#
#_@__#
#____#
######"""


def test_prompt_and_board_rendering_are_exact(sk2, kit):
  env, codec = sk2.env, sk2.codec
  chat = codec.chat_text()
  task = env.task_from_text(RENDER_LEVEL)
  user = ("Board, 6 rows by 6 columns; row 0 is the top:\n" + RENDER_LEVEL + "\n" + LEGEND
          + "Push all 2 boxes onto the targets.")
  assert env.prompt_user_text(task) == user
  _, obs = sk2.reset(jax.random.key(0), task, 7)
  assert codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] + user
                               + "\nYou have 7 turns." + chat["user_to_assistant"])
  state, _ = sk2.reset(jax.random.key(0), task, -1)
  state, obs, info = sk2.step(state, kit.action(codec, "move(down)", env.max_action_len))
  board = "######\n#.$__#\n#@*__#\n#____#\n#__#_#\n######"
  assert codec.decode(obs) == (chat["pre_obs"] + "You move down.\n" + board
                               + chat["obs_to_assistant"])
  assert env.board_text(task, [2, 1]) == board + "\n"
  # Pushing the box (1, 2) onto nothing: from (1, 1) right -> the box to (1, 3).
  state, _ = sk2.reset(jax.random.key(0), task, 3)
  state, obs, info = sk2.step(state, kit.action(codec, "move(right)", env.max_action_len))
  board = "######\n#.@$_#\n#_*__#\n#____#\n#__#_#\n######"
  assert codec.decode(obs) == (chat["pre_obs"] + "You move right and push a box.\n" + board
                               + "\nTurns left: 2." + chat["obs_to_assistant"])
  assert int(info.error_kind) == K.NONE and bool(info.valid_call) and not bool(info.done)


def test_crafted_actions_give_every_error_kind(any_tokenizer, kit):
  fix = kit.jitted(envs.make("sokoban", any_tokenizer, size=6, num_boxes=1))
  env, codec, n = fix.env, fix.codec, fix.env.max_action_len
  chat = codec.chat_text()
  task = env.task_from_text(ERRORS_LEVEL)
  walls, targets, boxes, player = np_task(task)
  opt = py_solve(walls, targets, boxes, player)
  # Push the box right twice, walk round to (1, 4), push it down twice: 1 + 2 + 2 + 2 moves.
  assert int(task.optimal_turns) == opt == 7
  state, _ = fix.reset(jax.random.key(0), task, 30)
  # (action, kind, message, board after) ; the player walks (1,1) -> ... and finally pushes the
  # box into the corner (1, 4), which is no target.
  start = ERRORS_LEVEL
  script = [
      ("move up", K.PARSE_ERROR,
       "Error: the action is not a tool call. Write one call, for example move(up).", start),
      ("jump(up)", K.UNKNOWN_TOOL, "Error: unknown tool. The only tool is move(direction).", start),
      ("move(north)", K.BAD_ARGUMENTS, "Error: the direction must be up, down, left or right.",
       start),
      ("move()", K.BAD_ARGUMENTS, "Error: move takes exactly one argument, the direction.", start),
      ("move(up, left)", K.BAD_ARGUMENTS, "Error: move takes exactly one argument, the direction.",
       start),
      ("move(up)", K.TOOL_FAILURE, "Error: a wall blocks the way up.", start),
      ("move(right)", K.NONE, "You move right.", None),
      ("move(down)", K.TOOL_FAILURE,
       "Error: cannot push the box down: a wall or another box is behind it.", None),
      (" move( 'left' ) ", K.NONE, "You move left.", start),
      ("move(down)", K.NONE, "You move down.", None),
      ("move(right)", K.NONE, "You move right and push a box.", None),
      ("move(right)", K.NONE, "You move right and push a box.", None),
      ("move(down)", K.NONE, "You move down.", None),
      ("move(right)", K.NONE, "You move right.", None),
      ("move(up)", K.IRREVERSIBLE,
       "You move up and push a box. The puzzle can no longer be solved. The episode is over.",
       "######\n#___$#\n#___@#\n#_#__#\n#___.#\n######"),
  ]
  pos, box = player, frozenset(boxes)
  for t, (text, kind, body, board) in enumerate(script):
    before = py_solve(walls, targets, box, pos)
    state, obs, info = fix.step(state, kit.action(codec, text, n))
    if kind in (K.NONE, K.IRREVERSIBLE):
      pos, box = py_step(walls, box, pos, text.strip().split("'")[1] if "'" in text
                         else text[5:-1])
    after = py_solve(walls, targets, box, pos)
    board = board or env.board_text(task, pos, sorted(box)).rstrip("\n")
    assert codec.decode(obs) == (chat["pre_obs"] + f"{body}\n{board}\nTurns left: {29 - t}."
                                 + chat["obs_to_assistant"]), text
    assert ERROR_KIND_NAMES[int(info.error_kind)] == kind.name.lower(), text
    assert bool(info.valid_call) == (kind in (K.NONE, K.IRREVERSIBLE)), text
    # oracle_match: the move lowers the Python solver's distance by one.
    moved = kind in (K.NONE, K.IRREVERSIBLE)
    assert bool(info.oracle_match) == (moved and after is not None and after == before - 1), text
    assert (after is None) == (kind == K.IRREVERSIBLE), text
    assert int(info.optimal_turns) == opt
    assert bool(info.done) == (kind == K.IRREVERSIBLE) and not bool(info.solved), text
    assert float(info.reward) == 0.0
  assert bool(state.done) and not bool(state.solved)
  # After done: no-ops.
  before_state = state
  state, obs, info = fix.step(state, kit.action(codec, "move(down)", n))
  jax.tree.map(np.testing.assert_array_equal, before_state, state)
  assert int(obs.length) == 0 and bool(info.done) and not bool(info.valid_call)


def test_a_frozen_pair_of_boxes_is_irreversible(sk2, kit):
  """Exact deadlock test, not a dead-square table: (1, 2) is a live square (a box there alone
  slides to the target (1, 1)), but beside the box (1, 3) on the wall neither can move."""
  env, codec = sk2.env, sk2.codec
  task = env.task_from_text(FREEZE_LEVEL)
  walls, targets, boxes, player = np_task(task)
  assert int(task.optimal_turns) == py_solve(walls, targets, boxes, player) > 0
  assert py_solve(walls, targets, [(1, 2), (1, 3)], (2, 2)) is None
  # Alone, a box on (1, 2) slides to the target (1, 1).
  alone = envs.make("sokoban", codec, size=6, num_boxes=1)
  lone = alone.task_from_text("######\n#.$__#\n#____#\n#_@__#\n#____#\n######")
  assert 0 < int(lone.optimal_turns) < UNSOLVABLE
  state, _ = sk2.reset(jax.random.key(0), task, -1)
  state, obs, info = sk2.step(state, kit.action(codec, "move(up)", env.max_action_len))
  assert int(info.error_kind) == K.IRREVERSIBLE and bool(info.valid_call) and bool(info.done)
  assert not bool(info.solved) and float(info.reward) == 0.0
  assert "The puzzle can no longer be solved." in codec.decode(obs)


@pytest.mark.parametrize("knobs", [
    dict(size=6, num_boxes=1, wall_density=0.2),
    dict(size=6, num_boxes=2, wall_density=0.15, min_moves=6, max_moves=14),
    dict(size=7, num_boxes=1, wall_density=0.3, min_moves=3, max_moves=9)])
def test_sampled_levels_are_solvable_in_the_python_solvers_optimal_turns(builtin_tokenizer, knobs):
  env = envs.make("sokoban", builtin_tokenizer, **knobs)
  b = 40
  tasks = jax.jit(jax.vmap(env.sample_task))(jax.random.split(jax.random.key(1), b))
  recomputed = np.asarray(jax.jit(jax.vmap(env.optimal_turns))(tasks))
  stored = np.asarray(tasks.optimal_turns)
  np.testing.assert_array_equal(stored, recomputed)
  lo, hi = env.min_moves, env.max_moves
  solver = []
  for i in range(b):
    walls, targets, boxes, player = np_task(tasks, i)
    assert walls[0].all() and walls[-1].all() and walls[:, 0].all() and walls[:, -1].all()
    cells = targets + boxes + [player]
    assert not any(walls[c] for c in cells) and len(set(boxes + [player])) == env.num_boxes + 1
    solver.append(py_solve(walls, targets, boxes, player))
  np.testing.assert_array_equal(stored, np.asarray(solver))
  assert np.all((stored >= 1) & (stored <= hi))
  assert np.mean(stored >= lo) > 0.9   # the room allows min_moves nearly always
  # Deterministic per key.
  again = jax.jit(jax.vmap(env.sample_task))(jax.random.split(jax.random.key(1), b))
  jax.tree.map(np.testing.assert_array_equal, tasks, again)


@pytest.mark.parametrize("size,num_boxes,draws", [(6, 1, 512), (6, 3, 128), (8, 1, 512)])
def test_every_level_has_a_start_within_the_turn_range(size, num_boxes, draws):
  """Even in crowded rooms (walls at 0.55, near the largest density allowed) every draw is
  solvable at 1..max_moves moves (the wall-free fallback room; see `sample_level`)."""
  sp = sokoban_levels.state_space(size, num_boxes)
  out = jax.jit(jax.vmap(lambda k: sokoban_levels.sample_level(k, sp, 0.55, 5, 8)))(
      jax.random.split(jax.random.key(2), draws))
  opt = np.asarray(out["optimal_turns"])
  assert np.all((opt >= 1) & (opt <= 8)), np.unique(opt)


def test_the_distance_table_is_the_python_solvers_state_by_state(builtin_tokenizer):
  """The table, state by state, on three sampled levels: every illegal state (player or box on a
  wall, player on the box) is UNSOLVABLE, and 80 random legal states per level (of ~150; one box
  on a 4 x 4 interior) have the Python solver's distance, unsolvable ones included."""
  env = envs.make("sokoban", builtin_tokenizer, size=6, num_boxes=1, wall_density=0.25)
  sp = env.space
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(7), 3))
  tables = np.asarray(jax.jit(jax.vmap(env.distances))(tasks))
  rng = np.random.default_rng(0)
  unsolvable = 0
  for i in range(3):
    walls, targets, _, _ = np_task(tasks, i)
    legal = []
    for p, box in itertools.product(range(sp.n), range(sp.n)):
      pc, bc = (p // sp.m + 1, p % sp.m + 1), (box // sp.m + 1, box % sp.m + 1)
      d = tables[i, p * sp.c + sp._rank_host([box])]
      if walls[pc] or walls[bc] or p == box:
        assert d == UNSOLVABLE
      else:
        legal.append((pc, bc, d))
    for j in rng.choice(len(legal), 80, replace=False):
      pc, bc, d = legal[j]
      want = py_solve(walls, targets, [bc], pc)
      assert d == (UNSOLVABLE if want is None else want), (i, pc, bc)
      unsolvable += want is None
  assert unsolvable > 10   # dead squares and walled-in players are among the checked states


@pytest.mark.parametrize("tokenizer,knobs", [
    ("builtin", dict(size=6, num_boxes=1)),
    ("large", dict(size=6, num_boxes=2, wall_density=0.1, min_moves=5, max_moves=10))])
def test_oracle_solves_every_task_in_optimal_turns(request, kit, tokenizer, knobs):
  env = envs.make("sokoban", request.getfixturevalue(f"{tokenizer}_tokenizer"), **knobs)
  b = 128
  keys = jax.random.split(jax.random.key(0), b)   # the keys kit.run_oracle resets with
  opt = np.asarray(jax.jit(jax.vmap(lambda k: env.sample_task(k).optimal_turns))(keys))
  assert np.all((opt >= 1) & (opt <= env.max_moves))
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
  assert np.all(np.asarray(state.solved)) and np.all(np.asarray(state.turn) == opt)


def test_noisy_oracle_errors_leave_the_state_and_the_plan_intact(builtin_tokenizer):
  """Every injected error is recoverable: the noisy oracle (errors at 0.5, always recovering)
  solves every task with exactly optimal_turns valid moves, and no error is irreversible."""
  env = envs.make("sokoban", builtin_tokenizer)
  run = demos.make_episode_runner(env, demos.noisy_oracle_policy(env, 0.5, 1.0), max_turns=30,
                                  max_len=4096)
  b = 64
  tr = jax.tree.map(np.asarray, run(jax.random.split(jax.random.key(3), b)))
  assert tr.success_turn.max() <= 30 and np.all(tr.success_turn <= 30)
  valid = (tr.valid_call & tr.acted).sum(axis=1)
  np.testing.assert_array_equal(valid, tr.optimal_turns)
  kinds = set(tr.error_kind[tr.injected].tolist())
  assert kinds == {K.PARSE_ERROR, K.UNKNOWN_TOOL, K.BAD_ARGUMENTS, K.TOOL_FAILURE}
  assert not np.any(tr.error_kind == K.IRREVERSIBLE) and not np.any(tr.truncated)


def test_bad_knobs_name_the_fix(builtin_tokenizer):
  with pytest.raises(ValueError, match="smaller size or fewer boxes"):
    envs.make("sokoban", builtin_tokenizer, size=10, num_boxes=2)
  with pytest.raises(ValueError, match="min_moves <= max_moves"):
    envs.make("sokoban", builtin_tokenizer, min_moves=9, max_moves=4)
  with pytest.raises(ValueError, match=r"size must be in \[6, 10\]"):
    envs.make("sokoban", builtin_tokenizer, size=5)
  env = envs.make("sokoban", builtin_tokenizer)
  with pytest.raises(ValueError, match="border must be all walls"):
    env.task_from_text(ERRORS_LEVEL.replace("######", "#__###", 1))


def test_the_state_space_ranks_every_box_set_once():
  sp = sokoban_levels.state_space(6, 2)
  ranks = jax.vmap(sp.rank)(jnp.asarray(sp.combos))
  np.testing.assert_array_equal(np.asarray(ranks), np.arange(sp.c))
  assert sp.num_states == 16 * 120 and np.all(np.diff(sp.combos, axis=1) > 0)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_tokens_never_break_the_env(sk, kit, data):
  state, new, _, info = kit.arbitrary_step(sk, data, budgets=[-1, 0, 3],
                                           extra_ids=[sk.codec.end_of_turn_id, 0, 1])
  if not bool(info.valid_call):
    assert int(new.player) == int(state.player) and int(info.error_kind) != K.NONE
    np.testing.assert_array_equal(np.asarray(new.boxes), np.asarray(state.boxes))


_words = st.sampled_from(("move", "mvoe", "up", "down", "left", "right", "north", "'up'", ""))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tool=_words, args=st.lists(_words, max_size=3), pad=st.sampled_from(["", " ", "  "]))
def test_the_same_text_tokenised_differently_acts_identically(sk, kit, tool, args, pad):
  text = f"{pad}{tool}({pad}{(',' + pad).join(args)})"
  state, _ = sk.reset(jax.random.key(0), sk.env.task_from_text(ERRORS_LEVEL), 5)
  kit.assert_splits_act_alike(sk, state, text)


@pytest.mark.parametrize("variant", ["default", "quick", "smoke"])
def test_the_study_config_builds_and_its_budgets_cover_the_tasks(variant, builtin_tokenizer):
  from configs import sokoban as sokoban_config
  from jaxagent.runs import config as rc
  c = sokoban_config.get_config(variant)
  rc.validate(c)
  st = rc.study_config(c)
  assert c.env.name == "sokoban" and st.seeds >= 2
  env = envs.make("sokoban", builtin_tokenizer, **dict(c.env.difficulty))
  opt = np.asarray(jax.jit(jax.vmap(lambda k: env.sample_task(k).optimal_turns))(
      jax.random.split(jax.random.key(0), 256)))
  # Every task fits the generous budget and the evaluation's T_max; outside the smoke run the
  # tight budget is the longest start's optimal turns.
  tight, generous = (int(b.split(":")[1]) for b in (st.tight_budget, st.generous_budget))
  assert opt.max() == env.max_moves <= generous <= c.eval.max_turns
  assert tight == env.max_moves or variant == "smoke"
  with pytest.raises(ValueError, match="use default, quick or smoke"):
    sokoban_config.get_config("full")
