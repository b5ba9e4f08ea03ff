"""The decoder on its own: KV-cache decoding equals full recomputation, padding and batching do
not change a row's result, and the parameter tree is consistent with its metadata."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import attention, decoder
from jaxagent.models.config import ModelConfig

# Every feature at once: qkv bias, q/k norm, GQA, llama3 rope scaling, untied head.
CFG = ModelConfig(
    model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=True, qk_norm=True, max_position_embeddings=128,
    rope_scaling=(("factor", 4.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 8), ("rope_type", "llama3")))

apply = jax.jit(decoder.apply, static_argnums=0, static_argnames=("return_hidden", "cache_block"))


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random parameters with O(1) logits (norm weights around 1, everything else N(0, 0.3))."""
  rng = np.random.RandomState(seed)
  _, shapes = decoder.abstract_params(cfg)
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  leaves = []
  for path, s in flat:
    is_norm = "norm" in jax.tree_util.keystr(path)
    leaves.append(jnp.asarray((1.0 if is_norm else 0.0) + rng.normal(size=s.shape) * 0.3,
                              s.dtype))
  return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


@pytest.fixture(scope="module")
def params():
  return random_params(CFG)


def test_param_tree_matches_metadata(params):
  axes = decoder.logical_axes(CFG)
  _, shapes = decoder.abstract_params(CFG)
  assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == \
      jax.tree.structure(shapes)
  jax.tree.map(lambda a, s: len(a) == s.ndim or pytest.fail(f"{a} vs {s.shape}"),
               axes, shapes, is_leaf=lambda x: isinstance(x, tuple))
  assert axes["layers"]["q_proj"] == ("layers", "embed", "heads", "head_dim")
  assert axes["lm_head"] == ("embed", "vocab")
  assert sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)) == CFG.num_params()
  assert params["layers"]["q_proj"].shape == (2, 32, 4, 8)


