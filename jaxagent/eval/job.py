"""The checkpoint-evaluation job and the multi-run comparison, as library functions.

    evaluate_checkpoint(config, workdir, step=None)   # one checkpoint (default: the latest)
    evaluate_all(config, workdir)                     # every kept checkpoint
    watch(config, workdir, poll_seconds, timeout_seconds)   # each new checkpoint as it lands
    compare({"base": W1, "rl": W2}, out_dir, config)        # side by side, with the claims

Checkpoints are `<workdir>/checkpoints/<phase>/<step>` (phases "sft" then "rl", written by
`jaxagent.learners.trainer`); only the params are restored (orbax partial restore), placed with the
config's mesh shardings. Evaluation uses the fixed, seeded test split (`config.data`), and keys
from `config.eval.seed`, so two evaluations of the same params produce the same episodes.

One evaluation writes `<workdir>/eval/<name>/` with name = the step for the RL phase and
`<phase>_<step>` otherwise:

    report.json, report.md        every number, with the definitions (`jaxagent.eval.report`)
    pass_heatmap.png, pass_curves.png, step_quality.png, recovery.png, recovery_on_policy.png,
    likelihood.png
    episodes.npz                  raw arrays: success_turn [tasks, n] (the T_max run: truncation
                                  mode's source), success_turn_by_t [len(budgets), tasks, n] and
                                  budgets (rerun mode; truncation mode stores the single run under
                                  budgets = [T_max]), task_id [tasks] (index in the test split),
                                  optimal_turns [tasks], task/<leaf> (the task arrays),
                                  traj/<field> (every Trajectory field of the policy's T_max run),
                                  sq/<policy>/<mode>/{valid,oracle}, sq/source,
                                  rec/<policy>/<mode>/{valid,oracle}, rec/kind (per-state outcomes)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from jaxagent.checkpoint import Checkpointer
from jaxagent.eval import likelihood, pass_at_kt, plots, recovery, report, step_quality
from jaxagent.rollout import rollout
from jaxagent.rollout.stats import trajectory_stats
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.sharding import distributed

# The trainer's phases, in training order (jaxagent.learners.trainer.PHASES).
PHASES = ("sft", "rl")
POLICY, BASE = "policy", "base"
TRAJ_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory))


# ---- checkpoints ----------------------------------------------------------------------------------


def _ckpt_dir(workdir, phase) -> pathlib.Path:
  return pathlib.Path(workdir) / "checkpoints" / phase


def checkpoint_steps(workdir, phase: str = "") -> list[tuple[str, int]]:
  """All kept (phase, step) of `workdir`, in training order; `phase` "" means every phase."""
  workdir = pathlib.Path(workdir)
  if phase and phase not in PHASES:
    raise ValueError(f"config.eval.phase={phase!r}: use one of {PHASES} or '' (every phase)")
  if not (workdir / "checkpoints").is_dir():
    raise FileNotFoundError(
        f"{workdir} has no checkpoints/ directory: pass the training run's --workdir, or train "
        f"first (python -m launch.train --config=... --workdir={workdir})")
  out = []
  for p in ([phase] if phase else PHASES):
    if _ckpt_dir(workdir, p).is_dir():
      ckpt = Checkpointer.reader(_ckpt_dir(workdir, p))
      out += [(p, s) for s in ckpt.all_steps()]
      ckpt.close()
  return out


def resolve_checkpoint(workdir, phase: str = "", step: int | None = None) -> tuple[str, int]:
  """(phase, step) to evaluate: the latest checkpoint (of the last phase holding one) by default,
  or `step` (of `phase`, or of the last phase holding that step)."""
  have = checkpoint_steps(workdir, phase)
  if not have:
    raise FileNotFoundError(
        f"no checkpoint in {pathlib.Path(workdir) / 'checkpoints'}"
        f"{'/' + phase if phase else ''}: train first, or fix --workdir"
        + (" / config.eval.phase" if phase else ""))
  if step is None:
    return have[-1]
  hits = [ps for ps in have if ps[1] == int(step)]
  if not hits:
    raise FileNotFoundError(f"no checkpoint for step {step} in {workdir}; available (phase, step): "
                            f"{have}; pass one of those steps to --step")
  return hits[-1]


def eval_dir_name(phase: str, step: int) -> str:
  return str(step) if phase == "rl" else f"{phase}_{step}"


def abstract_params(params):
  """ShapeDtypeStructs (with shardings) of a params tree, for restoring onto the same layout."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      params)


def restore_params(workdir, phase: str, step: int, abstract):
  """Params only of checkpoint (phase, step), placed as `abstract`'s shardings say."""
  ckpt = Checkpointer.reader(_ckpt_dir(workdir, phase))
  try:
    return ckpt.restore_params(step, abstract)
  finally:
    ckpt.close()


# ---- the evaluator --------------------------------------------------------------------------------


def _ints(spec: str) -> list[int]:
  try:
    return [int(x) for x in str(spec).split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"{spec!r}: give comma-separated integers, e.g. '1,2,4'") from None


def _cat(parts):
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _take(tree, idx):
  return jax.tree.map(lambda x: x[idx], tree)


