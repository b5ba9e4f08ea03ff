"""`Evaluator`: what one config's evaluations share, and the analyses every evaluation runs.

    ev = Evaluator(config, workdir)          # policy skeleton, env, test tasks, compiled programs
    traj = ev.rollouts(params, key, ev.max_turns, budget_visible=False, temperature=1.0)
    block = ev.policy_analyses({"rl": p1, "base": p0}, oracle_traj, base_traj, k_oracle, k_act)

Evaluation uses the fixed, seeded test split (`config.data`) and keys from `config.eval.seed`, so
two evaluations of the same params produce the same episodes. One `Evaluator` serves many
checkpoints (`jaxagent.eval.checkpoints`) and the comparison of runs (`jaxagent.eval.compare`);
its `Programs` (`jaxagent.runs.programs`) hold every compiled function it uses.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxagent.data.tasks import tasks_from_arrays
from jaxagent.eval import likelihood, pass_at_kt, recovery, report, step_quality
from jaxagent.models import decoder
from jaxagent.models.policy import param_shardings
from jaxagent.rollout.stats import trajectory_stats
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.runs import config as sections
from jaxagent.runs import adapters, layout, setup
from jaxagent.runs.programs import Programs, programs_for

TRAJ_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory))


def _cat(parts):
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _take(tree, idx):
  return jax.tree.map(lambda x: x[idx], tree)


def action_tokens(e: sections.EvalConfig, env) -> int:
  """Tokens per turn of evaluation rollouts and next actions in `env`: eval.max_action_tokens
  (0: the environment's max_action_len), at most the environment's max_action_len (the report
  records the value used)."""
  return min(int(e.max_action_tokens or env.max_action_len), int(env.max_action_len))


def trajectory_summary(traj) -> dict:
  """`trajectory_stats` of a batch as plain floats."""
  return {k: float(v) for k, v in jax.device_get(trajectory_stats(traj)).items()}


class EnvSet:
  """One environment whose test tasks the evaluator rolls out: its programs (compiled functions)
  and fixed test tasks (the same split training on it would use), and its tokens per turn."""

  def __init__(self, config, model_config, tokenizer, workdir, test_arrays: dict | None = None,
               programs: Programs | None = None):
    e = sections.eval_config(config)
    self.config = config
    self.programs = programs_for(config, model_config, tokenizer, programs)
    self.env = self.programs.env
    if test_arrays is None:
      test_arrays = setup.load_tasks(sections.data_config(config), sections.env_config(config),
                                     workdir, "test")
      if e.num_tasks:
        test_arrays = {k: v[:e.num_tasks] for k, v in test_arrays.items()}
    self.test_arrays = {k: np.asarray(v) for k, v in test_arrays.items()}
    self.tasks = tasks_from_arrays(self.env, self.test_arrays)
    self.num_tasks = int(jax.tree.leaves(self.tasks)[0].shape[0])
    self.action_tokens = action_tokens(e, self.env)
    knobs = dict(config.env.difficulty)
    self.label = config.env.name + ("(" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items()))
                                    + ")" if knobs else "")

  def next_action_fn(self):
    return self.programs.next_action(self.action_tokens)


def _extra_config(config, name: str, knobs: dict):
  c = copy.deepcopy(config)
  with c.unlocked():
    c.env.name = name
    c.env.difficulty = ml_collections.ConfigDict(knobs)
  return c


@dataclasses.dataclass
class PolicyAnalyses:
  """Step-level quality and controlled recovery of several policies on one common set of states
  (`Evaluator.policy_analyses`): the raw outcomes and the report's sections."""
  refs: step_quality.ReferenceStates     # oracle + base prefixes (not error states)
  errs: step_quality.ReferenceStates     # error states of the base's trajectories
  step_quality: dict                     # label -> {mode: next-action outcomes} on refs
  recovery: dict                         # label -> {mode: next-action outcomes} on errs
  report: dict                           # "reference_states", "step_quality", "controlled"
  sweep: dict = dataclasses.field(default_factory=dict)   # label -> {T: outcomes on refs}


class Evaluator:
  """The pieces one config's evaluations share: the policy skeleton (on the config's mesh), the
  environment, the test tasks and the compiled functions. Evaluate many checkpoints with one."""

  def __init__(self, config, workdir=None, test_arrays: dict | None = None,
               programs: Programs | None = None):
    self.config = config
    self.e = e = sections.eval_config(config)
    self.max_turns = e.max_turns
    self.budgets = list(e.budgets)
    self.budget_visible = e.budget_visible
    # The model's skeleton and mesh: its weights are read only when evaluated themselves
    # (`policy`); checkpoints restore onto `abstract`.
    self.model_config, self.tokenizer = setup.load_skeleton(config)
    self.mesh = setup.run_mesh(config)
    self._policy = None
    root = workdir if workdir is not None else config.data.dir or "."
    self.main = EnvSet(config, self.model_config, self.tokenizer, root, test_arrays, programs)
    self.programs, self.env = self.main.programs, self.main.env
    self.action_tokens, self.test_arrays = self.main.action_tokens, self.main.test_arrays
    self.tasks, self.num_tasks = self.main.tasks, self.main.num_tasks
    setup.check_context(self.model_config, self.env, self.max_turns, self.action_tokens,
                        "config.eval.max_turns / config.eval.max_action_tokens")
    self.abstract = layout.placed(decoder.abstract_params(self.model_config)[1],
                                  param_shardings(self.model_config, self.mesh))
    # The base of adapter (LoRA) checkpoints: config.model.init_from's full checkpoint, else the
    # model's own weights; read on the first adapter checkpoint restored (`restore`).
    self.lora_base = adapters.base_loader(config.model.init_from, lambda: self.policy.params,
                                          self.abstract)
    # Rollouts that several evaluations share (the base policy's and the oracle's), by key.
    self._memo: dict = {}
    # More environments for step-level quality by environment (config.eval.extra_envs).
    self.extra = [EnvSet(_extra_config(config, name, knobs), self.model_config, self.tokenizer,
                         root)
                  for name, knobs in e.env_specs()]

  @property
  def policy(self):
    """The config's model with its own weights, read (or initialised) on first use."""
    if self._policy is None:
      self._policy = setup.load_policy(self.config)
    return self._policy

  def restore(self, workdir, phase: str, step: int) -> dict:
    """The policy params of checkpoint (phase, step) of `workdir`, placed on the config's mesh:
    a full checkpoint's params, or for an adapter (LoRA) checkpoint the base with its adapters
    attached (`jaxagent.runs.adapters.restore_policy`; another base is refused)."""
    return adapters.restore_policy(workdir, phase, step, self.abstract, self.model_config,
                                   self.lora_base, self.mesh)

  def memo(self, key, compute):
    """compute() once per key for this evaluator (e.g. the base policy's runs, which every RL
    run of a study compares against)."""
    if key not in self._memo:
      self._memo[key] = compute()
    return self._memo[key]

  # -- rollouts -------------------------------------------------------------------------------

  def rollouts(self, params, key, budget: int, *, budget_visible: bool, temperature: float,
               group_size: int | None = None, oracle: bool = False, forced_action=None,
               env_set: EnvSet | None = None) -> Trajectory:
    """Episodes of every test task (group_size each, default num_samples), as one numpy
    Trajectory with rows task-major (row = task * group_size + j) and task_id = the index of
    the task in the test split. Tasks go in fixed-size batches (the last padded with task 0),
    batch i with key fold_in(key, i), so one program serves every call with the same T_max
    (budgets are traced). oracle: the environment's oracle acts (forced), not the policy;
    forced_action: any other `(env_state, key) -> TokenBuffer` to force (one program per
    function object). env_set: one of `self.extra` instead of the config's environment and test
    tasks."""
    es = env_set or self.main
    g = int(group_size or self.e.num_samples)
    per = min(self.e.tasks_per_batch, es.num_tasks)
    parts = []
    for i, start in enumerate(range(0, es.num_tasks, per)):
      idx = np.arange(start, start + per)
      real = idx < es.num_tasks
      idx = np.where(real, idx, 0)
      traj = es.programs.rollouts(
          params, jax.random.fold_in(key, i), _take(es.tasks, idx), g, budget,
          mesh=self.mesh, max_turns=self.max_turns, max_action_tokens=es.action_tokens,
          budget_visible=budget_visible, temperature=temperature,
          forced_action=es.programs.oracle if oracle else forced_action)
      traj = jax.device_get(traj)
      keep = np.repeat(real, g)
      traj = _take(traj, keep)
      traj = traj.replace(task_id=np.repeat(idx[real], g).astype(np.int32),
                          group_id=np.repeat(idx[real], g).astype(np.int32))
      parts.append(traj)
    return _cat(parts)

  def row_tasks(self, traj, env_set: EnvSet | None = None):
    """The task pytree of each row of `traj` (leaves [B, ...])."""
    return _take((env_set or self.main).tasks, jnp.asarray(traj.task_id))

  # -- step quality and recovery ----------------------------------------------------------------

  def _state_kw(self, rows_per_batch: int, max_states: int | None = None) -> dict:
    return dict(max_states=self.e.max_reference_states if max_states is None else max_states,
                seed=self.e.seed, row_batch=rows_per_batch)

  def reference_states(self, oracle_traj, base_traj, budget_visible: bool):
    """(reference states: oracle + base prefixes, error states of base_traj)."""
    replay = self.programs.replay(budget_visible)
    kw = self._state_kw(self.e.tasks_per_batch * self.e.num_samples)
    base_tasks = self.row_tasks(base_traj)
    # The base's trajectories are replayed once, for its reference and its error states.
    replayed = step_quality.replay_env_states(replay, base_tasks, base_traj, kw["row_batch"])
    refs = step_quality.concat_states([
        step_quality.reference_states(replay, self.row_tasks(oracle_traj), oracle_traj,
                                      oracle_traj.acted, source="oracle", **kw),
        step_quality.reference_states(replay, base_tasks, base_traj, base_traj.acted,
                                      source="base", replayed=replayed, **kw)])
    errs = recovery.controlled_error_states(
        replay, base_tasks, base_traj, replayed=replayed,
        **self._state_kw(self.e.tasks_per_batch * self.e.num_samples, self.e.max_error_states))
    # One prefix width for both sets: one compiled next-action program.
    width = max(refs.prefix.shape[1], errs.prefix.shape[1])
    return step_quality.pad_prefix(refs, width), step_quality.pad_prefix(errs, width)

  def act(self, params, states, key, env_set: EnvSet | None = None,
          modes: tuple[str, ...] = step_quality.MODES) -> dict[str, dict]:
    """Next-action outcomes per decoding mode: {mode: step_quality.next_actions dict}, in the
    config's environment or `env_set`'s (one prefill per batch of states for all modes)."""
    return self.act_sweep(params, states, key, (), env_set, modes)[0]

  def act_sweep(self, params, states, key, temperatures, env_set: EnvSet | None = None,
                modes: tuple[str, ...] = step_quality.MODES) -> tuple[dict, dict]:
    """({mode: outcomes} as `act`, {T: outcomes} as `act_at` for each of `temperatures`), each
    batch of states prefilled once for all of them (`step_quality.next_actions_at`): mode m
    decodes with fold_in(key, MODES.index(m)), every temperature with the sampled mode's key."""
    temps = {"greedy": 0.0, "sampled": self.e.temperature}
    sampled = jax.random.fold_in(key, step_quality.MODES.index("sampled"))
    decodings = ([(jax.random.fold_in(key, step_quality.MODES.index(m)), temps[m]) for m in modes]
                 + [(sampled, float(t)) for t in temperatures])
    got = step_quality.next_actions_at((env_set or self.main).next_action_fn(), params, states,
                                       decodings, self.e.state_batch)
    return dict(zip(modes, got)), dict(zip(temperatures, got[len(modes):]))

  def act_at(self, params, states, key, temperature: float) -> dict:
    """Next-action outcomes (`step_quality.next_actions`) at any temperature, with the sampled
    mode's key (the sampled mode's outcomes at config.eval.temperature, the greedy mode's at 0):
    the sharpening control's sweep, through the one compiled next-action program."""
    return step_quality.next_actions(self.main.next_action_fn(), params, states,
                                     jax.random.fold_in(key, step_quality.MODES.index("sampled")),
                                     temperature, self.e.state_batch)

  def pass_rollouts(self, params, key, temperature: float):
    """(T_max trajectories, success turns [len(budgets), tasks, n]) of the Pass@(K,T)
    evaluation: the T_max run (truncation mode) or one run per budget (rerun mode), the same
    key for every T."""
    if self.e.mode == "truncation":
      runs = [self.rollouts(params, key, self.max_turns, budget_visible=False,
                            temperature=temperature)]
    else:
      runs = [self.rollouts(params, key, t, budget_visible=self.budget_visible,
                            temperature=temperature) for t in self.budgets]
    n = self.e.num_samples
    success = np.stack([np.asarray(r.success_turn).reshape(self.num_tasks, n) for r in runs])
    return runs[-1], success

  def extra_states(self, params, key) -> list:
    """[(env_set, oracle reference states)] of every extra environment (computed once)."""
    def build():
      out = []
      for j, es in enumerate(self.extra):
        traj = self.rollouts(params, jax.random.fold_in(key, j), self.max_turns,
                             budget_visible=False, temperature=self.e.temperature, group_size=1,
                             oracle=True, env_set=es)
        refs = step_quality.reference_states(
            es.programs.replay(False), self.row_tasks(traj, es), traj, traj.acted,
            source="oracle", **self._state_kw(self.e.tasks_per_batch))
        out.append((es, refs))
      return out
    return self.memo(("extra_states", self.max_turns), build)

  def act_extra(self, params, key, extra_states) -> list[dict]:
    """Per extra environment: {mode: next-action outcomes} on its oracle reference states."""
    return [self.act(params, refs, key, es) for es, refs in extra_states]

  def quality(self, outcomes, refs, extra_outcomes=(), extra_states=()) -> dict:
    """Step-quality rates overall, by source and by environment: the config's environment's
    reference states plus each extra environment's oracle states."""
    sources = [refs.source] + [r.source for _, r in extra_states]
    # Extra environments' tasks are other tasks: offset so no two environments share an id.
    tasks, offset = [refs.task], self.num_tasks
    for es, r in extra_states:
      tasks.append(r.task + offset)
      offset += es.num_tasks
    task = np.concatenate(tasks)
    names = [np.full((len(refs),), self.env.name)] + [np.full((len(r),), es.label)
                                                     for es, r in extra_states]
    after = [np.where(refs.prev_error_kind != 0, "after an error", "no error")] + [
        np.where(r.prev_error_kind != 0, "after an error", "no error") for _, r in extra_states]
    groups = {"source": np.concatenate(sources), "env": np.concatenate(names),
              "state": np.concatenate(after)}
    out = {}
    for m, o in outcomes.items():
      cat = {k: np.concatenate([o[k]] + [x[m][k] for x in extra_outcomes])
             for k in ("valid_call", "oracle_match", "oracle_logp", "entropy", "scored")}
      out[m] = step_quality.quality_rates(
          cat["valid_call"], cat["oracle_match"], task, groups, **self._boot(),
          prob=step_quality.oracle_prob(cat), entropy=cat["entropy"], scored=cat["scored"])
    return out

  def _boot(self) -> dict:
    return dict(num_bootstrap=self.e.num_bootstrap, confidence=self.e.confidence, seed=self.e.seed)

  def recovery_rates(self, outcomes, errs) -> dict:
    return {m: recovery.recovery_rates(errs.prev_error_kind, o["valid_call"], o["oracle_match"],
                                       errs.task, **self._boot())
            for m, o in outcomes.items()}

  def on_policy(self, traj) -> dict:
    return recovery.on_policy_recovery(traj, **self._boot())

  def policy_analyses(self, params: dict, oracle_traj, base_traj, k_oracle, k_act,
                      budget_visible: bool, sweep: dict | None = None) -> PolicyAnalyses:
    """Step-level quality and controlled recovery of every policy in `params` (label -> params)
    on one common set of states: oracle prefixes and base_traj's prefixes (reference states),
    base_traj's error states, and each extra environment's oracle prefixes. Labels holding the
    same params object are computed once. sweep: label -> temperatures at which that policy also
    acts on the reference states (`act_at`'s outcomes, in PolicyAnalyses.sweep; the sharpening
    control's bases), from the same prefills as its greedy and sampled actions."""
    refs, errs = self.reference_states(oracle_traj, base_traj, budget_visible)
    extra = self.extra_states(next(iter(params.values())), k_oracle)
    sweep = sweep or {}
    temps: dict = {}
    for lab, ts in sweep.items():
      temps.setdefault(id(params[lab]), set()).update(float(t) for t in ts)
    done: dict = {}

    def once(p):
      if id(p) not in done:
        # Error states: sampled only. Recovery is a property of the policy's distribution (the
        # claims use sampled actions), and the error states are most of the states.
        modes, at = self.act_sweep(p, refs, k_act, tuple(sorted(temps.get(id(p), ()))))
        done[id(p)] = (modes, self.act(p, errs, k_act, modes=("sampled",)),
                       self.act_extra(p, k_act, extra), at)
      return done[id(p)]

    outs = {lab: once(p) for lab, p in params.items()}
    sections_ = {
        "reference_states": {"oracle": int(np.sum(refs.source == "oracle")),
                             "base": int(np.sum(refs.source == "base")), "error": len(errs),
                             "extra_envs": {es.label: len(r) for es, r in extra}},
        "step_quality": {lab: self.quality(o[0], refs, o[2], extra) for lab, o in outs.items()},
        "controlled": {lab: self.recovery_rates(o[1], errs) for lab, o in outs.items()},
    }
    return PolicyAnalyses(refs=refs, errs=errs,
                          step_quality={lab: o[0] for lab, o in outs.items()},
                          recovery={lab: o[1] for lab, o in outs.items()}, report=sections_,
                          sweep={lab: {float(t): outs[lab][3][float(t)] for t in ts}
                                 for lab, ts in sweep.items()})

  # -- likelihoods ------------------------------------------------------------------------------

  def likelihood_rows(self, n: int) -> np.ndarray:
    """The rows (of n) the likelihood matrix scores: a seeded subset of
    config.eval.likelihood_trajectories rows (all when 0 or >= n), the same for every policy."""
    m = self.e.likelihood_trajectories
    if m <= 0 or m >= n:
      return np.arange(n)
    rng = np.random.default_rng(self.e.seed)
    return np.sort(rng.choice(n, size=m, replace=False))

  def likelihoods(self, trajs: dict, params: dict) -> dict:
    t, seen = {}, {}
    for k, v in trajs.items():
      if id(v) not in seen:     # one trajectory set under two labels stays one object
        rows = self.likelihood_rows(int(np.asarray(v.length).shape[0]))
        seen[id(v)] = {"tokens": np.asarray(v.tokens)[rows], "length": np.asarray(v.length)[rows],
                       "loss_mask": np.asarray(v.loss_mask)[rows]}
      t[k] = seen[id(v)]
    out = likelihood.cross_likelihood(self.model_config, t, params,
                                      temperature=self.e.temperature,
                                      batch_size=self.e.score_batch)
    out["temperature"] = self.e.temperature
    out["num_trajectories"] = {k: int(v["length"].shape[0]) for k, v in t.items()}
    return out

  # -- Pass@(K,T) -------------------------------------------------------------------------------

  def pass_grid(self, success_by_t: np.ndarray) -> dict:
    """The Pass@(K,T) grid from success turns [len(budgets), tasks, n] (truncation mode: one
    T_max run, cut at every T; rerun mode: run j capped at budgets[j])."""
    if self.e.mode == "truncation":
      g = pass_at_kt.pass_grid_truncation(success_by_t[-1], self.max_turns, **self._boot())
      return report.grid_json(g)
    counts = pass_at_kt.per_budget_counts(success_by_t, self.budgets)
    g = pass_at_kt.pass_at_kt(counts, success_by_t.shape[2], **self._boot())
    return report.grid_json(g, self.budgets)
