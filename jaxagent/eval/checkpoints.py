"""The checkpoint-evaluation job, as library functions.

    evaluate_checkpoint(config, workdir, step=None)          # one checkpoint (default: the latest)
    evaluate_all(config, workdir)                            # every kept checkpoint
    watch(config, workdir, poll_seconds, timeout_seconds)    # each new checkpoint as it lands

Checkpoints are `<workdir>/checkpoints/<phase>/<step>` (`jaxagent.runs.layout`); only the params
are restored (orbax partial restore), placed with the config's mesh shardings. An adapter (LoRA)
checkpoint is restored as the base with its adapters (`Evaluator.restore`).

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

import json
import pathlib
import time

import jax
import numpy as np
from absl import logging

from jaxagent.eval import plots, report
from jaxagent.learners import credit
from jaxagent.eval.evaluator import TRAJ_FIELDS, Evaluator, trajectory_summary
from jaxagent.rollout.budget import Budget
from jaxagent.runs import config as sections
from jaxagent.runs import layout
from jaxagent.runs.lock import WorkdirLock
from jaxagent.runs.pinning import check_pinned
from jaxagent.sharding import distributed

POLICY, BASE = "policy", "base"


def _base_params(ev: Evaluator, config, workdir, phase: str):
  """(params, description, checkpoint) of the base policy of the run `config` trained in
  `workdir` (see config.eval.base_workdir); checkpoint = (resolved workdir, phase, step), or None
  for the model's own weights."""
  src = config.eval.base_workdir or config.model.init_from
  if src:
    p, s = layout.resolve_checkpoint(src)
    return (ev.restore(src, p, s), f"{src} ({p} step {s})",
            (pathlib.Path(src).resolve(), p, s))
  if phase == "rl":
    sft = [ps for ps in layout.checkpoint_steps(workdir) if ps[0] == "sft"]
    if sft:
      p, s = sft[-1]
      return (ev.restore(workdir, p, s), f"this run's {p} step {s}",
              (pathlib.Path(workdir).resolve(), p, s))
  return ev.policy.params, f"the model's own weights ({config.model.path})", None


def _train_config(workdir, config) -> dict:
  """The training run's budget settings: <workdir>/config.json when training wrote one (else
  this config's), with the budget's arm (`Budget.arm`: fixed, mix or schedule) and its credit
  assignment (`learners.credit.describe`: "" for episode-level)."""
  rl = config.rl
  found = {"budget": rl.budget, "budget_per": rl.budget_per, "steps": rl.steps,
           "budget_visible": rl.budget_visible, "learner": dict(rl.learner.items())}
  seed = config.seed
  path = pathlib.Path(workdir) / "config.json"
  if path.exists():
    try:
      whole = json.loads(path.read_text())
    except json.JSONDecodeError:
      whole = {}
    written = whole.get("rl", {})
    found.update({k: written[k] for k in found if k in written})
    seed = whole.get("seed", seed)
  found["seed"] = seed
  found["arm"] = Budget.parse(found["budget"], per=found["budget_per"]).arm
  found["credit"] = credit.describe(found.pop("learner"))
  return found


def _episodes_arrays(ev: Evaluator, success_by_t, traj, analyses=None) -> dict:
  out = {"success_turn": success_by_t[-1].astype(np.int32),
         "success_turn_by_t": success_by_t.astype(np.int32),
         "budgets": np.asarray(ev.budgets if ev.e.mode == "rerun" else [ev.max_turns], np.int32),
         "task_id": np.arange(ev.num_tasks, dtype=np.int32),
         "optimal_turns": np.asarray(traj.optimal_turns).reshape(ev.num_tasks, -1)[:, 0]}
  out.update({f"task/{k}": v for k, v in ev.test_arrays.items()})
  out.update({f"traj/{f}": np.asarray(getattr(traj, f)) for f in TRAJ_FIELDS})
  if analyses is None:
    return out
  for prefix, outcomes in (("sq", analyses.step_quality), ("rec", analyses.recovery)):
    for who, modes in outcomes.items():
      for m, o in modes.items():
        out[f"{prefix}/{who}/{m}/valid"] = o["valid_call"]
        out[f"{prefix}/{who}/{m}/oracle"] = o["oracle_match"]
  out["sq/source"] = analyses.refs.source.astype(str)
  out["rec/kind"] = analyses.errs.prev_error_kind
  return out


def _eval_lock(workdir) -> WorkdirLock:
  """One evaluator writes a workdir's eval/ at a time (a trainer may run beside it)."""
  return WorkdirLock(workdir, "eval", enabled=distributed.is_primary())


def evaluate_checkpoint(config, workdir, step: int | None = None, *,
                        evaluator: Evaluator | None = None, phase: str | None = None,
                        analyses: bool = True) -> dict:
  """Evaluates one checkpoint of `workdir` (default: the latest) and writes its eval directory.

  analyses=False: rollouts only (Pass@(K,T), episode statistics, the trajectories): what a
  comparison of runs needs, which recomputes step quality, recovery and likelihoods for every run
  on common states (`jaxagent.eval.compare`).

  Returns the report dict (also in report.json), with "dir" the output directory.
  Raises FileNotFoundError (naming the fix) when the workdir or step has no checkpoint, and
  WorkdirLockedError when another evaluator is writing this workdir's evaluations.
  """
  _check_run(config, workdir)     # before the lock: a mistyped workdir is not created
  with _eval_lock(workdir):
    return _evaluate_checkpoint(config, workdir, step, evaluator=evaluator, phase=phase,
                                analyses=analyses)


