"""Comparing runs: their evaluations side by side, with the claims of docs/STUDY.md decided.

    compare({"base": W0, "fixed_tight_s0": W1, "fixed_tight_s1": W2, "budgetmix_s0": W3, ...},
            out_dir, config, base="base")

Each run's newest evaluation (`jaxagent.eval.checkpoints`) is read back; the policy-level analyses
(step quality, controlled recovery, log-likelihoods) are recomputed for every run on one common
set of states. Labels `ARM_sN` are seed N of arm ARM (`arm_and_seed`); a label without the suffix
is seed 0 of its own arm. Runs of the base arm (`base`, or `base_s0`, `base_s1`, ... when the
base itself was trained with several seeds) are the bases; every other arm is an RL arm, all with
the same seeds (paired: seed N of every arm). An arm's kind (fixed, mix or schedule) comes from
its training budget (`Budget.arm`), so `8`, `fixed:8` and `FIXED:8` are all fixed-T arms and a
schedule is not a mix. The claims are decided by `jaxagent.eval.claims`.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import numpy as np

from jaxagent.eval import claims as claims_lib
from jaxagent.eval import evidence, likelihood, pass_at_kt, plots, report
from jaxagent.eval.checkpoints import recovery_bars
from jaxagent.eval.evaluator import TRAJ_FIELDS, Evaluator
from jaxagent.rollout.budget import Budget
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.runs import config as sections
from jaxagent.runs import layout
from jaxagent.sharding import distributed

_SEEDED = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")


def arm_and_seed(label: str) -> tuple[str, int]:
  """("fixed_tight", 2) for "fixed_tight_s2"; (label, 0) for a label without the suffix."""
  m = _SEEDED.match(label)
  return (m["arm"], int(m["seed"])) if m else (label, 0)


def latest_eval(workdir) -> tuple[dict, dict]:
  """(report, episodes) of the newest evaluated checkpoint of `workdir` (by phase, then step)."""
  root = pathlib.Path(workdir) / "eval"
  found = []
  for p in sorted(root.glob("*/report.json")) if root.is_dir() else []:
    rep = json.loads(p.read_text())
    found.append(((layout.PHASES.index(rep["run"]["phase"]), rep["run"]["step"]), p.parent, rep))
  if not found:
    raise FileNotFoundError(f"{workdir} has no evaluation (eval/*/report.json): run "
                            f"python -m launch.evaluate --config=... --workdir={workdir} first")
  _, d, rep = max(found, key=lambda x: x[0])
  with np.load(d / "episodes.npz", allow_pickle=False) as z:
    eps = {k: z[k] for k in z.files}
  return rep, eps


def _traj_from(eps: dict) -> Trajectory:
  out = {f: eps[f"traj/{f}"] for f in TRAJ_FIELDS if f"traj/{f}" in eps}
  if "state_id" not in out:           # evaluations stored before state fingerprints were recorded
    out["state_id"] = np.zeros(out["acted"].shape + (2,), np.uint32)
  if "obs_truncated" not in out:      # evaluations stored before truncations were recorded
    out["obs_truncated"] = np.zeros(out["acted"].shape, bool)
  return Trajectory(**out)


def run_kind(label: str, base: str, train_budget: str) -> str:
  """"base" for the base label, else the training budget's arm: "fixed" (one value: `8`,
  `fixed:8`, `FIXED:8`, `mix:8`), "mix" (BudgetMix: mix/weighted over several values) or
  "schedule" (values that change over training steps)."""
  if label == base:
    return "base"
  return Budget.parse(str(train_budget)).arm


def group_runs(labels, base: str) -> tuple[list[str], dict[str, list[str]]]:
  """(base labels by seed, {RL arm: labels by seed}) from run labels (see the module docstring).
  Raises ValueError naming the fix when the base is missing or the arms' seeds differ."""
  arms: dict[str, dict[int, str]] = {}
  for lab in labels:
    arm, seed = arm_and_seed(lab)
    if seed in arms.setdefault(arm, {}):
      raise ValueError(f"runs {arms[arm][seed]!r} and {lab!r} are both seed {seed} of arm {arm!r}; "
                       "give each run its own label")
    arms[arm][seed] = lab
  if base not in arms:
    raise ValueError(f"no run labelled {base!r} (or {base}_s0, ...) among {list(labels)}; label "
                     f"the base run --run {base}=WORKDIR or pass --base=LABEL")
  by_seed = arms.pop(base)
  bases = [by_seed[k] for k in sorted(by_seed)]
  if not arms:
    raise ValueError("compare needs at least one RL run beside the base (--run label=workdir)")
  seeds = {arm: sorted(d) for arm, d in arms.items()}
  first = next(iter(seeds.values()))
  if any(v != first for v in seeds.values()):
    raise ValueError(f"every RL arm needs the same seeds (seed N of each arm is paired with seed "
                     f"N of the others), got {seeds}; train the missing seeds or leave the extra "
                     "runs out")
  return bases, {arm: [d[k] for k in sorted(d)] for arm, d in arms.items()}