def parse_env_specs(spec: str) -> list[tuple[str, dict]]:
  """"name:knob=value,knob=value;name2:..." -> [(name, knobs)]; values are JSON literals where
  they parse (1, 0.2, true), else strings. Empty -> []."""
  out = []
  for part in str(spec or "").split(";"):
    part = part.strip()
    if not part:
      continue
    name, _, knobs = part.partition(":")
    kw = {}
    for item in filter(None, (x.strip() for x in knobs.split(","))):
      k, eq, v = item.partition("=")
      if not eq or not k.strip():
        raise ValueError(f"config.eval.extra_envs={spec!r}: {item!r} is not knob=value; write "
                         "e.g. 'lookup:hops=1,distractor_entities=2;arithmetic:num_ops=2'")
      try:
        kw[k.strip()] = json.loads(v.strip())
      except json.JSONDecodeError:
        kw[k.strip()] = v.strip()
    out.append((name.strip(), kw))
  return out


class EnvSet:
  """One more environment whose oracle prefixes every policy is asked to act on (step-level
  quality by environment): its test tasks (the same fixed split training on it would use) and its
  compiled next-action program."""

  def __init__(self, config, name: str, knobs: dict, workdir, policy):
    from jaxagent.data.tasks import tasks_from_arrays
    from jaxagent.learners import trainer
    c = copy.deepcopy(config)
    with c.unlocked():
      c.env.name = name
      c.env.difficulty = ml_collections.ConfigDict(knobs)
    self.config = c
    self.label = name + ("(" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) + ")"
                         if knobs else "")
    self.env = trainer.make_env(c, policy.tokenizer)
    arrays = trainer.load_tasks(c, workdir, "test")
    if config.eval.num_tasks:
      arrays = {k: v[:config.eval.num_tasks] for k, v in arrays.items()}
    self.tasks = tasks_from_arrays(self.env, arrays)
    self.num_tasks = int(jax.tree.leaves(self.tasks)[0].shape[0])
    self.action_tokens = action_tokens(config, self.env)
    self.next_action_fn = step_quality.make_next_action_fn(policy.config, self.env,
                                                           self.action_tokens)


def action_tokens(config, env) -> int:
  """Tokens per turn of evaluation rollouts and next actions in `env`: eval.max_action_tokens
  (0: the environment's max_action_len), at most the environment's max_action_len (the report
  records the value used)."""
  return min(int(config.eval.max_action_tokens or env.max_action_len), int(env.max_action_len))


_ORACLES: dict = {}


def oracle_policy(env):
  """`(state, key) -> env.oracle_action(state)`, one function object per environment (the
  rollout cache is keyed by the function, so every evaluation shares one compiled program)."""
  hit = _ORACLES.get(id(env))
  if hit is None or hit[0] is not env:
    hit = (env, lambda state, key: env.oracle_action(state))
    _ORACLES[id(env)] = hit
  return hit[1]


