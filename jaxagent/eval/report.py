"""Evaluation reports: the definitions every report states, paired bootstrap helpers, the five
claims of docs/STUDY.md decided by stated mechanical rules, and markdown rendering.

Verdicts. Every claim is decided per RL run from a percentile bootstrap interval [lo, hi] of a
difference D (confidence `confidence`): "held" when the interval lies above 0 as the rule says,
"not held" when it lies on the wrong side of 0, otherwise "inconclusive" (the data cannot decide).
Intervals are paired: the same resampled tasks (or states, or trajectories) for every policy, so
a difference's interval reflects the paired design. A claim's overall verdict: "held" if it held
for at least one run it applies to and failed for none, "not held" in the converse case, "mixed"
if both occur, "inconclusive" if no run decided it. No rule refers to any published figure.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Sequence

import numpy as np

HELD, NOT_HELD, INCONCLUSIVE, MIXED = "held", "not held", "inconclusive", "mixed"

DEFINITIONS = {
    "pass_at_kt": "Pass@(K,T): per task 1 - C(n - c_T, K) / C(n, K) with c_T of n episodes solved "
                  "within T turns, averaged over tasks; percentile bootstrap interval over tasks. "
                  "Truncation mode: one run per task at T_max with the budget hidden, solved "
                  "within T <=> success turn <= T. Rerun mode: one run per T.",
    "error_state": "A turn t >= 1 taken right after an acted turn whose action failed "
                   "(error_kind != none); its kind is that failed action's error_kind.",
    "recovery": "Over error states: fraction whose action is a valid call (valid), and fraction "
                "equal to the oracle's action in that state (oracle). On-policy: a policy's own "
                "rollouts. Controlled: the error prefixes of the base policy's rollouts, each "
                "policy acting once at each.",
    "step_quality": "On reference states (prefixes of oracle and base-policy trajectories; env "
                    "state rebuilt by replaying the recorded actions) each policy emits one action, "
                    "greedy and sampled: fraction valid and fraction equal to the oracle's action.",
    "likelihood": "For trajectories of policy A: sum and per-token mean of log-probabilities of the "
                  "agent's tokens only (loss_mask), under A and under B, averaged over trajectories.",
    "intervals": "Percentile bootstrap over tasks (Pass), states (rates) or trajectories "
                 "(likelihoods), paired across policies where they share the units.",
}

CLAIMS = {
    1: "Trajectory-level RL gains depend on the interaction budget T: large when T is generous, "
       "shrinking or vanishing when T is tight.",
    2: "RL mostly improves error recovery rather than the quality of each single action "
       "(per-step quality can even drop under standard multi-turn RL).",
    3: "BudgetMix RL gives robust performance across budgets and keeps single-step quality.",
    4: "RL-generated trajectories are far more likely under the RL policy than under the base "
       "policy.",
    5: "In error states, the RL policy corrects a failed tool call more often than the base policy.",
}

RULES = {
    1: "Pass@(1,T). T_tight is per task: the smallest evaluated T >= that task's optimal number "
       "of turns (no slack for a single wasted turn); T_gen = the largest evaluated T. "
       "gain(T) = Pass_RL(1,T) - Pass_base(1,T), averaged over tasks; "
       "D = gain(T_gen) - gain(T_tight). Per RL run: held iff lo(D) > 0 and lo(gain(T_gen)) > 0; "
       "not held iff hi(D) < 0 or hi(gain(T_gen)) < 0; else inconclusive (also when "
       "T_tight = T_gen for every task). Intervals: paired bootstrap over tasks.",
    2: "Valid-call rates of sampled actions. d_step = step-quality rate RL - base on the common "
       "reference states; d_rec = controlled recovery rate RL - base on the common error states; "
       "D = d_rec - d_step. Per fixed-T RL run: held iff lo(D) > 0; not held iff hi(D) < 0; else "
       "inconclusive. 'Step quality dropped' is reported iff hi(d_step) < 0.",
    3: "Per BudgetMix run m, with Pass@(1,T) at T in {T_tight, T_gen} (claim 1) and the sampled "
       "valid-call step-quality rate: held iff lo(Pass_m - Pass_base) > 0 at both T, no fixed-T run "
       "f has lo(Pass_f - Pass_m) > 0 at either T, and hi(d_step_m) >= 0; not held iff "
       "hi(Pass_m - Pass_base) < 0 at some T, or some fixed-T run has lo(Pass_f - Pass_m) > 0, or "
       "hi(d_step_m) < 0; else inconclusive.",
    4: "Per RL run r, over r's own evaluation trajectories: x = sum_ll(tau; r) - sum_ll(tau; base) "
       "(the log-likelihood ratio, agent tokens only). held iff lo(mean x) > 0; not held iff "
       "hi(mean x) < 0; else inconclusive. Bootstrap over trajectories.",
    5: "Controlled recovery, valid-call rate of sampled actions on the common error states: "
       "D = rate_RL - rate_base. Per RL run: held iff lo(D) > 0; not held iff hi(D) < 0; else "
       "inconclusive. Each policy's rates (controlled and on-policy) are listed.",
}


# ---- JSON ---------------------------------------------------------------------------------------


def to_jsonable(x):
  """numpy / nested containers -> plain JSON types (NaN and inf become None)."""
  if isinstance(x, dict):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return to_jsonable(x.tolist())
  if isinstance(x, (np.bool_, bool)):
    return bool(x)
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating, float)):
    v = float(x)
    return v if math.isfinite(v) else None
  return x


def write_json(obj, path) -> None:
  with open(path, "w") as f:
    json.dump(to_jsonable(obj), f, indent=1, sort_keys=False)
    f.write("\n")


def grid_json(grid: dict, t_values: Sequence[int] | None = None) -> dict:
  """A `pass_at_kt` result as JSON lists; `t_values` replaces grid["t"] (rerun-mode budgets)."""
  return {"k": [int(k) for k in grid["k"]],
          "t": [int(t) for t in (grid["t"] if t_values is None else t_values)],
          "mean": np.asarray(grid["mean"]).tolist(), "lo": np.asarray(grid["lo"]).tolist(),
          "hi": np.asarray(grid["hi"]).tolist(), "num_tasks": int(grid["num_tasks"]),
          "n": int(grid["n"])}


# ---- bootstrap ----------------------------------------------------------------------------------


def interval(samples: np.ndarray, confidence: float, estimate: float | None = None) -> dict:
  """{"est", "lo", "hi"} from bootstrap samples (percentile interval, widened to hold est)."""
  s = np.asarray(samples, np.float64)
  est = float(np.mean(s)) if estimate is None else float(estimate)
  alpha = (1 - confidence) / 2
  lo, hi = np.quantile(s, [alpha, 1 - alpha])
  return {"est": est, "lo": float(min(lo, est)), "hi": float(max(hi, est))}


def resample_weights(n: int, num_bootstrap: int, rng: np.random.Generator) -> np.ndarray:
  """[num_bootstrap, n] multiplicities / n of n units resampled with replacement, so
  `w @ x` is the bootstrap means of per-unit values x [n] (same resamples for every x)."""
  w = np.zeros((num_bootstrap, n))
  if n:
    idx = rng.integers(0, n, size=(num_bootstrap, n))
    np.add.at(w, (np.arange(num_bootstrap)[:, None], idx), 1.0)
  return w / max(n, 1)


def paired_diff(x: np.ndarray, y: np.ndarray, w: np.ndarray, confidence: float) -> dict:
  """Interval of mean(x - y) over shared units (x, y [n]) with resample weights w [B, n]."""
  d = np.asarray(x, np.float64) - np.asarray(y, np.float64)
  return interval(w @ d, confidence, float(d.mean()) if d.size else float("nan"))


def _lo(i: dict) -> float:
  return i["lo"]


def _hi(i: dict) -> float:
  return i["hi"]


def combine(verdicts: Sequence[str]) -> str:
  """Overall verdict of a claim from its per-run verdicts (see the module docstring)."""
  held, failed = HELD in verdicts, NOT_HELD in verdicts
  if held and failed:
    return MIXED
  if held:
    return HELD
  if failed:
    return NOT_HELD
  return INCONCLUSIVE


# ---- claims -------------------------------------------------------------------------------------


def tight_generous(t_values: Sequence[int], optimal_turns: np.ndarray) -> tuple[np.ndarray, int]:
  """(T_tight [tasks], T_gen) of claim 1's rule: per task the smallest evaluated T >= its optimal
  turns (T_gen where none is), and the largest evaluated T."""
  t_values = np.asarray(sorted(int(t) for t in t_values))
  opt = np.asarray(optimal_turns, np.int64).reshape(-1)
  idx = np.minimum(np.searchsorted(t_values, opt, side="left"), len(t_values) - 1)
  return t_values[idx], int(t_values[-1])


def at_budget(p: np.ndarray, t_values, t) -> np.ndarray:
  """Per-task values of p [tasks, len(t_values)] at budget t: one T for all tasks, or [tasks]."""
  t_values = [int(v) for v in t_values]
  t = np.asarray(t)
  if t.ndim == 0:
    return p[:, t_values.index(int(t))]
  cols = np.asarray([t_values.index(int(x)) for x in t], np.int64)
  return p[np.arange(p.shape[0]), cols]


def describe_budget(t) -> int | dict:
  """JSON form of a budget: the T, or a summary of per-task budgets."""
  t = np.asarray(t)
  if t.ndim == 0:
    return int(t)
  counts = {int(v): int(c) for v, c in zip(*np.unique(t, return_counts=True))}
  return {"per_task": True, "mean": float(t.mean()) if t.size else None, "tasks_at": counts}


def fmt_budget(t) -> str:
  if isinstance(t, dict):
    at = ", ".join(f"T={v}: {c}" for v, c in t["tasks_at"].items())
    return f"per task (mean {t['mean']:.2f}; tasks at {at})"
  return str(t)


def claim_budget_gain(pass1: dict[str, np.ndarray], t_values, t_tight: int, t_gen: int, base: str,
                      rl: Sequence[str], w: np.ndarray, confidence: float) -> dict:
  """Claim 1. pass1[label] = per-task Pass@(1,T) [tasks, len(t_values)]; w: task resampling."""
  at = functools.partial(at_budget, t_values=t_values)
  same = bool(np.all(np.asarray(t_tight) == t_gen))
  per = {}
  for r in rl:
    g = pass1[r] - pass1[base]
    gain_t = paired_diff(at(pass1[r], t=t_tight), at(pass1[base], t=t_tight), w, confidence)
    gain_g = paired_diff(at(pass1[r], t=t_gen), at(pass1[base], t=t_gen), w, confidence)
    d = paired_diff(at(g, t=t_gen), at(g, t=t_tight), w, confidence)
    if same:
      v = INCONCLUSIVE
    elif _lo(d) > 0 and _lo(gain_g) > 0:
      v = HELD
    elif _hi(d) < 0 or _hi(gain_g) < 0:
      v = NOT_HELD
    else:
      v = INCONCLUSIVE
    per[r] = {"verdict": v, "gain_tight": gain_t, "gain_generous": gain_g, "D": d,
              "pass_rl_tight": float(at(pass1[r], t=t_tight).mean()),
              "pass_rl_generous": float(at(pass1[r], t=t_gen).mean()),
              "pass_base_tight": float(at(pass1[base], t=t_tight).mean()),
              "pass_base_generous": float(at(pass1[base], t=t_gen).mean())}
  return {"T_tight": describe_budget(t_tight), "T_gen": t_gen, "per_run": per}


def claim_recovery_vs_step(step: dict[str, np.ndarray], rec: dict[str, np.ndarray], base: str,
                           fixed: Sequence[str], num_bootstrap: int, confidence: float,
                           seed: int) -> dict:
  """Claim 2. step[label] [N] and rec[label] [M]: 0/1 outcomes on the common states."""
  rng = np.random.default_rng(seed)
  ws = resample_weights(len(step[base]), num_bootstrap, rng)
  wr = resample_weights(len(rec[base]), num_bootstrap, rng)
  per = {}
  for r in fixed:
    ds = np.asarray(step[r], float) - np.asarray(step[base], float)
    dr = np.asarray(rec[r], float) - np.asarray(rec[base], float)
    if len(ds) == 0 or len(dr) == 0:
      per[r] = {"verdict": INCONCLUSIVE, "note": "no reference or error states"}
      continue
    d_step = interval(ws @ ds, confidence, ds.mean())
    d_rec = interval(wr @ dr, confidence, dr.mean())
    d = interval(wr @ dr - ws @ ds, confidence, dr.mean() - ds.mean())
    v = HELD if _lo(d) > 0 else NOT_HELD if _hi(d) < 0 else INCONCLUSIVE
    per[r] = {"verdict": v, "d_step": d_step, "d_rec": d_rec, "D": d,
              "step_quality_dropped": bool(_hi(d_step) < 0)}
  return {"per_run": per}


def claim_budgetmix(pass1: dict[str, np.ndarray], t_values, t_tight: int, t_gen: int,
                    step: dict[str, np.ndarray], base: str, mix: Sequence[str],
                    fixed: Sequence[str], w: np.ndarray, num_bootstrap: int, confidence: float,
                    seed: int) -> dict:
  """Claim 3 (see RULES[3])."""
  at = functools.partial(at_budget, t_values=t_values)
  ts = {"tight": t_tight, "generous": t_gen}
  ws = resample_weights(len(step[base]), num_bootstrap, np.random.default_rng(seed))
  per = {}
  for m in mix:
    vs_base = {n: paired_diff(at(pass1[m], t=t), at(pass1[base], t=t), w, confidence)
               for n, t in ts.items()}
    fixed_better = {f: {n: paired_diff(at(pass1[f], t=t), at(pass1[m], t=t), w, confidence)
                        for n, t in ts.items()}
                    for f in fixed}
    ds = np.asarray(step[m], float) - np.asarray(step[base], float)
    d_step = interval(ws @ ds, confidence, ds.mean()) if len(ds) else None
    any_fixed_better = any(_lo(i) > 0 for f in fixed_better.values() for i in f.values())
    if d_step is None:
      v = INCONCLUSIVE
    elif (all(_lo(i) > 0 for i in vs_base.values()) and not any_fixed_better
          and _hi(d_step) >= 0):
      v = HELD
    elif any(_hi(i) < 0 for i in vs_base.values()) or any_fixed_better or _hi(d_step) < 0:
      v = NOT_HELD
    else:
      v = INCONCLUSIVE
    per[m] = {"verdict": v, "gain_vs_base": {str(t): i for t, i in vs_base.items()},
              "fixed_minus_mix": {f: {str(t): i for t, i in d.items()}
                                  for f, d in fixed_better.items()},
              "d_step": d_step}
  return {"T_tight": describe_budget(t_tight), "T_gen": t_gen, "per_run": per}


def claim_likelihood(per_traj: dict, base: str, rl: Sequence[str], num_bootstrap: int,
                     confidence: float, seed: int) -> dict:
  """Claim 4. per_traj[A][B] = `likelihood.agent_loglik` of A's trajectories under B."""
  rng = np.random.default_rng(seed)
  per = {}
  for r in rl:
    x = per_traj[r][r]["sum"] - per_traj[r][base]["sum"]
    keep = per_traj[r][r]["count"] > 0
    x = x[keep]
    if x.size == 0:
      per[r] = {"verdict": INCONCLUSIVE, "note": "no agent tokens"}
      continue
    i = interval(resample_weights(x.size, num_bootstrap, rng) @ x, confidence, x.mean())
    tok = (per_traj[r][r]["mean"] - per_traj[r][base]["mean"])[keep]
    v = HELD if _lo(i) > 0 else NOT_HELD if _hi(i) < 0 else INCONCLUSIVE
    per[r] = {"verdict": v, "log_ratio": i, "per_token_diff": float(np.mean(tok)),
              "num_trajectories": int(x.size)}
  return {"per_run": per}


