"""Jitted sampling: prefill a batch of right-padded prompts into a KV cache, then a
`lax.while_loop` decode that exits as soon as every row has stopped.

Sampling knobs (temperature, top-k, top-p) are traced scalars, and stop tokens / max new tokens
are per-row arrays, so changing any of them, or the prompt contents at the same shapes, never
recompiles. temperature == 0 is greedy.

Log-probabilities returned with each token are those of the policy's softmax at the sampling
temperature, before top-k / top-p truncation: log_softmax(logits / T) (T = 1 when greedy). This is
what `jaxagent.rollout.score` recomputes for PPO ratios and the likelihood analysis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig


@struct.dataclass
class SamplingConfig:
  temperature: jax.Array  # [] float32; 0 = greedy
  top_k: jax.Array        # [] int32; 0 = no top-k
  top_p: jax.Array        # [] float32; 1 = no nucleus truncation

  @classmethod
  def make(cls, temperature=1.0, top_k=0, top_p=1.0) -> "SamplingConfig":
    """The knobs as traced scalars. Concrete values are checked (`check_sampling`); traced ones
    (inside jit) are the caller's to check."""
    check_sampling(temperature, top_k, top_p)
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def check_sampling(temperature, top_k, top_p) -> None:
  """Raises ValueError for knobs that would silently sample something else: temperature < 0 or
  NaN (greedy), top_p <= 0 (greedy) or > 1 or NaN (no nucleus), top_k < 0 (no top-k). Traced
  values are skipped."""
  def concrete(x):
    try:
      return float(x)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return None
  t, k, p = concrete(temperature), concrete(top_k), concrete(top_p)
  if t is not None and not t >= 0:
    raise ValueError(f"temperature={temperature}: use 0 (greedy) or a positive temperature")
  if k is not None and (k < 0 or k != int(k)):
    raise ValueError(f"top_k={top_k}: use 0 (no top-k) or a positive integer")
  if p is not None and not 0 < p <= 1:
    raise ValueError(f"top_p={top_p}: use a value in (0, 1] (1: no nucleus truncation)")


@struct.dataclass
class Generation:
  tokens: jax.Array    # [B, N] int32 generated tokens (pad_id after each row's end)
  logprobs: jax.Array  # [B, N] float32 (0 after each row's end)
  lengths: jax.Array   # [B] int32 number of generated tokens, stop token included
  stopped: jax.Array   # [B] bool: ended on a stop token (else on max_new_tokens)
  cache: decoder.KVCache  # holds prompt + generated tokens (the last one included)
  next_logits: jax.Array  # [B, V] float32 logits after each row's last token
  # [B] float32: sum over the generated tokens of the entropy (nats) of the distribution each was
  # sampled from, softmax(logits / T) (0 when greedy); only from `decode(..., entropy=True)`.
  entropy: jax.Array | None = None


def scaled_logprobs(logits, temperature):
  """log_softmax(logits / T) with T = 1 for greedy (T == 0). logits [..., V] float32."""
  t = jnp.where(temperature > 0, temperature, 1.0)
  return jax.nn.log_softmax(logits / t, axis=-1)


def argmax_last(x):
  """jnp.argmax(x, axis=-1) as int32 (the first index of the maximum) for NaN-free x, as two
  plain reductions: XLA:CPU's fused (value, index) reduction of argmax took twice as long
  (measured on [64, 720] logits, 2026-12-06), once per decode step."""
  m = jnp.max(x, axis=-1, keepdims=True)
  v = x.shape[-1]
  return jnp.min(jnp.where(x == m, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def categorical(key, logits):
  """jax.random.categorical(key, logits, axis=-1) token for token (the same Gumbel noise, the
  same arg-max) with `argmax_last`."""
  return argmax_last(logits + jax.random.gumbel(key, logits.shape, logits.dtype))


def entropy_of(logits, temperature):
  """Entropy (nats) of softmax(logits / T) over the last axis, 0 when greedy (T == 0: the greedy
  policy is deterministic). logits [..., V] float32 -> [...]."""
  logp = scaled_logprobs(logits, temperature)
  h = -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0), axis=-1)
  return jnp.where(temperature > 0, h, 0.0)


