"""The training loop: `run(config, workdir)` runs the phases of a config (SFT, then RL).

Every phase checkpoints to `<workdir>/checkpoints/<phase>` (params, optimizer state, step and
RNG; the data position is derived from the step), so a run restarted on the same workdir resumes
from the latest checkpoint and continues exactly as if never stopped: batch s always uses the same
tasks, budgets and keys (folded from the seed and s). A finished phase is not redone. SIGTERM
saves a checkpoint and exits cleanly. Per step: one line in `<workdir>/metrics.jsonl`, TensorBoard
scalars, and a progress bar. The workdir layout is `jaxagent.runs.layout`'s.

With LoRA (config.model.lora.rank > 0) the train state holds the adapters and their optimizer
state only; the frozen base is loaded once and passed to every step (`jaxagent.runs.adapters`),
rollouts use base + adapters, and checkpoints hold the adapters with the base's fingerprint (a
resume on another base is refused). RL continues the SFT adapters on the same base; its KL
reference is the policy it starts from (base + a frozen copy of those adapters).

The config is read once, into its typed sections (`jaxagent.runs.config.RunConfig`), and those
are what the phases get; the raw config is only pinned to the workdir and handed to the set-up of
the policy and its compiled programs (`jaxagent.runs.setup`, shared with evaluation).

Guards: the whole config is validated before any compute (`jaxagent.runs.config`); one trainer
at a time holds the workdir (`jaxagent.runs.lock`); a rerun with a config that differs in a key
that matters refuses unless allowed, and every change is recorded (`jaxagent.runs.pinning`); a
non-finite loss stops the run (NaN guard), and so does a run that cannot be learning
(`config.guard`: gradients exactly zero, or an exploding SFT loss, for `stall_steps` consecutive
steps).
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

from jaxagent.checkpoint import FINGERPRINT_KEY, Checkpointer, PreemptionGuard, model_fingerprint
from jaxagent.data import tasks as task_data
from jaxagent.learners.logger import MetricsLog, check_finite
from jaxagent.learners.update import TrainState, init_train_state, offload_to_host
from jaxagent.models import Policy
from jaxagent.models.lora import LoraConfig
from jaxagent.rollout.stats import trajectory_stats
from jaxagent.rollout.trajectory import trim
from jaxagent.runs import config as sections
from jaxagent.runs import adapters, layout, setup
from jaxagent.runs.lock import WorkdirLock
from jaxagent.runs.pinning import pin_config
from jaxagent.runs.programs import Programs, programs_for
from jaxagent.sharding import distributed


def _batch_slice(arrays: dict, start: int, size: int) -> dict:
  n = len(next(iter(arrays.values())))
  idx = (start + np.arange(size)) % n
  return {k: v[idx] for k, v in arrays.items()}


def _state_dict(state: TrainState) -> dict:
  """The saved layout: a dict, so evaluation can restore the `params` subtree alone."""
  return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
          "key": state.key}


class _Phase:
  """Checkpointing, metrics, progress and preemption for one phase."""

  def __init__(self, name: str, run: sections.RunSection, workdir, fingerprint, total_steps: int,
               frozen: adapters.FrozenBase | None = None):
    self.name, self.total = name, total_steps
    self.ckpt = Checkpointer(layout.checkpoint_dir(workdir, name), max_to_keep=run.max_to_keep,
                             save_interval_steps=run.checkpoint_every)
    self.ckpt.check_compatible(fingerprint)
    # LoRA: checkpoints of adapters on this base only (another base refused, both named).
    adapters.check_workdir(self.ckpt, frozen.lcfg if frozen else LoraConfig(),
                           frozen.fingerprint if frozen else None)
    self.fingerprint = fingerprint
    self.lora_meta = frozen.meta() if frozen else {}

  def restore(self, state: TrainState) -> tuple[TrainState, int]:
    """(state, step) of the newest intact checkpoint of the phase (damaged newer ones are
    skipped, named in a warning, and set aside), or (state, 0) when there is none."""
    restored, step = self.ckpt.restore_latest(layout.abstract_params(_state_dict(state)),
                                              fingerprint=self.fingerprint)
    if restored is None:
      return state, 0
    logging.info("%s: resuming from step %d", self.name, step)
    return TrainState(**restored), step

  def finished_params(self, params) -> Any | None:
    """The params of a phase already run to its end, decided from the checkpoint listing, not
    by restoring the whole state; None when the phase still has steps to run (also when its
    final checkpoint is damaged: the run then resumes from the newest intact one and redoes
    the rest, exactly)."""
    latest = self.ckpt.latest_step()
    if latest is None or latest < self.total:
      return None
    restored, step = self.ckpt.restore_params_latest(layout.abstract_params(params),
                                                     fingerprint=self.fingerprint)
    if restored is None or step < self.total:
      logging.warning("%s: the final checkpoint (step %d) is damaged; resuming from step %s",
                      self.name, latest, step)
      return None
    logging.info("%s: already done (%d steps)", self.name, step)
    return restored

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
                                                   FINGERPRINT_KEY: self.fingerprint,
                                                   **self.lora_meta}, force=force)


class DivergenceError(RuntimeError):
  """A run that cannot be learning (see `StallGuard`); the message names the likely cause."""


class StallGuard:
  """Counts consecutive steps in which the run cannot be learning and raises DivergenceError at
  guard.stall_steps of them (config.guard): the gradient norm exactly 0 where it should not be
  (SFT; RL steps whose advantages are not all zero), or (SFT) the loss above
  guard.loss_explode_factor x the first step's loss."""

  def __init__(self, guard: sections.GuardConfig, phase: str):
    self.limit, self.factor, self.phase = guard.stall_steps, guard.loss_explode_factor, phase
    self.zero = self.explode = 0
    self.first_loss: float | None = None

  def check(self, step: int, metrics: dict) -> None:
    grad = float(metrics["grad_norm"])
    learnable = self.phase == "sft" or float(metrics["advantage_abs_mean"]) > 0
    self.zero = self.zero + 1 if grad == 0.0 and learnable else 0
    if self.phase == "sft":
      loss = float(metrics["loss"])
      self.first_loss = loss if self.first_loss is None else self.first_loss
      self.explode = self.explode + 1 if loss > self.factor * abs(self.first_loss) else 0
    if self.zero >= self.limit:
      raise DivergenceError(
          f"{self.phase} step {step}: the gradient has been exactly zero for {self.zero} steps "
          f"while there is something to learn; the policy is saturated (a learning rate far too "
          f"large, e.g. config.{self.phase}{'.learner' if self.phase == 'rl' else ''}"
          ".learning_rate) or the loss does not depend on the params. Lower the rate and restart "
          "from an earlier checkpoint or a new workdir")
    if self.explode >= self.limit:
      raise DivergenceError(
          f"{self.phase} step {step}: the loss ({float(metrics['loss']):.4g}) has been above "
          f"{self.factor:g} x its first value ({self.first_loss:.4g}) for {self.explode} steps; "
          "the run diverged (learning rate too large, or of the wrong sign). Lower "
          f"config.{self.phase}.learning_rate and restart from an earlier checkpoint or a new "
          "workdir")


