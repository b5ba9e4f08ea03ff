"""Comparing runs: their evaluations side by side, with the claims of docs/STUDY.md decided.

    compare({"base": W0, "fixed_tight_s0": W1, "fixed_tight_s1": W2, "budgetmix_s0": W3, ...},
            out_dir, config, base="base")

Each run's newest evaluation (`jaxagent.eval.checkpoints`) is read back; the policy-level analyses
(step quality, controlled recovery, log-likelihoods) are recomputed for every run on one common
set of states. Labels `ARM_sN` are seed N of arm ARM (`arm_and_seed`); a label without the suffix
is seed 0 of its own arm. Runs of the base arm (`base`, or `base_s0`, `base_s1`, ... when the
base itself was trained with several seeds) are the bases; every other arm is an RL arm, all with
the same seeds (paired: seed N of every arm). An arm's kind (fixed, mix or schedule) is the
training arm its evaluation recorded (report.json's run.train_arm, `Budget.arm` of the training
budget), so `8`, `fixed:8` and `FIXED:8` are all fixed-T arms and a schedule is not a mix. The
claims are decided by `jaxagent.eval.claims`.

    check_evaluations -> arm_kinds -> measure -> study_data -> claims -> comparison_record
    -> write_comparison        (the steps of `compare`, each its own function)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import numpy as np

from jaxagent.eval import claims as claims_lib
from jaxagent.eval import evidence, likelihood, pass_at_kt, plots, power, report, sharpening
from jaxagent.eval.checkpoints import recovery_bars
from jaxagent.eval.evaluator import TRAJ_FIELDS, Evaluator, PolicyAnalyses
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


@dataclasses.dataclass(frozen=True)
class RunSet:
  """The runs compared: their workdirs, newest evaluations, grouping and arm kinds."""
  workdirs: dict[str, str]               # label -> workdir
  evals: dict[str, tuple[dict, dict]]    # label -> (report, episodes) of `latest_eval`
  bases: list[str]                       # the base labels by seed (`group_runs`)
  arms: dict[str, list[str]]             # RL arm -> its labels by seed
  kinds: dict[str, str]                  # RL arm -> kind (`arm_kinds`)
  turns: dict[str, int]                  # RL arm -> its training T_max

  @property
  def shown(self) -> list[str]:
    """The runs drawn in the likelihood matrix and pass curves: the bases and seed 0 of every
    arm."""
    return self.bases + [labs[0] for labs in self.arms.values()]


def check_evaluations(evals: dict[str, tuple[dict, dict]], bases: list[str]) -> None:
  """Raises ValueError naming the fix unless every run was evaluated like the first base (same
  eval mode, budgets, samples per task and test tasks) and every RL run with its budget as
  visible as during its training (`report.json`'s run.train_budget_visible)."""
  rep0, eps0 = evals[bases[0]]
  tasks0 = [k for k in eps0 if k.startswith("task/")]
  for lab, (rep, eps) in evals.items():
    same = (all(rep["eval"][k] == rep0["eval"][k] for k in ("mode", "budgets", "num_samples"))
            and set(eps) >= set(tasks0)
            and all(np.array_equal(eps[k], eps0[k]) for k in tasks0))
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


def arm_kinds(evals: dict[str, tuple[dict, dict]],
              arms: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, int]]:
  """({arm: kind}, {arm: training T_max}) from the evaluation of each arm's seed 0.

  The kind is the training arm stored with the evaluation (report.json's run.train_arm: "fixed",
  "mix" or "schedule", `Budget.arm` of the training budget), or "credit" for an arm trained with
  turn-level credit or process rewards: it is reported beside the standard arm, never taken for
  it (or for a fixed-T arm of claim 3). T_max is the training budget's largest value (the report
  stores its spec, run.train_budget)."""
  kinds, turns = {}, {}
  for arm, labs in arms.items():
    run = evals[labs[0]][0]["run"]
    if "train_arm" not in run:
      raise ValueError(f"the evaluation of run {labs[0]!r} does not record its training arm "
                       "(report.json run.train_arm; evaluations before it was recorded); "
                       "evaluate the run again with python -m launch.evaluate")
    kinds[arm] = "credit" if run.get("train_credit") else run["train_arm"]
    turns[arm] = Budget.parse(str(run["train_budget"])).max_turns
  return kinds, turns


