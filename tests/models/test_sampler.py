"""The sampler: sampling statistics of temperature / top-k / top-p / greedy, returned
log-probabilities, per-row stop tokens and limits, batch independence, and no recompilation."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.models.policy import Policy
from jaxagent.models import sampler
from jaxagent.models.sampler import SamplingConfig

N_DRAWS = 40_000
# Deliberately not sorted, so a sampler that confuses rank with token id fails.
LOGITS = np.array([0.5, 2.0, -1.0, 1.5, -3.0, 1.0, 0.0, -0.5], np.float32)

sample = jax.jit(sampler.sample_from_logits)


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _draw(sc: SamplingConfig, logits=LOGITS, seed=0):
  logits_nv = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, len(logits)))
  tok, lp = sample(jax.random.key(seed), logits_nv, sc)
  return np.asarray(tok), np.asarray(lp)


def _chi2_critical(df: int, z: float = 4.26) -> float:
  """Upper quantile of chi-square(df) at normal z-score z (4.26 ~ p = 1e-5), Wilson-Hilferty."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distribution(tokens, probs):
  """Chi-square goodness of fit of the token counts to `probs` (tokens with p = 0 never drawn).

  Cells expecting fewer than 5 draws are pooled, as the chi-square approximation needs."""
  counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
  zero = probs == 0
  assert counts[zero].sum() == 0, f"drew tokens of probability 0: {np.nonzero(counts * zero)}"
  expected = probs * len(tokens)
  big = expected >= 5
  obs = list(counts[big]) + ([counts[~big & ~zero].sum()] if (~big & ~zero).any() else [])
  exp = list(expected[big]) + ([expected[~big & ~zero].sum()] if (~big & ~zero).any() else [])
  obs, exp = np.array(obs), np.array(exp)
  if len(obs) == 1:     # a single possible outcome: the support check above is the whole test
    return
  chi2 = float(((obs - exp) ** 2 / exp).sum())
  assert chi2 < _chi2_critical(len(obs) - 1), (chi2, counts, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
  tokens, lp = _draw(SamplingConfig.make(temperature))
  probs = _softmax(LOGITS.astype(np.float64) / temperature)
  assert_distribution(tokens, probs)
  np.testing.assert_allclose(lp, np.log(probs)[tokens], atol=1e-5)


def test_top_k_samples_only_the_k_best_renormalised():
  k = 3
  tokens, lp = _draw(SamplingConfig.make(1.0, top_k=k))
  top = np.argsort(-LOGITS)[:k]                      # tokens 1, 3, 5
  assert set(np.unique(tokens)) == set(top.tolist())
  probs = np.zeros(len(LOGITS))
  probs[top] = _softmax(LOGITS[top].astype(np.float64))
  assert_distribution(tokens, probs)
  # Log-probs are those of the untruncated softmax at the temperature.
  np.testing.assert_allclose(lp, np.log(_softmax(LOGITS.astype(np.float64)))[tokens], atol=1e-5)


def _nucleus(probs, p):
  """Smallest prefix (by decreasing probability) with mass >= p, worked out in float64."""
  order = np.argsort(-probs)
  cum = np.cumsum(probs[order])
  return order[:int(np.searchsorted(cum, p)) + 1]


@pytest.mark.parametrize("prefix", [1, 2, 3, 5])
def test_top_p_keeps_exactly_the_smallest_prefix_with_mass_p(prefix):
  base = _softmax(LOGITS.astype(np.float64))
  cum = np.cumsum(np.sort(base)[::-1])
  # A p strictly between two prefix masses, so the expected set is unambiguous.
  lo = cum[prefix - 2] if prefix > 1 else 0.0
  p = (lo + cum[prefix - 1]) / 2
  keep = _nucleus(base, p)
  assert len(keep) == prefix
  tokens, _ = _draw(SamplingConfig.make(1.0, top_p=p))
  assert set(np.unique(tokens)) == set(keep.tolist())
  probs = np.zeros(len(LOGITS))
  probs[keep] = base[keep] / base[keep].sum()
  assert_distribution(tokens, probs)


def test_top_p_and_top_k_together_with_temperature():
  t, k = 0.7, 4
  base = _softmax(LOGITS.astype(np.float64) / t)     # the nucleus is taken at the temperature
  cum = np.cumsum(np.sort(base)[::-1])
  p = (cum[1] + cum[2]) / 2
  keep = _nucleus(base, p)                            # 3 tokens, fewer than k
  assert len(keep) == 3
  tokens, _ = _draw(SamplingConfig.make(t, top_k=k, top_p=p))
  probs = np.zeros(len(LOGITS))
  probs[keep] = base[keep] / base[keep].sum()
  assert_distribution(tokens, probs)
  tokens, _ = _draw(SamplingConfig.make(t, top_k=2, top_p=p))     # now top-k is the tighter one
  assert set(np.unique(tokens)) == {1, 3}


# Random logits of the same shape as above: `sample` is compiled once for the whole module.
def _random_logits(seed, scale):
  return np.random.RandomState(seed).normal(size=(N_DRAWS, len(LOGITS))).astype(np.float32) * scale


def test_greedy_at_temperature_zero():
  logits = _random_logits(1, 3.0)
  best = np.argmax(logits, -1)
  for knobs in [dict(), dict(top_k=5, top_p=0.3)]:     # truncation knobs are irrelevant
    tok, lp = sample(jax.random.key(2), jnp.asarray(logits), SamplingConfig.make(0.0, **knobs))
    np.testing.assert_array_equal(tok, best)
    want = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(N_DRAWS), best]
    np.testing.assert_allclose(lp, want, atol=1e-6)