def claim_recovery(rec: dict[str, np.ndarray], base: str, rl: Sequence[str], num_bootstrap: int,
                   confidence: float, seed: int) -> dict:
  """Claim 5. rec[label] [M]: 0/1 valid next call on the common error states (controlled)."""
  w = resample_weights(len(rec[base]), num_bootstrap, np.random.default_rng(seed))
  per = {}
  for r in rl:
    if len(rec[base]) == 0:
      per[r] = {"verdict": INCONCLUSIVE, "note": "no error states"}
      continue
    d = paired_diff(rec[r], rec[base], w, confidence)
    v = HELD if _lo(d) > 0 else NOT_HELD if _hi(d) < 0 else INCONCLUSIVE
    per[r] = {"verdict": v, "D": d, "rate_rl": float(np.mean(rec[r])),
              "rate_base": float(np.mean(rec[base]))}
  return {"per_run": per}


def finish_claim(num: int, result: dict, note: str = "") -> dict:
  verdicts = [p["verdict"] for p in result["per_run"].values()]
  out = {"claim": CLAIMS[num], "rule": RULES[num], **result, "verdict": combine(verdicts)}
  if not verdicts:
    out["note"] = note or "no run this claim applies to"
  elif note:
    out["note"] = note
  return out


# ---- markdown -----------------------------------------------------------------------------------