def test_rope_frequencies_by_hand():
  plain = dataclasses.replace(CFG, rope_scaling=())
  want = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)               # [1, 0.1, 0.01, 0.001]
  np.testing.assert_allclose(plain.rope_inv_freq(), want, rtol=1e-6)
  linear = dataclasses.replace(CFG, rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
  np.testing.assert_allclose(linear.rope_inv_freq(), want / 2, rtol=1e-6)
  # llama3 with original context 8, factor 4: wavelengths 2*pi/f = [6.3, 63, 628, 6283]. Above
  # 8 / low_freq_factor = 8 they are divided by 4. Between 8 / high_freq_factor = 2 and 8 (only
  # the first) they are interpolated: s = (8 / wavelen - 1) / (4 - 1), f' = (1 - s) f / 4 + s f.
  s = (8 / (2 * np.pi) - 1) / 3
  np.testing.assert_allclose(CFG.rope_inv_freq(), [(1 - s) / 4 + s, 0.025, 0.0025, 0.00025],
                             rtol=1e-6)


def _full_logits(params, seqs: list[np.ndarray], width: int = 16) -> list[np.ndarray]:
  """No-cache logits of each sequence alone (batch of one). The sequence is followed by junk up
  to `width` tokens, which causal attention never lets an earlier token see, so every call
  shares one compiled program."""
  out = []
  for s in seqs:
    tokens = np.full((1, width), 7, np.int32)
    tokens[0, :len(s)] = s
    out.append(np.asarray(apply(CFG, params, jnp.asarray(tokens))[0][0, :len(s)]))
  return out


@pytest.mark.parametrize("cache_block", [decoder.CACHE_BLOCK, 4])
def test_cache_in_uneven_chunks_equals_full_recompute(params, cache_block):
  rng = np.random.RandomState(1)
  totals = [14, 14, 13]
  seqs = [rng.randint(0, 64, size=t).astype(np.int32) for t in totals]
  # Per-row chunk lengths per call; every call has the same width (5), so one compiled program.
  schedule = np.array([[5, 1, 3], [5, 5, 0], [4, 3, 5], [0, 5, 5]], np.int32)
  assert (schedule.sum(0) == totals).all()
  width = 5
  cache = decoder.init_cache(CFG, batch=3, capacity=20)   # >= 14 + width: padding fits
  pos = np.zeros(3, int)
  got = [[] for _ in range(3)]
  for lens in schedule:
    chunk = rng.randint(0, 64, size=(3, width)).astype(np.int32)   # junk in the padding
    for b, n in enumerate(lens):
      chunk[b, :n] = seqs[b][pos[b]:pos[b] + n]
    logits, cache = apply(CFG, params, jnp.asarray(chunk), cache=cache,
                          chunk_lens=jnp.asarray(lens), cache_block=cache_block)
    for b, n in enumerate(lens):
      got[b].append(np.asarray(logits[b, :n]))
    pos += lens
  np.testing.assert_array_equal(np.asarray(cache.length), totals)
  want = _full_logits(params, seqs)
  for b in range(3):
    g = np.concatenate(got[b])
    assert g.shape == want[b].shape
    assert np.abs(g - want[b]).max() < 1e-5, b
  assert max(np.abs(w).max() for w in want) > 1.0   # the comparison is not vacuous


@pytest.mark.parametrize("cache_block", [16, 7])
def test_blocked_cache_attention_counts_every_slot_once(params, cache_block):
  """A 40-slot cache read in blocks: with 16 the third block starts at slot 24 (capacity - block)
  and overlaps the second; with 7 six blocks tile it. Rows of different lengths, chunks of 4."""
  rng = np.random.RandomState(4)
  totals = (38, 29)
  seqs = [rng.randint(0, 64, size=t).astype(np.int32) for t in totals]
  cache = decoder.init_cache(CFG, batch=2, capacity=40)
  got = [[], []]
  for start in range(0, 38, 4):
    lens = np.array([max(0, min(4, t - start)) for t in totals], np.int32)
    chunk = rng.randint(0, 64, size=(2, 4)).astype(np.int32)
    for b, n in enumerate(lens):
      chunk[b, :n] = seqs[b][start:start + n]
    logits, cache = apply(CFG, params, jnp.asarray(chunk), cache=cache,
                          chunk_lens=jnp.asarray(lens), cache_block=cache_block)
    for b, n in enumerate(lens):
      got[b].append(np.asarray(logits[b, :n]))
  want = _full_logits(params, seqs, width=40)
  for b in range(2):
    assert np.abs(np.concatenate(got[b]) - want[b]).max() < 1e-5, b


def test_padding_either_side_equals_each_row_alone(params):
  rng = np.random.RandomState(2)
  seqs = [rng.randint(0, 64, size=n).astype(np.int32) for n in (9, 4, 6)]
  want = _full_logits(params, seqs)
  L = 10
  for side in ("left", "right"):
    tokens = rng.randint(0, 64, size=(4, L)).astype(np.int32)   # junk padding
    mask = np.zeros((4, L), np.int32)                           # row 3: all padding
    for b, s in enumerate(seqs):
      sl = slice(L - len(s), L) if side == "left" else slice(0, len(s))
      tokens[b, sl], mask[b, sl] = s, 1
    logits = np.asarray(apply(CFG, params, jnp.asarray(tokens),
                              attention_mask=jnp.asarray(mask))[0])
    assert np.isfinite(logits).all()
    for b in range(3):
      assert np.abs(logits[b][mask[b] == 1] - want[b]).max() < 1e-5, (side, b)


def test_batched_prefill_then_decode_equals_each_row_alone(params):
  """Rows with different prompt lengths share a cache; decoding one token at a time gives every
  row exactly what it gets alone (and rows with chunk_len 0 are left untouched)."""
  rng = np.random.RandomState(3)
  seqs = [rng.randint(0, 64, size=n).astype(np.int32) for n in (5, 2, 4)]
  new = rng.randint(0, 64, size=(3, 4)).astype(np.int32)
  prompt = np.zeros((3, 5), np.int32)   # the chunk shape of the test above: no new compile
  for b, s in enumerate(seqs):
    prompt[b, :len(s)] = s
  cache = decoder.init_cache(CFG, batch=3, capacity=20)
  lens = np.array([len(s) for s in seqs], np.int32)
  logits, cache = apply(CFG, params, jnp.asarray(prompt), cache=cache, chunk_lens=jnp.asarray(lens))
  step = [[np.asarray(logits[b, len(s) - 1])] for b, s in enumerate(seqs)]
  live = np.array([1, 1, 0], np.int32)          # row 2 pauses at step 1 (its token is junk)
  for i in range(4):
    chunk_lens = live if i == 1 else np.ones(3, np.int32)
    logits, cache = apply(CFG, params, jnp.asarray(new[:, i:i + 1]), cache=cache,
                          chunk_lens=jnp.asarray(chunk_lens))
    for b in range(3):
      if chunk_lens[b]:
        step[b].append(np.asarray(logits[b, 0]))
  # Expected: each row alone, full recompute over prompt + the tokens it consumed.
  consumed = [new[0], new[1], np.delete(new[2], 1)]
  want = _full_logits(params, [np.concatenate([s, c]) for s, c in zip(seqs, consumed)])
  for b, s in enumerate(seqs):
    g = np.stack(step[b])
    w = want[b][len(s) - 1:]
    assert g.shape == w.shape
    assert np.abs(g - w).max() < 1e-5, b
  np.testing.assert_array_equal(np.asarray(cache.length), lens + [4, 4, 3])


def _reference_attention(q, k_cache, v_cache, length, scores, v):
  """Plain masked softmax over [every cache slot, the chunk]: q [B, K, G, L, hd], k_cache and
  v_cache [B, K, S, hd], scores [B, K, G, L, L] (the chunk's masked self-scores), v [B, K, L, hd]."""
  hd, s = q.shape[-1], k_cache.shape[2]
  sc = np.einsum("bkgld,bksd->bkgls", q, k_cache) * hd ** -0.5
  sc = np.where((np.arange(s)[None, :] < length[:, None])[:, None, None, None], sc, -np.inf)
  allsc = np.concatenate([sc, scores], axis=-1)
  p = np.exp(allsc - allsc.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bkgls,bksd->bkgld", p, np.concatenate([v_cache, v], axis=2))


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("block", [4, 7, 16, 40, 64])   # tiles, overlaps, dense (>= capacity)
def test_every_cache_attention_path_equals_masked_softmax(chunk, block):
  """Ragged rows (empty, mid, exactly full after the chunk, one slot short), against the plain
  masked softmax over the whole cache; block 7 makes the last block overlap the previous one,
  blocks >= the capacity take the dense path."""
  rng = np.random.RandomState(chunk * 100 + block)
  b, kh, g, hd, s, layers = 5, 2, 3, 8, 40, 2
  length = np.array([0, 13, s - chunk, s - chunk - 1, 28], np.int32)
  q = rng.normal(size=(b, kh, g, chunk, hd)).astype(np.float32)
  kc = rng.normal(size=(layers, b, kh, s, hd)).astype(np.float32) * 2
  vc = rng.normal(size=(layers, b, kh, s, hd)).astype(np.float32)
  v = rng.normal(size=(b, kh, chunk, hd)).astype(np.float32)
  scores = rng.normal(size=(b, kh, g, chunk, chunk)).astype(np.float32) * 2
  scores = np.where(np.tril(np.ones((chunk, chunk), bool)), scores, attention._NEG)
  fn = jax.jit(functools.partial(attention.cache_attention, "xla"), static_argnums=7)
  for layer in range(layers):
    got = fn(jnp.asarray(q), jnp.asarray(kc.swapaxes(3, 4)), jnp.asarray(vc), layer,
             jnp.asarray(length), jnp.asarray(scores), jnp.asarray(v), block)
    want = _reference_attention(q, kc[layer], vc[layer], length, scores, v)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5,
                               err_msg=f"layer {layer}")


def _numpy_causal_attention(q, k, v, mask):
  """float64 masked softmax of q [B, K, G, L, hd] over k, v [B, K, L, hd] under mask [B, L, L]."""
  sc = np.einsum("bkgld,bksd->bkgls", q, k) * q.shape[-1] ** -0.5
  sc = np.where(mask[:, None, None], sc, -1e300)   # rows with no key: uniform, as in the model
  p = np.exp(sc - sc.max(-1, keepdims=True))
  return np.einsum("bkgls,bksd->bkgld", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("block", [1, 4, 5, 13, 64])   # L = 13: ragged last block; >= L: one product
def test_causal_attention_in_query_blocks_equals_one_masked_softmax(block):
  """Values against float64 numpy, gradients against autodiff of the one-product path, with a
  full row, left and right padding and a row with one real token. Padding queries (no visible
  key) carry a zero cotangent, as they do in the model."""
  rng = np.random.RandomState(block)
  b, kh, g, l, hd = 4, 2, 3, 13, 8
  valid = np.ones((b, l), bool)
  valid[1, :5] = False
  valid[2, 9:] = False
  valid[3, :12] = False
  mask = np.tril(np.ones((l, l), bool))[None] & valid[:, None, :]
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(b, kh, g, l, hd), (b, kh, l, hd), (b, kh, l, hd)])
  sees = mask.any(-1)                                                    # [B, L]
  cot = rng.normal(size=q.shape).astype(np.float32) * sees[:, None, None, :, None]

  out = np.asarray(jax.jit(attention.causal_attention, static_argnums=4)(q, k, v, mask, block))
  assert np.isfinite(out).all()
  want = _numpy_causal_attention(q.astype(np.float64), k.astype(np.float64),
                                 v.astype(np.float64), mask)
  np.testing.assert_allclose(out.transpose(0, 3, 1, 2, 4)[sees],
                             want.transpose(0, 3, 1, 2, 4)[sees], rtol=0, atol=2e-6)

  def loss(blk):
    return lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, mask, blk) * cot)

  got = jax.jit(jax.grad(loss(block), argnums=(0, 1, 2)))(q, k, v)
  ref = jax.jit(jax.grad(loss(0), argnums=(0, 1, 2)))(q, k, v)
  for name, a, r in zip("qkv", got, ref):
    assert np.abs(np.asarray(r)).max() > 0.1, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=0, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("right_padded", [True, False])