def test_argmax_last_is_the_first_index_of_the_maximum():
  rng = np.random.RandomState(7)
  x = rng.randint(-3, 3, size=(500, 9)).astype(np.float32)   # many ties
  x[::5, 2] = np.inf
  x[1::7] = -np.inf                                           # whole rows of -inf: index 0
  x[3::11, 4] = -np.inf
  got = np.asarray(jax.jit(sampler.argmax_last)(jnp.asarray(x)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.argmax(x, -1))


def test_categorical_is_the_gumbel_argmax_and_never_draws_minus_infinity():
  logits = _random_logits(5, 2.0)
  logits[:, 3] = -np.inf
  key = jax.random.key(6)
  got = np.asarray(jax.jit(sampler.categorical)(key, jnp.asarray(logits)))
  noise = np.asarray(jax.random.gumbel(key, logits.shape, jnp.float32))
  np.testing.assert_array_equal(got, np.argmax(logits + noise, -1))
  assert not np.any(got == 3)


def test_logprobs_are_log_softmax_over_temperature_at_the_sampled_token():
  logits = _random_logits(3, 2.0)
  for t, k, p in [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8)]:
    sc = SamplingConfig.make(t, top_k=k, top_p=p)
    tok, lp = sample(jax.random.key(4), jnp.asarray(logits), sc)
    want = np.asarray(jax.nn.log_softmax(logits / t, -1))[np.arange(N_DRAWS), np.asarray(tok)]
    np.testing.assert_allclose(lp, want, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Generation with a tiny random model.

CFG = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=True, qk_norm=False, max_position_embeddings=128)


@pytest.fixture(scope="module")
def params():
  rng = np.random.RandomState(0)
  _, shapes = decoder.abstract_params(CFG)
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  leaves = [jnp.asarray(("norm" in jax.tree_util.keystr(p)) + rng.normal(size=s.shape) * 0.3,
                        jnp.float32) for p, s in flat]
  return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def _right_padded(prompts, width):
  toks = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  return jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32)


