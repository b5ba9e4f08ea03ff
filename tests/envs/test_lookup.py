"""Tests of the `lookup` environment (envs/lookup.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxagent.envs as envs
from jaxagent.envs.base import ERROR_KIND_NAMES, ErrorKind
from jaxagent.envs.lookup import ENTITY_NAMES, RELATION_NAMES, LookupTask

K = ErrorKind
SYSTEM = (
    "You answer a question about a hidden knowledge base by calling tools, one call per turn.\n"
    "Tools:\n"
    "lookup(entity, relation): returns the entity that is the given relation of the given entity.\n"
    "answer(entity): gives your final answer and ends the episode.\n"
    "Relations: owner, city, mentor.")
ACTION_LEN = 48


@pytest.fixture(scope="module")
def lk(any_tokenizer, kit):
  env = envs.make("lookup", any_tokenizer, hops=2, distractor_entities=2, num_relations=3,
                  max_action_len=ACTION_LEN)
  return kit.jitted(env)


def hand_task():
  """Alba -owner-> Brix -city-> Cato; distractors Alba -city-> Dara -mentor-> Elko."""
  ids = [ENTITY_NAMES.index(n) for n in ("Alba", "Brix", "Cato", "Dara", "Elko")]
  rels = [RELATION_NAMES.index(r) for r in ("owner", "city", "mentor")]
  link = -np.ones((5, 3), np.int32)
  link[0, 0], link[1, 1], link[0, 1], link[3, 2] = 1, 2, 3, 4
  return LookupTask(entities=jnp.asarray(ids, jnp.int32), relations=jnp.asarray(rels, jnp.int32),
                    link=jnp.asarray(link), path=jnp.asarray([0, 1], jnp.int32))


@pytest.mark.parametrize("tokenizer,hops,distractors,relations", [
    ("builtin", 1, 0, 1), ("large", 3, 6, 8)])   # one compile each: the CPU budget of a test
def test_oracle_solves_every_task_in_optimal_turns(request, kit, tokenizer, hops, distractors, relations):
  tok = request.getfixturevalue(f"{tokenizer}_tokenizer")
  env = envs.make("lookup", tok, hops=hops, distractor_entities=distractors, num_relations=relations)
  budget = np.where(np.arange(256) % 2 == 0, -1, hops + 1)   # hidden and tight visible budgets
  infos, state = kit.run_oracle(env, batch=256, budget=budget)
  assert len(infos) == hops + 1
  for t, info in enumerate(infos):
    assert np.all(info.error_kind == K.NONE) and np.all(info.valid_call) and np.all(info.oracle_match)
    assert np.all(info.optimal_turns == hops + 1)
    last = t == hops
    assert np.all(info.solved == last) and np.all(info.done == last) and np.all(info.reward == float(last))
  assert np.all(np.asarray(state.progress) == hops) and np.all(np.asarray(state.done))


def test_prompt_is_chatml_for_the_builtin_tokenizer(builtin_tokenizer):
  env = envs.make("lookup", builtin_tokenizer, hops=2, distractor_entities=2, num_relations=3)
  _, obs = jax.jit(env.reset)(jax.random.key(0), hand_task(), 10)
  assert env.codec.decode(obs) == (
      "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n"
      "Question: what is the city of the owner of Alba?\nYou have 10 turns.<|im_end|>\n"
      "<|im_start|>assistant\n")


def test_observations_and_error_kinds_exact(lk, kit):
  codec, step = lk.codec, lk.step
  chat = codec.chat_text()
  state, obs = lk.reset(jax.random.key(0), hand_task(), 10)
  assert codec.decode(obs) == (
      chat["pre_system"] + SYSTEM + chat["system_to_user"] +
      "Question: what is the city of the owner of Alba?\nYou have 10 turns." + chat["user_to_assistant"])
  script = [
      ("lookup Alba", K.PARSE_ERROR,
       "Error: could not parse the action. Reply with one tool call, e.g. lookup(entity, relation)."),
      ("search(Alba)", K.UNKNOWN_TOOL, "Error: unknown tool. The tools are lookup and answer."),
      ("lookup(Alba)", K.BAD_ARGUMENTS, "Error: lookup takes two arguments: lookup(entity, relation)."),
      ("lookup(Pax, owner)", K.BAD_ARGUMENTS, "Error: unknown entity."),   # a name, not in this task
      ("lookup(Alba, rival)", K.BAD_ARGUMENTS, "Error: unknown relation."),
      ("lookup(Brix, owner)", K.TOOL_FAILURE, "Error: Brix has no owner."),
      ("lookup(Alba, owner)", K.NONE, "The owner of Alba is Brix."),
      ("lookup( 'Alba' ,city )", K.NONE, "The city of Alba is Dara."),
      ("lookup(Brix, city)", K.NONE, "The city of Brix is Cato."),
      ("answer(Dara)", K.WRONG_ANSWER, "Wrong answer."),
  ]
  oracle_matches = [False] * 6 + [True, False, True, False]
  for t, ((text, kind, body), om) in enumerate(zip(script, oracle_matches)):
    state, obs, info = step(state, kit.action(codec, text, ACTION_LEN))
    assert codec.decode(obs) == (
        chat["pre_obs"] + f"{body}\nTurns left: {9 - t}." + chat["obs_to_assistant"]), text
    assert ERROR_KIND_NAMES[int(info.error_kind)] == kind.name.lower(), text
    assert bool(info.valid_call) == (kind in (K.NONE, K.WRONG_ANSWER)), text
    assert bool(info.oracle_match) == om, text
    assert bool(info.done) == (kind == K.WRONG_ANSWER) and float(info.reward) == 0.0
  # After done: no-ops.
  before = state
  state, obs, info = step(state, kit.action(codec, "answer(Cato)", ACTION_LEN))
  jax.tree.map(np.testing.assert_array_equal, before, state)
  assert int(obs.length) == 0 and bool(info.done) and float(info.reward) == 0.0
  assert int(info.error_kind) == K.NONE and not bool(info.solved)


def test_correct_answer_and_hidden_budget(lk, kit):
  codec = lk.codec
  state, obs = lk.reset(jax.random.key(0), hand_task(), -1)
  assert "You have" not in codec.decode(obs)
  assert codec.decode(lk.oracle(state)) == "lookup(Alba, owner)"
  state, obs, info = lk.step(state, lk.oracle(state))
  body = codec.decode(obs)
  assert "The owner of Alba is Brix." in body and "Turns left" not in body
  state, _, _ = lk.step(state, lk.oracle(state))
  assert codec.decode(lk.oracle(state)) == "answer(Cato)"
  state, obs, info = lk.step(state, kit.action(codec, ' answer( "Cato" ) ', ACTION_LEN))
  assert bool(info.solved) and bool(info.done) and float(info.reward) == 1.0 and bool(info.oracle_match)
  assert "Correct." in codec.decode(obs)


def test_spent_budget_is_shown_not_enforced(lk, kit):
  state, _ = lk.reset(jax.random.key(0), hand_task(), 2)
  state, obs, info = lk.step(state, kit.action(lk.codec, "nope", ACTION_LEN))
  assert not bool(info.done) and "Turns left: 1." in lk.codec.decode(obs)
  state, obs, info = lk.step(state, kit.action(lk.codec, "nope", ACTION_LEN))
  # The rollout engine ends an episode whose budget is spent (visible or hidden), not the env.
  assert not bool(info.done) and not bool(info.solved) and "Turns left: 0." in lk.codec.decode(obs)
  assert int(state.turn) == 2 and not bool(state.done)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_tokens_never_break_the_env(lk, kit, data):
  _, new, _, info = kit.arbitrary_step(lk, data, budgets=[-1, 0, 3],
                                       extra_ids=[lk.codec.end_of_turn_id, 0, 1, 2])
  assert int(new.progress) in (0, 1)
  if not bool(info.valid_call):
    assert int(new.progress) == 0 and int(info.error_kind) != K.NONE


_names = st.sampled_from(("Alba", "Brix", "Cato", "Dara", "Pax", "owner", "city", "mentor", "x", "42"))
_calls = st.builds(
    lambda tool, args, sp, q: tool + "(" + ",".join(sp + q + a + q + sp for a in args) + ")",
    st.sampled_from(("lookup", "answer", "look", "")), st.lists(_names, max_size=3),
    st.sampled_from(("", " ", "  ")), st.sampled_from(("", "'", '"')))
_texts = (_calls | st.text(alphabet="lookupanswer(),' Alba1234", max_size=ACTION_LEN)).filter(
    lambda t: len(t) <= ACTION_LEN)   # one token per character must fit the action buffer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts)
def test_tokenisation_does_not_change_parsing(lk, kit, text):
  state, _ = lk.reset(jax.random.key(0), hand_task(), 5)
  kit.assert_splits_act_alike(lk, state, text)


def test_bad_token_sequences_are_parse_errors(lk, kit):
  codec = lk.codec
  state, _ = lk.reset(jax.random.key(0), hand_task(), -1)
  ok = kit.action(codec, "lookup(Alba, owner)", ACTION_LEN)
  bt = lambda bs: [kit.byte_token(codec, b) for b in bs]
  cases = {
      "empty": ([], 0),
      "all padding": ([codec.pad_id] * ACTION_LEN, ACTION_LEN),
      "end of turn inside": (list(codec.encode("lookup(Alba, owner)")) + [codec.end_of_turn_id], None),
      "invalid utf-8": (bt(b"lookup(Alba, ") + bt(b"\xc3\x28") + bt(b")"), None),
      "out-of-vocab ids": (list(codec.encode("lookup(Alba, owner)"))[:-1] + [codec.vocab_size + 7, -1], None),
  }
  for name, (ids, length) in cases.items():
    ids = ids[:ACTION_LEN]
    tokens = np.full(ACTION_LEN, codec.pad_id, np.int32)
    tokens[:len(ids)] = ids
    action = envs.TokenBuffer(tokens=jnp.asarray(tokens), length=jnp.int32(len(ids) if length is None else length))
    new, obs, info = lk.step(state, action)
    assert int(info.error_kind) == K.PARSE_ERROR, name
    assert "Error: could not parse the action." in codec.decode(obs), name
    assert int(new.progress) == 0 and not bool(new.done), name
  # More bytes than max_action_bytes: a parse error even though the text would be a valid call.
  short_env = envs.make("lookup", codec, hops=2, distractor_entities=2, num_relations=3,
                       max_action_len=ACTION_LEN, max_action_bytes=16)
  short_state, _ = short_env.reset(jax.random.key(0), hand_task(), -1)
  _, _, info = jax.jit(short_env.step)(short_state, ok)      # "lookup(Alba, owner)" is 19 bytes
  assert int(info.error_kind) == K.PARSE_ERROR
  _, _, info = lk.step(state, ok)
  assert int(info.error_kind) == K.NONE