def fmt(x, digits: int = 3) -> str:
  if x is None:
    return "-"
  if isinstance(x, float) and not math.isfinite(x):
    return "-"
  if isinstance(x, (float, np.floating)):
    return f"{x:.{digits}f}"
  return str(x)


def fmt_rate(r: dict | None) -> str:
  if not r or r.get("rate") is None:
    return "- (n=0)"
  return f"{r['rate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] (n={r['n']})"


def fmt_interval(i: dict | None) -> str:
  if not i:
    return "-"
  return f"{i['est']:+.3f} [{i['lo']:+.3f}, {i['hi']:+.3f}]"


def table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return out + [""]


def grid_table(grid: dict, ks: Sequence[int] | None = None) -> list[str]:
  ks = list(grid["k"]) if ks is None else [k for k in ks if k in grid["k"]]
  rows = []
  for k in ks:
    i = list(grid["k"]).index(k)
    rows.append([f"K={k}"] + [f"{m:.3f} [{lo:.2f},{hi:.2f}]" for m, lo, hi in
                              zip(grid["mean"][i], grid["lo"][i], grid["hi"][i])])
  return table(["", *[f"T={t}" for t in grid["t"]]], rows)


def definitions_md() -> list[str]:
  out = ["## Definitions", ""]
  out += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
  return out + [""]