# `sampler.generate` that fails on a second trace. Every generation in this module has the
# shapes Policy.generate gives 3 prompts of <= 16 tokens, 5..8 new tokens and <= 4 stop ids, so
# the whole module compiles the sampler once.
GENERATE = jax.jit(chex.assert_max_traces(sampler.generate.__wrapped__, n=1),
                   static_argnames=("cfg", "max_new_tokens", "pad_id"))


def _generate(params, prompts, *, max_new, stops, sc, seed=0):
  toks, lens = _right_padded(prompts, 16)
  return GENERATE(CFG, params, toks, lens, jax.random.key(seed), sc,
                  jnp.asarray(max_new, jnp.int32), jnp.asarray(stops, jnp.int32),
                  max_new_tokens=8, pad_id=0)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
NO_STOP = [[-1] * 4] * 3


def test_per_row_max_new_and_stop_tokens(params):
  greedy = SamplingConfig.make(0.0)
  free = _generate(params, PROMPTS, max_new=[8, 8, 8], stops=NO_STOP, sc=greedy)
  ref = np.asarray(free.tokens)
  np.testing.assert_array_equal(free.lengths, [8, 8, 8])
  assert not np.asarray(free.stopped).any()
  stop1 = int(ref[1, 2])
  first = list(ref[1]).index(stop1)                   # first occurrence (<= 2)
  gen = _generate(params, PROMPTS, max_new=[3, 8, 0], sc=greedy,
                  stops=[[-1] * 4, [63, stop1, -1, -1], [-1] * 4])
  lengths = np.asarray(gen.lengths)
  np.testing.assert_array_equal(lengths, [3, first + 1, 0])
  np.testing.assert_array_equal(gen.stopped, [False, True, False])
  toks, lps = np.asarray(gen.tokens), np.asarray(gen.logprobs)
  for b in range(3):
    n = lengths[b]
    np.testing.assert_array_equal(toks[b, :n], ref[b, :n])
    np.testing.assert_allclose(lps[b, :n], np.asarray(free.logprobs)[b, :n], atol=1e-6)
    assert (toks[b, n:] == 0).all() and (lps[b, n:] == 0).all()
  # The cache holds prompt + generated tokens.
  np.testing.assert_array_equal(gen.cache.length, [7 + 3, 1 + first + 1, 4])


def test_rows_do_not_depend_on_their_batch(params):
  """Greedy tokens and log-probs of a row are the same whatever the other rows hold."""
  greedy = SamplingConfig.make(0.0)
  a = _generate(params, PROMPTS, max_new=[8, 5, 8], stops=NO_STOP, sc=greedy)
  other = [[1, 2], PROMPTS[0], [3] * 8]               # row 0's prompt moved to row 1
  b = _generate(params, other, max_new=[8, 8, 2], stops=NO_STOP, sc=greedy)
  np.testing.assert_array_equal(np.asarray(b.tokens)[1], np.asarray(a.tokens)[0])
  np.testing.assert_allclose(np.asarray(b.logprobs)[1], np.asarray(a.logprobs)[0], atol=1e-6)


def test_sampled_logprobs_match_a_full_forward(params):
  """Sampling through the KV cache scores each token as a full recomputation would."""
  t, k = 0.8, 10
  gen = _generate(params, PROMPTS, max_new=[8, 8, 8], stops=NO_STOP,
                  sc=SamplingConfig.make(t, top_k=k), seed=5)
  toks, lps = np.asarray(gen.tokens), np.asarray(gen.logprobs)
  seqs = np.zeros((3, 16), np.int32)
  for b, p in enumerate(PROMPTS):
    seqs[b, :len(p) + 8] = list(p) + list(toks[b])
  logits = np.asarray(jax.jit(decoder.apply, static_argnums=0)(CFG, params, jnp.asarray(seqs))[0])
  for b, p in enumerate(PROMPTS):
    step = logits[b, len(p) - 1:len(p) + 7]             # logits predicting each new token
    want = np.asarray(jax.nn.log_softmax(step / t, -1))[np.arange(8), toks[b]]
    np.testing.assert_allclose(lps[b], want, atol=1e-4)
    ranks = (step > step[np.arange(8), toks[b]][:, None]).sum(-1)
    assert (ranks < k).all()
  # Same seed, same samples; another seed, other samples.
  again = _generate(params, PROMPTS, max_new=[8, 8, 8], stops=NO_STOP,
                    sc=SamplingConfig.make(t, top_k=k), seed=5)
  np.testing.assert_array_equal(again.tokens, toks)
  other = _generate(params, PROMPTS, max_new=[8, 8, 8], stops=NO_STOP,
                    sc=SamplingConfig.make(t, top_k=k), seed=6)
  assert not np.array_equal(np.asarray(other.tokens), toks)