class LogLikelihoods:
  """Log-likelihoods of each run's stored trajectories under each policy: `self(a, b)` scores
  run a's trajectories (rows `rows[a]`, `Evaluator.likelihood_rows`) under run b's params,
  once per pair, when first asked (`likelihood.agent_loglik`: {"sum", "mean", "count"} [R]).
  Policies sharing one params object (a base and its sharpened self) are scored together: one
  forward pass of a's trajectories serves every temperature (`likelihood.score_rows_at`)."""

  def __init__(self, ev: Evaluator, params: dict, trajs: dict[str, Trajectory],
               e: sections.EvalConfig):
    self.ev, self.params, self.trajs, self.e = ev, dict(params), dict(trajs), e
    self.rows = {lab: ev.likelihood_rows(int(np.asarray(t.length).shape[0]))
                 for lab, t in trajs.items()}
    self.temps: dict[str, float] = {}      # label -> scoring temperature (default the eval's)
    self._scored: dict = {}

  def add(self, label: str, params, traj: Trajectory, temperature: float) -> None:
    """Another policy: `params` scoring at `temperature` (a sharpened base), with its own
    trajectories. Greedy (0) has no finite likelihood: its scores are NaN."""
    self.params[label], self.trajs[label], self.temps[label] = params, traj, temperature
    self.rows[label] = self.ev.likelihood_rows(int(np.asarray(traj.length).shape[0]))

  def __call__(self, a: str, b: str) -> dict:
    if (a, b) not in self._scored:
      t, r = self.trajs[a], self.rows[a]
      temp = self.temps.get(b, self.e.temperature)
      if temp == 0:
        nan = np.full((len(r),), np.nan)
        self._scored[(a, b)] = {"sum": nan, "mean": nan, "count": np.zeros((len(r),))}
        return self._scored[(a, b)]
      # Every policy with b's params (b itself, b sharpened) scores a's trajectories from one
      # forward pass: each transcript is run once per params, at every temperature they need.
      same = [c for c, p in self.params.items()
              if p is self.params[b] and self.temps.get(c, self.e.temperature) != 0]
      temps = sorted({self.temps.get(c, self.e.temperature) for c in same})
      lps = likelihood.score_rows_at(self.ev.model_config, self.params[b],
                                     np.asarray(t.tokens)[r], np.asarray(t.length)[r], temps,
                                     self.e.score_batch)
      mask = np.asarray(t.loss_mask)[r]
      for c in same:
        if (a, c) not in self._scored:
          lp = lps[temps.index(self.temps.get(c, self.e.temperature))]
          self._scored[(a, c)] = likelihood.agent_loglik(lp, mask)
    return self._scored[(a, b)]

  def matrix(self, shown: list[str]) -> dict:
    """The matrix reported (rows: trajectories, cols: scoring policies): mean sum and mean
    per-token log p of the agent's tokens (None where no row has an agent token)."""
    return {"rows": shown, "cols": shown,
            "sum": [[float(np.mean(self(a, b)["sum"])) for b in shown] for a in shown],
            "mean": [[float(np.nanmean(self(a, b)["mean"])) if np.any(self(a, b)["count"] > 0)
                      else None for b in shown] for a in shown],
            "temperature": self.e.temperature,
            "num_trajectories": {lab: int(len(self.rows[lab])) for lab in shown}}


@dataclasses.dataclass
class Measured:
  """The policy-level measurements of every run on one common set of states (`measure`)."""
  evaluator: Evaluator
  trajs: dict[str, Trajectory]     # label -> its stored evaluation trajectories
  policy: PolicyAnalyses           # step quality and controlled recovery of every run
  loglik: LogLikelihoods           # (trajectories' label, scoring label) -> log-likelihoods
  sharpening: sharpening.Sharpening | None = None    # the sharpening control (None: no sweep)