def quality_md(sq: dict) -> list[str]:
  """Step-quality table from {policy: {mode: quality_rates}}."""
  rows = []
  for policy, modes in sq.items():
    for mode, q in modes.items():
      groups = [("overall", q["overall"])]
      for g in ("source", "env"):
        groups += [(f"{g}={k}", v) for k, v in q.get(g, {}).items()]
      for name, r in groups:
        rows.append([policy, mode, name, fmt_rate(r["valid"]), fmt_rate(r["oracle"])])
  return table(["policy", "mode", "states", "valid-call rate", "oracle-match rate"], rows)


def recovery_md(rec: dict) -> list[str]:
  """Recovery table from {policy: {kind: {"valid", "oracle"}}} (or {policy: {mode: ...}})."""
  rows = []
  for policy, v in rec.items():
    nested = v and all(isinstance(x, dict) and "all" in x for x in v.values())
    items = v.items() if nested else [("", v)]
    for mode, kinds in items:
      for kind, r in kinds.items():
        rows.append([policy, mode or "rollouts", kind, fmt_rate(r["valid"]),
                     fmt_rate(r["oracle"])])
  return table(["policy", "mode", "previous error", "valid next call", "oracle next call"], rows)


def likelihood_md(lik: dict) -> list[str]:
  rows = []
  for i, a in enumerate(lik["rows"]):
    for j, b in enumerate(lik["cols"]):
      rows.append([a, b, fmt(lik["sum"][i][j]), fmt(lik["mean"][i][j], 4)])
  return table(["trajectories of", "scored under", "mean sum log p (agent tokens)",
                "mean per-token log p"], rows)


