"""Tests of the text codec (envs/codec.py) and the shared parsing helpers (envs/common.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.envs import codec_for
from jaxagent.envs.base import TokenBuffer
from jaxagent.envs.codec import byte_table, concat, concat_host
from jaxagent.envs import common


def _buf(ids, n=None):
  ids = np.asarray(ids, np.int32)
  n = len(ids) if n is None else n
  return TokenBuffer(tokens=jnp.asarray(np.pad(ids, (0, n - len(ids)))), length=jnp.int32(len(ids)))


def test_to_bytes_matches_tokenizer_decode(any_tokenizer):
  codec = codec_for(any_tokenizer)
  text = "lookup( Alba , 'owner') 42 123  <|x|> caf\u00e9"
  ids = codec.encode(text)
  data, n = jax.jit(lambda b: codec.to_bytes(b, 96))(_buf(ids, 40))
  assert int(n) == len(text.encode())
  assert bytes(np.asarray(data)[:int(n)]) == text.encode()
  assert np.all(np.asarray(data)[int(n):] == 0)
  # Random ids (special tokens included) decode like the tokenizer itself does.
  rng = np.random.default_rng(0)
  rand = rng.integers(0, codec.vocab_size, size=30)
  want = any_tokenizer.decode(rand.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
  assert codec.decode(rand) == want


def test_chat_wrapping_and_end_of_turn(any_tokenizer):
  codec = codec_for(any_tokenizer)
  sys_, usr = codec.fragment("SYS"), codec.fragment("USR")
  first = codec.decode(concat(codec.prompt([sys_], [usr])))
  want = any_tokenizer.apply_chat_template(
      [{"role": "system", "content": "SYS"}, {"role": "user", "content": "USR"}],
      tokenize=False, add_generation_prompt=True)
  assert first == want
  later = codec.decode(concat(codec.observation([codec.fragment("OBS")])))
  full = any_tokenizer.apply_chat_template(
      [{"role": "system", "content": "SYS"}, {"role": "user", "content": "USR"},
       {"role": "assistant", "content": "ACT"}, {"role": "tool", "content": "OBS"}],
      tokenize=False, add_generation_prompt=True)
  eot = codec.decode([codec.end_of_turn_id])
  assert full == want + "ACT" + eot + later
  assert eot in ("<|im_end|>", "<|eot_id|>")


def test_concat_pieces_and_numbers(builtin_tokenizer):
  codec = codec_for(builtin_tokenizer)
  table = codec.fragment_table(["zero", "one", ""])

  @jax.jit
  def f(i, v, budget):
    pieces = [codec.fragment("a "), table.get(i), codec.fragment(" "), *codec.int_pieces(v),
              *common.budget_suffix(codec, budget, jnp.int32(2))]
    return concat(pieces, 40)

  for i, v, budget, want in [(0, 7, -1, "a zero 7"), (1, 1000, 5, "a one 1000\nTurns left: 3."),
                             (2, 123456789, 1, "a  123456789\nTurns left: 0.")]:
    out = f(i, v, budget)
    assert out.tokens.shape == (40,)
    assert codec.decode(out) == want
    host = concat_host([codec.fragment("a "), table.host(i), codec.fragment(" "), codec.int_host(v),
                        *common.budget_suffix_host(codec, budget, 2)])
    np.testing.assert_array_equal(np.asarray(out.tokens)[:int(out.length)], host)
  # Truncation to out_len.
  out = concat([codec.fragment("hello world " * 10)], 5)
  assert int(out.length) == 5


@pytest.mark.parametrize("text,tool,args", [
    ("lookup(Alba, owner)", 0, ["Alba", "owner"]),
    ("  answer( 'Brix' )\n", 1, ["Brix"]),
    ('answer("a b",,)', 1, ["a b", "", ""]),
    ("lookup()", 0, []),
    ("nope(x)", -1, ["x"]),
])
def test_parse_call_valid_syntax(builtin_tokenizer, text, tool, args):
  codec = codec_for(builtin_tokenizer)
  tools = byte_table(["lookup", "answer"])
  call = jax.jit(lambda b: common.parse_action(codec, b, tools, 3, 64))(_buf(codec.encode(text), 32))
  assert bool(call.syntax_ok)
  assert int(call.tool) == tool
  assert int(call.num_args) == len(args)
  data = bytes(np.asarray(call.data))
  got = [data[int(s):int(s) + int(n)].decode() for s, n in zip(call.arg_start, call.arg_len)]
  assert got[:len(args)] == args


@pytest.mark.parametrize("text", ["", "   ", "lookup", "lookup(a", "lookup(a))", "lookup((a))",
                                  "look up(a)", "(a)", "lookup(a) x", "lookup(caf\u00e9)", "x" * 70])
def test_parse_call_syntax_errors(builtin_tokenizer, text):
  codec = codec_for(builtin_tokenizer)
  tools = byte_table(["lookup"])
  call = common.parse_action(codec, _buf(codec.encode(text), 80), tools, 2, 64)
  assert not bool(call.syntax_ok)
  assert int(call.tool) == -1


def test_parse_uint():
  data = jnp.asarray(np.frombuffer(b"x 0 007 123456789 1234567890 12a  ", np.uint8))
  cases = [(2, 1, 0, True), (4, 3, 7, True), (8, 9, 123456789, True), (18, 10, 0, False),
           (29, 3, 0, False), (0, 0, 0, False)]
  for start, n, value, ok in cases:
    v, good = common.parse_uint(data, jnp.int32(start), jnp.int32(n))
    assert (int(v), bool(good)) == (value, ok), (start, n)


def test_int_pieces_print_every_magnitude(any_tokenizer):
  codec = codec_for(any_tokenizer)
  rng = np.random.default_rng(0)
  vals = np.concatenate([[0, 5, 10, 999, 1000, 1001, 12345, 100000, 999999, 1000000, 1002003,
                          100000000, 999999999, 2_000_000_000], rng.integers(0, 10**9, 50)])
  out = jax.jit(jax.vmap(lambda v: concat(codec.int_pieces(v, 9), 16)))(jnp.asarray(vals, jnp.int32))
  for i, v in enumerate(vals):
    got = np.asarray(out.tokens[i, :int(out.length[i])])
    want = str(min(v, 10**9 - 1))   # clipped to max_digits
    assert codec.decode(got) == want
    if v < 10**9:
      np.testing.assert_array_equal(got, codec.int_host(int(v)))
  # Below 1000 the tokens are the tokenizer's own for the number.
  for v in (0, 42, 999):
    np.testing.assert_array_equal(concat_host(codec.int_pieces(jnp.int32(v), 3)), codec.encode(str(v)))


def test_registry(builtin_tokenizer):
  import jaxagent.envs as envs
  assert {"lookup", "arithmetic"} <= set(envs.names())
  assert envs.names() == sorted(envs.names())
  assert {"grid", "sokoban"} <= set(envs.jax_names()) and not {"sql", "host_lookup"} & set(
      envs.jax_names())
  with pytest.raises(ValueError, match="unknown environment"):
    envs.make("nope", builtin_tokenizer)
  env = envs.make("lookup", builtin_tokenizer, hops=1)
  assert env.codec.tokenizer is builtin_tokenizer               # the tokenizer's own codec
  fresh = codec_for(builtin_tokenizer)                          # built anew, not cached
  np.testing.assert_array_equal(env.codec.token_bytes, fresh.token_bytes)
  np.testing.assert_array_equal(env.codec.token_nbytes, fresh.token_nbytes)
  assert (env.codec.end_of_turn_id, env.codec.pad_id) == (fresh.end_of_turn_id, fresh.pad_id)
  assert codec_for(env.codec) is env.codec                      # a codec passes through
  assert envs.make("arithmetic", env.codec).codec is env.codec  # a codec is accepted too
  with pytest.raises(TypeError):
    envs.make("lookup", builtin_tokenizer, no_such_knob=1)


# A Qwen2.5-style template (tool results as a user turn wrapped in <tool_response>) and a
# Gemma-style one (no system role: raises on it; roles must alternate).
QWEN25_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GEMMA_STYLE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}")


@pytest.mark.parametrize("template", ["qwen25", "gemma"])
def test_chat_wrapping_follows_other_templates(builtin_tokenizer, template):
  import copy
  from jaxagent.envs.codec import TextCodec
  tok = copy.deepcopy(builtin_tokenizer)
  tok.chat_template = QWEN25_STYLE if template == "qwen25" else GEMMA_STYLE
  codec = TextCodec.from_tokenizer(tok)
  first = codec.decode(concat(codec.prompt([codec.fragment("SYS")], [codec.fragment("USR")])))
  later = codec.decode(concat(codec.observation([codec.fragment("OBS")])))
  eot = codec.decode([codec.end_of_turn_id])
  assert eot == "<|im_end|>"
  if template == "qwen25":
    assert codec.tool_role == "tool" and codec.has_system_role
    msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "USR"}]
    tail = [{"role": "tool", "content": "OBS"}]
    assert later == "\n<|im_start|>user\n<tool_response>\nOBS\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  else:
    assert codec.tool_role == "user" and not codec.has_system_role
    msgs = [{"role": "user", "content": "SYS\n\nUSR"}]
    tail = [{"role": "user", "content": "OBS"}]
  assert first == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "ACT"}] + tail,
                                 tokenize=False, add_generation_prompt=True)
  assert full == first + "ACT" + eot + later


# Llama 3.x style: a system block that always prints a date, today's unless `date_string` is
# given, and tool results in an "ipython" turn (written for this test, not the real template).
DATED_STYLE = (
    "{{- bos_token }}{%- if date_string is not defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set sys = '' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n\\n'"
    " + sys + '<|eot_id|>' }}"
    "{%- for m in rest %}{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def test_dated_templates_get_a_fixed_date(large_tokenizer):
  """A template printing today's date would make prompts (and their lengths) change from day to
  day, so a run resumed the next day would not continue as if never stopped."""
  import copy
  import datetime
  from jaxagent.envs.codec import TEMPLATE_KWARGS, TextCodec
  tok = copy.deepcopy(large_tokenizer)
  tok.chat_template = DATED_STYLE
  msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "USR"}]
  today = datetime.date.today().strftime("%d %b %Y")
  assert f"Today Date: {today}" in tok.apply_chat_template(msgs, tokenize=False)
  codec = TextCodec.from_tokenizer(tok)
  first = codec.decode(concat(codec.prompt([codec.fragment("SYS")], [codec.fragment("USR")])))
  later = codec.decode(concat(codec.observation([codec.fragment("OBS")])))
  assert codec.has_system_role and codec.tool_role == "tool"
  assert codec.decode([codec.end_of_turn_id]) == "<|eot_id|>"
  assert first == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                   f"Today Date: {TEMPLATE_KWARGS['date_string']}\n\nSYS<|eot_id|><|start_header_id|>user"
                   "<|end_header_id|>\n\nUSR<|eot_id|><|start_header_id|>assistant"
                   "<|end_header_id|>\n\n")
  assert later == ("<|start_header_id|>ipython<|end_header_id|>\n\nOBS<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


# Qwen3 style: the generation prompt holds an empty think block when thinking is off (written for
# this test, not the real template).
THINKING_STYLE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] +"
    " '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_thinking_templates_get_the_empty_think_block(builtin_tokenizer):
  import copy
  from jaxagent.envs.codec import TextCodec
  tok = copy.deepcopy(builtin_tokenizer)
  tok.chat_template = THINKING_STYLE
  codec = TextCodec.from_tokenizer(tok)
  first = codec.decode(concat(codec.prompt([codec.fragment("SYS")], [codec.fragment("USR")])))
  later = codec.decode(concat(codec.observation([codec.fragment("OBS")])))
  assert first.endswith("USR<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert later == ("\n<|im_start|>user\n<tool_response>\nOBS\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