class Evaluator:
  """The pieces one config's evaluations share: the policy skeleton (on the config's mesh), the
  environment, the test tasks and the compiled functions. Evaluate many checkpoints with one."""

  def __init__(self, config, workdir=None, test_arrays: dict | None = None):
    from jaxagent.data.tasks import tasks_from_arrays
    from jaxagent.learners import trainer
    e = config.eval
    if e.mode not in ("truncation", "rerun"):
      raise ValueError(f"config.eval.mode={e.mode!r}: use 'truncation' or 'rerun'")
    self.config = config
    self.t_max = int(e.max_turns)
    self.budgets = (_ints(e.rerun_budgets) if e.mode == "rerun"
                    else list(range(1, self.t_max + 1)))
    if not self.budgets or min(self.budgets) < 1 or max(self.budgets) > self.t_max:
      raise ValueError(f"config.eval.rerun_budgets={e.rerun_budgets!r}: give budgets in "
                       f"[1, config.eval.max_turns={self.t_max}]")
    if e.num_samples < 1 or e.tasks_per_batch < 1 or e.state_batch < 1 or e.score_batch < 1:
      raise ValueError("config.eval.num_samples, tasks_per_batch, state_batch and score_batch "
                       "must be >= 1")
    self.budget_visible = e.mode == "rerun" and bool(e.rerun_budget_visible)
    self.policy = trainer.load_policy(config)
    self.env = trainer.make_env(config, self.policy.tokenizer)
    self.action_tokens = action_tokens(config, self.env)
    if test_arrays is None:
      test_arrays = trainer.load_tasks(config, workdir, "test")
      if e.num_tasks:
        test_arrays = {k: v[:e.num_tasks] for k, v in test_arrays.items()}
    self.test_arrays = {k: np.asarray(v) for k, v in test_arrays.items()}
    self.tasks = tasks_from_arrays(self.env, self.test_arrays)
    self.num_tasks = int(jax.tree.leaves(self.tasks)[0].shape[0])
    self.abstract = abstract_params(self.policy.params)
    self.oracle = oracle_policy(self.env)
    self.next_action_fn = step_quality.make_next_action_fn(self.policy.config, self.env,
                                                           self.action_tokens)
    # Rollouts that several evaluations share (the base policy's and the oracle's), by key.
    self._memo: dict = {}
    # More environments for step-level quality by environment (config.eval.extra_envs).
    self.extra = [EnvSet(config, name, knobs, workdir if workdir is not None else
                         config.data.dir or ".", self.policy)
                  for name, knobs in parse_env_specs(e.get("extra_envs", ""))]

  def memo(self, key, compute):
    """compute() once per key for this evaluator (e.g. the base policy's runs, which every RL
    run of a study compares against)."""
    if key not in self._memo:
      self._memo[key] = compute()
    return self._memo[key]

  # -- rollouts -------------------------------------------------------------------------------

  def rollouts(self, params, key, budget: int, *, budget_visible: bool, temperature: float,
               group_size: int | None = None, forced_action=None,
               env_set: EnvSet | None = None) -> Trajectory:
    """Episodes of every test task (group_size each, default num_samples), as one numpy
    Trajectory with rows task-major (row = task * group_size + j) and task_id = the index of
    the task in the test split. Tasks go in fixed-size batches (the last padded with task 0),
    batch i with key fold_in(key, i), so one program serves every call with the same T_max
    (budgets are traced). forced_action: see `jaxagent.rollout.rollout` (e.g. `self.oracle`).
    env_set: one of `self.extra` instead of the config's environment and test tasks."""
    e = self.config.eval
    env, tasks, num_tasks, action_tokens = (
        (self.env, self.tasks, self.num_tasks, self.action_tokens) if env_set is None else
        (env_set.env, env_set.tasks, env_set.num_tasks, env_set.action_tokens))
    g = int(group_size or e.num_samples)
    per = min(int(e.tasks_per_batch), num_tasks)
    parts = []
    for i, start in enumerate(range(0, num_tasks, per)):
      idx = np.arange(start, start + per)
      real = idx < num_tasks
      idx = np.where(real, idx, 0)
      traj = rollout(self.policy, env, jax.random.fold_in(key, i), _take(tasks, idx),
                     g, budget, max_turns=self.t_max, max_action_tokens=action_tokens,
                     budget_visible=budget_visible, temperature=temperature, params=params,
                     forced_action=forced_action)
      traj = jax.device_get(traj)
      keep = np.repeat(real, g)
      traj = _take(traj, keep)
      traj = traj.replace(task_id=np.repeat(idx[real], g).astype(np.int32),
                          group_id=np.repeat(idx[real], g).astype(np.int32))
      parts.append(traj)
    return _cat(parts)

  def row_tasks(self, traj):
    """The task pytree of each row of `traj` (leaves [B, ...])."""
    return _take(self.tasks, jnp.asarray(traj.task_id))

  # -- step quality and recovery ----------------------------------------------------------------

  def reference_states(self, oracle_traj, base_traj, budget_visible: bool):
    """(reference states: oracle + base prefixes, error states of base_traj)."""
    e = self.config.eval
    kw = dict(budget_visible=budget_visible, max_states=int(e.max_reference_states),
              seed=int(e.seed), row_batch=int(e.tasks_per_batch) * int(e.num_samples))
    refs = step_quality.concat_states([
        step_quality.reference_states(self.env, self.row_tasks(oracle_traj), oracle_traj,
                                      oracle_traj.acted, source="oracle", **kw),
        step_quality.reference_states(self.env, self.row_tasks(base_traj), base_traj,
                                      base_traj.acted, source="base", **kw)])
    errs = recovery.controlled_error_states(self.env, self.row_tasks(base_traj), base_traj, **kw)
    # One prefix width for both sets: one compiled next-action program.
    width = max(refs.prefix.shape[1], errs.prefix.shape[1])
    return step_quality.pad_prefix(refs, width), step_quality.pad_prefix(errs, width)

  def act(self, params, states, key, next_action_fn=None) -> dict[str, dict[str, np.ndarray]]:
    """Next-action outcomes per decoding mode: {mode: step_quality.next_actions dict}.
    next_action_fn: an extra environment's (default: the config's environment's)."""
    e = self.config.eval
    temps = {"greedy": 0.0, "sampled": float(e.temperature)}
    return {m: step_quality.next_actions(next_action_fn or self.next_action_fn, params, states,
                                         jax.random.fold_in(key, i), temps[m], int(e.state_batch))
            for i, m in enumerate(step_quality.MODES)}

  def extra_states(self, params, key) -> list:
    """[(env_set, oracle reference states)] of every extra environment (computed once)."""
    def build():
      e = self.config.eval
      out = []
      for j, es in enumerate(self.extra):
        traj = self.rollouts(params, jax.random.fold_in(key, j), self.t_max, budget_visible=False,
                             temperature=float(e.temperature), group_size=1,
                             forced_action=oracle_policy(es.env), env_set=es)
        refs = step_quality.reference_states(
            es.env, _take(es.tasks, jnp.asarray(traj.task_id)), traj, traj.acted,
            source="oracle", budget_visible=False, max_states=int(e.max_reference_states),
            seed=int(e.seed), row_batch=int(e.tasks_per_batch))
        out.append((es, refs))
      return out
    return self.memo(("extra_states", self.t_max), build)

  def act_extra(self, params, key, extra_states) -> list[dict]:
    """Per extra environment: {mode: next-action outcomes} on its oracle reference states."""
    return [self.act(params, refs, key, es.next_action_fn) for es, refs in extra_states]

  def quality(self, outcomes, refs, extra_outcomes=(), extra_states=()) -> dict:
    """Step-quality rates overall, by source and by environment: the config's environment's
    reference states plus each extra environment's oracle states."""
    e = self.config.eval
    sources = [refs.source] + [r.source for _, r in extra_states]
    names = [np.full((len(refs),), self.env.name)] + [np.full((len(r),), es.label)
                                                     for es, r in extra_states]
    groups = {"source": np.concatenate(sources), "env": np.concatenate(names)}
    out = {}
    for m, o in outcomes.items():
      valid = np.concatenate([o["valid_call"]] + [x[m]["valid_call"] for x in extra_outcomes])
      match = np.concatenate([o["oracle_match"]] + [x[m]["oracle_match"] for x in extra_outcomes])
      out[m] = step_quality.quality_rates(valid, match, groups, num_bootstrap=int(e.num_bootstrap),
                                          confidence=float(e.confidence), seed=int(e.seed))
    return out

  def recovery_rates(self, outcomes, errs) -> dict:
    e = self.config.eval
    return {m: recovery.recovery_rates(errs.prev_error_kind, o["valid_call"], o["oracle_match"],
                                       num_bootstrap=int(e.num_bootstrap),
                                       confidence=float(e.confidence), seed=int(e.seed))
            for m, o in outcomes.items()}

  def on_policy(self, traj) -> dict:
    e = self.config.eval
    return recovery.on_policy_recovery(traj, num_bootstrap=int(e.num_bootstrap),
                                       confidence=float(e.confidence), seed=int(e.seed))

  def likelihood_rows(self, n: int) -> np.ndarray:
    """The rows (of n) the likelihood matrix scores: a seeded subset of
    config.eval.likelihood_trajectories rows (all when 0 or >= n), the same for every policy."""
    m = int(self.config.eval.get("likelihood_trajectories", 0))
    if m <= 0 or m >= n:
      return np.arange(n)
    rng = np.random.default_rng(int(self.config.eval.seed))
    return np.sort(rng.choice(n, size=m, replace=False))

  def likelihoods(self, trajs: dict, params: dict) -> dict:
    e = self.config.eval
    t, seen = {}, {}
    for k, v in trajs.items():
      if id(v) not in seen:     # one trajectory set under two labels stays one object
        rows = self.likelihood_rows(int(np.asarray(v.length).shape[0]))
        seen[id(v)] = {"tokens": np.asarray(v.tokens)[rows], "length": np.asarray(v.length)[rows],
                       "loss_mask": np.asarray(v.loss_mask)[rows]}
      t[k] = seen[id(v)]
    out = likelihood.cross_likelihood(self.policy.config, t, params,
                                      temperature=float(e.temperature),
                                      batch_size=int(e.score_batch))
    out["temperature"] = float(e.temperature)
    out["num_trajectories"] = {k: int(v["length"].shape[0]) for k, v in t.items()}
    return out


