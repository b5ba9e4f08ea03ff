"""Evaluation reports: the definitions every report states, JSON helpers and markdown rendering
of one checkpoint's evaluation and of a comparison of runs (whose claims `jaxagent.eval.claims`
decides by the rules of `jaxagent.eval.evidence`). No rule refers to any published figure.
"""

from __future__ import annotations

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
    "intervals": "Per run: percentile bootstrap over tasks (with all their episodes and states) "
                 "for every rate and Pass@(K,T). A study's claims: the seed-level model "
                 "(jaxagent.eval.seedmodel), bases and seeds nested, tasks crossed, paired across "
                 "policies that share the units; Student quantiles with units - 1 df.",
    "error_classes": "Errors that need a different action: tool_failure, precondition_failed, "
                     "wrong_answer. Format errors: parse_error, unknown_tool, bad_arguments (a "
                     "valid re-emitted call fixes them: the skill of step validity).",
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


# ---- claims -------------------------------------------------------------------------------------


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
  if not i or i.get("est") is None:
    return "-"
  if i.get("lo") is None:
    return f"{i['est']:+.3f} [no resample holds data]"
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
        rows.append([policy, mode, name, fmt_rate(r["valid"]), fmt_rate(r["oracle"]),
                     fmt_rate(r.get("oracle_prob")), fmt_rate(r.get("entropy"))])
  return table(["policy", "mode", "states", "valid-call rate", "oracle-match rate",
                "expected oracle-match probability", "entropy (nats/token)"], rows)


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
  if "step_quality" not in rep:
    out += ["Rollouts only (a study's evaluation: step quality, recovery and likelihoods are in "
            "its comparison, on states common to every run).", ""]
  else:
    out += ["## Step-level action quality", "",
            f"Reference states: {rep['reference_states']}.", ""] + quality_md(rep["step_quality"])
    out += ["## Error recovery", "", "On-policy (each policy's own rollouts):", ""]
    out += recovery_md(rep["recovery"]["on_policy"])
    out += ["Controlled (the base policy's error prefixes, every policy acting once):", ""]
    out += recovery_md(rep["recovery"]["controlled"])
    out += ["## Log-likelihoods", "", f"Scoring temperature {rep['likelihood']['temperature']}.",
            ""]
    out += likelihood_md(rep["likelihood"])
  out += ["## Files", ""] + [f"- `{f}`" for f in rep["files"]] + [""]
  return "\n".join(out)


def conditions_md(conds: list[dict]) -> list[str]:
  rows = [[c["condition"], fmt_interval(c), fmt(c["threshold"]), c["tasks"], c.get("units", "-"),
           fmt(c["p_show"]), fmt(c["p_refute"]), fmt(c.get("p_exact_show")),
           "shown" if c["shown"] else "refuted" if c["refuted"] else "-"]
          for c in conds]
  return table(["condition", "estimate [interval]", "threshold", "tasks", "units", "p(not shown)",
                "p(not refuted)", "exact p(not shown)", "outcome"], rows)


def plan_md(plan: dict | None) -> list[str]:
  """The pre-registered plan the comparison was run under, and the power it achieved."""
  if not plan:
    return []
  out = ["## Pre-registered plan and achieved power", ""] + list(plan["lines"])
  out += table(["claim", "achieved power at the planned effect"],
               [[k, fmt(v, 2)] for k, v in plan["achieved_power"].items()])
  return out


def _details_md(num: int, det: dict) -> list[str]:
  out = []
  if num == 1 and "per_budget" in det:
    out += table(["T", "Pass base", "Pass RL", "gain [interval]", "share of headroom"],
                 [[t, fmt(b["pass_base"]), fmt(b["pass_rl"]), fmt_interval(b["gain"]),
                   fmt_interval(b["share_of_headroom"])] for t, b in det["per_budget"].items()])
  if num == 5 and "by_error_kind" in det:
    out += table(["previous error", "class", "states", "RL", "base", "RL - base"],
                 [[k, v["class"], v["states"], fmt_interval(v["rate_rl"]),
                   fmt_interval(v["rate_base"]), fmt_interval(v["difference"])]
                  for k, v in det["by_error_kind"].items()])
  plain = {k: v for k, v in det.items() if k not in ("per_budget", "by_error_kind")}
  out += [f"- {k}: " + (fmt_interval(v) if isinstance(v, dict) else fmt(v, 4))
          for k, v in plain.items()]
  return out + [""] if plain else out


def _first(d: dict | None) -> str:
  """A decision's first condition with its estimate and interval ("-" without one)."""
  first = (d["conditions"] or [None])[0] if d else None
  return f"{first['condition']}: {fmt_interval(first)}" if first else "-"