def test_no_recompilation_across_calls(params, monkeypatch):
  """Prompt contents, prompt lengths within a bucket, sampling knobs, stop tokens (their number
  too) and per-row limits are all data: one trace serves every call below."""
  # (The trace counter is not cleared: GENERATE may already have been traced by the tests above,
  # and any further trace, here or there, is an error.)
  monkeypatch.setattr(sampler, "generate", GENERATE)
  policy = Policy(config=CFG, params=params, tokenizer=None)
  calls = [
      dict(prompts=[[1, 2, 3], [4, 5], [6]], max_new_tokens=5),
      dict(prompts=[[9] * 9, [4], [1, 2]], max_new_tokens=7, temperature=0.0, seed=1,
           stop_tokens=(3,)),
      dict(prompts=[[7] * 16, [2] * 10, [3] * 12], max_new_tokens=8, temperature=0.5, top_k=5,
           top_p=0.9, seed=2, stop_tokens=(3, 4, 5)),
      dict(prompts=[[8, 1], [6] * 11, [5] * 3], max_new_tokens=6, temperature=1.3, top_p=0.5,
           stop_tokens=(60, 61)),
  ]
  for kw in calls:
    outs = policy.generate(**kw)
    assert len(outs) == 3 and all(1 <= len(o) <= kw["max_new_tokens"] for o in outs)
  # Per-row limits and stop ids straight through the sampler.
  for max_new, stops in [([1, 8, 2], [[3, -1, -1, -1], [-1] * 4, [-1] * 4]),
                         ([8, 0, 8], [[-1] * 4, [2, 9, 4, 1], [7, 7, -1, -1]])]:
    _generate(params, [[1, 2], [3], [4, 5, 6]], max_new=max_new, stops=stops,
              sc=SamplingConfig.make(0.9, top_k=3))
  assert GENERATE._cache_size() == 1


def test_chunked_prefill_equals_one_chunk(params):
  """A prompt appended chunk by chunk (chunks of 4, rows ending in different chunks, one row
  empty) gives the same last-token logits and cache as one chunk, and the full forward's."""
  rng = np.random.RandomState(7)
  prompts = [rng.randint(1, 64, size=n).tolist() for n in (13, 4, 9)] + [[]]
  toks, lens = _right_padded(prompts, 14)
  prefill = jax.jit(sampler.prefill, static_argnames=("cfg", "chunk"))
  empty = decoder.init_cache(CFG, 4, 20)
  one, c1 = prefill(CFG, params, empty, toks, lens, chunk=16)
  many, c4 = prefill(CFG, params, empty, toks, lens, chunk=4)
  live = np.asarray(lens) > 0
  np.testing.assert_allclose(np.asarray(many)[live], np.asarray(one)[live], atol=1e-5)
  np.testing.assert_array_equal(c4.length, lens)
  for b, p in enumerate(prompts[:3]):     # the rows' k/v slots; junk past a row's length
    np.testing.assert_allclose(np.asarray(c4.k)[:, b, :, :, :len(p)],   # k: slots last
                               np.asarray(c1.k)[:, b, :, :, :len(p)], atol=1e-5)
    np.testing.assert_allclose(np.asarray(c4.v)[:, b, :, :len(p)],
                               np.asarray(c1.v)[:, b, :, :len(p)], atol=1e-5)
  full = np.asarray(jax.jit(decoder.apply, static_argnums=0)(CFG, params, toks)[0])
  for b, p in enumerate(prompts[:3]):
    np.testing.assert_allclose(np.asarray(many)[b], full[b, len(p) - 1], atol=1e-4)