def _show_progress(run: sections.RunSection) -> bool:
  """Progress bars on the primary process only (one bar per job, not one per host)."""
  return run.progress_bar and distributed.is_primary()


def run_sft(cfg: sections.RunConfig, workdir, policy: Policy, programs: Programs, params,
            fingerprint, frozen: adapters.FrozenBase | None = None) -> Any:
  """The SFT phase (cfg.sft) on the noisy-oracle demonstrations; returns the final params.
  With `frozen` (LoRA) `params` and the result are the adapters, trained on frozen.params."""
  c, seed = cfg.sft, cfg.run.seed
  phase = _Phase("sft", cfg.run, workdir, fingerprint, c.steps, frozen)
  done = phase.finished_params(params)
  if done is not None:
    return done
  optimizer, step_fn = programs.sft_step(c, frozen.lcfg if frozen else None)
  base = (frozen.params,) if frozen else ()        # read in place by every step, never copied
  state = init_train_state(params, optimizer, jax.random.key(seed), mesh=policy.mesh)
  state, start = phase.restore(state)
  demos = setup.load_demos(cfg.data, cfg.env, workdir, policy.tokenizer, "train", seed=seed)
  n = len(demos["length"])
  perm_key = jax.random.key(seed + 1)
  log = MetricsLog(workdir, "sft", resume_step=start)
  bar = tqdm(total=c.steps, initial=start, desc="sft", disable=not _show_progress(cfg.run))
  stall = StallGuard(cfg.guard, "sft")
  with PreemptionGuard() as guard:
    for s in range(start, c.steps):
      epoch, pos = divmod(s * c.batch_size, n)
      perm = np.asarray(jax.random.permutation(jax.random.fold_in(perm_key, epoch), n))
      idx = perm[(pos + np.arange(c.batch_size)) % n]
      batch = {k: jnp.asarray(demos[k][idx]) for k in ("tokens", "loss_mask", "length")}
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batch, *base)
      metrics = jax.device_get(metrics)
      check_finite(s + 1, metrics)
      stall.check(s + 1, metrics)
      dt = time.perf_counter() - t0
      if (s + 1) % cfg.run.log_every == 0 or s + 1 == c.steps:
        log.write(s + 1, metrics, {"step_seconds": dt,
                                   "tokens_per_second": float(np.sum(batch["length"])) / dt})
      bar.update(1)
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
      phase.end_step(s + 1, state, guard)
  phase.ckpt.wait_until_finished()
  bar.close()
  log.close()
  return state.params