def deciding_arms(rs: RunSet) -> list[str]:
  """The arms the claims are decided on (`claims.StudyData.standard_arm`, the first mix arm)."""
  fixed = [a for a in rs.arms if rs.kinds[a] == "fixed"]
  mixes = [a for a in rs.arms if rs.kinds[a] == "mix"]
  return ([max(fixed, key=lambda a: rs.turns[a])] if fixed else []) + mixes[:1]


def measure(rs: RunSet, config, e: sections.EvalConfig, programs=None) -> Measured:
  """Restores every run's evaluated params and analyses all of them on one common set of states:
  oracle prefixes (rolled out with config.eval.seed's key on the first base's test tasks) and
  the first base run's stored trajectories (prefixes and error states). With
  config.eval.sharpen_temperatures, the sharpening control (`jaxagent.eval.sharpening`): every
  base acts at each temperature on the reference states, every RL run of the deciding arms is
  matched to a sharpened base by action entropy, and each distinct sharpened base is evaluated
  (Pass@(K,T) rollouts, error-state actions, likelihoods)."""
  rep0, eps0 = rs.evals[rs.bases[0]]
  test_arrays = {k[len("task/"):]: v for k, v in eps0.items() if k.startswith("task/")}
  ev = Evaluator(config, test_arrays=test_arrays, programs=programs)
  vis = bool(rep0["eval"]["budget_visible"])
  params = {lab: ev.restore(rs.workdirs[lab], rep["run"]["phase"], rep["run"]["step"])
            for lab, (rep, _) in rs.evals.items()}
  trajs = {lab: _traj_from(eps) for lab, (_, eps) in rs.evals.items()}
  k_roll, k_oracle, k_act = jax.random.split(jax.random.key(e.seed), 3)
  oracle_traj = ev.rollouts(params[rs.bases[0]], k_oracle, max(rep0["eval"]["budgets"]),
                            budget_visible=vis, temperature=e.temperature, group_size=1,
                            oracle=True)
  # The bases' sweep temperatures are decoded from the prefills of their step-quality actions.
  at = (sharpening.sweep_temperatures(e.sharpen_temperatures, e.temperature)
        if e.sharpen_temperatures else ())
  policy = ev.policy_analyses(params, oracle_traj, trajs[rs.bases[0]], k_oracle, k_act, vis,
                              sweep={b: at for b in rs.bases} if at else None)
  loglik = LogLikelihoods(ev, params, trajs, e)
  sh = None
  if e.sharpen_temperatures:
    sh = sharpening.sweep(ev, params, policy.refs, rs.bases, rs.arms, policy.step_quality,
                          k_act, e.sharpen_temperatures, e.temperature, done=policy.sweep)
    sharpening.evaluate(sh, ev, params, policy.errs, k_roll, k_act, deciding_arms(rs))
    for lab, r in sh.runs.items():
      loglik.add(lab, r["params"], r["traj"], r["temperature"])
  return Measured(ev, trajs, policy, loglik, sh)


def study_data(rs: RunSet, m: Measured) -> claims_lib.StudyData:
  """What the claims are decided from: per-task Pass@1 at every evaluated T (1..T_max when
  truncated, the rerun budgets else), claim 1's tight and generous budgets, the step-quality and
  recovery outcomes on the common states, and the log-likelihoods."""
  rep0, eps0 = rs.evals[rs.bases[0]]
  mode, budgets = rep0["eval"]["mode"], rep0["eval"]["budgets"]
  t_top = max(budgets)
  t_values = list(range(1, t_top + 1)) if mode == "truncation" else list(budgets)
  t_tight, t_gen = claims_lib.tight_generous(t_values, eps0["optimal_turns"])
  a = m.policy
  sh = m.sharpening
  pass1 = {lab: pass_at_kt.per_task_pass1(mode, eps["success_turn_by_t"], t_values, t_top)
           for lab, (_, eps) in rs.evals.items()}
  step = {lab: o["sampled"]["valid_call"] for lab, o in a.step_quality.items()}
  rec = {lab: o["sampled"]["valid_call"] for lab, o in a.recovery.items()}
  traj_task = {lab: np.asarray(t.task_id)[m.loglik.rows[lab]] for lab, t in m.loglik.trajs.items()}
  sharpened = {}
  if sh is not None:
    pass1.update(sharpening.per_task_pass1(sh, mode, t_values, t_top))
    step.update({lab: r["step"]["valid_call"] for lab, r in sh.runs.items()})
    rec.update({lab: r["rec"]["valid_call"] for lab, r in sh.runs.items()})
    sharpened = {arm: sh.arms[arm] for arm in deciding_arms(rs)}
  return claims_lib.StudyData(
      arms=rs.arms, bases=rs.bases, kinds=rs.kinds, turns=rs.turns,
      num_tasks=m.evaluator.num_tasks, t_values=t_values, t_tight=t_tight, t_gen=t_gen,
      pass1=pass1, step=step, step_task=a.refs.task,
      step_after_error=a.refs.prev_error_kind != 0, rec=rec, rec_task=a.errs.task,
      rec_kind=a.errs.prev_error_kind, loglik=m.loglik, traj_task=traj_task,
      sharpened=sharpened)


