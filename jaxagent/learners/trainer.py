"""The training loop: `run(config, workdir)` runs the phases of a config (SFT, then RL).

Every phase checkpoints to `<workdir>/checkpoints/<phase>` (params, optimizer state, step and
RNG; the data position is derived from the step), so a run restarted on the same workdir resumes
from the latest checkpoint and continues exactly as if never stopped: batch s always uses the same
tasks, budgets and keys (folded from the seed and s). A finished phase is not redone. SIGTERM
saves a checkpoint and exits cleanly. Per step: one line in `<workdir>/metrics.jsonl`, TensorBoard
scalars, and a progress bar.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

import jaxagent.envs as envs
from jaxagent.checkpoint import FINGERPRINT_KEY, Checkpointer, PreemptionGuard, model_fingerprint

from jaxagent.data import demos as demo_data
from jaxagent.data import tasks as task_data
from jaxagent.learners import sft as sft_lib
from jaxagent.learners.logger import MetricsLog, check_finite
from jaxagent.learners.update import (LearnerConfig, TrainState, make_optimizer, make_update_fn,
                                      offload_to_host)
from jaxagent.models import Policy, from_pretrained
from jaxagent.rollout import budget as budget_lib
from jaxagent.rollout import rollout
from jaxagent.rollout.stats import trajectory_stats
from jaxagent.rollout.trajectory import trim
from jaxagent.sharding import distributed, make_mesh

PHASES = ("sft", "rl")


# ---- set-up shared by train and eval -----------------------------------------------------------


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises a clear error for a bad config before any compute starts."""
  if config.env.name not in envs.names():
    raise ValueError(f"config.env.name={config.env.name!r} is not an environment; choose one of "
                     f"{envs.names()}")
  budget_lib.parse_budget(config.rl.budget, per=config.rl.budget_per)
  learner_config(config)


def learner_config(config) -> LearnerConfig:
  """The learner knobs; log-probs are recomputed at the rollout's sampling temperature."""
  return LearnerConfig.from_config({**config.rl.learner.to_dict(),
                                    "temperature": float(config.rl.temperature)})


def load_policy(config) -> Policy:
  devices = jax.devices()[:config.num_devices or None]
  mesh = make_mesh(dict(config.mesh), devices=devices)
  return from_pretrained(config.model.path, dtype=config.model.dtype, mesh=mesh,
                         param_dtype=config.model.param_dtype)


_ENVS: dict = {}
_STEP_FNS: dict = {}


def make_env(config, tokenizer):
  """The config's environment; one object per (name, knobs, tokenizer), so runs in one process
  (the study's phases, tests) share the compiled rollouts, which are cached per environment."""
  key = (config.env.name, json.dumps(config.env.difficulty.to_dict(), sort_keys=True),
         tokenizer.name_or_path, len(tokenizer))
  if key not in _ENVS:
    _ENVS[key] = envs.make(config.env.name, tokenizer, **dict(config.env.difficulty))
  return _ENVS[key]


def _cached(key, build):
  """Jitted step functions, reused across runs in one process when their settings are equal."""
  if key not in _STEP_FNS:
    _STEP_FNS[key] = build()
  return _STEP_FNS[key]


def data_dir(config, workdir) -> pathlib.Path:
  return pathlib.Path(config.data.dir or pathlib.Path(workdir) / "data")


def task_kwargs(config) -> dict:
  return dict(seed=config.data.seed, num_train=config.data.num_train,
              num_validation=config.data.num_validation, num_test=config.data.num_test,
              **dict(config.env.difficulty))


def build_once(name: str, build) -> None:
  """Runs `build()` (writing a dataset into the shared data dir) on the primary process only;
  on a multi-host job the others wait for it at a barrier, then read what it wrote."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    if distributed.is_primary():
      build()
    multihost_utils.sync_global_devices(f"jaxagent data: {name}")
  else:
    build()


def load_tasks(config, workdir, split: str) -> dict[str, np.ndarray]:
  """The fixed task split as numpy arrays (built into the data dir on first use)."""
  d = data_dir(config, workdir)
  build_once("tasks", lambda: task_data.build(d, config.env.name, **task_kwargs(config)))
  return task_data.load(d, config.env.name, split, **task_kwargs(config))


def new_train_state(policy: Policy, params, optimizer, key) -> TrainState:
  """A train state whose every leaf lives on the policy's mesh: params and the optimizer's
  moments keep the params' shardings, scalars (step, key, counts) are replicated."""
  state = TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params), key=key)
  mesh = policy.mesh
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  on_mesh = lambda x: (isinstance(x, jax.Array) and hasattr(x.sharding, "mesh")
                       and x.sharding.mesh == mesh)
  return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, rep), state)