def sample_from_logits(key, logits_bv, sc: SamplingConfig):
  """Samples one token per row. Returns (tokens [B] int32, logprobs [B] float32)."""
  logp = scaled_logprobs(logits_bv, sc.temperature)
  greedy = argmax_last(logits_bv)

  def truncated_sample(_):
    order = jnp.argsort(-logp, axis=-1)
    sorted_logp = jnp.take_along_axis(logp, order, axis=-1)
    rank = jnp.arange(logp.shape[-1])
    keep = jnp.where(sc.top_k > 0, rank < sc.top_k, True)[None, :]
    mass_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
    keep = keep & (mass_before < sc.top_p)
    keep = keep.at[:, 0].set(True)
    choice = categorical(key, jnp.where(keep, sorted_logp, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  def plain_sample(_):
    return categorical(key, logp)

  truncate = (sc.top_k > 0) | (sc.top_p < 1.0)
  sampled = jax.lax.cond(truncate, truncated_sample, plain_sample, None)
  tok = jnp.where(sc.temperature > 0, sampled, greedy)
  return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def decode(cfg: ModelConfig, params, cache: decoder.KVCache, next_logits, key, sc: SamplingConfig,
           max_new, stop_tokens, max_new_tokens: int, pad_id: int = 0, active=None,
           entropy: bool = False) -> Generation:
  """Decodes up to `max_new_tokens` tokens per row from a filled cache.

  Args:
    next_logits: [B, V] float32 logits for each row's next token.
    max_new: [B] int32 per-row limit (<= max_new_tokens).
    stop_tokens: [B, S] int32 per-row stop ids, padded with -1.
    active: [B] bool rows to decode (others generate nothing); default all.
    entropy: also sum, per row, the entropy of the distribution each generated token was drawn
      from (`entropy_of`; Generation.entropy). Static; off in rollouts, which do not need it.
  """
  params = decoder.for_decode(cfg, params)
  b = next_logits.shape[0]
  if active is None:
    active = jnp.ones((b,), bool)
  done0 = ~active | (max_new <= 0)
  init = (jnp.int32(0), cache, next_logits, jnp.full((b, max_new_tokens), pad_id, jnp.int32),
          jnp.zeros((b, max_new_tokens), jnp.float32), done0, jnp.zeros((b,), jnp.int32),
          jnp.zeros((b,), bool), key, jnp.zeros((b,), jnp.float32))

  def cond(state):
    i, done = state[0], state[5]
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, cache, logits, toks, lps, done, n, stopped, key, ent = state
    key, sub = jax.random.split(key)
    tok, lp = sample_from_logits(sub, logits, sc)
    live = ~done
    if entropy:
      ent = ent + jnp.where(live, entropy_of(logits, sc.temperature), 0.0)
    toks = toks.at[:, i].set(jnp.where(live, tok, pad_id))
    lps = lps.at[:, i].set(jnp.where(live, lp, 0.0))
    n = n + live
    is_stop = jnp.any(tok[:, None] == stop_tokens, axis=-1) & live
    stopped = stopped | is_stop
    new_logits, cache = decoder.apply(cfg, params, tok[:, None], cache=cache,
                                      chunk_lens=live.astype(jnp.int32))
    logits = jnp.where(live[:, None], new_logits[:, 0], logits)
    done = done | is_stop | (n >= max_new)
    return i + 1, cache, logits, toks, lps, done, n, stopped, key, ent

  _, cache, logits, toks, lps, _, n, stopped, _, ent = jax.lax.while_loop(cond, body, init)
  return Generation(tokens=toks, logprobs=lps, lengths=n, stopped=stopped, cache=cache,
                    next_logits=logits, entropy=ent if entropy else None)


# Tokens per prefill chunk: a long prompt is appended to the cache chunk by chunk, so attention
# scores stay [chunk, chunk] plus cache blocks instead of [L, L] (for 64 rows of 900 tokens that
# was 0.8 GB of float32 scores per layer).
PREFILL_CHUNK = 128


def chunk_width(width: int, chunk: int = PREFILL_CHUNK) -> int:
  """The width of the chunks `prefill` splits a [B, width] input into: the fewest chunks of at
  most `chunk` tokens, all of one width. Every row pays for whole chunks up to the batch's
  longest real row, so equal chunks pad less than `chunk`-wide ones plus a remainder: a 224-wide
  first prompt is 2 x 112, not 2 x 128; a 97-wide observation 4 x 25, of which rows of <= 50
  real tokens run 2, where chunks of 32 ran 2 x 32 (the peers' workload: rollout 1.74 -> 1.53 s,
  median of 5 interleaved, 2026-12-07)."""
  return -(-width // -(-width // chunk))


def _last_logits(cfg: ModelConfig, params, hidden, lengths):
  """Logits [B, V] at each row's last real token of a chunk's hidden states [B, L, D]; only
  those positions are unembedded."""
  last = jnp.clip(lengths - 1, 0, hidden.shape[1] - 1)
  h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  return decoder.unembed(cfg, params, h)


def prefill(cfg: ModelConfig, params, cache: decoder.KVCache, tokens, lengths,
            chunk: int = PREFILL_CHUNK):
  """Appends right-padded `tokens` [B, L] (`lengths` [B] real) to the cache.

  Returns (logits [B, V] at each row's last real token, cache). Rows with length 0 keep their
  previous state; their returned logits are meaningless and must be masked by the caller.
  Inputs wider than `chunk` (static) go in equal chunks of at most `chunk` (`chunk_width`), with
  the same result, and only as many chunks run as the longest row needs: a buffer sized for the
  longest possible input (an environment's observation width) costs what its longest real row
  costs, rounded up to a chunk.
  """
  b, l = tokens.shape
  if l <= chunk:
    hidden, cache = decoder.apply(cfg, params, tokens, cache=cache, chunk_lens=lengths,
                                  return_hidden=True)
    return _last_logits(cfg, params, hidden, lengths), cache
  chunk = chunk_width(l, chunk)
  n = -(-l // chunk)
  tokens = jnp.pad(tokens, ((0, 0), (0, n * chunk - l)))

  def body(i, carry):
    cache, logits = carry
    part = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)
    lens = jnp.clip(lengths - i * chunk, 0, chunk)
    hidden, cache = decoder.apply(cfg, params, part, cache=cache, chunk_lens=lens,
                                  return_hidden=True)
    logits = jnp.where((lens > 0)[:, None], _last_logits(cfg, params, hidden, lens), logits)
    return cache, logits

  used = jnp.minimum((jnp.max(lengths) + chunk - 1) // chunk, n)    # chunks with any real token
  init = (cache, jnp.zeros((b, cfg.vocab_size), jnp.float32))
  cache, logits = jax.lax.fori_loop(0, used, body, init)
  return logits, cache


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "pad_id"))
def generate(cfg: ModelConfig, params, prompt_tokens, prompt_lens, key, sc: SamplingConfig,
             max_new, stop_tokens, max_new_tokens: int, pad_id: int = 0) -> Generation:
  """Prefill + decode. prompt_tokens [B, P] right-padded with prompt_lens [B] >= 1 real tokens.

  The cache has capacity P + max_new_tokens. Shapes (B, P, max_new_tokens, S) decide the compiled
  program; contents, lengths, per-row limits, stop ids and sampling knobs never recompile.
  """
  b, p = prompt_tokens.shape
  cache = decoder.init_cache(cfg, b, p + max_new_tokens)
  logits, cache = prefill(cfg, params, cache, prompt_tokens, prompt_lens)
  return decode(cfg, params, cache, logits, key, sc, max_new, stop_tokens, max_new_tokens, pad_id)
