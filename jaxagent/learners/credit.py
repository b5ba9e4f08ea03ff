"""Turn-level credit: per-turn rewards with process terms, and step-level advantage estimators.

**Per-turn rewards.** For acted turn t of episode b (0 on turns the row did not act):

    r[b, t] = success_reward * [t is the first solving turn]
              - invalid_call_penalty * [not valid_call]  - turn_cost                 (the outcome)
              + process_valid_call * [valid_call] + process_oracle_match * [oracle_match]
              - process_error * [error_kind != NONE]                      (process rewards; 0 by default)

so sum_t r[b, t] is `rewards.episode_rewards` plus the process terms: with zero process weights
the episode-level estimators see exactly today's reward. Process rewards use what the environment
knows at each turn: whether the call was valid, whether it equalled the oracle's action (progress
toward the goal along a shortest solution) and whether it raised an error of any kind.

**Returns.** G[b, t] = sum_{k >= t} gamma^(k - t) r[b, k] (discounted reward-to-go).

**Turn-level estimators** (advantages [B, T]; each turn's action tokens get their turn's value):

    gigpo      A[b, t] = A_E[b] + step_weight * A_S[b, t]
               A_E: GRPO over the episode returns G[b, 0] within the task group;
               A_S: G[b, t] normalised within its anchor group, the acted steps (b', t') of the same
               task group whose environment state is identical (`state_id`, a fingerprint of the
               state pytree computed on device in the rollout); 0 for a step alone in its group.
               (GiGPO, Feng et al. 2025: steps grouped by identical anchor states.)
    per_turn   A[b, t] = G[b, t] normalised among the episodes of b's task group that acted at
               turn t (a group baseline per turn); 0 for a turn only one episode reached.

"Normalised" is x - mean over the group, divided by (population std + eps) with normalize_std.
Both are registered beside the episode-level estimators (`advantages.py`) and chosen by
`learner.advantage`; `compute_turn_advantages(name, ...)` is the entry point.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from jaxagent.rollout.trajectory import Trajectory


def describe(learner) -> str:
  """"" for episode-level credit without process rewards (the study's fixed-T and BudgetMix
  arms), else what the learner settings (a mapping of LearnerConfig keys) add, e.g.
  "gigpo(step_weight=1, gamma=1) + process(valid_call=0.1)"."""
  get = lambda k, d: learner.get(k, d) if hasattr(learner, "get") else getattr(learner, k, d)
  parts = []
  name = get("advantage", "grpo")
  if name in TURN_ADVANTAGE_ESTIMATORS:
    knobs = ["gamma"] + (["step_weight"] if name == "gigpo" else [])
    parts.append(f"{name}(" + ", ".join(f"{k}={get(k, 1.0):g}" for k in knobs) + ")")
  proc = {k: get(f"process_{k}", 0.0) for k in ("valid_call", "oracle_match", "error")}
  if any(proc.values()):
    parts.append("process(" + ", ".join(f"{k}={v:g}" for k, v in proc.items() if v) + ")")
  return " + ".join(parts)


def turn_rewards(traj: Trajectory, *, success_reward: float, invalid_call_penalty: float,
                 turn_cost: float, process_valid_call: float = 0.0,
                 process_oracle_match: float = 0.0, process_error: float = 0.0) -> jax.Array:
  """r [B, T] float32 (module docstring)."""
  acted = traj.acted
  solved = traj.solved & acted
  first = solved & (jnp.cumsum(solved.astype(jnp.int32), axis=1) == 1)
  f = lambda x: x.astype(jnp.float32)
  r = (success_reward * f(first) - invalid_call_penalty * f(acted & ~traj.valid_call)
       - turn_cost * f(acted))
  if process_valid_call or process_oracle_match or process_error:
    r = r + (process_valid_call * f(acted & traj.valid_call)
             + process_oracle_match * f(acted & traj.oracle_match)
             - process_error * f(acted & (traj.error_kind != 0)))
  return r


def process_rewards(traj: Trajectory, *, process_valid_call: float, process_oracle_match: float,
                    process_error: float) -> jax.Array:
  """The process terms of `turn_rewards` summed per episode [B] float32."""
  return turn_rewards(traj, success_reward=0.0, invalid_call_penalty=0.0, turn_cost=0.0,
                      process_valid_call=process_valid_call,
                      process_oracle_match=process_oracle_match,
                      process_error=process_error).sum(axis=1)


def returns_to_go(r: jax.Array, gamma: float) -> jax.Array:
  """G [B, T]: G[:, t] = sum_{k >= t} gamma^(k - t) r[:, k]."""
  t = r.shape[1]
  k = jnp.arange(t)
  power = jnp.where(k[:, None] >= k[None, :], (k[:, None] - k[None, :]).astype(jnp.float32), 0.0)
  disc = jnp.where(k[:, None] >= k[None, :], jnp.float32(gamma) ** power, 0.0)   # [k, t]
  return r @ disc


def normalise_in_groups(x: jax.Array, seg: jax.Array, member: jax.Array, num_segments: int,
                        normalize_std: bool, eps: float) -> jax.Array:
  """x [N] minus its segment's mean (over members), divided by (std + eps) with normalize_std;
  0 for non-members and for members alone in their segment. seg [N] int32 in [0, num_segments)."""
  m = member.astype(jnp.float32)
  seg_sum = lambda v: jax.ops.segment_sum(v, seg, num_segments=num_segments)[seg]
  count = seg_sum(m)
  mean = seg_sum(x * m) / jnp.maximum(count, 1.0)
  d = x - mean
  if normalize_std:
    d = d / (jnp.sqrt(seg_sum(jnp.square(d) * m) / jnp.maximum(count, 1.0)) + eps)
  return jnp.where(member & (count > 1), d, 0.0)


def anchor_groups(group_id: jax.Array, state_id: jax.Array, acted: jax.Array) -> jax.Array:
  """Segment ids [B * T] int32 of the flattened steps: two acted steps share an id iff they are
  in the same task group and their state fingerprints are equal; every step a row did not take
  is alone. Sort-based (N log N in the number of steps), no host round trip."""
  b, t = acted.shape
  n = b * t
  flat = jnp.arange(n, dtype=jnp.int32)
  g = jnp.where(acted.reshape(-1), jnp.repeat(group_id.astype(jnp.int32), t), -1 - flat)
  h0 = state_id[..., 0].reshape(-1)
  h1 = state_id[..., 1].reshape(-1)
  order = jnp.lexsort((h1, h0, g))                          # the last key is the primary one
  gs, h0s, h1s = g[order], h0[order], h1[order]
  new = (gs[1:] != gs[:-1]) | (h0s[1:] != h0s[:-1]) | (h1s[1:] != h1s[:-1])
  seg_sorted = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(new.astype(jnp.int32))])
  return jnp.zeros((n,), jnp.int32).at[order].set(seg_sorted)


class TurnAdvantageFn(Protocol):
  def __call__(self, r: jax.Array, acted: jax.Array, state_id: jax.Array, group_id: jax.Array, *,
               num_groups: int, normalize_std: bool, eps: float, gamma: float,
               step_weight: float) -> tuple[jax.Array, dict]: ...


TURN_ADVANTAGE_ESTIMATORS: dict[str, TurnAdvantageFn] = {}


def register_turn_advantage(name: str) -> Callable[[TurnAdvantageFn], TurnAdvantageFn]:
  """Decorator: registers `fn(r [B,T], acted, state_id [B,T,2], group_id [B], *, num_groups,
  normalize_std, eps, gamma, step_weight) -> (advantages [B, T], metrics)`."""
  def deco(fn):
    if name in TURN_ADVANTAGE_ESTIMATORS:
      raise ValueError(f"turn-level advantage estimator {name!r} is already registered")
    TURN_ADVANTAGE_ESTIMATORS[name] = fn
    return fn
  return deco


def compute_turn_advantages(name: str, r, acted, state_id, group_id, *, num_groups: int,
                            normalize_std: bool = True, eps: float = 1e-6, gamma: float = 1.0,
                            step_weight: float = 1.0) -> tuple[jax.Array, dict]:
  """Advantages [B, T] float32 (0 where the row did not act) and the estimator's metrics."""
  if name not in TURN_ADVANTAGE_ESTIMATORS:
    raise ValueError(f"unknown turn-level advantage estimator {name!r}; registered: "
                     f"{', '.join(sorted(TURN_ADVANTAGE_ESTIMATORS))}")
  adv, metrics = TURN_ADVANTAGE_ESTIMATORS[name](
      jnp.asarray(r, jnp.float32), jnp.asarray(acted, bool), jnp.asarray(state_id, jnp.uint32),
      jnp.asarray(group_id, jnp.int32), num_groups=num_groups, normalize_std=normalize_std,
      eps=eps, gamma=gamma, step_weight=step_weight)
  return jnp.where(acted, adv, 0.0), metrics