def _rules_record(rules: evidence.Rules) -> dict:
  """comparison.json's "rules": the decision rules in words, their margins and the method."""
  return {"summary": rules.describe(), "margins": dict(
              effect=rules.effect, non_inferiority=rules.non_inferiority,
              loglik_nats=rules.loglik_nats, confidence=rules.confidence,
              min_seeds=rules.min_seeds, min_tasks=rules.min_tasks),
          "method": RULES_METHOD}


def _runs_record(rs: RunSet) -> dict:
  """comparison.json's "runs": label -> where the run is, which checkpoint was evaluated, its
  arm, seed, kind and training settings."""
  out = {}
  for lab, (rep, _) in rs.evals.items():
    arm, seed = arm_and_seed(lab)
    run = rep["run"]
    out[lab] = {"workdir": str(rs.workdirs[lab]), "arm": arm, "seed": seed,
                "config_seed": run.get("seed"), "phase": run["phase"], "step": run["step"],
                "train_budget": run["train_budget"], "rl_steps": run["rl_steps"],
                "credit": run.get("train_credit", ""),
                "kind": "base" if lab in rs.bases else rs.kinds[arm]}
  return out


def comparison_record(rs: RunSet, m: Measured, data: claims_lib.StudyData, decided: dict,
                      credit: dict, rules: evidence.Rules, e: sections.EvalConfig) -> dict:
  """The comparison as comparison.json holds it (before "dir" and "files"): rules, runs, the
  decided claims and every measurement behind them."""
  rep0 = rs.evals[rs.bases[0]][0]
  lik = m.loglik.matrix(rs.shown)
  labels = list(rs.workdirs)
  return {
      "definitions": report.DEFINITIONS,
      "rules": _rules_record(rules),
      "runs": _runs_record(rs),
      "bases": rs.bases,
      "arms": rs.arms,
      "budgets": {"T_tight": report.describe_budget(data.t_tight), "T_gen": data.t_gen},
      "eval": {k: rep0["eval"][k] for k in ("mode", "budgets", "budget_visible", "num_samples",
                                            "num_tasks", "temperature")},
      "curve_ks": [k for k in e.curve_ks if k <= rep0["eval"]["num_samples"]],
      "claims": {str(k): v for k, v in decided.items()},
      "plan": power.record(decided),
      "credit": credit,
      "pass_at_kt": {lab: rep["pass_at_kt"] for lab, (rep, _) in rs.evals.items()},
      "reference_states": m.policy.report["reference_states"],
      "step_quality": {lab: m.policy.report["step_quality"][lab] for lab in labels},
      "recovery": {"controlled": {lab: m.policy.report["controlled"][lab] for lab in labels},
                   "on_policy": {lab: m.evaluator.on_policy(t) for lab, t in m.trajs.items()}},
      "likelihood": lik,
      "sharpening": (None if m.sharpening is None else m.sharpening.record(
          sharpening.rates_overall(m.evaluator, m.sharpening, m.policy.refs))),
  }


