"""The pre-registered plan of docs/STUDY.md: each claim's primary statistic, its margin, the effect
it is powered for, the variance components the committed runs measured, and the design (SFT
bases x RL seeds per base) that reaches the target power.

    python -m jaxagent.eval.power          # prints the plan

**Variance components** of a primary statistic, from the two committed 3-seed studies with
different master seeds (hence different SFT bases), docs/results/study_default/seed{0,1}/
comparison.md, standard arm `fixed_generous` (numbers copied in `MEASURED`, each with its table):
per study, the seed part s^2 = var of the 3 per-seed contrasts (ddof 1); the task part
T = V_boot - s^2 (S-1) / S^2, V_boot = ((hi - lo) / 3.92)^2 from the study's seed-and-task
bootstrap interval (its seed part is the population variance over S); the base part = the
variance of the two studies' estimates minus the mean seed part / S (clipped at 0; 1 df: rough).
Where the per-seed values are not in the report (claim 4), the whole bootstrap variance is taken
as seed variance (S V_boot: conservative).

**Power** of one condition "X > c" with planned effect delta, B bases of R seeds, N tasks (f = N /
128): V = base / B + seed / (B R) + T / f, G = B units (R if B = 1), the noncentral t with G - 1
df: P(t_{G-1}(ncp = (delta - c) / sqrt(V)) > t_{G-1, 1 - alpha}). It ignores the task part's
extra df (conservative) and the sign-flip guard (with G < 6 every unit must be above c; the t
test's power bounds it from above).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

ALPHA, TARGET = 0.025, 0.8
SOURCE = "docs/results/study_default/seed{0,1}/comparison.md, arm fixed_generous"


@dataclasses.dataclass(frozen=True)
class Measured:
  """One primary statistic's measurements: per study, the per-seed contrasts (None where the
  report lacks them) and the bootstrap interval of the pooled estimate."""
  statistic: str
  threshold: float
  per_seed: tuple                     # per study: (c_0, c_1, c_2) or None
  estimate: tuple                     # per study: pooled estimate
  interval: tuple                     # per study: (lo, hi) of the seed-and-task bootstrap
  where: str


MEASURED = {
    1: Measured("gain(T_gen) = Pass_RL(1,8) - Pass_base(1,8)", 0.02,
                ((0.119, 0.113, 0.136), (0.035, 0.097, 0.115)), (0.123, 0.083),
                ((0.093, 0.155), (0.019, 0.141)),
                "Pass@(K,T) per run, K=1, T=8 (base 0.629 / 0.303); Verdicts row 1"),
    3: Measured("Pass_mix(1,T) - Pass_fixed_tight(1,T), the worst T", -0.05,
                ((-0.015, -0.032, 0.003), (-0.036, -0.030, 0.004)), (-0.015, -0.021),
                ((-0.035, 0.004), (-0.045, 0.003)),
                "Pass@(K,T) per run, K=1, T=3 (seed0) and T=5 (seed1); claim 3 conditions"),
    4: Measured("x = log p_RL(tau_RL) - log p_base(tau_RL) (nats)", 1.0, (None, None),
                (1.085, 1.873), ((0.839, 1.338), (0.902, 2.986)),
                "claim 4, fixed_generous, rl_vs_base"),
    5: Measured("d_rec(action errors), controlled, sampled", 0.02,
                ((0.027, 0.024, 0.083), (0.110, 0.022, 0.029)), (0.045, 0.053),
                ((0.012, 0.090), (0.007, 0.106)),
                "controlled recovery, sampled, action rows (base 0.172 / 0.261); Verdicts row 5"),
}
# Claim 2's first condition is claim 5's statistic; its second, d_rec - d_step, measured -0.039
# [-0.093, +0.022] (seed1): below its margin, so no design powers it to be held.
MEASURED[2] = dataclasses.replace(MEASURED[5], statistic="d_rec(action errors) (claim 2's first)")


def components(m: Measured, seeds: int = 3) -> dict:
  """{"seed", "task", "base", "delta"}: the variance components (`module docstring`) and the
  planned effect (the mean of the studies' estimates)."""
  seed_v, task_v = [], []
  for per, (lo, hi) in zip(m.per_seed, m.interval):
    boot = ((hi - lo) / (2 * stats.norm.ppf(0.975))) ** 2
    if per is None:
      seed_v.append(seeds * boot)
      task_v.append(0.0)
    else:
      s2 = float(np.var(per, ddof=1))
      seed_v.append(s2)
      task_v.append(max(boot - s2 * (seeds - 1) / seeds ** 2, 0.0))
  seed, task = float(np.mean(seed_v)), float(np.mean(task_v))
  base = max(float(np.var(m.estimate, ddof=1)) - seed / seeds, 0.0)
  return {"seed": seed, "task": task, "base": base, "delta": float(np.mean(m.estimate))}


def power(delta: float, threshold: float, comps: dict, bases: int, seeds_per_base: int,
          task_factor: float = 1.0, alpha: float = ALPHA) -> float:
  """The power to show "X > threshold" at effect `delta` (module docstring)."""
  v = (comps["base"] / bases + comps["seed"] / (bases * seeds_per_base)
       + comps["task"] / task_factor)
  units = bases if bases > 1 else seeds_per_base
  if units < 2 or v <= 0:
    return float("nan")
  df = units - 1
  return float(stats.nct.sf(stats.t.ppf(1 - alpha, df), df, (delta - threshold) / math.sqrt(v)))


def achieved(delta: float, threshold: float, se: float | None, units: int,
             alpha: float = ALPHA) -> float | None:
  """The power a finished run had at the planned effect: its own standard error and units."""
  if se is None or not se > 0 or units < 2:
    return None
  df = units - 1
  return float(stats.nct.sf(stats.t.ppf(1 - alpha, df), df, (delta - threshold) / se))


def smallest_design(delta, threshold, comps, target=TARGET, max_bases=12,
                    task_factors=(1, 2, 4)) -> dict | None:
  """The cheapest design (fewest RL runs per arm B R, then fewest tasks) with at least 3 bases
  that reaches `target`; None if none up to `max_bases` x 4 seeds x 4x tasks does."""
  best = None
  for f in task_factors:
    for b in range(3, max_bases + 1):
      for r in range(1, 5):
        p = power(delta, threshold, comps, b, r, f)
        if p >= target:
          key = (b * r, f)
          if best is None or key < best[0]:
            best = (key, {"bases": b, "seeds_per_base": r, "task_factor": f, "power": p})
  return None if best is None else best[1]


def plan() -> dict:
  """{claim: {"statistic", "threshold", "components", "design", "power_3x1", "power_3x3"}}."""
  out = {}
  for num in sorted(MEASURED):
    m = MEASURED[num]
    c = components(m)
    out[num] = {"statistic": m.statistic, "threshold": m.threshold, "components": c,
                "power_3x1": power(c["delta"], m.threshold, c, 3, 1),
                "power_3x3": power(c["delta"], m.threshold, c, 3, 3),
                "design": smallest_design(c["delta"], m.threshold, c)}
  return out


def plan_lines(p: dict | None = None) -> list[str]:
  """The plan as markdown lines (printed by the report and by `python -m`)."""
  p = plan() if p is None else p
  rows = ["| claim | primary statistic | threshold | planned effect | sd base / seed / task "
          "| power 3x1 | power 3x3 | design for 80% |", "|---|---|---|---|---|---|---|---|"]
  for num, d in p.items():
    c, g = d["components"], d["design"]
    design = (f"{g['bases']} bases x {g['seeds_per_base']} seeds, {g['task_factor']}x tasks "
              f"(power {g['power']:.2f})" if g else "none up to 12 x 4, 4x tasks")
    rows.append(f"| {num} | {d['statistic']} | {d['threshold']:g} | {c['delta']:+.3f} | "
                f"{math.sqrt(c['base']):.3f} / {math.sqrt(c['seed']):.3f} / "
                f"{math.sqrt(c['task']):.3f} | {d['power_3x1']:.2f} | {d['power_3x3']:.2f} | "
                f"{design} |")
  return [f"Variances measured in {SOURCE}; one-sided alpha {ALPHA}, target power {TARGET}.",
          ""] + rows + [""]


if __name__ == "__main__":
  print("\n".join(plan_lines()))


def record(claims_out: dict, p: dict | None = None) -> dict:
  """comparison.json's "plan": the plan's lines and, per claim, the power the run achieved at
  the planned effect (its deciding arm's first primary condition: its se and units)."""
  p = plan() if p is None else p
  achieved_by = {}
  for num, c in claims_out.items():
    num = int(num)
    arm = c.get("decided_on")
    conds = c["per_arm"][arm]["conditions"] if arm else []
    if num not in p or not conds:
      achieved_by[str(num)] = None
      continue
    first = conds[0]
    achieved_by[str(num)] = achieved(p[num]["components"]["delta"], first["threshold"],
                                     first.get("se"), int(first.get("units", 0)))
  return {"lines": plan_lines(p), "achieved_power": achieved_by}