def demo_kwargs(config) -> dict:
  d = config.data
  return dict(task_seed=d.seed, num_train=d.num_train, num_validation=d.num_validation,
              num_test=d.num_test, error_rate=d.demo_error_rate,
              recovery_rate=d.demo_recovery_rate, max_turns=d.demo_max_turns,
              max_len=d.demo_max_len, seed=config.seed,
              episodes_per_task=d.demo_episodes_per_task, **dict(config.env.difficulty))


def load_demos(config, workdir, tokenizer, split: str) -> dict[str, np.ndarray]:
  """Noisy-oracle demonstrations (built on first use), token arrays cut to the longest one."""
  d = data_dir(config, workdir)
  build_once("demos", lambda: demo_data.build(d, config.env.name, tokenizer,
                                              **demo_kwargs(config)))
  arrays = demo_data.load(d, config.env.name, tokenizer, split, **demo_kwargs(config))
  keep = -(-int(arrays["length"].max()) // 64) * 64
  for k in ("tokens", "loss_mask", "turn_of_token"):
    arrays[k] = arrays[k][:, :keep]
  return arrays


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def latest_params(workdir, abstract_params) -> tuple[Any, str, int]:
  """Params of the latest checkpoint of the last phase that has one: (params, phase, step)."""
  for phase in reversed(PHASES):
    directory = pathlib.Path(workdir) / "checkpoints" / phase
    if not directory.exists():
      continue
    ckpt = Checkpointer.reader(directory)
    step = ckpt.latest_step()
    if step is not None:
      params = ckpt.restore_params(step, abstract_params)
      ckpt.close()
      return params, phase, step
    ckpt.close()
  raise FileNotFoundError(f"{workdir}: no checkpoint under checkpoints/{{{','.join(PHASES)}}}; "
                          "train it first, or fix the path")


# ---- phases --------------------------------------------------------------------------------------


def _batch_slice(arrays: dict, start: int, size: int) -> dict:
  n = len(next(iter(arrays.values())))
  idx = (start + np.arange(size)) % n
  return {k: v[idx] for k, v in arrays.items()}


class _Phase:
  """Checkpointing, metrics, progress and preemption for one phase."""

  def __init__(self, name, config, workdir, fingerprint, total_steps):
    self.name, self.total = name, total_steps
    self.ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints" / name,
                             max_to_keep=config.max_to_keep,
                             save_interval_steps=config.checkpoint_every)
    self.ckpt.check_compatible(fingerprint)
    self.fingerprint = fingerprint
    self.config = config
    self.workdir = workdir

  def restore(self, state: TrainState) -> tuple[TrainState, int]:
    step = self.ckpt.latest_step()
    if step is None:
      return state, 0
    logging.info("%s: resuming from step %d", self.name, step)
    restored = self.ckpt.restore(step, abstract_state=_abstract(_state_dict(state)))
    return TrainState(**restored), step

  def end_step(self, step: int, state: TrainState, guard: PreemptionGuard) -> None:
    """Checkpoints (every checkpoint_every steps, and the last); on SIGTERM saves and exits."""
    self.save(step, state, force=step == self.total)
    if guard.should_stop(step):
      self.save(step, state, force=True)
      self.ckpt.wait_until_finished()
      raise SystemExit(f"{self.name}: preempted; saved step {step}; rerun the same command to "
                       "resume")

  def save(self, step: int, state: TrainState, force=False):
    self.ckpt.save(step, _state_dict(state), meta={"phase": self.name, "step": step,
                                                   FINGERPRINT_KEY: self.fingerprint}, force=force)


def _show_progress(config) -> bool:
  """Progress bars on the primary process only (one bar per job, not one per host)."""
  return bool(config.progress_bar) and distributed.is_primary()


def _state_dict(state: TrainState) -> dict:
  """The saved layout: a dict, so evaluation can restore the `params` subtree alone."""
  return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
          "key": state.key}


def run_sft(config, workdir, policy: Policy, env, params, fingerprint) -> Any:
  c = config.sft
  phase = _Phase("sft", config, workdir, fingerprint, c.steps)
  optimizer = make_optimizer(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps,
                             total_steps=c.steps, schedule="cosine", weight_decay=c.weight_decay,
                             max_grad_norm=c.max_grad_norm)
  step_fn = _cached(("sft", policy.config, c.learning_rate, c.warmup_steps, c.steps,
                     c.weight_decay, c.max_grad_norm),
                    lambda: sft_lib.make_sft_step(policy.config, optimizer))
  state = new_train_state(policy, params, optimizer, jax.random.key(config.seed))
  state, start = phase.restore(state)
  if start >= c.steps:
    logging.info("sft: already done (%d steps)", start)
    return state.params
  demos = load_demos(config, workdir, policy.tokenizer, "train")
  n = len(demos["length"])
  perm_key = jax.random.key(config.seed + 1)
  log = MetricsLog(workdir, "sft", resume_step=start)
  bar = tqdm(total=c.steps, initial=start, desc="sft", disable=not _show_progress(config))
  with PreemptionGuard() as guard:
    for s in range(start, c.steps):
      epoch, pos = divmod(s * c.batch_size, n)
      perm = np.asarray(jax.random.permutation(jax.random.fold_in(perm_key, epoch), n))
      idx = perm[(pos + np.arange(c.batch_size)) % n]
      batch = {k: jnp.asarray(demos[k][idx]) for k in ("tokens", "loss_mask", "length")}
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batch)
      metrics = jax.device_get(metrics)
      check_finite(s + 1, metrics)
      dt = time.perf_counter() - t0
      if (s + 1) % config.log_every == 0 or s + 1 == c.steps:
        log.write(s + 1, metrics, {"step_seconds": dt,
                                   "tokens_per_second": float(np.sum(batch["length"])) / dt})
      bar.update(1)
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
      phase.end_step(s + 1, state, guard)
  phase.ckpt.wait_until_finished()
  bar.close()
  log.close()
  return state.params


