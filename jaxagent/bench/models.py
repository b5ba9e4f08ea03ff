"""The larger models the benchmark measures beside the built-in one: random-weight policies of
given sizes (BIG) and the real SmolLM2-135M, each through one `model_section`: its jitted
rollout, its decode against the bandwidth bound, and its RL update against the peak.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxagent.bench.decode import decode_only
from jaxagent.bench.machine import timed
from jaxagent.bench.rollouts import rollout_fn, rollout_row
from jaxagent.bench.update import update_step
from jaxagent.learners.update import LearnerConfig
from jaxagent.models.policy import Policy, init_sharded
from jaxagent.planning.flops import param_counts

# Larger random-weight models on the built-in tokenizer's 720-token vocabulary. 100m: 12 x
# (768 x 64 x (12 + 4 + 4 + 12) + 3 x 768 x 2816) ~ 97M in the layers; 0.5b: 32 x (1024 x 64 x
# (16 + 4 + 4 + 16) + 3 x 1024 x 4096) ~ 487M (for a GPU or TPU: --big_size=0.5b
# --big_dtype=bfloat16 --big_episodes=64 --big_turns=4 --noscaling); tiny: 2 x (64 x 16 x (4 + 2
# + 2 + 4) + 3 x 64 x 128) ~ 74K, a check that the section runs (the suite's end-to-end run).
BIG = {"100m": dict(hidden_size=768, intermediate_size=2816, num_layers=12, num_heads=12,
                    num_kv_heads=4, head_dim=64),
       "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_layers=32, num_heads=16,
                    num_kv_heads=4, head_dim=64),
       "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16)}


def random_policy(base, seed: int = 0, dtype: str = "float32", **sizes):
  """A policy with `base`'s tokenizer and vocabulary, other sizes replaced, random weights in
  `dtype` (parameters and compute)."""
  cfg = dataclasses.replace(base.config, dtype=dtype, param_dtype=dtype, **sizes)
  return Policy(config=cfg, params=init_sharded(cfg, seed), tokenizer=base.tokenizer,
                path=f"random({sizes})")


def big_policy(base, size: str, dtype: str = "float32"):
  """The random-weight model `BIG[size]` on `base`'s tokenizer."""
  if size not in BIG:
    raise ValueError(f"big model size {size!r}: pick one of {', '.join(BIG)}")
  return random_policy(base, dtype=dtype, **BIG[size])


def model_section(policy, env, learner: LearnerConfig, episodes: int, group: int,
                  turns: int) -> dict:
  """One model's jax rollout (one timed run after compilation), decode-only (against its
  bandwidth bound) and RL update (against the peak) on about `episodes` episodes (tasks drawn
  with key 0, `group` episodes each) of `turns` turns: the big and SmolLM2 sections."""
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), max(1, episodes // group)))
  secs, traj = timed(rollout_fn(policy, env, tasks, group, turns), 1)
  return {"dtype": policy.config.param_dtype,
          "params": param_counts(policy.config, policy.params)["total"],
          "episodes": int(traj.batch_size), "turns": turns,
          "rollout": rollout_row(secs, traj, int(traj.batch_size)),
          "decode": decode_only(policy, env, tasks, group, traj, 1),
          "update": update_step(policy, traj, learner, 1)}