def run_rl(cfg: sections.RunConfig, workdir, policy: Policy, programs: Programs, params,
           fingerprint, frozen: adapters.FrozenBase | None = None) -> Any:
  """The RL phase (cfg.rl) on the train split's tasks; returns the final params. With `frozen`
  (LoRA) `params` and the result are the adapters (continued from SFT's, or fresh), trained on
  frozen.params; the KL reference is the policy RL starts from: the base with adapters off when
  they are fresh (B = 0), else the base with a frozen copy of the starting adapters (an
  adapter-sized copy, never a second base)."""
  c, seed = cfg.rl, cfg.run.seed
  lcfg = c.learner         # the budget's fit in the context: `setup.preflight`, before any phase
  phase = _Phase("rl", cfg.run, workdir, fingerprint, c.steps, frozen)
  done = phase.finished_params(params)
  if done is not None:
    return done
  optimizer, update = programs.update(lcfg, c.steps * lcfg.optimizer_steps_per_update,
                                      frozen.lcfg if frozen else None)
  # A copy: the update donates the train state, whose params start as these arrays.
  ref_params = jax.tree.map(jnp.copy, params) if lcfg.kl_coef > 0 else None
  if frozen is not None:
    ref_params = (None if ref_params is None or adapters.all_zero_b(params)
                  else frozen.policy(ref_params))
  elif ref_params is not None and c.reference_on_host:
    ref_params = offload_to_host(ref_params)
  base = {"base": frozen.params} if frozen else {}
  as_policy = frozen.policy if frozen else (lambda p: p)
  state = init_train_state(params, optimizer, jax.random.key(seed + 2), mesh=policy.mesh)
  state, start = phase.restore(state)
  train = setup.load_tasks(cfg.data, cfg.env, workdir, "train")
  key = jax.random.key(seed + 3)
  log = MetricsLog(workdir, "rl", resume_step=start)
  bar = tqdm(total=c.steps, initial=start, desc=f"rl {c.budget.spec}",
             disable=not _show_progress(cfg.run))
  stall = StallGuard(cfg.guard, "rl")
  with PreemptionGuard() as guard:
    for s in range(start, c.steps):
      k_budget, k_roll = jax.random.split(jax.random.fold_in(key, s))
      budgets = c.budget.sample(s, k_budget, c.num_tasks)
      tasks = task_data.tasks_from_arrays(programs.env,
                                          _batch_slice(train, s * c.num_tasks, c.num_tasks))
      t0 = time.perf_counter()
      traj = programs.rollouts(as_policy(state.params), k_roll, tasks, c.group_size, budgets,
                               mesh=policy.mesh, max_turns=c.budget.max_turns,
                               max_action_tokens=c.max_action_tokens or None,
                               budget_visible=c.budget_visible, temperature=c.temperature)
      stats = jax.device_get(trajectory_stats(traj))
      t1 = time.perf_counter()
      state, metrics = update(state, trim(traj), ref_params, **base)
      metrics = {**jax.device_get(metrics), **stats}
      check_finite(s + 1, metrics)
      stall.check(s + 1, metrics)
      t2 = time.perf_counter()
      if (s + 1) % cfg.run.log_every == 0 or s + 1 == c.steps:
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


