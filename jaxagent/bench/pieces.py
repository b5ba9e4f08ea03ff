"""Where the jitted rollout's time goes: its pieces run as separate programs on the rollout's own
tokens, and one decode step split by ablation at the rollout's mean context.

The pieces and the rollout should add up: the first observation's prefill and the decode
(`decode.decode_only`), the later observations' prefill (`observation_prefill_only`) and the
environment's steps (`env_steps_only`). The report sets the rollout's time against their sum (the
target: at most 1.5x, the rest being the rollout's own bookkeeping).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.bench.decode import decode_step_profile
from jaxagent.bench.machine import timed
from jaxagent.envs.base import TokenBuffer
from jaxagent.models import decoder, sampler
from jaxagent.rollout.api import build_batch


def observation_chunks(traj):
  """The rollout's later observations as prefill chunks: (chunks [T, B, W], starts [T, B],
  lengths [T, B]): each turn's <eot>-or-not + observation tokens, at the cache length where the
  rollout wrote them (after the turn's action); zero length where the turn was not acted."""
  t = jax.device_get(traj)
  b, tm = t.acted.shape
  starts = (t.turn_start + t.action_length).T                        # [T, B] after each action
  ends = np.concatenate([t.turn_start[:, 1:], t.length[:, None]], axis=1).T
  lens = np.where(t.acted.T, np.maximum(ends - starts, 0), 0).astype(np.int32)   # acted: t < turns
  w = max(1, int(lens.max()))
  chunks = np.zeros((tm, b, w), np.int32)
  for i in range(tm):
    for r in range(b):
      n = int(lens[i, r])
      chunks[i, r, :n] = t.tokens[r, starts[i, r]:starts[i, r] + n]
  return chunks, starts.astype(np.int32), lens


def observation_prefill_only(policy, traj, repeats: int) -> dict:
  """The rollout's later observations (`observation_chunks`) prefilled with no decoding and no
  environment: T prefills of [B, W] chunks, as the rollout's observe step runs them. Seconds, the
  tokens prefilled and the chunk width."""
  chunks, starts, lens = observation_chunks(traj)
  b, cfg, cap = chunks.shape[1], policy.config, int(traj.tokens.shape[1])

  @jax.jit
  def run_all(params, chunks, starts, lens):
    cache = decoder.init_cache(cfg, b, cap)

    def body(cache, x):
      chunk, start, n = x
      logits, cache = sampler.prefill(cfg, params, cache.replace(length=start), chunk, n)
      return cache, logits[:, 0]
    _, first = jax.lax.scan(body, cache, (chunks, starts, lens))
    return first          # the programs' results (else the compiler drops the model)

  args = (policy.params, jnp.asarray(chunks), jnp.asarray(starts), jnp.asarray(lens))
  secs, _ = timed(lambda: jax.block_until_ready(run_all(*args)), repeats)
  return {"seconds": secs, "tokens": int(lens.sum()), "chunk_width": int(chunks.shape[2])}


def env_steps_only(env, tasks, group: int, traj, repeats: int) -> dict:
  """The environment alone: reset, then T vmapped steps on the rollout's recorded actions."""
  b = int(traj.batch_size)
  batch, _, _, _ = build_batch(env, jax.random.key(0), tasks, group)
  actions, alen = jnp.asarray(traj.action_tokens), jnp.asarray(traj.action_tokens_len)

  @jax.jit
  def run_all(batch, actions, alen):
    state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(2), b), batch,
                                   jnp.full((b,), -1, jnp.int32))

    def body(state, x):
      a, n = x
      state, obs, info = jax.vmap(env.step)(state, TokenBuffer(tokens=a, length=n))
      return state, info.reward
    _, r = jax.lax.scan(body, state, (actions.swapaxes(0, 1), alen.T))
    return r

  secs, _ = timed(lambda: jax.block_until_ready(run_all(batch, actions, alen)), repeats)
  return {"seconds": secs}


def breakdown(policy, env, tasks, group: int, traj, repeats: int) -> dict:
  """The rollout's pieces beside the decode: the later observations' prefill, the environment's
  steps, and a decode step at the rollout's batch and mean transcript length."""
  return {"observation_prefill": observation_prefill_only(policy, traj, repeats),
          "environment": env_steps_only(env, tasks, group, traj, repeats),
          "decode_step": decode_step_profile(policy, int(traj.batch_size),
                                             int(np.asarray(traj.length).mean()))}