def _plot_files(comp: dict, out: pathlib.Path) -> list[str]:
  """Draws the comparison's plots into `out`; returns their file names: pass curves of the
  shown runs at the smallest and largest K, a Pass@(K,T) heatmap per run, step quality,
  controlled recovery and the likelihood matrix."""
  ks, lik = comp["curve_ks"], comp["likelihood"]
  shown_grids = {lab: comp["pass_at_kt"][lab] for lab in lik["rows"]}
  paths = [plots.pass_curves_runs(shown_grids, k, out / f"pass_curves_k{k}.png")
           for k in sorted({ks[0], ks[-1]} if ks else set())]
  paths += [plots.pass_heatmap(g, out / f"pass_heatmap_{lab}.png", f"Pass@(K,T): {lab}")
            for lab, g in comp["pass_at_kt"].items()]
  paths.append(plots.rate_bars(
      {lab: {"valid": q["sampled"]["overall"]["valid"], "oracle": q["sampled"]["overall"]["oracle"],
             "valid (greedy)": q["greedy"]["overall"]["valid"],
             "oracle (greedy)": q["greedy"]["overall"]["oracle"]}
       for lab, q in comp["step_quality"].items()},
      out / "step_quality.png", "Step-level action quality (common reference states)"))
  paths.append(plots.rate_bars(recovery_bars(comp["recovery"]["controlled"]),
                               out / "recovery.png",
                               "Controlled recovery: valid next call (sampled)"))
  paths.append(plots.matrix(lik["sum"], lik["rows"], lik["cols"], out / "likelihood.png",
                            "Mean sum log p of agent tokens"))
  return [pathlib.Path(p).name for p in paths]


def write_comparison(comp: dict, out: pathlib.Path) -> None:
  """Writes the plots, comparison.json and comparison.md into `out` (created if needed) and
  lists them in comp["files"]."""
  out.mkdir(parents=True, exist_ok=True)
  comp["files"] = ["comparison.json", "comparison.md"] + _plot_files(comp, out)
  report.write_json(comp, out / "comparison.json")
  (out / "comparison.md").write_text(report.comparison_markdown(report.to_jsonable(comp)))


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
  n, and with the budget as visible as its training's (`check_evaluations`). Step quality and
  controlled recovery are recomputed for every policy on one common set of states (`measure`);
  log-likelihoods score each run's stored trajectories under the policies its claims compare it
  with. Returns comparison.json's content; only the primary process writes the files.
  """
  bases, arms = group_runs(list(runs), base)
  out = pathlib.Path(out_dir)
  e, rules = sections.eval_config(config), study_rules(config)
  evals = {lab: latest_eval(w) for lab, w in runs.items()}
  check_evaluations(evals, bases)
  rs = RunSet(dict(runs), evals, bases, arms, *arm_kinds(evals, arms))
  m = measure(rs, config, e, programs)
  data = study_data(rs, m)
  decided = claims_lib.decide_claims(data, rules, num_bootstrap=e.num_bootstrap, seed=e.seed)
  credit = claims_lib.decide_credit(data, rules, num_bootstrap=e.num_bootstrap, seed=e.seed)
  comp = comparison_record(rs, m, data, decided, credit, rules, e)
  comp["dir"] = str(out)
  if distributed.is_primary():          # every process computed it; one writes it
    write_comparison(comp, out)
  return comp


RULES_METHOD = (
    "Units: SFT bases, training seeds nested in them (seed N of every arm paired) and test tasks "
    "(crossed). Every interval is the seed-level model's (jaxagent.eval.seedmodel): variance from "
    "the seeds' (or bases') spread plus the tasks', Student quantiles with units - 1 df for the "
    "seed part (Cochran-Cox). A claim is a list of primary conditions 'X > c' with thresholds "
    "fixed in config.study. Held iff every condition is shown (one-sided p < alpha and the exact "
    "sign-flip test over the units at max(alpha, 2^-units)); not held iff one is refuted after "
    "Holm's correction over the claim's conditions; else inconclusive. Secondary conditions are "
    "decided beside, never the verdict. Too few seeds or tasks is always inconclusive, and a "
    "statistic with no variance neither shows nor refutes its condition.")