@register_turn_advantage("gigpo")
def gigpo(r, acted, state_id, group_id, *, num_groups, normalize_std, eps, gamma, step_weight):
  b, t = acted.shape
  g = returns_to_go(r, gamma)
  ep = normalise_in_groups(g[:, 0], group_id, jnp.ones((b,), bool), num_groups, normalize_std,
                           eps)
  seg = anchor_groups(group_id, state_id, acted)
  step = normalise_in_groups(g.reshape(-1), seg, acted.reshape(-1), b * t, normalize_std,
                             eps).reshape(b, t)
  count = jax.ops.segment_sum(acted.reshape(-1).astype(jnp.float32), seg, num_segments=b * t)
  steps = jnp.maximum(jnp.sum(acted), 1)
  metrics = {
      # Mean size of a step's anchor group, and the share of steps that share their state.
      "anchor_group_size": jnp.sum(jnp.where(acted.reshape(-1), count[seg], 0.0)) / steps,
      "anchor_shared_fraction": jnp.sum(acted.reshape(-1) & (count[seg] > 1)) / steps,
  }
  return ep[:, None] + step_weight * step, metrics


@register_turn_advantage("per_turn")
def per_turn(r, acted, state_id, group_id, *, num_groups, normalize_std, eps, gamma,
             step_weight):
  del state_id, step_weight
  b, t = acted.shape
  g = returns_to_go(r, gamma)
  seg = (group_id[:, None] * t + jnp.arange(t)[None, :]).reshape(-1)
  adv = normalise_in_groups(g.reshape(-1), seg, acted.reshape(-1), num_groups * t,
                            normalize_std, eps)
  return adv.reshape(b, t), {}


def token_advantages(adv_bt: jax.Array, turn_of_token: jax.Array) -> jax.Array:
  """[B, L]: each token gets the advantage of its turn (`Trajectory.turn_of_token`), 0 on the
  prompt and padding (turn -1). The loss mask then keeps the agent's tokens only."""
  tt = jnp.clip(turn_of_token, 0, adv_bt.shape[1] - 1)
  return jnp.where(turn_of_token >= 0, jnp.take_along_axis(adv_bt, tt, axis=1), 0.0)