def study_rules(config) -> evidence.Rules:
  """The decision rules of config.study (margins) and config.eval (confidence)."""
  st, e = sections.study_config(config), sections.eval_config(config)
  return evidence.Rules(effect=st.margin_effect, non_inferiority=st.margin_non_inferiority,
                        loglik_nats=st.margin_loglik_nats, confidence=e.confidence,
                        min_seeds=st.min_seeds, min_tasks=st.min_tasks)


def compare(runs: dict[str, str], out_dir, config, base: str = "base", *,
            programs=None) -> dict:
  """Side-by-side comparison of several runs' evaluations, with the claims of docs/STUDY.md decided.

  Args:
    runs: label -> workdir, each evaluated before (`evaluate_checkpoint`); the newest evaluation
      of each is used, and its checkpoint's params are restored for the policy-level analyses.
      Labels group into arms and seeds (`group_runs`).
    out_dir: where comparison.json, comparison.md and the plots go.
    config: the config the runs share (model, environment, eval settings, study margins).
    base: the base arm's name (its runs: `base`, or `base_s0`, `base_s1`, ...).
    programs: compiled functions to reuse (`jaxagent.runs.programs.Programs` of this config's
      policy and environment, e.g. the study's); default new ones.
  Every run must have been evaluated on the same test tasks with the same eval mode, budgets and
  n, and with the budget as visible as its training's. Step quality and controlled recovery are
  recomputed for every policy on one common set of states: oracle prefixes and the first base
  run's evaluation trajectories (prefixes and error states); log-likelihoods score each run's
  stored trajectories under the policies its claims compare it with.
  """
  bases, arms = group_runs(list(runs), base)
  out = pathlib.Path(out_dir)
  e = sections.eval_config(config)
  rules = study_rules(config)
  evals = {lab: latest_eval(w) for lab, w in runs.items()}
  rep0, eps0 = evals[bases[0]]
  for lab, (rep, eps) in evals.items():
    same = (rep["eval"]["mode"] == rep0["eval"]["mode"]
            and rep["eval"]["budgets"] == rep0["eval"]["budgets"]
            and rep["eval"]["num_samples"] == rep0["eval"]["num_samples"]
            and set(eps) >= {k for k in eps0 if k.startswith("task/")}
            and all(np.array_equal(eps[k], eps0[k]) for k in eps0 if k.startswith("task/")))
    if not same:
      raise ValueError(f"run {lab!r} was evaluated on other tasks or settings than "
                       f"{bases[0]!r}; evaluate every run with the same config (data, env and "
                       "eval sections)")
    trained = bool(rep["run"].get("train_budget_visible", False))
    if lab not in bases and trained != bool(rep["eval"]["budget_visible"]):
      raise ValueError(
          f"run {lab!r} was trained with the budget {'visible' if trained else 'hidden'} but "
          f"evaluated with it {'visible' if rep['eval']['budget_visible'] else 'hidden'}; "
          "evaluate as it was trained: " + ("config.eval.mode=rerun with "
                                            "config.eval.rerun_budget_visible=True" if trained
                                            else "config.eval.mode=truncation, or rerun with "
                                            "config.eval.rerun_budget_visible=False"))
  test_arrays = {k[len("task/"):]: v for k, v in eps0.items() if k.startswith("task/")}
  ev = Evaluator(config, test_arrays=test_arrays, programs=programs)
  mode, budgets = rep0["eval"]["mode"], rep0["eval"]["budgets"]
  vis = bool(rep0["eval"]["budget_visible"])
  t_top = max(budgets)
  params = {lab: layout.restore_params(runs[lab], rep["run"]["phase"], rep["run"]["step"],
                                      ev.abstract)
            for lab, (rep, _) in evals.items()}
  trajs = {lab: _traj_from(eps) for lab, (_, eps) in evals.items()}
  # An arm trained with turn-level credit or process rewards is its own kind: it is reported
  # beside the standard arm, never taken for it (or for a fixed-T arm of claim 3).
  arm_kind = {arm: ("credit" if evals[labs[0]][0]["run"].get("train_credit")
                    else Budget.parse(str(evals[labs[0]][0]["run"]["train_budget"])).arm)
              for arm, labs in arms.items()}
  arm_turns = {arm: Budget.parse(str(evals[labs[0]][0]["run"]["train_budget"])).max_turns
               for arm, labs in arms.items()}

  key = jax.random.key(e.seed)
  _, k_oracle, k_act = jax.random.split(key, 3)
  oracle_traj = ev.rollouts(params[bases[0]], k_oracle, t_top, budget_visible=vis,
                            temperature=e.temperature, group_size=1, oracle=True)
  analyses = ev.policy_analyses(params, oracle_traj, trajs[bases[0]], k_oracle, k_act, vis)

  # Log-likelihoods, each (trajectories, scoring policy) pair scored once, when first needed.
  rows = {lab: ev.likelihood_rows(int(np.asarray(t.length).shape[0])) for lab, t in trajs.items()}
  scored: dict = {}

  def loglik(a: str, b: str) -> dict:
    if (a, b) not in scored:
      t, r = trajs[a], rows[a]
      lp = likelihood.score_rows(ev.policy.config, params[b], np.asarray(t.tokens)[r],
                                 np.asarray(t.length)[r], e.temperature, e.score_batch)
      scored[(a, b)] = likelihood.agent_loglik(lp, np.asarray(t.loss_mask)[r])
    return scored[(a, b)]

  t_values = list(range(1, t_top + 1)) if mode == "truncation" else list(budgets)
  t_tight, t_gen = claims_lib.tight_generous(t_values, eps0["optimal_turns"])
  data = claims_lib.StudyData(
      arms=arms, bases=bases, kinds=arm_kind, turns=arm_turns, num_tasks=ev.num_tasks,
      t_values=t_values, t_tight=t_tight, t_gen=t_gen,
      pass1={lab: pass_at_kt.per_task_pass1(mode, eps["success_turn_by_t"], t_values, t_top)
             for lab, (_, eps) in evals.items()},
      step={lab: o["sampled"]["valid_call"] for lab, o in analyses.step_quality.items()},
      step_task=analyses.refs.task, step_after_error=analyses.refs.prev_error_kind != 0,
      rec={lab: o["sampled"]["valid_call"] for lab, o in analyses.recovery.items()},
      rec_task=analyses.errs.task, rec_kind=analyses.errs.prev_error_kind,
      loglik=loglik,
      traj_task={lab: np.asarray(t.task_id)[rows[lab]] for lab, t in trajs.items()})
  decided = claims_lib.decide_claims(data, rules, num_bootstrap=e.num_bootstrap, seed=e.seed)
  credit = claims_lib.decide_credit(data, rules, num_bootstrap=e.num_bootstrap, seed=e.seed)

  # The likelihood matrix shown: the bases and seed 0 of every arm.
  shown = bases + [labs[0] for labs in arms.values()]
  lik = {"rows": shown, "cols": shown,
         "sum": [[float(np.mean(loglik(a, b)["sum"])) for b in shown] for a in shown],
         "mean": [[float(np.nanmean(loglik(a, b)["mean"])) if np.any(loglik(a, b)["count"] > 0)
                   else None for b in shown] for a in shown],
         "temperature": e.temperature,
         "num_trajectories": {lab: int(len(rows[lab])) for lab in shown}}
  labels = {lab: arm_and_seed(lab) for lab in runs}
  ks = [k for k in e.curve_ks if k <= rep0["eval"]["num_samples"]]
  comp = {
      "definitions": report.DEFINITIONS,
      "rules": {"summary": rules.describe(), "margins": dict(
                    effect=rules.effect, non_inferiority=rules.non_inferiority,
                    loglik_nats=rules.loglik_nats, confidence=rules.confidence,
                    min_seeds=rules.min_seeds, min_tasks=rules.min_tasks),
                "method": RULES_METHOD},
      "runs": {lab: {"workdir": str(runs[lab]), "arm": labels[lab][0], "seed": labels[lab][1],
                     "config_seed": rep["run"].get("seed"), "phase": rep["run"]["phase"],
                     "step": rep["run"]["step"], "train_budget": rep["run"]["train_budget"],
                     "rl_steps": rep["run"]["rl_steps"],
                     "credit": rep["run"].get("train_credit", ""),
                     "kind": "base" if lab in bases else arm_kind[labels[lab][0]]}
               for lab, (rep, _) in evals.items()},
      "bases": bases,
      "arms": arms,
      "budgets": {"T_tight": report.describe_budget(t_tight), "T_gen": t_gen},
      "eval": {k: rep0["eval"][k] for k in ("mode", "budgets", "budget_visible", "num_samples",
                                            "num_tasks", "temperature")},
      "curve_ks": ks,
      "claims": {str(k): v for k, v in decided.items()},
      "credit": credit,
      "pass_at_kt": {lab: rep["pass_at_kt"] for lab, (rep, _) in evals.items()},
      "reference_states": analyses.report["reference_states"],
      "step_quality": {lab: analyses.report["step_quality"][lab] for lab in runs},
      "recovery": {"controlled": {lab: analyses.report["controlled"][lab] for lab in runs},
                   "on_policy": {lab: ev.on_policy(t) for lab, t in trajs.items()}},
      "likelihood": lik,
  }
  comp["dir"] = str(out)
  if not distributed.is_primary():          # every process computed it; one writes it
    return comp
  out.mkdir(parents=True, exist_ok=True)
  files = ["comparison.json", "comparison.md"]
  shown_grids = {lab: comp["pass_at_kt"][lab] for lab in shown}
  for k in sorted({ks[0], ks[-1]} if ks else set()):
    files.append(pathlib.Path(plots.pass_curves_runs(shown_grids, k,
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
      recovery_bars(comp["recovery"]["controlled"]), out / "recovery.png",
      "Controlled recovery: valid next call (sampled)")).name)
  files.append(pathlib.Path(plots.matrix(lik["sum"], lik["rows"], lik["cols"],
                                         out / "likelihood.png",
                                         "Mean sum log p of agent tokens")).name)
  comp["files"] = files
  report.write_json(comp, out / "comparison.json")
  (out / "comparison.md").write_text(report.comparison_markdown(report.to_jsonable(comp)))
  return comp


RULES_METHOD = (
    "Units: training seeds (seed N of every arm paired) and test tasks; every interval resamples "
    "seeds, then tasks (with all their episodes and states). A claim is a list of conditions "
    "'X > c' with thresholds fixed in config.study. Held iff every condition is shown (one-sided "
    "bootstrap p < alpha); not held iff one is refuted after Holm's correction over the claim's "
    "conditions; else inconclusive. Too few seeds or tasks is always inconclusive, and a statistic "
    "that does not vary across resamples neither shows nor refutes its condition.")