def _stats(traj) -> dict:
  return {k: float(v) for k, v in jax.device_get(trajectory_stats(traj)).items()}


def pass_grid(ev: Evaluator, success_by_t: np.ndarray) -> dict:
  """The Pass@(K,T) grid from success turns [len(budgets), tasks, n] (truncation mode: one
  T_max run, cut at every T; rerun mode: run j capped at budgets[j])."""
  e = ev.config.eval
  kw = dict(num_bootstrap=int(e.num_bootstrap), confidence=float(e.confidence), seed=int(e.seed))
  if e.mode == "truncation":
    g = pass_at_kt.pass_grid_truncation(success_by_t[-1], ev.t_max, **kw)
    return report.grid_json(g)
  counts = per_budget_counts(success_by_t, ev.budgets)
  g = pass_at_kt.pass_at_kt(counts, success_by_t.shape[2], **kw)
  return report.grid_json(g, ev.budgets)


def per_budget_counts(success_by_t: np.ndarray, budgets) -> np.ndarray:
  """c[tasks, j] = #episodes of run j solved within budgets[j] turns (rerun mode)."""
  b = np.asarray(budgets)[:, None, None]
  return (np.asarray(success_by_t) <= b).sum(axis=2).T


def per_task_pass1(mode: str, success_by_t: np.ndarray, budgets, t_max: int) -> np.ndarray:
  """Per-task Pass@(1,T) [tasks, len(budgets)] (the grid's K=1 row before averaging)."""
  st = np.asarray(success_by_t)
  if mode == "truncation":
    counts = pass_at_kt.solved_counts_truncation(st[-1], t_max)[:, np.asarray(budgets) - 1]
  else:
    counts = per_budget_counts(st, budgets)
  return pass_at_kt.per_task_pass(counts, st.shape[2], k_max=1)[:, 0, :]


# ---- one checkpoint -------------------------------------------------------------------------------


def _base_params(ev: Evaluator, config, workdir, phase: str):
  """(params, description, checkpoint) of the base policy of the run `config` trained in
  `workdir` (see config.eval.base_workdir); checkpoint = (resolved workdir, phase, step), or None
  for the model's own weights."""
  e, m = config.eval, config.model
  src = e.base_workdir or m.init_from
  if src:
    p, s = resolve_checkpoint(src)
    return (restore_params(src, p, s, ev.abstract), f"{src} ({p} step {s})",
            (pathlib.Path(src).resolve(), p, s))
  if phase == "rl":
    sft = [ps for ps in checkpoint_steps(workdir) if ps[0] == "sft"]
    if sft:
      p, s = sft[-1]
      return (restore_params(workdir, p, s, ev.abstract), f"this run's {p} step {s}",
              (pathlib.Path(workdir).resolve(), p, s))
  return ev.policy.params, f"the model's own weights ({m.path})", None


