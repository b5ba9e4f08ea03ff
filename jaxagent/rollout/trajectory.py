"""The `Trajectory` pytree: everything a batch of multi-turn episodes produced, with fixed shapes.

Row b's transcript occupies slots [0, length[b]) of the [B, L] arrays, compactly: the first
observation (the prompt), then per turn the action tokens the policy sampled, its end-of-turn
token, and the environment's observation. Positions are slot indices (RoPE positions), so
`score` can recompute every log-probability with one forward pass.
"""

from __future__ import annotations

import enum

import jax
from flax import struct


class Status(enum.IntEnum):
  """Why an episode stopped (`Trajectory.status`)."""
  RUNNING = 0        # never returned by `rollout` (the loop ran to T_max)
  SOLVED = 1         # the environment reported the task solved
  ENDED = 2          # the environment ended the episode unsolved (wrong final answer, trap, ...)
  BUDGET_SPENT = 3   # the row's budget of turns was used up
  CONTEXT_FULL = 4   # the next turn would not fit in the context


STATUS_NAMES = tuple(s.name.lower() for s in Status)


@struct.dataclass
class Trajectory:
  # Token level, [B, L].
  tokens: jax.Array              # int32 transcript (pad after length)
  positions: jax.Array           # int32 RoPE positions (slot index; 0 after length)
  loss_mask: jax.Array           # float32 1 exactly on tokens the policy sampled
  behaviour_logprobs: jax.Array  # float32 log-prob of each sampled token (0 elsewhere)
  turn_of_token: jax.Array       # int32 turn (0-based) of action + following observation; -1 prompt/pad
  length: jax.Array              # [B] int32 transcript length
  # Turn level, [B, T_max].
  acted: jax.Array               # bool the policy acted at this turn
  valid_call: jax.Array          # bool
  error_kind: jax.Array          # int32 jaxagent.envs.base.ErrorKind
  oracle_match: jax.Array        # bool
  reward: jax.Array              # float32 environment reward
  solved: jax.Array              # bool solved at this turn
  action_length: jax.Array       # int32 sampled tokens of the action (end-of-turn included)
  turn_start: jax.Array          # int32 transcript length before the turn's action (its prefix)
  action_tokens: jax.Array       # [B, T_max, A] int32 the action the environment received
  action_tokens_len: jax.Array   # int32 its length (no end-of-turn token)
  state_id: jax.Array            # [B, T_max, 2] uint32 fingerprint of the state the turn acted in
                                 # (`envs.base.state_fingerprint`; 0 where the row did not act)
  obs_truncated: jax.Array       # [B, T_max] bool the turn's observation was cut to fit its buffer
                                 # (a marker shows the cut; `envs.codec.TRUNCATION_MARKER`)
  # Episode level, [B].
  success_turn: jax.Array        # int32 first solving turn (1-based), or T_max + 1
  num_turns: jax.Array           # int32 turns taken
  budget: jax.Array              # int32 the row's interaction budget
  task_id: jax.Array             # int32 index of the task in the batch of tasks
  group_id: jax.Array            # int32 GRPO group (episodes of the same task)
  status: jax.Array              # int32 `Status`
  optimal_turns: jax.Array       # int32 the task's optimal number of turns

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def max_turns(self) -> int:
    return self.acted.shape[1]


TOKEN_FIELDS = ("tokens", "positions", "loss_mask", "behaviour_logprobs", "turn_of_token")


def trim(traj: Trajectory, multiple: int = 128) -> Trajectory:
  """Cuts the token-level arrays to the longest transcript, rounded up to `multiple` (host side).

  Rollouts reserve room for the longest possible turns; learning on the used prefix only saves
  most of the scoring cost, and rounding keeps the number of compiled shapes small.
  """
  import numpy as np
  used = int(np.asarray(traj.length).max())
  keep = min(traj.tokens.shape[1], max(multiple, -(-used // multiple) * multiple))
  return traj.replace(**{f: getattr(traj, f)[:, :keep] for f in TOKEN_FIELDS})
