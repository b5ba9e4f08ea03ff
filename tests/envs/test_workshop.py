"""Tests of the `workshop` environment (envs/workshop.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxagent.envs as envs
from jaxagent.envs.base import ERROR_KIND_NAMES, ErrorKind
from jaxagent.envs.workshop import ABSENT, FLOOR, HELD, NAMES, WorkshopTask

K = ErrorKind
SYSTEM = (
    "You are in a workshop with containers, keys and items. Tools:\n"
    "- open(container): open a closed container that is not locked.\n"
    "- take(object): pick up a key or an item that is on the floor or in an open container.\n"
    "- unlock(container, key): unlock a locked container with the key that opens it; "
    "you must hold the key.\n"
    "- put(object, container): put an object you hold into an open container.\n"
    "Call one tool per turn and reply with the call only, for example open(box).")
HAND_USER = ("Goal: put the gem in the box.\n"
             "The chest is locked; the red_key opens it.\n"
             "The crate is locked; the blue_key opens it.\n"
             "The box is closed.\n"
             "The safe is open.\n"
             "The red_key is in the crate.\n"
             "The blue_key is on the floor.\n"
             "The gem is in the chest.\n"
             "The coin is in the safe.\n"
             "You hold nothing.")
ORACLE_PLAN = ["take(blue_key)", "unlock(crate, blue_key)", "open(crate)", "take(red_key)",
               "unlock(chest, red_key)", "open(chest)", "take(gem)", "open(box)", "put(gem, box)"]


def hand_task():
  """Slots: containers chest, crate, box (goal), safe (open); keys red_key (opens the chest, in the
  crate), blue_key (opens the crate, on the floor), two absent key slots; the gem (target, in the
  chest); a coin (in the safe)."""
  name = [NAMES.index(n) for n in ("chest", "crate", "box", "safe", "red_key", "blue_key")]
  name += [-1, -1, NAMES.index("gem"), NAMES.index("coin")]
  loc = [FLOOR] * 4 + [1, FLOOR, ABSENT, ABSENT, 0, 3]
  return WorkshopTask(name=jnp.asarray(name, jnp.int32), loc=jnp.asarray(loc, jnp.int32),
                      locked=jnp.asarray([True, True, False, False]),
                      opened=jnp.asarray([False, False, False, True]), goal=jnp.int32(2))


@pytest.fixture(scope="module")
def ws(any_tokenizer, kit):
  env = envs.make("workshop", any_tokenizer, depth=2, num_containers=4, num_items=1,
                  max_action_len=48)
  return kit.jitted(env)


@pytest.mark.parametrize("tokenizer,knobs", [
    ("builtin", dict(depth=3, num_containers=6, num_items=3)),
    ("large", dict(depth=0, num_containers=3, num_items=2))])
def test_oracle_solves_every_task_in_optimal_turns(request, kit, tokenizer, knobs):
  env = envs.make("workshop", request.getfixturevalue(f"{tokenizer}_tokenizer"), **knobs)
  b = 256
  opt = max(3 * knobs["depth"] + 3, 4)
  budget = np.where(np.arange(b) % 2 == 0, -1, opt).astype(np.int32)   # hidden / exactly enough
  infos, state = kit.run_oracle(env, batch=b, budget=budget)
  assert len(infos) == opt
  for t, info in enumerate(infos):
    assert np.all(info.error_kind == K.NONE) and np.all(info.valid_call)
    assert np.all(info.oracle_match) and np.all(info.optimal_turns == opt)
    assert np.all(info.solved == (t == opt - 1)) and np.all(info.done == (t == opt - 1))
  assert np.all(np.asarray(state.solved)) and np.all(np.asarray(state.optimal_turns) == opt)


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_sampled_tasks_have_the_documented_structure(builtin_tokenizer, depth):
  env = envs.make("workshop", builtin_tokenizer, depth=depth, num_containers=depth + 3, num_items=2)
  tasks = jax.jit(jax.vmap(env.sample_task))(jax.random.split(jax.random.key(depth), 64))
  opt = np.asarray(jax.jit(jax.vmap(env.optimal_turns))(tasks))
  assert np.all(opt == (3 * depth + 3 if depth else 4))
  c = env.num_containers
  for i in range(64):
    name, loc = np.asarray(tasks.name[i]), np.asarray(tasks.loc[i])
    locked, opened, goal = np.asarray(tasks.locked[i]), np.asarray(tasks.opened[i]), int(tasks.goal[i])
    present = name[name >= 0]
    assert len(set(present.tolist())) == len(present)            # names are distinct
    assert np.all((name[c:2 * c] >= 0) == locked)                 # a key exactly for each lock
    assert np.all(loc[c:2 * c][~locked] == ABSENT) and not np.any(loc == HELD)
    assert not locked[goal] and not opened[goal]
    # Walk the chain from the target: depth locks, then a key on the floor.
    box, chain = int(loc[2 * c]), 0
    assert box >= 0 and box != goal and not opened[box]
    while locked[box]:
      chain += 1
      box = int(loc[c + box])
      if box == FLOOR:
        break
    assert chain == depth


def test_prompt_is_exact(ws):
  chat = ws.codec.chat_text()
  _, obs = ws.reset(jax.random.key(0), hand_task(), 40)
  assert ws.codec.decode(obs) == (chat["pre_system"] + SYSTEM + chat["system_to_user"] + HAND_USER
                                  + "\nYou have 40 turns." + chat["user_to_assistant"])
  assert ws.env.prompt_user_text(hand_task()) == HAND_USER


def test_observations_and_error_kinds_exact(ws, kit):
  codec, step, n = ws.codec, ws.step, ws.env.max_action_len
  chat = codec.chat_text()
  state, _ = ws.reset(jax.random.key(0), hand_task(), 40)
  assert int(state.optimal_turns) == 9
  B, P, T = K.BAD_ARGUMENTS, K.PRECONDITION_FAILED, K.TOOL_FAILURE
  script = [
      ("open chest", K.PARSE_ERROR,
       "Error: the action is not a tool call. Write one call, for example open(box).", False),
      ("grab(gem)", K.UNKNOWN_TOOL, "Error: unknown tool. The tools are open, take, unlock and put.",
       False),
      ("open()", B, "Error: open takes one argument, a container.", False),
      ("take(gem, coin)", B, "Error: take takes one argument, a key or an item.", False),
      ("unlock(chest)", B, "Error: unlock takes two arguments, a container and a key.", False),
      ("put(gem)", B, "Error: put takes two arguments, an object and a container.", False),
      ("open(lamp)", B, "Error: the first argument names no object here.", False),   # not here
      ("open(dragon)", B, "Error: the first argument names no object here.", False),  # no such name
      ("unlock(chest, green_key)", B, "Error: the second argument names no object here.", False),
      ("open(gem)", B, "Error: the gem is not a container.", False),
      ("unlock(chest, coin)", B, "Error: the coin is not a key.", False),
      ("take(box)", B, "Error: the box cannot be carried.", False),
      ("put(gem, coin)", B, "Error: the coin is not a container.", False),
      ("open(chest)", P, "Error: the chest is locked.", False),
      ("open(safe)", P, "Error: the safe is already open.", False),
      ("take(gem)", P, "Error: the gem is in the chest, which is closed.", False),
      ("unlock(box, red_key)", P, "Error: the box is not locked.", False),
      ("unlock(chest, red_key)", P, "Error: you do not hold the red_key.", False),
      ("put(coin, box)", P, "Error: you do not hold the coin.", False),
      ("take(coin)", K.NONE, "You take the coin.", False),                   # a detour
      ("take(coin)", P, "Error: you already hold the coin.", False),
      ("put(coin, box)", P, "Error: the box is closed.", False),
      ("put(coin, chest)", P, "Error: the chest is locked.", False),
      ("take( blue_key )", K.NONE, "You take the blue_key.", True),
      ("unlock(chest, blue_key)", T, "Error: the blue_key does not fit the chest.", False),
      ("unlock(crate,blue_key)", K.NONE, "You unlock the crate with the blue_key.", True),
      ("open(crate)", K.NONE, "You open the crate.", True),
      ("put(coin, crate)", K.NONE, "You put the coin in the crate.", False),  # another detour
      ("take(red_key)", K.NONE, "You take the red_key.", True),
      ("unlock(chest, red_key)", K.NONE, "You unlock the chest with the red_key.", True),
      ("open(chest)", K.NONE, "You open the chest.", True),
      ("take('gem')", K.NONE, "You take the gem.", True),
      ("open(box)", K.NONE, "You open the box.", True),
      ("put(gem, box)", K.NONE, "You put the gem in the box. Task solved.", True),
  ]
  for t, (text, kind, body, match) in enumerate(script):
    state, obs, info = step(state, kit.action(codec, text, n))
    assert codec.decode(obs) == (
        chat["pre_obs"] + f"{body}\nTurns left: {39 - t}." + chat["obs_to_assistant"]), text
    assert ERROR_KIND_NAMES[int(info.error_kind)] == kind.name.lower(), text
    assert bool(info.valid_call) == (kind == K.NONE), text
    assert bool(info.oracle_match) == match, text
    last = t == len(script) - 1
    assert bool(info.solved) == last and bool(info.done) == last and float(info.reward) == float(last)
  assert np.asarray(state.loc).tolist() == [FLOOR] * 4 + [HELD, HELD, ABSENT, ABSENT, 2, 1]
  before = state
  state, obs, info = step(state, kit.action(codec, "take(gem)", n))
  jax.tree.map(np.testing.assert_array_equal, before, state)
  assert int(obs.length) == 0 and bool(info.done) and float(info.reward) == 0.0
  assert int(info.error_kind) == K.NONE and not bool(info.solved) and not bool(info.valid_call)


def test_oracle_plan_and_replanning_after_a_detour(ws, kit):
  codec = ws.codec
  state, _ = ws.reset(jax.random.key(0), hand_task(), -1)
  plan = []
  for _ in range(9):
    action = ws.oracle(state)
    plan.append(codec.decode(action))
    state, obs, info = ws.step(state, action)
    assert bool(info.oracle_match) and "Turns left" not in codec.decode(obs)
  assert plan == ORACLE_PLAN and bool(state.solved)
  # Holding the red_key already (taken from an opened crate) shortens the plan; the oracle uses it.
  state, _ = ws.reset(jax.random.key(0), hand_task(), -1)
  for text in ("take(blue_key)", "unlock(crate, blue_key)", "open(crate)", "take(red_key)",
               "take(coin)"):
    state, _, _ = ws.step(state, kit.action(codec, text, ws.env.max_action_len))
  assert codec.decode(ws.oracle(state)) == "unlock(chest, red_key)"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_tokens_never_break_the_env(ws, kit, data):
  state, new, _, info = kit.arbitrary_step(ws, data, budgets=[-1, 0, 3],
                                           extra_ids=[ws.codec.end_of_turn_id, 0, 1])
  if not bool(info.valid_call):
    for field in ("loc", "locked", "opened"):
      np.testing.assert_array_equal(getattr(new, field), getattr(state, field))


_words = st.sampled_from(("open", "take", "unlock", "put", "opne", "chest", "crate", "box", "gem",
                          "red_key", "'coin'", "lamp", ""))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tool=_words, args=st.lists(_words, max_size=3), pad=st.sampled_from(["", " "]))
def test_the_same_text_tokenised_differently_acts_identically(ws, kit, tool, args, pad):
  text = f"{tool}({pad}{(',' + pad).join(args)})"
  state, _ = ws.reset(jax.random.key(0), hand_task(), 5)
  kit.assert_splits_act_alike(ws, state, text)
