"""Fixtures for the environment tests: a large (~150k-entry) byte-level BPE tokenizer built here.

The vocabulary is made programmatically (no download, no training, ~1 s): every byte, every
number 0..999 with and without a leading space, the words the environments print and parse
(with and without a leading space), and filler (letter strings of length 1..4) up to ~150k
entries. Its chat template is Llama-3 style (<|start_header_id|>role<|end_header_id|>, <|eot_id|>),
so it also exercises a template unlike the built-in ChatML one.

Merges: for every token, one merge for each way to split it into two tokens. Because every
substring of a token is itself a token, BPE can always merge any adjacent pair inside a
pre-token that is in the vocabulary, so such pre-tokens ("123", " 42", " lookup") end as a single
token regardless of merge order.
"""

import itertools
import string

import pytest

LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
# Words the environments print or parse, merged into single tokens (with and without a space).
WORDS = """lookup answer add sub mul Error error unknown entity relation tool tools arguments
argument Turns turns left You have What is the of The Correct Wrong Result result""".split()
TARGET_SIZE = 150_000


def _byte_chars():
  from jaxagent.envs.codec import _bytes_to_unicode
  return _bytes_to_unicode()


def build_large_bpe():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  b2u = _byte_chars()
  sp = b2u[ord(" ")]
  vocab: dict[str, int] = {}

  def add(tok):
    if tok not in vocab:
      vocab[tok] = len(vocab)

  for b in range(256):
    add(b2u[b])

  def add_closed(word):  # the word and all its substrings
    for n in range(2, len(word) + 1):
      for i in range(len(word) - n + 1):
        add(word[i:i + n])

  for i in range(1000):
    add_closed(str(i))
    add_closed(sp + str(i))
  for w in WORDS:
    add_closed(w)
    add_closed(sp + w)
  lower, upper = string.ascii_lowercase, string.ascii_uppercase
  for n in (2, 3):
    for t in itertools.product(lower, repeat=n):
      add_closed("".join(t))
  for first in upper + lower:
    for n in (0, 1, 2):
      for t in itertools.product(lower, repeat=n):
        add_closed(sp + first + "".join(t))
        add_closed(first + "".join(t))
  for t in itertools.product(lower, repeat=4):
    if len(vocab) >= TARGET_SIZE:
      break
    add("".join(t))   # its substrings (length <= 3) are all in already
  merges = []
  for tok in vocab:
    for i in range(1, len(tok)):
      a, b = tok[:i], tok[i:]
      if a in vocab and b in vocab:
        merges.append((a, b))
  merges.sort(key=lambda ab: len(ab[0]) + len(ab[1]))
  model = models.BPE(vocab=vocab, merges=merges)
  tk = Tokenizer(model)
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tk.decoder = decoders.ByteLevel()
  tk.add_special_tokens(SPECIALS)
  return PreTrainedTokenizerFast(
      tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
      pad_token="<|end_of_text|>", chat_template=LLAMA_STYLE_TEMPLATE)


@pytest.fixture(scope="session")
def large_tokenizer():
  return build_large_bpe()


@pytest.fixture(scope="session", params=["builtin", "large"])
def any_tokenizer(request, builtin_tokenizer):
  """Each test using this runs with the built-in tokenizer and with the 150k BPE."""
  if request.param == "builtin":
    return builtin_tokenizer
  return request.getfixturevalue("large_tokenizer")


# ---- helpers shared by the environment tests (exposed as fixtures: tests/envs has no package) ----