_PREFILL = jax.jit(sampler.prefill, static_argnames=("cfg", "chunk"))


def _chunked_like_one(params, seed: int, sizes, width: int, capacity: int, chunk: int):
  """Random prompts of `sizes` tokens right-padded to `width`, prefilled into a cache whose every
  k/v slot holds 7.0 (to see which slots a prefill writes) as one chunk and in chunks of at most
  `chunk`: asserts the same last logits and lengths; returns (tokens, lengths, the marked cache,
  the one-chunk cache, the chunked cache)."""
  rng = np.random.RandomState(seed)
  toks, lens = _right_padded([rng.randint(1, 64, size=n).tolist() for n in sizes], width)
  marked = decoder.init_cache(CFG, len(sizes), capacity)
  marked = marked.replace(k=jnp.full(marked.k.shape, 7.0, marked.k.dtype),
                          v=jnp.full(marked.v.shape, 7.0, marked.v.dtype))
  one, one_cache = _PREFILL(CFG, params, marked, toks, lens, chunk=width)
  many, cache = _PREFILL(CFG, params, marked, toks, lens, chunk=chunk)
  np.testing.assert_allclose(np.asarray(many), np.asarray(one), atol=1e-5)
  np.testing.assert_array_equal(cache.length, lens)
  return toks, lens, marked, one_cache, cache


def test_prefill_runs_only_the_chunks_the_longest_row_needs(params):
  """A buffer far wider than its rows (24 columns, rows of <= 5 tokens, chunks of 4): the same
  logits as one chunk, and only two chunks run (a third would write past slot 8). With every
  row empty, no chunk runs and the cache is untouched."""
  toks, lens, marked, _, cache = _chunked_like_one(params, 8, (5, 2, 4), 24, 32, 4)
  assert np.all(np.asarray(cache.k)[..., 8:] == 7.0)           # k: slots last
  assert np.all(np.asarray(cache.v)[:, :, :, 8:] == 7.0)
  assert not np.all(np.asarray(cache.k)[..., 4:8] == 7.0)      # the second chunk ran
  _, untouched = _PREFILL(CFG, params, marked, toks, jnp.zeros_like(lens), chunk=4)
  assert np.all(np.asarray(untouched.k) == 7.0) and np.all(np.asarray(untouched.v) == 7.0)
  np.testing.assert_array_equal(untouched.length, 0)


def test_prefill_splits_a_buffer_into_equal_chunks(params):
  """`chunk_width` is the fewest chunks of at most `chunk`, all one width (224 -> 2 x 112, a
  97-wide observation with chunks of 32 -> 25). A 14-wide buffer with chunk 6 runs chunks of 5:
  rows of <= 5 tokens run one (slot 5 onwards untouched, where a 6-wide chunk would write slot
  5), with the same logits and cache as one chunk."""
  assert [sampler.chunk_width(w, c) for w, c in [(224, 128), (97, 32), (128, 128), (129, 128),
                                                 (14, 6), (14, 4), (5, 8)]] == [
                                                     112, 25, 128, 65, 5, 4, 5]
  _, _, _, c1, cache = _chunked_like_one(params, 9, (5, 3, 1), 14, 16, 6)
  np.testing.assert_allclose(np.asarray(cache.k)[0, 0, :, :, :5], np.asarray(c1.k)[0, 0, :, :, :5],
                             atol=1e-5)
  assert np.all(np.asarray(cache.k)[..., 5:] == 7.0)           # k: slots last
  assert np.all(np.asarray(cache.v)[:, :, :, 5:] == 7.0)
