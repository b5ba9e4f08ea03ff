"""Decoding with no environment, against its memory-bandwidth bound; and one decode step split by
ablation.

The bound: every decode step must read the parameters once and each row's KV cache so far
(`jaxagent.planning.flops.decode_bound_bytes`); at the machine's measured read bandwidth that is
the fastest any decode of these tokens can be. `decode_only` reports the bytes, and
`report.with_limits` turns them into seconds and a fraction of the bound once the bandwidth is
known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.bench.machine import timed
from jaxagent.bench.rollouts import with_attention
from jaxagent.models import attention, decoder, sampler
from jaxagent.planning.flops import decode_bound_bytes, tree_bytes
from jaxagent.rollout.api import build_batch


def decode_only(policy, env, tasks, group: int, traj, repeats: int) -> dict:
  """The rollout's generated tokens, row by row, decoded with no environment: after one prefill
  of the first observation (timed apart, as `first_prefill_seconds`: the bound counts decode's
  bytes only), sampling with no stop token for exactly as many tokens as the row generated in
  the rollout `traj`. Returns the decode's seconds, tokens and tokens/s, and the bytes its
  bandwidth bound reads (`bound_bytes`)."""
  b = int(traj.batch_size)
  cfg, params = policy.config, policy.params
  batch, _, _, _ = build_batch(env, jax.random.key(0), tasks, group)
  _, obs0 = jax.vmap(env.reset)(jax.random.split(jax.random.key(2), b), batch,
                                jnp.full((b,), -1, jnp.int32))
  n = np.asarray(traj.loss_mask).sum(axis=1).astype(np.int32)
  cap = int(-(-int(n.max()) // 64) * 64)
  stop = jnp.full((b, 1), -1, jnp.int32)
  sc = sampler.SamplingConfig.make(1.0)
  prefill = jax.jit(lambda p: sampler.prefill(
      cfg, p, decoder.init_cache(cfg, b, obs0.tokens.shape[1] + cap), obs0.tokens, obs0.length))
  prefill_secs, (logits, cache) = timed(lambda: jax.block_until_ready(prefill(params)), repeats)
  decode = jax.jit(lambda p, c, lg: sampler.decode(cfg, p, c, lg, jax.random.key(3), sc,
                                                   jnp.asarray(n), stop, cap).tokens)

  secs, _ = timed(lambda: jax.block_until_ready(decode(params, cache, logits)), repeats)
  bound_bytes = decode_bound_bytes(cfg, tree_bytes(params), np.asarray(obs0.length), n)
  return {"seconds": secs, "tokens": int(n.sum()), "tokens_per_s": float(n.sum()) / secs,
          "bound_bytes": float(bound_bytes), "first_prefill_seconds": prefill_secs}


def _stepper(cfg, batch: int, tok, steps: int, block: int):
  """A jitted run of `steps` decode steps of `batch` rows, each at the cache's given length."""
  def run(params, cache, length):
    def body(i, carry):
      c, acc = carry
      logits, c = decoder.apply(cfg, params, tok, cache=c.replace(length=length),
                                cache_block=block)
      return c, acc + logits[:, 0, 0]
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch,))))[1]
  return jax.jit(run)


def _sampling_ms(cfg, batch: int, steps: int, repeats: int) -> float:
  """Milliseconds of one categorical draw over the vocabulary for `batch` rows."""
  key = jax.random.key(0)
  logits = jax.random.normal(key, (batch, cfg.vocab_size))
  sc = sampler.SamplingConfig.make(1.0)

  @jax.jit
  def sample(logits, key):
    def body(i, carry):
      k, acc = carry
      k, sub = jax.random.split(k)
      t, _ = sampler.sample_from_logits(sub, logits + acc[:, None], sc)
      return k, acc + t.astype(jnp.float32) * 0
    return jax.lax.fori_loop(0, steps, body, (key, jnp.zeros((batch,))))[1]

  secs, _ = timed(lambda: jax.block_until_ready(sample(logits, key)), repeats)
  return 1e3 * secs / steps


def decode_step_profile(policy, batch: int, context: int, steps: int = 16,
                        repeats: int = 3) -> dict:
  """Milliseconds per decode step of `batch` rows with `context` cached slots, split by ablation:
  the whole step on the model's attention path (`step_ms`, blocked cache attention as the
  rollout runs it; `step_path` names it), XLA's blocks beside it where the path is the kernel
  (`step_xla_blocks_ms`), XLA's dense path (`step_dense_ms`), the step with no cached slots to
  attend (projections, MLP, unembedding, the cache write), their difference
  (`cache_attention_ms`), and sampling from the logits (categorical over the vocabulary).
  `kv_bytes` is the cache the step reads (the report sets it against the bandwidth)."""
  cfg, params = policy.config, policy.params
  cap = -(-(context + steps) // decoder.CACHE_BLOCK) * decoder.CACHE_BLOCK
  cache = decoder.init_cache(cfg, batch, cap)
  key = jax.random.key(0)
  cache = cache.replace(k=jax.random.normal(key, cache.k.shape, cache.k.dtype),
                        v=jax.random.normal(key, cache.v.shape, cache.v.dtype))
  tok = jnp.ones((batch, 1), jnp.int32)
  out = {}
  kernel = attention.kernel_enabled(cfg.attention)
  runs = [("step", decoder.CACHE_BLOCK, context, None),
          ("step_dense", cap, context, "xla"),
          ("step_without_cache_attention", decoder.CACHE_BLOCK, 0, None)]
  if kernel:                             # XLA's blocks beside the kernel (else "step" is them)
    runs.insert(1, ("step_xla_blocks", decoder.CACHE_BLOCK, context, "xla"))
  for name, block, filled, mode in runs:
    f = _stepper(with_attention(policy, mode).config, batch, tok, steps, block)
    length = jnp.full((batch,), filled, jnp.int32)
    secs, _ = timed(lambda: jax.block_until_ready(f(params, cache, length)), repeats)
    out[name + "_ms"] = 1e3 * secs / steps
  out["step_path"] = "kernel" if kernel else "xla blocks"
  out["sampling_ms"] = _sampling_ms(cfg, batch, steps, repeats)
  out["cache_attention_ms"] = out["step_ms"] - out["step_without_cache_attention_ms"]
  kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim
  out.update(batch=batch, context=context, kv_bytes=kv * cfg.jnp_dtype.itemsize)
  return out