def verdicts_md(claims: dict) -> list[str]:
  """One row per claim: verdict, deciding arm, its first condition's estimate, and the same rule
  against the sharpened base (secondary)."""
  rows = []
  for num, c in claims.items():
    arm = c.get("decided_on")
    first = _first(c["per_arm"][arm]) if arm else c.get("note", "-")
    sh = c.get("sharpened")
    rows.append([num, f"**{c['verdict']}**", arm or "-", first,
                 f"{sh['verdict']}: {_first(sh)}" if sh else "-",
                 "; ".join(f"{a}: {d['verdict']}" for a, d in c["per_arm"].items() if a != arm)
                 or "-"])
  return table(["claim", "verdict", "decided on", "first condition",
                "vs a sharpened base (secondary)", "other arms"], rows)


def sharpening_md(sh: dict | None, claims: dict) -> list[str]:
  """The sharpening control: the bases' sweep (entropy, step quality, expected oracle-match
  probability per temperature), each RL run's match, and each claim against the sharpened
  base."""
  if not sh:
    return []
  out = ["## Sharpening control: RL vs a sharpened base (secondary)", "", sh["definition"], ""]
  rows = [[b, t, fmt_rate(r["entropy"]), fmt_rate(r["valid"]), fmt_rate(r["oracle"]),
           fmt_rate(r.get("oracle_prob"))]
          for b, per in sh["base_sweep"].items() for t, r in per.items()]
  out += table(["base", "temperature", "entropy (nats/token)", "valid-call rate",
                "oracle-match rate", "expected oracle-match probability"], rows)
  out += table(["RL run", "entropy (nats/token)", "matched base", "temperature",
                "base entropy there"],
               [[lab, fmt(m["entropy_rl"]), m["base"], m["temperature"], fmt(m["entropy_base"])]
                for lab, m in sh["matched"].items()])
  for num, c in claims.items():
    d = c.get("sharpened")
    if not d:
      continue
    out += [f"### Claim {num} on `{c['decided_on']}` vs {', '.join(sorted(set(d['against'])))}:"
            f" {d['verdict']}" + (f" ({d['note']})" if d.get("note") else ""), ""]
    if d["conditions"]:
      out += conditions_md(d["conditions"])
    out += _details_md(int(num), d["details"])
  return out


def comparison_markdown(comp: dict) -> str:
  """The multi-run comparison (`compare.compare`'s comparison.json) as markdown: the rules first
  (fixed before the numbers), then the verdicts and the evidence behind each."""
  out = ["# Comparison of runs", ""]
  out += table(["label", "arm", "seed", "kind", "workdir", "checkpoint", "train budget",
                "RL steps"],
               [[lab, r["arm"], r["seed"], r["kind"], r["workdir"], f"{r['phase']} {r['step']}",
                 r["train_budget"], r["rl_steps"]] for lab, r in comp["runs"].items()])
  out += [f"Base: {', '.join(f'`{b}`' for b in comp['bases'])}. Evaluation: {comp['eval']}.", ""]
  out += ["## Rules (fixed before the numbers)", "", comp["rules"]["summary"] + ".", "",
          comp["rules"]["method"], ""]
  out += [f"{num}. {c['rule']}" for num, c in comp["claims"].items()] + [""]
  out += [f"Claim 1's budgets: T_tight = {fmt_budget(comp['budgets']['T_tight'])}, T_gen = "
          f"{comp['budgets']['T_gen']}.", ""]
  out += ["## Verdicts", ""] + verdicts_md(comp["claims"])
  out += plan_md(comp.get("plan"))
  out += sharpening_md(comp.get("sharpening"), comp["claims"])
  if comp.get("credit"):
    out += ["## Turn-level credit against the standard arm", ""]
    for arm, d in comp["credit"].items():
      credit = next((r["credit"] for r in comp["runs"].values() if r["arm"] == arm), "")
      out += [f"### `{arm}` ({credit}) vs `{d['against']}`: **{d['verdict']}**", "", d["rule"], ""]
      out += conditions_md(d["conditions"]) + _details_md(0, d["details"])
  out += ["## Claims", ""]
  for num, c in comp["claims"].items():
    out += [f"### Claim {num}: **{c['verdict']}** (decided on `{c.get('decided_on')}`)", "",
            c["claim"], ""]
    if c.get("note"):
      out += [f"Note: {c['note']}", ""]
    for arm, d in c["per_arm"].items():
      out += [f"#### `{arm}`: {d['verdict']}" + (f" ({d['note']})" if d.get("note") else ""), ""]
      if d["conditions"]:
        out += conditions_md(d["conditions"])
      sec = d.get("secondary")
      if sec:
        out += [f"Secondary (reported, not the verdict): {sec['verdict']}"
                + (f" ({sec['note']})" if sec.get("note") else ""), ""]
        out += conditions_md(sec["conditions"]) if sec["conditions"] else []
      out += _details_md(int(num), d["details"])
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
