"""Rollout throughput: the jitted rollout against the host-environment path and the naive loop,
and the jitted rollout's scaling with batch, turns and tokens per turn.

The methods, in one process on the same model, tasks and budgets:
  * jax:   `jaxagent.rollout.Rollouts` with the JAX-native environment (one compiled program);
  * jax_xla_attention: the same with XLA's cache attention, where the model's path is the CPU
           kernel (`with_attention(policy, "xla")`), so both paths are measured side by side;
  * host:  the same engine with the host (Python) environment between jitted turn halves;
  * naive: what users write today, the baseline: a Python loop over turns that re-encodes the
           whole history with `policy.generate` every turn and steps a Python environment.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import logging

from jaxagent.bench.machine import timed
from jaxagent.envs.base import TokenBuffer
from jaxagent.models import attention
from jaxagent.rollout.api import Rollouts


def with_attention(policy, mode: str | None):
  """`policy` with its attention switch (`ModelConfig.attention`) at `mode` (None: as it is);
  a new config, so its programs are compiled anew and never shared with the other path."""
  if mode is None:
    return policy
  return dataclasses.replace(policy, config=dataclasses.replace(policy.config, attention=mode))


def rollout_fn(policy, env, tasks, group: int, turns: int, action_tokens: int | None = None):
  """A run of the rollout's program (key 1: every run samples the same episodes), compiled at its
  first call and reused. Returns the trajectory once its tokens are ready."""
  rollouts = Rollouts(policy.config, env)

  def run():
    traj = rollouts(policy.params, jax.random.key(1), tasks, group, turns, mesh=policy.mesh,
                    max_turns=turns, max_action_tokens=action_tokens)
    jax.block_until_ready(traj.tokens)
    return traj
  return run


def rollout_row(secs: float, traj, episodes: int) -> dict:
  """A timed rollout's row: seconds, episodes/s, generated (loss-masked) tokens and tokens/s, the
  mean transcript length and the turns taken."""
  toks = float(np.asarray(traj.loss_mask).sum())
  return {"seconds": secs, "episodes_per_s": episodes / secs, "generated_tokens": toks,
          "generated_tokens_per_s": toks / secs,
          "mean_length": float(np.asarray(traj.length).mean()),
          "turns_taken": int(np.asarray(traj.num_turns).sum())}


def naive_rollout(policy, host_env, tasks, budget: int, max_new: int, seed: int,
                  generate=None) -> int:
  """Python loop over turns; each turn re-encodes the full history of every live episode.
  Returns the number of generated tokens.

  generate: `(histories, max_new, seed) -> continuations` (each with its stop token when one was
  sampled); default `policy.generate` (JAX). `peers.hf_generate` is the same loop in
  transformers."""
  if generate is None:
    generate = lambda h, n, s: policy.generate(h, n, temperature=1.0, seed=s,
                                               stop_tokens=[host_env.codec.end_of_turn_id])
  state, obs = host_env.reset(tasks, -1)
  b = len(obs.length)
  history = [list(obs.tokens[i, :obs.length[i]]) for i in range(b)]
  eot = host_env.codec.end_of_turn_id
  done = np.zeros(b, bool)
  generated = 0
  for t in range(budget):
    live = np.flatnonzero(~done)
    if not len(live):
      break
    outs = generate([history[i] for i in live], max_new, seed + t)
    actions = np.full((b, host_env.max_action_len), host_env.codec.pad_id, np.int32)
    lengths = np.zeros(b, np.int32)
    for i, o in zip(live, outs):
      generated += len(o)
      act = o[:-1] if o and o[-1] == eot else o
      actions[i, :len(act)] = act
      lengths[i] = len(act)
      history[i] = history[i] + list(o) + ([] if o and o[-1] == eot else [eot])
    state, obs, info = host_env.step(state, TokenBuffer(actions, lengths))
    for i in live:
      history[i] += list(obs.tokens[i, :obs.length[i]])
    done |= np.asarray(info.done)
  return generated


def compare_methods(policy, env, host_env, tasks, group: int, turns: int, repeats: int,
                    jax_run=None) -> dict:
  """Each method's row (`rollout_row`; the naive loop's without token counts per trajectory) on
  `tasks` x `group` episodes of `turns` turns, median of `repeats` after a compiling run.

  jax_run: the jax method's `rollout_fn` (default: a new one), so the caller can take its
  trajectory afterwards without compiling it again."""
  episodes = len(jax.tree.leaves(tasks)[0]) * group
  runs = [("jax", jax_run or rollout_fn(policy, env, tasks, group, turns)),
          ("host", rollout_fn(policy, host_env, tasks, group, turns))]
  if attention.kernel_enabled(policy.config.attention):   # XLA's attention beside the kernel
    runs.insert(1, ("jax_xla_attention",
                    rollout_fn(with_attention(policy, "xla"), env, tasks, group, turns)))
  rows = {}
  for name, run in runs:
    secs, traj = timed(run, repeats)
    rows[name] = rollout_row(secs, traj, episodes)
    logging.info("%s rollout: %s", name, rows[name])
  rows["naive"] = naive_row(policy, host_env, tasks, group, turns, env.max_action_len, repeats)
  logging.info("naive rollout: %s", rows["naive"])
  return rows


def naive_row(policy, host_env, tasks, group: int, turns: int, max_new: int, repeats: int,
              generate=None) -> dict:
  """The naive loop (`naive_rollout`, `generate` as there) on `tasks` x `group` episodes of
  `turns` turns of at most `max_new` tokens, median of `repeats` after one untimed run: seconds,
  episodes/s, generated tokens and tokens/s (the workload of a jax rollout of the same tasks)."""
  rep_tasks = jax.tree.map(lambda x: np.repeat(np.asarray(x), group, axis=0), tasks)
  episodes = len(jax.tree.leaves(rep_tasks)[0])
  secs, toks = timed(lambda: naive_rollout(policy, host_env, rep_tasks, turns, max_new, 0,
                                           generate=generate), repeats)
  return {"seconds": secs, "episodes_per_s": episodes / secs, "generated_tokens": toks,
          "generated_tokens_per_s": toks / secs}


def scaling(policy, env, repeats: int, base_batch: int, base_turns: int,
            batches=(16, 64, 256), turns=(2, 4, 8), tokens=(8, 16, None),
            batch_turns: int = 4) -> list[dict]:
  """Jitted-rollout throughput as one axis grows at a time: the batch (`batches` episodes of
  `batch_turns` turns), the turns per episode (`turns`, at `base_batch` episodes) and the tokens
  per turn (`tokens`, None = the environment's whole action length, at `base_batch` x
  `base_turns`).
  Episodes come in groups of 8 (fewer where a batch is smaller). One row per point."""
  a_max = env.max_action_len
  points = ([("batch", b, batch_turns, a_max) for b in batches]
            + [("turns", base_batch, t, a_max) for t in turns]
            + [("tokens per turn", base_batch, base_turns, a or a_max) for a in tokens])
  rows = []
  for axis, b, t, a in points:
    group = min(8, b)
    tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), max(1, b // group)))
    secs, traj = timed(rollout_fn(policy, env, tasks, group, t, a), repeats)
    row = {"axis": axis, "episodes": b, "turns": t, "tokens_per_turn": a,
           **rollout_row(secs, traj, b)}
    logging.info("scaling %s: %s", axis, row)
    rows.append(row)
  return rows