def run_markdown(rep: dict) -> str:
  """The single-checkpoint report (`job.evaluate_checkpoint`'s report.json) as markdown."""
  r, e = rep["run"], rep["eval"]
  out = [f"# Evaluation of {r['workdir']} ({r['phase']} step {r['step']})", "",
         f"Environment `{r['env']}` {r['difficulty']}; trained with budget `{r['train_budget']}`. "
         f"Base policy: {r['base']}.", "",
         f"Mode **{e['mode']}** (budget {'visible' if e['budget_visible'] else 'hidden'}), "
         f"T = {e['budgets']}, n = {e['num_samples']} episodes per task, {e['num_tasks']} test "
         f"tasks, temperature {e['temperature']}, seed {e['seed']}, {e['confidence']:.0%} "
         f"intervals from {e['num_bootstrap']} bootstrap resamples.", ""]
  out += definitions_md()
  out += ["## Pass@(K,T)", ""] + grid_table(rep["pass_at_kt"])
  out += ["## Episode statistics (T_max rollouts)", ""]
  keys = list(next(iter(rep["stats"].values())))
  out += table(["policy", *keys], [[p, *[fmt(s[k]) for k in keys]] for p, s in rep["stats"].items()])
  out += ["## Step-level action quality", "",
          f"Reference states: {rep['reference_states']}.", ""] + quality_md(rep["step_quality"])
  out += ["## Error recovery", "", "On-policy (each policy's own rollouts):", ""]
  out += recovery_md(rep["recovery"]["on_policy"])
  out += ["Controlled (the base policy's error prefixes, every policy acting once):", ""]
  out += recovery_md(rep["recovery"]["controlled"])
  out += ["## Log-likelihoods", "", f"Scoring temperature {rep['likelihood']['temperature']}.", ""]
  out += likelihood_md(rep["likelihood"])
  out += ["## Files", ""] + [f"- `{f}`" for f in rep["files"]] + [""]
  return "\n".join(out)