def test_dot_product_attention_equals_the_blocked_path(right_padded):
  """The "dot_product" switch (jax.nn.dot_product_attention, for accelerators) against XLA's
  query blocks: values and gradients on every query that sees a key, with right padding (key
  lengths, the form cuDNN takes) and with left padding (a mask)."""
  rng = np.random.RandomState(4)
  b, kh, g, l, hd = 3, 2, 2, 11, 8
  lengths = np.array([11, 6, 1], np.int32)
  valid = np.arange(l)[None, :] < lengths[:, None]
  if not right_padded:
    valid = valid[:, ::-1]
  mask = np.tril(np.ones((l, l), bool))[None] & valid[:, None, :]
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(b, kh, g, l, hd), (b, kh, l, hd), (b, kh, l, hd)])
  sees = mask.any(-1)
  cot = rng.normal(size=q.shape).astype(np.float32) * sees[:, None, None, :, None]
  key_lengths = jnp.asarray(lengths) if right_padded else None

  def loss(impl):
    return lambda q, k, v: jnp.sum(
        attention.causal_attention(q, k, v, mask, 4, key_lengths, impl) * cot)

  outs = [np.asarray(attention.causal_attention(q, k, v, mask, 4, key_lengths, impl))
          for impl in ("dot_product", "xla")]
  np.testing.assert_allclose(outs[0].transpose(0, 3, 1, 2, 4)[sees],
                             outs[1].transpose(0, 3, 1, 2, 4)[sees], rtol=0, atol=2e-6)
  got, ref = (jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
              for impl in ("dot_product", "xla"))
  for name, a, r in zip("qkv", got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=0, atol=2e-5, err_msg=name)