def _train_config(workdir, config) -> dict:
  """The training run's budget settings: <workdir>/config.json when the trainer wrote one."""
  path = pathlib.Path(workdir) / "config.json"
  if path.exists():
    try:
      rl = json.loads(path.read_text()).get("rl", {})
      return {"budget": rl.get("budget", config.rl.budget), "steps": rl.get("steps", config.rl.steps),
              "budget_visible": rl.get("budget_visible", config.rl.budget_visible)}
    except json.JSONDecodeError:
      pass
  return {"budget": config.rl.budget, "steps": config.rl.steps,
          "budget_visible": config.rl.budget_visible}


def _episodes_arrays(ev: Evaluator, success_by_t, traj, sq, sq_refs, rec, errs) -> dict:
  out = {"success_turn": success_by_t[-1].astype(np.int32),
         "success_turn_by_t": success_by_t.astype(np.int32),
         "budgets": np.asarray(ev.budgets if ev.config.eval.mode == "rerun" else [ev.t_max],
                               np.int32),
         "task_id": np.arange(ev.num_tasks, dtype=np.int32),
         "optimal_turns": np.asarray(traj.optimal_turns).reshape(ev.num_tasks, -1)[:, 0]}
  out.update({f"task/{k}": v for k, v in ev.test_arrays.items()})
  out.update({f"traj/{f}": np.asarray(getattr(traj, f)) for f in TRAJ_FIELDS})
  for who, modes in sq.items():
    for m, o in modes.items():
      out[f"sq/{who}/{m}/valid"] = o["valid_call"]
      out[f"sq/{who}/{m}/oracle"] = o["oracle_match"]
  out["sq/source"] = sq_refs.source.astype(str)
  for who, modes in rec.items():
    for m, o in modes.items():
      out[f"rec/{who}/{m}/valid"] = o["valid_call"]
      out[f"rec/{who}/{m}/oracle"] = o["oracle_match"]
  out["rec/kind"] = errs.prev_error_kind
  return out


def evaluate_checkpoint(config, workdir, step: int | None = None, *,
                        evaluator: Evaluator | None = None, phase: str | None = None) -> dict:
  """Evaluates one checkpoint of `workdir` (default: the latest) and writes its eval directory.

  Returns the report dict (also in report.json), with "dir" the output directory.
  Raises FileNotFoundError (naming the fix) when the workdir or step has no checkpoint.
  """
  workdir = pathlib.Path(workdir)
  e = config.eval
  phase, step = resolve_checkpoint(workdir, e.phase if phase is None else phase, step)
  ev = evaluator or Evaluator(config, workdir)
  t0 = time.perf_counter()
  timing: dict[str, float] = {}
  tick = [t0]

  def lap(name):
    now = time.perf_counter()
    timing[name] = now - tick[0]
    tick[0] = now

  params = restore_params(workdir, phase, step, ev.abstract)
  base_params, base_desc, base_ckpt = _base_params(ev, config, workdir, phase)
  # The checkpoint evaluated is the base itself (e.g. the study's base run): same params, so the
  # base's rollouts (same keys) are the policy's own.
  is_base = base_ckpt == (workdir.resolve(), phase, step)
  if is_base:
    base_params = params
  logging.info("evaluating %s %s step %d (base: %s)", workdir, phase, step, base_desc)
  key = jax.random.key(int(e.seed))
  k_roll, k_oracle, k_act = jax.random.split(key, 3)
  temp = float(e.temperature)

  # Pass@(K,T): the T_max run (truncation) or one run per budget (rerun), same keys for every T.
  if e.mode == "truncation":
    traj = ev.rollouts(params, k_roll, ev.t_max, budget_visible=False, temperature=temp)
    runs = [traj]
  else:
    runs = [ev.rollouts(params, k_roll, t, budget_visible=ev.budget_visible, temperature=temp)
            for t in ev.budgets]
    traj = runs[-1]
  n = int(e.num_samples)
  success_by_t = np.stack([np.asarray(r.success_turn).reshape(ev.num_tasks, n) for r in runs])
  grid = pass_grid(ev, success_by_t)
  lap("policy_rollouts")
  t_top = ev.t_max if e.mode == "truncation" else ev.budgets[-1]

  # The base policy's runs at the same budget and keys; the oracle's (forced) runs.
  base_traj = ev.memo(("base", base_desc, t_top), lambda: traj if is_base else ev.rollouts(
      base_params, k_roll, t_top, budget_visible=ev.budget_visible, temperature=temp))
  # Forced oracle actions: the transcript does not depend on the params rolled out with.
  oracle_traj = ev.memo(("oracle", t_top), lambda: ev.rollouts(
      params, k_oracle, t_top, budget_visible=ev.budget_visible, temperature=temp, group_size=1,
      forced_action=ev.oracle))
  lap("base_and_oracle_rollouts")
  refs, errs = ev.reference_states(oracle_traj, base_traj, ev.budget_visible)
  lap("replay")
  who = {POLICY: params, BASE: base_params}

  def both(fn):
    """fn(params) for the policy and the base; once when they are the same checkpoint."""
    out = {POLICY: fn(params)}
    out[BASE] = out[POLICY] if is_base else fn(base_params)
    return out

  sq_out = both(lambda p: ev.act(p, refs, k_act))
  rec_out = both(lambda p: ev.act(p, errs, k_act))
  extra = ev.extra_states(params, k_oracle)
  sq_extra = both(lambda p: ev.act_extra(p, k_act, extra))
  lap("next_actions")
  train = _train_config(workdir, config)
  rep = {
      "definitions": report.DEFINITIONS,
      "run": {"workdir": str(workdir), "phase": phase, "step": int(step), "env": ev.env.name,
              "difficulty": dict(config.env.difficulty), "train_budget": train["budget"],
              "train_budget_visible": train["budget_visible"], "rl_steps": train["steps"],
              "base": base_desc},
      "eval": {"mode": e.mode, "budgets": ev.budgets, "max_turns": ev.t_max,
               "budget_visible": ev.budget_visible, "num_samples": n,
               "num_tasks": ev.num_tasks, "temperature": temp, "seed": int(e.seed),
               "max_action_tokens": ev.action_tokens, "num_bootstrap": int(e.num_bootstrap),
               "confidence": float(e.confidence)},
      "pass_at_kt": grid,
      "stats": {POLICY: _stats(traj), BASE: _stats(base_traj), "oracle": _stats(oracle_traj)},
      "reference_states": {"oracle": int(np.sum(refs.source == "oracle")),
                           "base": int(np.sum(refs.source == "base")), "error": len(errs),
                           "extra_envs": {es.label: len(r) for es, r in extra}},
      "step_quality": {w: ev.quality(o, refs, sq_extra[w], extra) for w, o in sq_out.items()},
      "recovery": {"on_policy": {POLICY: ev.on_policy(traj), BASE: ev.on_policy(base_traj)},
                   "controlled": {w: ev.recovery_rates(o, errs) for w, o in rec_out.items()}},
  }
  lik = ev.likelihoods({POLICY: traj, BASE: base_traj}, who)
  lik.pop("per_trajectory")
  rep["likelihood"] = lik
  lap("likelihood")

  out = workdir / "eval" / eval_dir_name(phase, step)
  rep["dir"] = str(out)
  if not distributed.is_primary():          # every process computed it; one writes it
    return rep
  out.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(out / "episodes.npz",
                      **_episodes_arrays(ev, success_by_t, traj, sq_out, refs, rec_out, errs))
  rep["files"] = ["report.json", "report.md", "episodes.npz"] + _run_plots(
      rep, out, [k for k in _ints(e.curve_ks) if k <= n], f"{phase} step {step}")
  lap("write")
  rep["seconds"] = time.perf_counter() - t0
  rep["timing"] = timing
  report.write_json(rep, out / "report.json")
  (out / "report.md").write_text(report.run_markdown(report.to_jsonable(rep)))
  logging.info("wrote %s (%.0f s)", out, rep["seconds"])
  return rep


