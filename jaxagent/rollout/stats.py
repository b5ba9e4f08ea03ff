"""Episode statistics computed from `Trajectory` tensors, vectorised (no loop over episodes).

Definitions (docs/STUDY.md): an *error state* is a turn t >= 1 taken right after an acted turn whose
action failed (error_kind != NONE: parse error, unknown tool, bad arguments, tool failure,
precondition failed). The *recovery rate* is the fraction of error states whose action is a valid
call; the strict version requires the action to equal the oracle's.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxagent.envs.base import ErrorKind
from jaxagent.rollout.trajectory import Trajectory


def error_states(traj: Trajectory):
  """[B, T] bool: turn t acted, and turn t-1 acted with a failed action."""
  prev_failed = traj.acted[:, :-1] & (traj.error_kind[:, :-1] != ErrorKind.NONE)
  first = jnp.zeros_like(traj.acted[:, :1])
  return traj.acted & jnp.concatenate([first, prev_failed], axis=1)


def _ratio(num, den):
  """num / den, or NaN when den == 0 (reported as 'no such states', never as a rate of 0)."""
  return jnp.where(den > 0, num / jnp.maximum(den, 1), jnp.nan)


def trajectory_stats(traj: Trajectory) -> dict:
  """Scalar statistics of a batch of episodes (jnp scalars; NaN where undefined)."""
  acted = traj.acted.astype(jnp.float32)
  err = error_states(traj).astype(jnp.float32)
  solved = jnp.any(traj.solved, axis=1).astype(jnp.float32)
  failed = (traj.acted & (traj.error_kind != ErrorKind.NONE)).astype(jnp.float32)
  return {
      "success_rate": jnp.mean(solved),
      "mean_turns": jnp.mean(traj.num_turns.astype(jnp.float32)),
      "mean_budget": jnp.mean(traj.budget.astype(jnp.float32)),
      "budget_used": jnp.mean(traj.num_turns / jnp.maximum(traj.budget, 1)),
      "valid_call_rate": _ratio(jnp.sum(traj.valid_call * acted), jnp.sum(acted)),
      "error_rate": _ratio(jnp.sum(failed), jnp.sum(acted)),
      "oracle_match_rate": _ratio(jnp.sum(traj.oracle_match * acted), jnp.sum(acted)),
      "error_states": jnp.sum(err),
      "recovery_rate": _ratio(jnp.sum(traj.valid_call * err), jnp.sum(err)),
      "recovery_oracle_rate": _ratio(jnp.sum(traj.oracle_match * err), jnp.sum(err)),
      "sampled_tokens": jnp.sum(traj.loss_mask),
      "mean_length": jnp.mean(traj.length.astype(jnp.float32)),
      "truncated_observations": jnp.sum(traj.obs_truncated & traj.acted),
  }