def run_rl(config, workdir, policy: Policy, env, params, fingerprint) -> Any:
  c = config.rl
  lcfg = learner_config(config)
  sampler = budget_lib.parse_budget(c.budget, per=c.budget_per)
  phase = _Phase("rl", config, workdir, fingerprint, c.steps)
  optimizer = lcfg.make_optimizer(total_steps=c.steps * lcfg.optimizer_steps_per_update)
  update = _cached(("rl", lcfg, policy.config, c.steps),
                   lambda: make_update_fn(lcfg, policy.config, optimizer))
  # A copy: the update donates the train state, whose params start as these arrays.
  ref_params = jax.tree.map(jnp.copy, params) if lcfg.kl_coef > 0 else None
  if ref_params is not None and c.get("reference_on_host", False):
    ref_params = offload_to_host(ref_params)
  state = new_train_state(policy, params, optimizer, jax.random.key(config.seed + 2))
  state, start = phase.restore(state)
  if start >= c.steps:
    logging.info("rl: already done (%d steps)", start)
    return state.params
  train = load_tasks(config, workdir, "train")
  key = jax.random.key(config.seed + 3)
  log = MetricsLog(workdir, "rl", resume_step=start)
  bar = tqdm(total=c.steps, initial=start, desc=f"rl {c.budget}",
             disable=not _show_progress(config))
  with PreemptionGuard() as guard:
    for s in range(start, c.steps):
      k_budget, k_roll = jax.random.split(jax.random.fold_in(key, s))
      budgets = sampler.sample(s, k_budget, c.num_tasks)
      tasks = task_data.tasks_from_arrays(env, _batch_slice(train, s * c.num_tasks, c.num_tasks))
      t0 = time.perf_counter()
      traj = rollout(policy, env, k_roll, tasks, c.group_size, budgets,
                     max_turns=sampler.max_budget, max_action_tokens=c.max_action_tokens or None,
                     budget_visible=c.budget_visible, temperature=c.temperature,
                     params=state.params)
      stats = jax.device_get(trajectory_stats(traj))
      t1 = time.perf_counter()
      state, metrics = update(state, trim(traj), ref_params)
      metrics = {**jax.device_get(metrics), **stats}
      check_finite(s + 1, metrics)
      t2 = time.perf_counter()
      if (s + 1) % config.log_every == 0 or s + 1 == c.steps:
        log.write(s + 1, metrics, {
            "rollout_seconds": t1 - t0, "update_seconds": t2 - t1,
            "sampled_tokens_per_second": float(stats["sampled_tokens"]) / (t1 - t0)})
      bar.update(1)
      bar.set_postfix(success=f"{float(stats['success_rate']):.2f}",
                      turns=f"{float(stats['mean_turns']):.1f}")
      phase.end_step(s + 1, state, guard)
  phase.ckpt.wait_until_finished()
  bar.close()
  log.close()
  return state.params


def run(config: ml_collections.ConfigDict, workdir) -> dict:
  """Runs the config's phases in `workdir` (resuming), returns a summary dict."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  validate(config)
  primary = distributed.is_primary()
  if primary:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  policy = load_policy(config)
  fingerprint = model_fingerprint(policy.config)
  env = make_env(config, policy.tokenizer)
  params = policy.params
  if config.model.init_from:
    params, phase, step = latest_params(config.model.init_from, _abstract(params))
    logging.info("initialised from %s (%s step %d)", config.model.init_from, phase, step)
  summary = {"workdir": str(workdir)}
  if config.sft.steps > 0:
    params = run_sft(config, workdir, policy, env, params, fingerprint)
    summary["sft_steps"] = config.sft.steps
  if config.rl.steps > 0:
    params = run_rl(config, workdir, policy, env, params, fingerprint)
    summary["rl_steps"] = config.rl.steps
  if primary:
    (workdir / "DONE").write_text(json.dumps(summary) + "\n")
  return summary