def _run_plots(rep: dict, out: pathlib.Path, ks: list[int], title: str) -> list[str]:
  """The PNG plots of one evaluation; returns their file names."""
  grid, lik, rec = rep["pass_at_kt"], rep["likelihood"], rep["recovery"]
  paths = [
      plots.pass_heatmap(grid, out / "pass_heatmap.png", f"Pass@(K,T), {title}"),
      plots.pass_curves(grid, ks, out / "pass_curves.png", f"Pass@(K,T) vs T, {title}"),
      plots.rate_bars(_quality_bars(rep["step_quality"]), out / "step_quality.png",
                      "Step-level action quality (reference states)"),
      plots.rate_bars(_recovery_bars(rec["controlled"]), out / "recovery.png",
                      "Controlled recovery: valid next call (sampled)"),
      plots.rate_bars({w: {k: v["valid"] for k, v in r.items()}
                       for w, r in rec["on_policy"].items()},
                      out / "recovery_on_policy.png", "On-policy recovery: valid next call"),
      plots.matrix(lik["mean"], lik["rows"], lik["cols"], out / "likelihood.png",
                   "Mean per-token log p (agent tokens)")]
  return [pathlib.Path(p).name for p in paths]


def _quality_bars(sq: dict) -> dict:
  """{policy/mode: {"valid"/"oracle" [source]: rate}} for `plots.rate_bars`."""
  out = {}
  for w, modes in sq.items():
    for m, q in modes.items():
      d = {"valid": q["overall"]["valid"], "oracle": q["overall"]["oracle"]}
      for s, r in q["source"].items():
        d[f"valid [{s}]"], d[f"oracle [{s}]"] = r["valid"], r["oracle"]
      out[f"{w}/{m}"] = d
  return out


def _recovery_bars(rec: dict, mode: str = "sampled") -> dict:
  return {w: {k: v["valid"] for k, v in modes[mode].items()} for w, modes in rec.items()}


def evaluate_all(config, workdir, *, evaluator: Evaluator | None = None) -> list[dict]:
  """Evaluates every kept checkpoint of the configured phase(s), oldest first."""
  have = checkpoint_steps(workdir, config.eval.phase)
  if not have:
    raise FileNotFoundError(f"no checkpoint under {pathlib.Path(workdir) / 'checkpoints'}: train "
                            "first, or fix --workdir")
  ev = evaluator or Evaluator(config, workdir)
  return [evaluate_checkpoint(config, workdir, s, evaluator=ev, phase=p) for p, s in have]


