"""The RL update on the rollout's trajectories: its tokens/s and model FLOP/s (the report adds the
utilisation over the measured peak), and the overhead of turn-level credit against GRPO.

The update is the one the trainer runs (`jaxagent.learners.update.make_update_fn`) with the
learner settings given (the launcher passes the default config's: PPO-clip, GRPO, a KL term to a
reference copy of the parameters). Its model FLOPs are `jaxagent.planning.flops.update_flops`:
forward and backward of every epoch, plus the reference's forward pass.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.bench.machine import timed
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.planning.flops import param_counts, update_flops
from jaxagent.rollout.trajectory import trim


def update_runner(policy, traj, learner: LearnerConfig, advantage: str | None = None):
  """(run, learner config, trimmed traj, reference): `run()` is one call of the RL update with
  `learner`'s settings on `traj` (advantage: another registered estimator than `learner`'s;
  minibatches drop to 1 where they do not divide the batch), each call on the state the last one
  left. The reference is a copy of the parameters where the settings have a KL term, else None."""
  lcfg = learner if advantage is None else dataclasses.replace(learner, advantage=advantage)
  if traj.batch_size % lcfg.minibatches:
    lcfg = dataclasses.replace(lcfg, minibatches=1)
  optimizer = lcfg.make_optimizer(total_steps=1000)
  update = make_update_fn(lcfg, policy.config, optimizer)
  ref = jax.tree.map(jnp.copy, policy.params) if lcfg.kl_coef > 0 else None
  traj = trim(traj)
  state = [init_train_state(jax.tree.map(jnp.copy, policy.params), optimizer, jax.random.key(0))]

  def run():
    state[0], metrics = update(state[0], traj, ref)
    return jax.block_until_ready(metrics)

  return run, lcfg, traj, ref


def update_step(policy, traj, learner: LearnerConfig, repeats: int) -> dict:
  """The RL update on `traj`: seconds (median of `repeats`), real (unpadded) tokens and tokens/s,
  the padded length, and its model FLOPs and FLOP/s (`report.with_limits` adds the utilisation).
  Log-probs are recomputed at the learner's temperature, as the trainer does."""
  run, lcfg, traj, ref = update_runner(policy, traj, learner)
  secs, _ = timed(run, repeats)
  lengths = np.asarray(traj.length)
  counts = param_counts(policy.config, policy.params)
  flops = update_flops(policy.config, counts, lengths, epochs=lcfg.epochs,
                       reference=ref is not None)
  return {"seconds": secs, "tokens": int(lengths.sum()), "padded_length": int(traj.tokens.shape[1]),
          "tokens_per_s": float(lengths.sum()) / secs, "model_flops": flops,
          "model_flops_per_s": flops / secs,
          "params": counts["total"]}


def credit_overhead(policy, traj, learner: LearnerConfig, repeats: int,
                    estimators=("gigpo", "per_turn"), runner=update_runner) -> dict:
  """The update with turn-level credit against GRPO on the same trajectories: per estimator its
  median seconds and overhead = seconds / GRPO's - 1. The updates run interleaved (GRPO, then
  each estimator, `repeats` rounds after one untimed round), so a drift of the machine hits all
  alike. gigpo's cost over GRPO is the state grouping (a sort of the batch's steps by task group
  and state fingerprint) and the per-turn token advantages.

  runner: `update_runner` or a stand-in with its signature (the tests' fake clock)."""
  names = ("grpo",) + tuple(estimators)
  runs = {n: runner(policy, traj, learner, n)[0] for n in names}
  for run in runs.values():
    run()
  times, metrics = {n: [] for n in names}, {}
  for _ in range(max(1, repeats)):
    for n, run in runs.items():
      t0 = time.perf_counter()
      metrics[n] = run()
      times[n].append(time.perf_counter() - t0)
  med = {n: statistics.median(t) for n, t in times.items()}
  out = {n: {"seconds": med[n], "overhead": med[n] / med["grpo"] - 1.0} for n in names}
  if "anchor_group_size" in metrics.get("gigpo", {}):
    out["gigpo"]["anchor_group_size"] = float(metrics["gigpo"]["anchor_group_size"])
  out["repeats"] = max(1, repeats)
  return out
