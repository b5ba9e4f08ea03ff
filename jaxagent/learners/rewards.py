"""Episode rewards from a `Trajectory`'s per-turn records, and the equal-reward group filter.

    r_b = success_reward * solved_b
          - invalid_call_penalty * #{t : acted[b, t] and not valid_call[b, t]}
          - turn_cost * num_turns[b]

solved_b is whether any turn of episode b solved the task (the environment reports it; episodes
stop at their budget, so this is success within the budget). Environments report only success
(`StepInfo.reward` is 1 on the solving step); all shaping lives here, so the same rollouts can be
rescored under another reward without re-running them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxagent.rollout.trajectory import Trajectory


def episode_rewards(traj: Trajectory, *, success_reward: float, invalid_call_penalty: float,
                    turn_cost: float) -> jax.Array:
  """Per-episode reward [B] float32 (formula in the module docstring)."""
  solved = jnp.any(traj.solved & traj.acted, axis=1).astype(jnp.float32)           # [B]
  invalid = jnp.sum(traj.acted & ~traj.valid_call, axis=1).astype(jnp.float32)     # [B]
  turns = traj.num_turns.astype(jnp.float32)                                       # [B]
  return success_reward * solved - invalid_call_penalty * invalid - turn_cost * turns


def equal_group_mask(rewards: jax.Array, group_id: jax.Array, num_groups: int) -> jax.Array:
  """[B] float32: 0 for episodes whose group's rewards are all equal, else 1.

  Such a group carries no learning signal under a group baseline (every advantage is 0), but it
  still dilutes a token- or sequence-mean loss; weighting the loss by this mask drops it (DAPO's
  dynamic-sampling filter, without the resampling). rewards [B] float32, group_id [B] int32 in
  [0, num_groups).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  hi = jax.ops.segment_max(rewards, group_id, num_segments=num_groups)[group_id]
  lo = jax.ops.segment_min(rewards, group_id, num_segments=num_groups)[group_id]
  return (hi > lo).astype(jnp.float32)