def watch(config, workdir, *, poll_seconds: float = 60.0, timeout_seconds: float = 3600.0,
          evaluator: Evaluator | None = None) -> list[dict]:
  """Evaluates each checkpoint of `workdir` without a report yet, as it lands.

  Polls every `poll_seconds`; returns when the training run has finished (<workdir>/DONE exists)
  and every kept checkpoint has a report, or when no new checkpoint appeared for
  `timeout_seconds`. A checkpoint deleted before its turn (max_to_keep) is skipped.
  """
  workdir = pathlib.Path(workdir)
  ev = evaluator
  done: list[dict] = []
  last_new = time.monotonic()
  while True:
    try:
      have = checkpoint_steps(workdir, config.eval.phase)
    except FileNotFoundError:
      have = []   # the training run has not written its first checkpoint yet
    todo = [(p, s) for p, s in have
            if not (workdir / "eval" / eval_dir_name(p, s) / "report.json").exists()]
    for p, s in todo:
      ev = ev or Evaluator(config, workdir)
      try:
        done.append(evaluate_checkpoint(config, workdir, s, evaluator=ev, phase=p))
      except FileNotFoundError as err:
        logging.warning("skipping %s step %d: %s", p, s, err)
      last_new = time.monotonic()
    if (workdir / "DONE").exists() and not todo:
      return done
    if time.monotonic() - last_new > timeout_seconds:
      logging.info("no new checkpoint for %.0f s; stopping", timeout_seconds)
      return done
    time.sleep(poll_seconds)


# ---- comparison -----------------------------------------------------------------------------------


def latest_eval(workdir) -> tuple[dict, dict]:
  """(report, episodes) of the newest evaluated checkpoint of `workdir` (by phase, then step)."""
  root = pathlib.Path(workdir) / "eval"
  found = []
  for p in sorted(root.glob("*/report.json")) if root.is_dir() else []:
    rep = json.loads(p.read_text())
    found.append(((PHASES.index(rep["run"]["phase"]), rep["run"]["step"]), p.parent, rep))
  if not found:
    raise FileNotFoundError(f"{workdir} has no evaluation (eval/*/report.json): run "
                            f"python -m launch.evaluate --config=... --workdir={workdir} first")
  _, d, rep = max(found, key=lambda x: x[0])
  with np.load(d / "episodes.npz", allow_pickle=False) as z:
    eps = {k: z[k] for k in z.files}
  return rep, eps


def _traj_from(eps: dict) -> Trajectory:
  return Trajectory(**{f: eps[f"traj/{f}"] for f in TRAJ_FIELDS})


def run_kind(label: str, base: str, train_budget: str) -> str:
  """"base" for the base label, "fixed" for a fixed:T training budget, else "mix"."""
  if label == base:
    return "base"
  return "fixed" if str(train_budget).startswith("fixed:") else "mix"


