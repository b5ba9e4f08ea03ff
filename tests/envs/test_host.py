"""Tests of the host (plain Python) environment path (envs/host.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxagent.envs import codec_for, common
from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.envs.codec import byte_table
from jaxagent.envs.host import HostCall, HostLookupEnv, parse_call_text

TOOLS = ("lookup", "answer", "x")
M, A = 48, 3
_parse = jax.jit(lambda d, n: common.parse_call(d, n, byte_table(TOOLS), A))


def _jax_parse(data: bytes):
  buf = np.zeros(M, np.uint8)
  buf[:min(len(data), M)] = np.frombuffer(data[:M], np.uint8)
  call = _parse(jnp.asarray(buf), jnp.int32(len(data)))
  if not bool(call.syntax_ok):
    return None
  args = [bytes(buf[int(s):int(s) + int(n)]).decode() for s, n in zip(call.arg_start, call.arg_len)]
  return int(call.tool), int(call.num_args), args


_pieces = st.sampled_from(["lookup", "answer", "x", "(", ")", ",", " ", "'", '"', "Alba", "\n", "\t",
                           "_", "42", "\x00", "\xff", "é", "(x)", "ab c"])
_text = st.lists(_pieces, max_size=12).map(lambda p: "".join(p).encode("utf-8", "surrogateescape"))


def test_parse_call_text_examples():
  assert parse_call_text(b" lookup( 'Alba' , owner)\n", 64) == HostCall("lookup", ["Alba", "owner"])
  assert parse_call_text(b"answer()", 64) == HostCall("answer", [])
  assert parse_call_text(b"answer(,)", 64) == HostCall("answer", ["", ""])
  for bad in [b"", b"lookup", b"look up(a)", b"f((a))", b"f(a) b", b"f(\xff)", b"f(a)" + b" " * 70]:
    assert parse_call_text(bad, 64) is None, bad


@settings(max_examples=150, deadline=None)
@given(data=_text | st.binary(max_size=M + 4))
def test_host_parser_agrees_with_jax_parser(data):
  host = parse_call_text(data, M)
  got = _jax_parse(data)
  if host is None:
    assert got is None, data
    return
  assert got is not None, data
  tool, num_args, args = got
  assert tool == (TOOLS.index(host.name) if host.name in TOOLS else -1)
  assert num_args == len(host.args)
  assert args[:len(host.args)] == host.args[:A]


def test_host_lookup_is_token_identical_to_jax_lookup(any_tokenizer):
  codec = codec_for(any_tokenizer)
  host = HostLookupEnv(codec, hops=2, distractor_entities=3, num_relations=3)
  env = host.jax_env
  b, n_act = 64, env.max_action_len
  tasks = host.sample_tasks(jax.random.key(1), b)
  budget = np.asarray([-1, 3, 6, 0] * (b // 4), np.int32)
  state, obs = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(0), b), tasks, budget)
  hstate, hobs = host.reset(tasks, budget)

  def same_obs(o, h):
    np.testing.assert_array_equal(np.asarray(o.length), h.length)
    for i in range(b):
      np.testing.assert_array_equal(np.asarray(o.tokens)[i, :h.length[i]], h.tokens[i, :h.length[i]])

  same_obs(obs, hobs)
  step, oracle = jax.jit(jax.vmap(env.step)), jax.jit(jax.vmap(env.oracle_action))
  errors = ["lookup(Zzz, owner)", "answer()", "lookup(a,b,c)", "search(x)", "lookup(", ""]
  rng = np.random.default_rng(0)
  kinds = set()
  for turn in range(6):
    o_jax = oracle(state)
    o_host = host.oracle_action(hstate)
    same_obs(o_jax, o_host)
    tokens = np.array(o_jax.tokens)
    lengths = np.array(o_jax.length)
    for i, ep in enumerate(hstate.episodes):
      choice = rng.integers(5)
      if choice == 1:   # a well-formed call on this task's names: off the chain, or no such link
        ids = codec.encode(f"lookup({rng.choice(ep.names)}, {rng.choice(ep.relations)})")
      elif choice == 2:  # a guess, usually wrong
        ids = codec.encode(f"answer({rng.choice(ep.names)})")
      elif choice == 3:  # malformed or bad calls
        ids = codec.encode(str(rng.choice(errors)))
      elif choice == 4:  # random tokens, any ids
        ids = rng.integers(-2, codec.vocab_size + 2, size=rng.integers(0, n_act))
      else:
        continue
      tokens[i] = codec.pad_id
      tokens[i, :len(ids)] = ids
      lengths[i] = len(ids)
    action = TokenBuffer(tokens=jnp.asarray(tokens), length=jnp.asarray(lengths))
    state, obs, info = step(state, action)
    hstate, hobs, hinfo = host.step(hstate, TokenBuffer(tokens=tokens, length=lengths))
    same_obs(obs, hobs)
    for field in ("reward", "done", "solved", "final_answer", "valid_call", "error_kind",
                  "oracle_match", "optimal_turns"):
      np.testing.assert_array_equal(np.asarray(getattr(info, field)), getattr(hinfo, field), err_msg=field)
    np.testing.assert_array_equal(np.asarray(state.done), hstate.done)
    np.testing.assert_array_equal(np.asarray(state.turn), hstate.turn)
    kinds |= set(np.asarray(info.error_kind).tolist())
  # The comparison covered successes and every error kind lookup has.
  assert kinds >= {ErrorKind.NONE, ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS,
                   ErrorKind.TOOL_FAILURE, ErrorKind.WRONG_ANSWER}, kinds
  # Visible budgets (<= 6) are spent by now unless the episode ended itself (an answer): the env
  # shows a spent budget but only the rollout engine ends episodes on it.
  vis = budget >= 0
  spent = np.asarray(state.turn)[vis] >= budget[vis]
  assert (spent | np.asarray(state.done)[vis]).all() and (spent & ~hstate.done[vis]).any()