def _check_run(config, workdir) -> None:
  """The workdir holds checkpoints (else FileNotFoundError naming the fix, and nothing is
  written) and was trained with this config (`pinning.check_pinned`: else ConfigError naming the
  differing keys)."""
  layout.checkpoint_steps(workdir)
  check_pinned(config, workdir)


def _evaluate_checkpoint(config, workdir, step: int | None = None, *,
                         evaluator: Evaluator | None = None, phase: str | None = None,
                         analyses: bool = True) -> dict:
  workdir = pathlib.Path(workdir)
  e = sections.eval_config(config)
  phase, step = layout.resolve_checkpoint(workdir, e.phase if phase is None else phase, step)
  check_pinned(config, workdir)   # again: `watch` reaches here once the run has pinned it
  ev = evaluator or Evaluator(config, workdir)
  t0 = time.perf_counter()
  timing: dict[str, float] = {}
  tick = [t0]

  def lap(name):
    now = time.perf_counter()
    timing[name] = now - tick[0]
    tick[0] = now

  params = ev.restore(workdir, phase, step)
  base_params, base_desc, base_ckpt = _base_params(ev, config, workdir, phase)
  # The checkpoint evaluated is the base itself (e.g. the study's base run): same params, so the
  # base's rollouts (same keys) are the policy's own.
  is_base = base_ckpt == (workdir.resolve(), phase, step)
  if is_base:
    base_params = params
  logging.info("evaluating %s %s step %d (base: %s)", workdir, phase, step, base_desc)
  key = jax.random.key(e.seed)
  k_roll, k_oracle, k_act = jax.random.split(key, 3)
  temp = e.temperature

  # Pass@(K,T): the T_max run (truncation) or one run per budget (rerun), same keys for every T.
  traj, success_by_t = ev.pass_rollouts(params, k_roll, temp)
  n = e.num_samples
  grid = ev.pass_grid(success_by_t)
  lap("policy_rollouts")
  t_top = ev.max_turns if e.mode == "truncation" else ev.budgets[-1]

  train = _train_config(workdir, config)
  rep = {
      "definitions": report.DEFINITIONS,
      "run": {"workdir": str(workdir), "phase": phase, "step": int(step), "env": ev.env.name,
              "difficulty": dict(config.env.difficulty), "train_budget": train["budget"],
              "train_budget_per": train["budget_per"], "train_arm": train["arm"],
              "train_budget_visible": train["budget_visible"], "rl_steps": train["steps"],
              "train_credit": train["credit"],
              "seed": train["seed"], "base": base_desc},
      "eval": {"mode": e.mode, "budgets": ev.budgets, "max_turns": ev.max_turns,
               "budget_visible": ev.budget_visible, "num_samples": n,
               "num_tasks": ev.num_tasks, "temperature": temp, "seed": e.seed,
               "max_action_tokens": ev.action_tokens, "num_bootstrap": e.num_bootstrap,
               "confidence": e.confidence},
      "pass_at_kt": grid,
      "stats": {POLICY: trajectory_summary(traj)},
  }
  block = None
  if analyses:
    # The base policy's runs at the same budget and keys; the oracle's (forced) runs.
    base_traj = ev.memo(("base", base_desc, t_top), lambda: traj if is_base else ev.rollouts(
        base_params, k_roll, t_top, budget_visible=ev.budget_visible, temperature=temp))
    # Forced oracle actions: the transcript does not depend on the params rolled out with.
    oracle_traj = ev.memo(("oracle", t_top), lambda: ev.rollouts(
        params, k_oracle, t_top, budget_visible=ev.budget_visible, temperature=temp,
        group_size=1, oracle=True))
    lap("base_and_oracle_rollouts")
    who = {POLICY: params, BASE: base_params}
    block = ev.policy_analyses(who, oracle_traj, base_traj, k_oracle, k_act, ev.budget_visible)
    lap("next_actions")
    rep["stats"].update({BASE: trajectory_summary(base_traj),
                         "oracle": trajectory_summary(oracle_traj)})
    rep.update({
        "reference_states": block.report["reference_states"],
        "step_quality": block.report["step_quality"],
        "recovery": {"on_policy": {POLICY: ev.on_policy(traj), BASE: ev.on_policy(base_traj)},
                     "controlled": block.report["controlled"]}})
    lik = ev.likelihoods({POLICY: traj, BASE: base_traj}, who)
    lik.pop("per_trajectory")
    rep["likelihood"] = lik
    lap("likelihood")

  out = workdir / "eval" / layout.eval_dir_name(phase, step)
  rep["dir"] = str(out)
  if not distributed.is_primary():          # every process computed it; one writes it
    return rep
  out.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(out / "episodes.npz", **_episodes_arrays(ev, success_by_t, traj, block))
  rep["files"] = ["report.json", "report.md", "episodes.npz"] + _run_plots(
      rep, out, [k for k in e.curve_ks if k <= n], f"{phase} step {step}")
  lap("write")
  rep["seconds"] = time.perf_counter() - t0
  rep["timing"] = timing
  report.write_json(rep, out / "report.json")
  (out / "report.md").write_text(report.run_markdown(report.to_jsonable(rep)))
  logging.info("wrote %s (%.0f s)", out, rep["seconds"])
  return rep