class EnvKit:
  """Builds action buffers and runs batched episodes for the environment tests."""

  @staticmethod
  def action(codec, text, n, split="tokenizer"):
    """TokenBuffer [n] of `text`: the tokenizer's own split, or one token per byte ("chars")."""
    import jax.numpy as jnp
    import numpy as np
    from jaxagent.envs.base import TokenBuffer
    if split == "tokenizer":
      ids = codec.encode(text)
    else:
      ids = np.asarray([EnvKit.byte_token(codec, b) for b in text.encode()], np.int32)
    assert len(ids) <= n, (text, len(ids), n)
    return TokenBuffer(tokens=jnp.asarray(np.pad(ids, (0, n - len(ids))), jnp.int32),
                       length=jnp.int32(len(ids)))

  @staticmethod
  def arbitrary_step(fix, data, budgets, extra_ids=()):
    """Draws any token ids (out of range, end-of-turn and padding ids included) and any length,
    steps a freshly reset env (`fix`: env, codec, jitted reset and step) with them and asserts what
    every env guarantees for any input. Returns (state before, state after, obs, info)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import strategies as st
    from jaxagent.envs.base import ErrorKind, TokenBuffer
    n = fix.env.max_action_len
    ids = st.integers(-3, fix.codec.vocab_size + 3)
    if extra_ids:
      ids = ids | st.sampled_from(list(extra_ids))
    drawn = data.draw(st.lists(ids, max_size=n))
    tokens = np.zeros(n, np.int32)
    tokens[:len(drawn)] = drawn
    length = data.draw(st.integers(0, n))
    state, _ = fix.reset(jax.random.key(data.draw(st.integers(0, 3))), None,
                         data.draw(st.sampled_from(budgets)))
    new, obs, info = fix.step(state, TokenBuffer(tokens=jnp.asarray(tokens), length=jnp.int32(length)))
    assert float(info.reward) in (0.0, 1.0) and 0 <= int(info.error_kind) < len(ErrorKind)
    assert 0 < int(obs.length) <= fix.env.max_step_obs_len < fix.env.max_obs_len
    assert int(new.turn) == 1
    return state, new, obs, info

  @staticmethod
  def assert_splits_act_alike(fix, state, text):
    """Stepping `text` as the tokenizer splits it and as one token per byte gives the same
    state, observation (padding included) and info."""
    import jax
    import numpy as np
    n = fix.env.max_action_len
    a, b = EnvKit.action(fix.codec, text, n), EnvKit.action(fix.codec, text, n, split="chars")
    (s1, o1, i1), (s2, o2, i2) = fix.step(state, a), fix.step(state, b)
    for x, y in ((s1, s2), (o1, o2), (i1, i2)):
      jax.tree.map(np.testing.assert_array_equal, x, y)

  @staticmethod
  def jitted(env):
    """The env with its reset, step and oracle jitted, as the tests' env fixtures hold it."""
    import types
    import jax
    return types.SimpleNamespace(env=env, codec=env.codec, reset=jax.jit(env.reset),
                                 step=jax.jit(env.step), oracle=jax.jit(env.oracle_action))

  @staticmethod
  def byte_token(codec, b):
    """The id of a single-byte token for byte b."""
    cache = codec.__dict__.setdefault("_test_byte_tokens", {})
    if not cache:
      import numpy as np
      for i in np.nonzero(codec.token_nbytes == 1)[0][::-1]:
        cache[int(codec.token_bytes[i, 0])] = int(i)
    return cache[b]

  @staticmethod
  def batch(tree, b):
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (b,) + jnp.shape(x)), tree)

  @staticmethod
  def run_oracle(env, batch=256, seed=0, budget=-1):
    """Runs the oracle on `batch` sampled tasks for optimal_turns steps with jit(vmap(step)),
    asserting the step function is traced once for all turns (per-row budgets included). Returns the per-turn infos (numpy) and the
    final state."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    traces = []

    def counted_step(state, action):
      traces.append(1)   # runs once per trace, not per call
      return env.step(state, action)

    step = jax.jit(jax.vmap(counted_step))
    reset = jax.jit(jax.vmap(env.reset))
    oracle = jax.jit(jax.vmap(env.oracle_action))
    keys = jax.random.split(jax.random.key(seed), batch)
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), (batch,))
    state, obs = reset(keys, None, budget)
    assert np.all(np.asarray(obs.length) > 0) and np.all(np.asarray(obs.length) <= env.max_obs_len)
    infos = []
    turns = int(np.asarray(jax.vmap(env.optimal_turns)(state.task)).max())
    for _ in range(turns):
      action = oracle(state)
      assert np.all(np.asarray(action.length) < env.max_action_len)
      state, obs, info = step(state, action)
      assert np.all(np.asarray(obs.length) <= env.max_step_obs_len)
      infos.append(jax.tree.map(np.asarray, info))
    assert len(traces) == 1, f"jit(vmap(step)) traced {len(traces)} times"
    return infos, state


@pytest.fixture(scope="session")
def kit():
  return EnvKit