def run(config: ml_collections.ConfigDict, workdir, *, programs: Programs | None = None,
        allow_config_change: bool = False) -> dict:
  """Runs the config's phases in `workdir` (resuming), returns a summary dict.

  programs: compiled functions to reuse (e.g. the study's, shared by its runs); default new ones.
  allow_config_change: continue a workdir whose pinned config differs in a key that matters
    (`jaxagent.runs.pinning`; the change is recorded).
  Raises ConfigError (bad or changed config, before any compute), WorkdirLockedError (another
  trainer holds the workdir), FloatingPointError / DivergenceError (the run stopped learning).
  """
  workdir = pathlib.Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise sections.ConfigError(f"--workdir={workdir} is an existing file, not a directory; pass "
                               "a directory (it is created if missing)")
  cfg = sections.run_config(config)          # every section read and checked, before compute
  setup.preflight(config)          # before anything is computed or pinned
  workdir.mkdir(parents=True, exist_ok=True)
  primary = distributed.is_primary()
  with WorkdirLock(workdir, "train", enabled=primary):
    if primary:
      pin_config(config, workdir, allow_change=allow_config_change)
    return _run_phases(config, cfg, workdir, programs, primary)


def _run_phases(config, cfg: sections.RunConfig, workdir: pathlib.Path,
                programs: Programs | None, primary: bool) -> dict:
  """The policy (from the raw `config`: `setup.load_policy`, `programs_for`), then the phases of
  `cfg` (its typed sections) from it or from cfg.model.init_from's newest checkpoint."""
  policy = setup.load_policy(config)
  programs = programs_for(config, policy.config, policy.tokenizer, programs)
  fingerprint = model_fingerprint(policy.config)
  params, frozen = _start_params(cfg, policy)
  summary = {"workdir": str(workdir)}
  if frozen is not None:
    summary.update(lora_rank=frozen.lcfg.rank, base_fingerprint=frozen.fingerprint)
  if cfg.sft.steps > 0:
    params = run_sft(cfg, workdir, policy, programs, params, fingerprint, frozen)
    summary["sft_steps"] = cfg.sft.steps
  if cfg.rl.steps > 0:
    # LoRA: RL continues the SFT adapters on the same base (no merge: one base, one fingerprint
    # for every checkpoint of the run).
    params = run_rl(cfg, workdir, policy, programs, params, fingerprint, frozen)
    summary["rl_steps"] = cfg.rl.steps
  if primary:
    (workdir / "DONE").write_text(json.dumps(summary) + "\n")
  return summary


def _start_params(cfg: sections.RunConfig, policy: Policy):
  """(trainable params, FrozenBase or None): the model's weights or cfg.model.init_from's newest
  checkpoint; with LoRA (cfg.model.lora.rank > 0) the adapters (init_from's, or fresh) and the
  frozen base (`jaxagent.runs.adapters.run_base`)."""
  init_from, lcfg = cfg.model.init_from, cfg.model.lora
  if lcfg.enabled:
    base, params = adapters.run_base(init_from, policy.params, policy.config, lcfg, policy.mesh)
    if params is None:
      params = adapters.init_adapters(policy.config, lcfg, jax.random.key(cfg.run.seed + 4),
                                      policy.mesh)
    frozen = adapters.FrozenBase(lcfg, base)
    if lcfg.quantized_base:      # the float weights are not kept beside the quantised base
      policy.params = base
    logging.info("LoRA rank %d on %s: base %s%s", lcfg.rank, ",".join(lcfg.targets),
                 frozen.fingerprint, f" (from {init_from})" if init_from else "")
    return params, frozen
  if init_from:
    adapters.refuse_adapter_init(init_from)
    params, phase, step = layout.latest_params(init_from, layout.abstract_params(policy.params))
    logging.info("initialised from %s (%s step %d)", init_from, phase, step)
    return params, None
  return policy.params, None