def compare(runs: dict[str, str], out_dir, config, base: str = "base") -> dict:
  """Side-by-side comparison of several runs' evaluations, with the claims of STUDY.md decided.

  Args:
    runs: label -> workdir, each evaluated before (`evaluate_checkpoint`); the newest evaluation
      of each is used, and its checkpoint's params are restored for the policy-level analyses.
    out_dir: where comparison.json, comparison.md and the plots go.
    config: the config the runs share (model, environment, eval settings).
    base: the label of the base policy's run.
  Every run must have been evaluated on the same test tasks with the same eval mode, budgets and
  n. Step quality and controlled recovery are recomputed for every policy on one common set of
  states: oracle prefixes and the base run's own evaluation trajectories (prefixes and error
  states); the cross log-likelihood matrix scores each run's stored trajectories under every run.
  """
  if base not in runs:
    raise ValueError(f"no run labelled {base!r} among {list(runs)}; label the base run "
                     f"--run {base}=WORKDIR or pass --base=LABEL")
  if len(runs) < 2:
    raise ValueError("compare needs at least two runs (--run label=workdir, twice or more)")
  out = pathlib.Path(out_dir)
  e = config.eval
  evals = {lab: latest_eval(w) for lab, w in runs.items()}
  rep0, eps0 = evals[base]
  for lab, (rep, eps) in evals.items():
    same = (rep["eval"]["mode"] == rep0["eval"]["mode"]
            and rep["eval"]["budgets"] == rep0["eval"]["budgets"]
            and rep["eval"]["num_samples"] == rep0["eval"]["num_samples"]
            and set(eps) >= {k for k in eps0 if k.startswith("task/")}
            and all(np.array_equal(eps[k], eps0[k]) for k in eps0 if k.startswith("task/")))
    if not same:
      raise ValueError(f"run {lab!r} was evaluated on other tasks or settings than {base!r}; "
                       "evaluate every run with the same config (data, env and eval sections)")
  test_arrays = {k[len("task/"):]: v for k, v in eps0.items() if k.startswith("task/")}
  ev = Evaluator(config, test_arrays=test_arrays)
  mode, budgets = rep0["eval"]["mode"], rep0["eval"]["budgets"]
  vis = bool(rep0["eval"]["budget_visible"])
  t_top = max(budgets)
  params = {lab: restore_params(runs[lab], rep["run"]["phase"], rep["run"]["step"], ev.abstract)
            for lab, (rep, _) in evals.items()}
  trajs = {lab: _traj_from(eps) for lab, (_, eps) in evals.items()}
  kinds = {lab: run_kind(lab, base, rep["run"]["train_budget"]) for lab, (rep, _) in evals.items()}
  rl = [lab for lab in runs if lab != base]
  fixed = [lab for lab in rl if kinds[lab] == "fixed"]
  mix = [lab for lab in rl if kinds[lab] == "mix"]

  key = jax.random.key(int(e.seed))
  _, k_oracle, k_act = jax.random.split(key, 3)
  oracle_traj = ev.rollouts(params[base], k_oracle, t_top, budget_visible=vis,
                            temperature=float(e.temperature), group_size=1,
                            forced_action=ev.oracle)
  refs, errs = ev.reference_states(oracle_traj, trajs[base], vis)
  sq_out = {lab: ev.act(p, refs, k_act) for lab, p in params.items()}
  rec_out = {lab: ev.act(p, errs, k_act) for lab, p in params.items()}
  extra = ev.extra_states(params[base], k_oracle)
  sq_extra = {lab: ev.act_extra(p, k_act, extra) for lab, p in params.items()}
  lik = ev.likelihoods(trajs, params)
  per_traj = lik.pop("per_trajectory")

  # Claims.
  nb, conf, seed = int(e.num_bootstrap), float(e.confidence), int(e.seed)
  t_values = list(range(1, t_top + 1)) if mode == "truncation" else list(budgets)
  pass1 = {lab: per_task_pass1(mode, eps["success_turn_by_t"], t_values, t_top)
           for lab, (_, eps) in evals.items()}
  t_tight, t_gen = report.tight_generous(t_values, eps0["optimal_turns"])
  w_tasks = report.resample_weights(ev.num_tasks, nb, np.random.default_rng(seed))
  step_v = {lab: o["sampled"]["valid_call"] for lab, o in sq_out.items()}
  rec_v = {lab: o["sampled"]["valid_call"] for lab, o in rec_out.items()}
  claims = {
      1: report.finish_claim(1, report.claim_budget_gain(pass1, t_values, t_tight, t_gen, base,
                                                         rl, w_tasks, conf)),
      2: report.finish_claim(2, report.claim_recovery_vs_step(step_v, rec_v, base, fixed, nb,
                                                              conf, seed),
                             "" if fixed else "no fixed-T RL run"),
      3: report.finish_claim(3, report.claim_budgetmix(pass1, t_values, t_tight, t_gen, step_v,
                                                       base, mix, fixed, w_tasks, nb, conf, seed),
                             "" if mix else "no BudgetMix run"),
      4: report.finish_claim(4, report.claim_likelihood(per_traj, base, rl, nb, conf, seed)),
      5: report.finish_claim(5, report.claim_recovery(rec_v, base, rl, nb, conf, seed)),
  }
  ks = [k for k in _ints(e.curve_ks) if k <= rep0["eval"]["num_samples"]]
  comp = {
      "definitions": report.DEFINITIONS,
      "runs": {lab: {"workdir": str(runs[lab]), "phase": rep["run"]["phase"],
                     "step": rep["run"]["step"], "train_budget": rep["run"]["train_budget"],
                     "rl_steps": rep["run"]["rl_steps"], "kind": kinds[lab]}
               for lab, (rep, _) in evals.items()},
      "base": base,
      "eval": {k: rep0["eval"][k] for k in ("mode", "budgets", "budget_visible", "num_samples",
                                            "num_tasks", "temperature")},
      "curve_ks": ks,
      "claims": {str(k): v for k, v in claims.items()},
      "pass_at_kt": {lab: rep["pass_at_kt"] for lab, (rep, _) in evals.items()},
      "reference_states": {"oracle": int(np.sum(refs.source == "oracle")),
                           "base": int(np.sum(refs.source == "base")), "error": len(errs),
                           "extra_envs": {es.label: len(r) for es, r in extra}},
      "step_quality": {lab: ev.quality(o, refs, sq_extra[lab], extra)
                       for lab, o in sq_out.items()},
      "recovery": {"controlled": {lab: ev.recovery_rates(o, errs) for lab, o in rec_out.items()},
                   "on_policy": {lab: ev.on_policy(t) for lab, t in trajs.items()}},
      "likelihood": lik,
  }
  comp["dir"] = str(out)
  if not distributed.is_primary():          # every process computed it; one writes it
    return comp
  out.mkdir(parents=True, exist_ok=True)
  files = ["comparison.json", "comparison.md"]
  for k in sorted({ks[0], ks[-1]} if ks else set()):
    files.append(pathlib.Path(plots.pass_curves_runs(comp["pass_at_kt"], k,
                                                     out / f"pass_curves_k{k}.png")).name)
  for lab, g in comp["pass_at_kt"].items():
    files.append(pathlib.Path(plots.pass_heatmap(g, out / f"pass_heatmap_{lab}.png",
                                                 f"Pass@(K,T): {lab}")).name)
  files.append(pathlib.Path(plots.rate_bars(
      {lab: {"valid": q["sampled"]["overall"]["valid"], "oracle": q["sampled"]["overall"]["oracle"],
             "valid (greedy)": q["greedy"]["overall"]["valid"],
             "oracle (greedy)": q["greedy"]["overall"]["oracle"]}
       for lab, q in comp["step_quality"].items()},
      out / "step_quality.png", "Step-level action quality (common reference states)")).name)
  files.append(pathlib.Path(plots.rate_bars(
      _recovery_bars(comp["recovery"]["controlled"]), out / "recovery.png",
      "Controlled recovery: valid next call (sampled)")).name)
  files.append(pathlib.Path(plots.matrix(lik["sum"], lik["rows"], lik["cols"],
                                         out / "likelihood.png",
                                         "Mean sum log p of agent tokens")).name)
  comp["files"] = files
  report.write_json(comp, out / "comparison.json")
  (out / "comparison.md").write_text(report.comparison_markdown(report.to_jsonable(comp)))
  return comp