def _run_plots(rep: dict, out: pathlib.Path, ks: list[int], title: str) -> list[str]:
  """The PNG plots of one evaluation; returns their file names."""
  grid = rep["pass_at_kt"]
  paths = [
      plots.pass_heatmap(grid, out / "pass_heatmap.png", f"Pass@(K,T), {title}"),
      plots.pass_curves(grid, ks, out / "pass_curves.png", f"Pass@(K,T) vs T, {title}")]
  if "step_quality" not in rep:
    return [pathlib.Path(p).name for p in paths]
  lik, rec = rep["likelihood"], rep["recovery"]
  paths += [
      plots.rate_bars(quality_bars(rep["step_quality"]), out / "step_quality.png",
                      "Step-level action quality (reference states)"),
      plots.rate_bars(recovery_bars(rec["controlled"]), out / "recovery.png",
                      "Controlled recovery: valid next call (sampled)"),
      plots.rate_bars({w: {k: v["valid"] for k, v in r.items()}
                       for w, r in rec["on_policy"].items()},
                      out / "recovery_on_policy.png", "On-policy recovery: valid next call"),
      plots.matrix(lik["mean"], lik["rows"], lik["cols"], out / "likelihood.png",
                   "Mean per-token log p (agent tokens)")]
  return [pathlib.Path(p).name for p in paths]


def quality_bars(sq: dict) -> dict:
  """{policy/mode: {"valid"/"oracle" [source]: rate}} for `plots.rate_bars`."""
  out = {}
  for w, modes in sq.items():
    for m, q in modes.items():
      d = {"valid": q["overall"]["valid"], "oracle": q["overall"]["oracle"]}
      for s, r in q["source"].items():
        d[f"valid [{s}]"], d[f"oracle [{s}]"] = r["valid"], r["oracle"]
      out[f"{w}/{m}"] = d
  return out


def recovery_bars(rec: dict, mode: str = "sampled") -> dict:
  return {w: {k: v["valid"] for k, v in modes[mode].items()} for w, modes in rec.items()}


def evaluate_all(config, workdir, *, evaluator: Evaluator | None = None) -> list[dict]:
  """Evaluates every kept checkpoint of the configured phase(s), oldest first."""
  have = layout.checkpoint_steps(workdir, config.eval.phase)
  check_pinned(config, workdir)
  if not have:
    raise FileNotFoundError(f"no checkpoint under {pathlib.Path(workdir) / 'checkpoints'}: train "
                            "first, or fix --workdir")
  with _eval_lock(workdir):
    ev = evaluator or Evaluator(config, workdir)
    return [_evaluate_checkpoint(config, workdir, s, evaluator=ev, phase=p) for p, s in have]


def watch(config, workdir, *, poll_seconds: float = 60.0, timeout_seconds: float = 3600.0,
          evaluator: Evaluator | None = None) -> list[dict]:
  """Evaluates each checkpoint of `workdir` without a report yet, as it lands.

  Polls every `poll_seconds`; returns when the training run has finished (<workdir>/DONE exists)
  and every kept checkpoint has a report, or when no new checkpoint appeared for
  `timeout_seconds`. A checkpoint deleted before its turn (max_to_keep) is skipped.
  """
  workdir = pathlib.Path(workdir)
  with _eval_lock(workdir):
    return _watch(config, workdir, poll_seconds, timeout_seconds, evaluator)


def _watch(config, workdir: pathlib.Path, poll_seconds: float, timeout_seconds: float,
           evaluator: Evaluator | None) -> list[dict]:
  ev = evaluator
  done: list[dict] = []
  last_new = time.monotonic()
  while True:
    try:
      have = layout.checkpoint_steps(workdir, config.eval.phase)
    except FileNotFoundError:
      have = []   # the training run has not written its first checkpoint yet
    todo = [(p, s) for p, s in have
            if not (workdir / "eval" / layout.eval_dir_name(p, s) / "report.json").exists()]
    for p, s in todo:
      ev = ev or Evaluator(config, workdir)
      try:
        done.append(_evaluate_checkpoint(config, workdir, s, evaluator=ev, phase=p))
      except FileNotFoundError as err:
        logging.warning("skipping %s step %d: %s", p, s, err)
      last_new = time.monotonic()
    if (workdir / "DONE").exists() and not todo:
      return done
    if time.monotonic() - last_new > timeout_seconds:
      logging.info("no new checkpoint for %.0f s; stopping", timeout_seconds)
      return done
    time.sleep(poll_seconds)