def test_the_dot_product_switch_keeps_the_models_logits(params):
  rng = np.random.RandomState(5)
  tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, size=(3, 11)), jnp.int32)
  lengths = jnp.array([11, 6, 1], jnp.int32)
  out = {impl: np.asarray(decoder.apply(dataclasses.replace(CFG, attention=impl), params, tokens,
                                        lengths=lengths, query_block=4)[0])
         for impl in ("dot_product", "xla")}
  real = np.arange(11)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(out["dot_product"][real], out["xla"][real], rtol=1e-5, atol=1e-5)


def test_swiglu_gradient_equals_autodiff():
  rng = np.random.RandomState(3)
  h, wg, wu, wd, cot = (jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in
                        [(2, 5, 6), (6, 7), (6, 7), (7, 6), (2, 5, 6)])

  def plain(h, wg, wu, wd):
    return jnp.einsum("blf,fd->bld", jax.nn.silu(h @ wg) * (h @ wu), wd)

  np.testing.assert_allclose(decoder.swiglu(h, wg, wu, wd), plain(h, wg, wu, wd), atol=1e-5)
  got = jax.grad(lambda *a: jnp.sum(decoder.swiglu(*a) * cot), argnums=(0, 1, 2, 3))(h, wg, wu, wd)
  ref = jax.grad(lambda *a: jnp.sum(plain(*a) * cot), argnums=(0, 1, 2, 3))(h, wg, wu, wd)
  for name, a, r in zip(["h", "w_gate", "w_up", "w_down"], got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)


def test_query_blocks_change_neither_logits_nor_parameter_gradients(params):
  """The whole model with padded rows: query blocks of 3 against one product, on the logits of
  real tokens and the gradient of their mean log-likelihood."""
  rng = np.random.RandomState(9)
  tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, size=(3, 11)), jnp.int32)
  valid = np.ones((3, 11), bool)
  valid[1, :4] = False
  valid[2, 7:] = False
  valid = jnp.asarray(valid)

  def loglik(p, block):
    logits, _ = decoder.apply(CFG, p, tokens, attention_mask=valid, query_block=block)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    pair = valid[:, :-1] & valid[:, 1:]
    return jnp.sum(jnp.where(pair, lp, 0.0)) / jnp.sum(pair), logits

  f = jax.jit(jax.value_and_grad(loglik, has_aux=True), static_argnums=1)
  (v3, logits3), g3 = f(params, 3)
  (v0, logits0), g0 = f(params, 0)
  np.testing.assert_allclose(np.asarray(logits3)[valid], np.asarray(logits0)[valid], atol=2e-5)
  np.testing.assert_allclose(v3, v0, atol=1e-6)
  for (path, a), r in zip(jax.tree_util.tree_flatten_with_path(g3)[0], jax.tree.leaves(g0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
