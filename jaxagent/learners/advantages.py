"""Advantage estimators, registered by name: per-episode rewards [B] -> advantages [B].

Episodes come in groups (the episodes of one task, `Trajectory.group_id`); group statistics are
vectorised segment sums with a static number of segments, so an estimator is one fused kernel and
never a Python loop over groups. With n_g episodes in group g, rewards r_i and i in group g:

    grpo       A_i = (r_i - mean_g) / (std_g + eps)        std_g: population std (ddof 0);
               A_i =  r_i - mean_g                          with normalize_std=False
    rloo       A_i = r_i - (sum_g - r_i) / (n_g - 1)        leave-one-out mean; 0 when n_g == 1
               (= n_g / (n_g - 1) * (r_i - mean_g); normalize_std does not apply: the baseline is
               already unbiased and the scale is the reward's)
    reinforce  A_i = (r_i - mean_B) / (std_B + eps)         a batch-mean baseline (groups ignored);
               A_i =  r_i - mean_B                          with normalize_std=False

    compute_advantages("grpo", rewards, group_id, num_groups=G)      # [B] float32
    register_advantage("name")(fn)                                   # add an estimator

A group whose rewards are all equal gets advantages 0 under grpo and rloo (see
`rewards.equal_group_mask` to drop such groups from the loss altogether).
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp


class AdvantageFn(Protocol):
  def __call__(self, rewards: jax.Array, group_id: jax.Array, *, num_groups: int,
               normalize_std: bool, eps: float) -> jax.Array: ...


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
  """Decorator: registers `fn(rewards, group_id, *, num_groups, normalize_std, eps)` as `name`."""
  def deco(fn):
    if name in ADVANTAGE_ESTIMATORS:
      raise ValueError(f"advantage estimator {name!r} is already registered")
    ADVANTAGE_ESTIMATORS[name] = fn
    return fn
  return deco


def get_advantage_fn(name: str) -> AdvantageFn:
  """The estimator registered as `name`; ValueError naming the registered ones otherwise."""
  if name not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"unknown advantage estimator {name!r}; registered: "
                     f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
  return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(name: str, rewards: jax.Array, group_id: jax.Array, *, num_groups: int,
                       normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
  """Advantages [B] float32 of episodes with rewards [B] in groups group_id [B] int32.

  group_id must lie in [0, num_groups) (static; an upper bound is fine: empty groups are
  ignored, so num_groups = B always works). See the module docstring for each formula.
  """
  fn = get_advantage_fn(name)
  return fn(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_id, jnp.int32),
            num_groups=num_groups, normalize_std=normalize_std, eps=eps)


def group_stats(rewards: jax.Array, group_id: jax.Array, num_groups: int):
  """Per-episode (count n_g, sum_g, mean_g, population std_g) of its group, each [B] float32."""
  seg = lambda x: jax.ops.segment_sum(x, group_id, num_segments=num_groups)[group_id]
  count = seg(jnp.ones_like(rewards))
  total = seg(rewards)
  mean = total / count                      # count >= 1: the episode itself is in its group
  var = seg(jnp.square(rewards - mean)) / count
  return count, total, mean, jnp.sqrt(var)


@register_advantage("grpo")
def grpo(rewards, group_id, *, num_groups, normalize_std, eps):
  """A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std normalisation."""
  _, _, mean, std = group_stats(rewards, group_id, num_groups)
  adv = rewards - mean
  return adv / (std + eps) if normalize_std else adv


@register_advantage("rloo")
def rloo(rewards, group_id, *, num_groups, normalize_std, eps):
  """A_i = r_i - (sum_g - r_i) / (n_g - 1); 0 for a group of one (no baseline to compare to)."""
  del normalize_std, eps
  count, total, _, _ = group_stats(rewards, group_id, num_groups)
  baseline = (total - rewards) / jnp.maximum(count - 1.0, 1.0)
  return jnp.where(count > 1, rewards - baseline, 0.0)


@register_advantage("reinforce")
def reinforce(rewards, group_id, *, num_groups, normalize_std, eps):
  """A_i = (r_i - mean_B) / (std_B + eps), or r_i - mean_B without std normalisation."""
  del group_id, num_groups
  adv = rewards - jnp.mean(rewards)
  return adv / (jnp.std(rewards) + eps) if normalize_std else adv
