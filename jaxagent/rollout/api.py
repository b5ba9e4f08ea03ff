"""Public rollout API: `Rollouts`, the owner of one (model config, environment)'s compiled
rollout programs, and `rollout(...)`, a one-off call.

    rollouts = Rollouts(policy.config, env)           # build once; reuse for every batch
    traj = rollouts(params, key, tasks, group_size, budgets, max_turns=8, mesh=policy.mesh)
    rollouts.compiles, rollouts.traces                 # programs built / traced (no recompiles)
    traj = rollout(policy, env, key, tasks, group_size, budgets, max_turns=8)   # the same,
                                    # with the owner kept on the policy (compiled once per shape)
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jaxagent.envs.host import HostEnv
from jaxagent.models import sampler
from jaxagent.models.config import ModelConfig
from jaxagent.rollout.engine import HostRollout, RolloutConfig, make_rollout_fn, step_obs_len
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.sharding import batch_sharding
from jaxagent.sharding.mesh import mesh_context


def max_transcript_len(env, max_turns: int, max_action_tokens: int) -> int:
  """The longest transcript `max_turns` turns can make: the prompt, then per turn the longest
  action, its end-of-turn token and the longest later observation."""
  return env.max_obs_len + max_turns * (max_action_tokens + 1 + step_obs_len(env))


def default_context_len(env, max_turns: int, max_action_tokens: int) -> int:
  """Room for the prompt and `max_turns` full turns (`max_transcript_len`), rounded up to a
  multiple of 64."""
  return -(-max_transcript_len(env, max_turns, max_action_tokens) // 64) * 64


def expand_budgets(budgets, num_tasks: int, group_size: int) -> np.ndarray:
  """A scalar, [num_tasks] (one per group) or [num_tasks * group_size] -> int32 [B]."""
  b = num_tasks * group_size
  arr = np.asarray(budgets, np.int32)
  if arr.ndim == 0:
    return np.full((b,), int(arr), np.int32)
  if arr.shape == (num_tasks,):
    return np.repeat(arr, group_size)
  if arr.shape == (b,):
    return arr
  raise ValueError(f"budgets of shape {arr.shape}: give a scalar, one per task ({num_tasks}) "
                   f"or one per episode ({b})")


def place_batch(mesh, tree, batch_size: int):
  """Places every array of `tree` (leading axis B) with the `batch` rule of the mesh: rows over
  (data, fsdp) where B divides (else the axis is replicated). The rollout's KV cache, buffers and
  trajectory follow these inputs, so each device holds and runs only its own episodes. Built
  from the full host value on every process (`make_array_from_callback`), so it also works when
  the mesh spans several hosts. No mesh: unchanged."""
  if mesh is None:
    return tree

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.ndim, batch_size),
                                        lambda idx: x[idx])
  return jax.tree.map(put, tree)


def _is_host(env) -> bool:
  return isinstance(env, HostEnv)


def build_batch(env, key, tasks_or_num, group_size: int):
  """(tasks [B], task_id [B], group_id [B]) with each task repeated `group_size` times."""
  if isinstance(tasks_or_num, (int, np.integer)) and _is_host(env):
    tasks = env.sample_tasks(key, int(tasks_or_num))
  elif isinstance(tasks_or_num, (int, np.integer)):
    tasks = jax.vmap(env.sample_task)(jax.random.split(key, int(tasks_or_num)))
  else:
    tasks = tasks_or_num
  n = jax.tree.leaves(tasks)[0].shape[0]
  tasks = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), group_size, axis=0), tasks)
  ids = np.repeat(np.arange(n, dtype=np.int32), group_size)
  return tasks, ids, ids.copy(), n


class Rollouts:
  """The compiled rollout programs of one (model config, environment): one program per static
  `RolloutConfig` and forced-action function, built on first use and kept for the owner's life.
  Build one per policy config and environment (the run's `Programs` does) and call it for every
  batch; `compiles` counts programs built and `traces` counts their traces, so a loop can assert
  that it never recompiles."""

  def __init__(self, model_config: ModelConfig, env):
    self.model_config, self.env = model_config, env
    self._programs: dict = {}
    self.compiles = 0   # programs built
    self.traces = 0     # traces of those programs (a JAX-native program traces once per shape)

  def _counted(self):
    self.traces += 1

  def program(self, cfg: RolloutConfig, forced_action=None):
    """The program for `cfg` (built on first use): `fn(params, key, tasks, budget, task_id,
    group_id, sampling) -> Trajectory`."""
    ck = (cfg, forced_action)
    if ck not in self._programs:
      if _is_host(self.env):
        self._programs[ck] = HostRollout(self.model_config, self.env, cfg, forced_action)
      else:
        self._programs[ck] = make_rollout_fn(self.model_config, self.env, cfg, forced_action,
                                             on_trace=self._counted)
      self.compiles += 1
    return self._programs[ck]

  def __call__(self, params, key, tasks_or_num, group_size: int = 1, budgets=None, *,
               mesh=None, max_turns: int | None = None, max_action_tokens: int | None = None,
               context_len: int | None = None, budget_visible: bool = False,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               forced_action=None) -> Trajectory:
    """Runs B = num_tasks x group_size episodes of the environment with `params`.

    Args:
      tasks_or_num: a batch of task pytrees (leading axis num_tasks) or a number of random tasks.
      budgets: interaction budget per episode: scalar, [num_tasks] or [B] (default max_turns).
      mesh: the policy's mesh (episodes are split over its batch axes), or None.
      max_turns: T_max, static (default: the largest budget). Keep it fixed across calls (e.g.
        `Budget.max_turns` of a BudgetMix spec) so changing budgets never recompiles.
      max_action_tokens: tokens per turn, <eot> included (default and at most
        env.max_action_len).
      context_len: transcript/KV capacity per row (default: room for every turn).
      forced_action: `(env_state, key) -> TokenBuffer` to force actions instead of sampling
        (e.g. `lambda s, k: env.oracle_action(s)`); see `make_rollout_fn`. One program per
        function object. With a host environment it gets the whole batch's host state and
        returns [B, A] (`HostRollout`); `env.oracle_action` serves both.
    """
    env = self.env
    k_tasks, k_run = jax.random.split(key)
    tasks, task_id, group_id, n = build_batch(env, k_tasks, tasks_or_num, group_size)
    if budgets is None:
      if max_turns is None:
        raise ValueError("rollout: give budgets or max_turns")
      budgets = max_turns
    budget = expand_budgets(budgets, n, group_size)
    if budget.min() < 0:
      raise ValueError(f"budgets must be >= 0, got min {budget.min()}")
    max_turns = int(budget.max()) if max_turns is None else max_turns
    if budget.max() > max_turns:
      raise ValueError(f"a budget of {budget.max()} exceeds max_turns={max_turns}; raise "
                       "max_turns")
    a = max_action_tokens or env.max_action_len
    cfg = RolloutConfig(max_turns=max_turns, max_action_tokens=a,
                        context_len=context_len or default_context_len(env, max_turns, a),
                        budget_visible=budget_visible)
    sc = sampler.SamplingConfig.make(temperature, top_k, top_p)
    fn = self.program(cfg, forced_action)
    # On a mesh the episodes are split over (data, fsdp) like every other batch; without this
    # every device would run (and hold the KV cache of) the whole batch.
    # (A host environment's tasks stay on the host; its observations follow the budgets.)
    b = budget.shape[0]
    budget, task_id, group_id = place_batch(mesh, (budget, task_id, group_id), b)
    if not _is_host(env):
      tasks = place_batch(mesh, tasks, b)
    args = (params, k_run, tasks, jnp.asarray(budget), jnp.asarray(task_id),
            jnp.asarray(group_id), sc)
    with mesh_context(mesh):     # the decoder keeps activations split over the batch axes
      return fn(*args)


def rollouts_for(policy, env) -> Rollouts:
  """The `Rollouts` of (policy.config, env), kept on the policy (`Policy.programs`) and released
  with it: every call for the same model config and environment gets the same owner, so its
  programs compile once per static rollout config (shapes, T_max)."""
  key = ("rollouts", id(env), policy.config)
  owner = policy.programs.get(key)
  if owner is None or owner.env is not env:       # the owner holds env: its id is not reused
    owner = policy.programs[key] = Rollouts(policy.config, env)
  return owner


def rollout(policy, env, key, tasks_or_num, group_size: int = 1, budgets=None, *,
            params=None, **kwargs) -> Trajectory:
  """`Rollouts(policy.config, env)(params or policy.params, ..., mesh=policy.mesh)`, with the
  owner kept on the policy (`rollouts_for`): calls in a loop compile once for the same model
  config, environment and shapes, and a new `policy.config` (e.g. another attention path) gets
  its own programs."""
  return rollouts_for(policy, env)(policy.params if params is None else params, key,
                                   tasks_or_num, group_size, budgets, mesh=policy.mesh, **kwargs)