def _claim_numbers(num: int, per: dict) -> str:
  if "note" in per:
    return per["note"]
  if num == 1:
    return (f"gain(T_tight) {fmt_interval(per['gain_tight'])}, gain(T_gen) "
            f"{fmt_interval(per['gain_generous'])}, D {fmt_interval(per['D'])}; Pass@1 RL "
            f"{per['pass_rl_tight']:.3f} -> {per['pass_rl_generous']:.3f}, base "
            f"{per['pass_base_tight']:.3f} -> {per['pass_base_generous']:.3f}")
  if num == 2:
    return (f"d_rec {fmt_interval(per['d_rec'])}, d_step {fmt_interval(per['d_step'])}, D "
            f"{fmt_interval(per['D'])}; step quality dropped: {per['step_quality_dropped']}")
  if num == 3:
    g = ", ".join(f"T_{t}: {fmt_interval(i)}" for t, i in per["gain_vs_base"].items())
    f = "; ".join(f"{lab} - mix " + ", ".join(f"T_{t}: {fmt_interval(i)}" for t, i in d.items())
                  for lab, d in per["fixed_minus_mix"].items())
    return f"vs base {g}; {f or 'no fixed-T run'}; d_step {fmt_interval(per['d_step'])}"
  if num == 4:
    return (f"mean log p_RL(tau) - log p_base(tau) {fmt_interval(per['log_ratio'])} nats over "
            f"{per['num_trajectories']} trajectories; per token {per['per_token_diff']:+.4f}")
  return (f"rate RL {per['rate_rl']:.3f}, base {per['rate_base']:.3f}, D {fmt_interval(per['D'])}")


def comparison_markdown(comp: dict) -> str:
  """The multi-run comparison (`job.compare`'s comparison.json) as markdown."""
  out = ["# Comparison of runs", ""]
  out += table(["label", "kind", "workdir", "checkpoint", "train budget", "RL steps"],
               [[lab, r["kind"], r["workdir"], f"{r['phase']} {r['step']}", r["train_budget"],
                 r["rl_steps"]] for lab, r in comp["runs"].items()])
  out += [f"Base: `{comp['base']}`. Evaluation: {comp['eval']}.", ""]
  out += ["## Claims", ""]
  for num, c in comp["claims"].items():
    out += [f"### Claim {num}: **{c['verdict']}**", "", c["claim"], "", f"Rule: {c['rule']}", ""]
    if "T_tight" in c:
      out += [f"T_tight = {fmt_budget(c['T_tight'])}, T_gen = {c['T_gen']}.", ""]
    out += [f"- `{lab}`: **{p['verdict']}** - {_claim_numbers(int(num), p)}"
            for lab, p in c["per_run"].items()]
    if c.get("note"):
      out += [f"- note: {c['note']}"]
    out += [""]
  out += definitions_md()
  out += ["## Pass@(K,T) per run", ""]
  for lab, g in comp["pass_at_kt"].items():
    out += [f"### {lab}", ""] + grid_table(g, comp["curve_ks"])
  out += ["## Step-level action quality (common reference states)", "",
          f"Reference states: {comp['reference_states']}.", ""] + quality_md(comp["step_quality"])
  out += ["## Error recovery", "", "Controlled (the base run's error prefixes):", ""]
  out += recovery_md(comp["recovery"]["controlled"])
  out += ["On-policy (each run's own evaluation rollouts):", ""]
  out += recovery_md(comp["recovery"]["on_policy"])
  out += ["## Cross log-likelihoods", "", f"Scoring temperature {comp['likelihood']['temperature']}.",
          ""] + likelihood_md(comp["likelihood"])
  out += ["## Files", ""] + [f"- `{f}`" for f in comp["files"]] + [""]
  return "\n".join(out)
