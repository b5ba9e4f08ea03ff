"""Comparing runs: their evaluations side by side, with the claims of docs/STUDY.md decided.

    compare({"base": W0, "fixed_tight": W1, "budgetmix": W2}, out_dir, config, base="base")

Each run's newest evaluation (`jaxagent.eval.checkpoints`) is read back; the policy-level analyses
(step quality, controlled recovery, cross log-likelihoods) are recomputed for every run on one
common set of states. A run's arm (base, fixed, mix or schedule) comes from its training budget
(`Budget.arm`), so `8`, `fixed:8` and `FIXED:8` are all fixed-T arms and a schedule is not a mix.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from jaxagent.eval import pass_at_kt, plots, report
from jaxagent.eval.checkpoints import recovery_bars
from jaxagent.eval.evaluator import TRAJ_FIELDS, Evaluator
from jaxagent.rollout.budget import Budget
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.runs import config as sections
from jaxagent.runs import layout
from jaxagent.sharding import distributed


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
  return Trajectory(**{f: eps[f"traj/{f}"] for f in TRAJ_FIELDS})


def run_kind(label: str, base: str, train_budget: str) -> str:
  """"base" for the base label, else the training budget's arm: "fixed" (one value: `8`,
  `fixed:8`, `FIXED:8`, `mix:8`), "mix" (BudgetMix: mix/weighted over several values) or
  "schedule" (values that change over training steps)."""
  if label == base:
    return "base"
  return Budget.parse(str(train_budget)).arm


def compare(runs: dict[str, str], out_dir, config, base: str = "base", *,
            programs=None) -> dict:
  """Side-by-side comparison of several runs' evaluations, with the claims of docs/STUDY.md decided.

  Args:
    runs: label -> workdir, each evaluated before (`evaluate_checkpoint`); the newest evaluation
      of each is used, and its checkpoint's params are restored for the policy-level analyses.
    out_dir: where comparison.json, comparison.md and the plots go.
    config: the config the runs share (model, environment, eval settings).
    base: the label of the base policy's run.
    programs: compiled functions to reuse (`jaxagent.runs.programs.Programs` of this config's
      policy and environment, e.g. the study's); default new ones.
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
  e = sections.eval_config(config)
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
  ev = Evaluator(config, test_arrays=test_arrays, programs=programs)
  mode, budgets = rep0["eval"]["mode"], rep0["eval"]["budgets"]
  vis = bool(rep0["eval"]["budget_visible"])
  t_top = max(budgets)
  params = {lab: layout.restore_params(runs[lab], rep["run"]["phase"], rep["run"]["step"],
                                      ev.abstract)
            for lab, (rep, _) in evals.items()}
  trajs = {lab: _traj_from(eps) for lab, (_, eps) in evals.items()}
  kinds = {lab: run_kind(lab, base, rep["run"]["train_budget"]) for lab, (rep, _) in evals.items()}
  rl = [lab for lab in runs if lab != base]
  fixed = [lab for lab in rl if kinds[lab] == "fixed"]
  mix = [lab for lab in rl if kinds[lab] == "mix"]

  key = jax.random.key(e.seed)
  _, k_oracle, k_act = jax.random.split(key, 3)
  oracle_traj = ev.rollouts(params[base], k_oracle, t_top, budget_visible=vis,
                            temperature=e.temperature, group_size=1, oracle=True)
  analyses = ev.policy_analyses({base: params[base], **params}, oracle_traj, trajs[base],
                                k_oracle, k_act, vis)
  lik = ev.likelihoods(trajs, params)
  per_traj = lik.pop("per_trajectory")

  # Claims.
  nb, conf, seed = e.num_bootstrap, e.confidence, e.seed
  t_values = list(range(1, t_top + 1)) if mode == "truncation" else list(budgets)
  pass1 = {lab: pass_at_kt.per_task_pass1(mode, eps["success_turn_by_t"], t_values, t_top)
           for lab, (_, eps) in evals.items()}
  t_tight, t_gen = report.tight_generous(t_values, eps0["optimal_turns"])
  w_tasks = report.resample_weights(ev.num_tasks, nb, np.random.default_rng(seed))
  step_v = {lab: o["sampled"]["valid_call"] for lab, o in analyses.step_quality.items()}
  rec_v = {lab: o["sampled"]["valid_call"] for lab, o in analyses.recovery.items()}
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
  ks = [k for k in e.curve_ks if k <= rep0["eval"]["num_samples"]]
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
      recovery_bars(comp["recovery"]["controlled"]), out / "recovery.png",
      "Controlled recovery: valid next call (sampled)")).name)
  files.append(pathlib.Path(plots.matrix(lik["sum"], lik["rows"], lik["cols"],
                                         out / "likelihood.png",
                                         "Mean sum log p of agent tokens")).name)
  comp["files"] = files
  report.write_json(comp, out / "comparison.json")
  (out / "comparison.md").write_text(report.comparison_markdown(report.to_jsonable(comp)))
  return comp
