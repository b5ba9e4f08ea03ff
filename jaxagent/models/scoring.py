"""Log-probabilities of a trajectory's tokens under any parameters (PPO ratios, KL, likelihoods).

One forward pass over the whole transcript (positions are slot indices, exactly as during the
rollout), then the log-softmax is taken chunk by chunk over the sequence so the [B, L, V] logits
of a large vocabulary never exist at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.models.sampler import scaled_logprobs


def _chunked_scores(cfg: ModelConfig, params, tokens, length, temperature, chunk: int,
                    with_entropy: bool):
  """(logprobs [B, L], entropy [B, L] or None); see `token_logprobs_and_entropy`.

  One forward pass to the final hidden states, then unembedding + log-softmax chunk by chunk
  (`lax.map`). Each chunk is rematerialised (`jax.checkpoint`), so a gradient through this
  function also never holds more than one chunk's [B, chunk, V] logits.
  """
  b, l = tokens.shape
  mask = jnp.arange(l)[None, :] < length[:, None]
  hidden, _ = decoder.apply(cfg, params, tokens, lengths=length.astype(jnp.int32),
                            return_hidden=True)
  h = hidden[:, :-1]                       # predicts tokens[:, 1:]
  tgt = tokens[:, 1:]
  n = l - 1
  c = min(chunk, n)
  pad = (-n) % c
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  tgt = jnp.pad(tgt, ((0, 0), (0, pad)))
  hc = h.reshape(b, -1, c, h.shape[-1]).swapaxes(0, 1)
  tc = tgt.reshape(b, -1, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    hx, tx = args
    logp = scaled_logprobs(decoder.unembed(cfg, params, hx), temperature)
    lp = jnp.take_along_axis(logp, tx[..., None], axis=-1)[..., 0]
    if not with_entropy:
      return lp, None
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

  def unchunk(x):
    x = x.swapaxes(0, 1).reshape(b, -1)[:, :n]
    x = jnp.concatenate([jnp.zeros((b, 1), x.dtype), x], axis=1)
    return jnp.where(mask, x, 0.0)

  lp, ent = jax.lax.map(one, (hc, tc))
  return unchunk(lp), (unchunk(ent) if with_entropy else None)


def token_logprobs(cfg: ModelConfig, params, tokens, length, temperature=1.0, chunk: int = 128):
  """logprobs [B, L] float32: entry i is log p(tokens[i] | tokens[:i]) at `temperature`
  (log_softmax(logits / T); T = 0 means 1). Entry 0 and entries at or past `length` are 0.

  tokens [B, L] int32, length [B] int32. Pure; jit it at the call site (or use `score`).
  """
  return _chunked_scores(cfg, params, tokens, length, temperature, chunk, with_entropy=False)[0]


def token_logprobs_and_entropy(cfg: ModelConfig, params, tokens, length, temperature=1.0,
                               chunk: int = 128):
  """(logprobs [B, L], entropy [B, L]) float32, aligned: entry i concerns the distribution
  p_i = softmax(logits_{i-1} / T) that predicts tokens[i] (T = 0 means 1):

      logprobs[b, i] = log p_i(tokens[b, i]),   entropy[b, i] = -sum_v p_i(v) log p_i(v).

  Entry 0 and entries at or past `length` are 0. Same single forward pass and chunked
  log-softmax as `token_logprobs` (identical log-probs); differentiable wrt params.
  """
  return _chunked_scores(cfg, params, tokens, length, temperature, chunk, with_entropy=True)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def _score(cfg, params, tokens, length, temperature, chunk=128):
  return token_logprobs(cfg, params, tokens, length, temperature, chunk)


def score(policy, trajectory, temperature: float = 1.0, params=None):
  """Recomputes log-probs [B, L] of `trajectory.tokens` under `params` (default the policy's).

  Multiply by `trajectory.loss_mask` for the agent's tokens only.
  """
  params = policy.params if params is None else params
  return _score(policy.config, params, trajectory.tokens, trajectory.length,
                jnp.float32(temperature))
