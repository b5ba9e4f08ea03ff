"""Evidence for the study's verdicts: estimates over the independent units (seeds, tasks), their
seed-level inference, and claim rules that are fixed before the numbers and can fail.

**Units.** A study's verdicts are about a training method, not one trained model, and about a
population of tasks, not one set of states. The independent units are therefore the training
seeds (each RL arm is trained once per seed, seed u of every arm paired with seed u of the others)
and the test tasks (every episode, reference state and error state belongs to one task). States of
one episode and episodes of one task are not independent (one stuck episode yields many error
states), so nothing here resamples states or episodes.

**Estimates.** Every quantity is a ratio of sums pooled over seeds and tasks,

    value = sum_u sum_t num[u, t] / sum_u sum_t den[u, t],

with num/den the per-task sums of one run (per seed u) of, e.g., successes and states (a rate),
per-task Pass@(1,T) and 1 (a mean over tasks), or log-likelihood ratios and trajectories. A run
shared by every seed (the one SFT base) has a single row. A contrast (RL minus base, a difference
of differences) is a linear combination of such values.

**Inference.** Each estimate carries its influence values [S, N] (the ratio's linearisation per
seed and task); contrasts add them, so seeds and tasks are paired across arms. Intervals and
p-values come from the seed-level model of `jaxagent.eval.seedmodel`: crossed task effects,
seeds nested in their SFT bases, Student quantiles with (top-level units - 1) degrees of freedom
for the seed part (Cochran-Cox), and an exact sign-flip test on the units. With S = 1 seed the seed
level is absent: nothing describes the method, and `decide` reads "inconclusive" (see
`Rules.min_seeds`). A bootstrap over seeds and tasks (`Resampler`) is kept as a description (and
for single runs, e.g. step quality); with few seeds it is too narrow to decide anything.

**Rules.** A claim is a list of conditions "X > c", each with a statistic X and a threshold c
chosen before the data (a smallest effect of interest for superiority, minus a margin for
non-inferiority). With alpha = (1 - confidence) / 2 per side and the model's estimate and
standard error, and q(p) the model's one-sided critical value at level p (`seedmodel.quantile`):

    p_show(X > c)   = the p with X - q(p) se = c      p_refute(X > c) = 1 - p_show(X > c)

A condition is shown iff p_show < alpha and the exact sign-flip p-value over the G top-level
units is at most max(alpha, 2^-G) (with 3 units: every unit above c). The claim is **held** iff
every condition is shown (an intersection-union test, valid without correction); **not held**
iff some condition is refuted (the mirror image) after Holm's correction over the claim's
conditions (sorted p_refute(1) <= ... <= p_refute(m): refute while p_(j) < alpha / (m - j + 1));
else **inconclusive**. Too little data (fewer seeds than `min_seeds`, or a statistic resting on
fewer than `min_tasks` tasks) is always inconclusive, and a statistic whose variance is 0 (every
seed and task gives the same value, e.g. every policy fails every task) says nothing about its
uncertainty: its condition is neither shown nor refuted. A condition that is neither shown nor
refuted leaves the claim inconclusive unless another one is refuted, so less data can only move a
verdict towards "inconclusive". Estimates without influence values (a bootstrap alone) are decided
on the bootstrap's fractions, as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from jaxagent.eval import seedmodel

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A point estimate with its bootstrap samples [B] (NaN where a resample holds no data; may be
  empty), `tasks`: the number of tasks the estimate rests on (the fewest of its parts'), and,
  from a study's `Resampler`, its influence values `infl` [S, N] (mean 0: the linearised error
  per seed and task, `seedmodel`) with the seeds' top-level units `groups` [S]."""
  est: float
  samples: np.ndarray
  tasks: int
  infl: np.ndarray | None = None
  groups: np.ndarray | None = None

  def __add__(self, other: "Estimate") -> "Estimate":
    infl = (self.infl + other.infl if self.infl is not None and other.infl is not None
            else None)
    samples = (self.samples + other.samples if self.samples.shape == other.samples.shape
               else np.zeros(0))
    return Estimate(self.est + other.est, samples, min(self.tasks, other.tasks), infl,
                    self.groups)

  def __sub__(self, other: "Estimate") -> "Estimate":
    return self + other.scale(-1.0)

  def scale(self, factor: float) -> "Estimate":
    return Estimate(self.est * factor, self.samples * factor, self.tasks,
                    None if self.infl is None else self.infl * factor, self.groups)

  def fit(self) -> seedmodel.Fit | None:
    """The seed-level model's variance (`seedmodel.fit`), None without influence values."""
    return self._fit

  @functools.cached_property
  def _fit(self) -> seedmodel.Fit | None:
    if self.infl is None or not np.isfinite(self.est):
      return None
    return seedmodel.fit(self.infl, self.groups)

  def interval(self, confidence: float) -> dict:
    """{"est", "lo", "hi"}: with influence values the model's t interval (and "se", its
    critical value "q", "units") when there are 2 units or more, else the percentile interval of the samples (not widened: a
    skewed bootstrap may leave est outside it); lo/hi None where neither holds data."""
    f = self.fit()
    if f is not None and f.units >= 2:     # one seed (a single run): the tasks' bootstrap
      if not (np.isfinite(f.se) and f.se > 0):
        return {"est": float(self.est), "lo": None, "hi": None, "units": f.units}
      lo, hi = seedmodel.interval(self.est, f, confidence)
      return {"est": float(self.est), "lo": float(lo), "hi": float(hi), "se": float(f.se),
              "q": float(seedmodel.quantile(f, (1 - confidence) / 2)), "units": f.units}
    s = self.samples[np.isfinite(self.samples)]
    if not s.size or not np.isfinite(self.est):
      return {"est": _finite(self.est), "lo": None, "hi": None}
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(s, [alpha, 1 - alpha])
    return {"est": float(self.est), "lo": float(lo), "hi": float(hi)}


def _finite(x) -> float | None:
  x = float(x)
  return x if np.isfinite(x) else None


def per_task(values: np.ndarray, task: np.ndarray, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
  """(num [num_tasks], den [num_tasks]): the sum and count of `values` [M] per task, for M units
  (states, trajectories) labelled with their task index `task` [M]."""
  task = np.asarray(task, np.int64)
  num = np.bincount(task, weights=np.asarray(values, np.float64), minlength=num_tasks)
  den = np.bincount(task, minlength=num_tasks).astype(np.float64)
  return num[:num_tasks], den[:num_tasks]


class Resampler:
  """B paired resamples of (seeds, tasks): `unit_idx` [B, S] and `task_idx` [B, N] (the indices
  drawn, kept for checking), and their multiplicities `unit_counts` [B, S], `task_counts` [B, N].
  `groups` [S]: the seeds' top-level units for the seed-level model (`seedmodel.unit_groups`;
  default each seed its own). The bootstrap is the secondary (percentile) description; a study's
  decisions use the model on the estimates' influence values.
  """

  def __init__(self, num_units: int, num_tasks: int, num_bootstrap: int, seed: int,
               groups: np.ndarray | None = None):
    if num_units < 1 or num_tasks < 1:
      raise ValueError(f"need at least one seed and one task, got {num_units} and {num_tasks}")
    rng = np.random.default_rng(seed)
    self.num_units, self.num_tasks, self.num_bootstrap = num_units, num_tasks, num_bootstrap
    self.groups = np.arange(num_units) if groups is None else np.asarray(groups)
    if self.groups.shape != (num_units,):
      raise ValueError(f"groups must give each of the {num_units} seeds its unit, got "
                       f"{self.groups.shape}")
    self.unit_idx = rng.integers(0, num_units, size=(num_bootstrap, num_units))
    self.task_idx = rng.integers(0, num_tasks, size=(num_bootstrap, num_tasks))
    self.unit_counts = _counts(self.unit_idx, num_units)
    self.task_counts = _counts(self.task_idx, num_tasks)

  def ratio(self, num, den=None) -> Estimate:
    """sum(num) / sum(den) over seeds and tasks, with its resamples and influence values
    infl[u, t] = S N (num[u, t] - est den[u, t]) / sum(den) (the ratio's linearisation).

    Args:
      num: [N] (one run shared by every seed) or [S, N] (one run per seed) per-task sums.
      den: the same shapes (default 1 per task: a mean over tasks).
    """
    num = self._rows(num)
    den = np.ones_like(num) if den is None else self._rows(den)
    num, den = np.broadcast_arrays(num, den)
    if num.shape[0] == 1:        # a shared run: every seed sees the same values
      num, den = (np.repeat(x, self.num_units, axis=0) for x in (num, den))
    tot_den = den.sum()
    est = num.sum() / tot_den if tot_den > 0 else np.nan
    n = (self.unit_counts * (self.task_counts @ num.T)).sum(axis=1)
    d = (self.unit_counts * (self.task_counts @ den.T)).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
      samples = np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)
    tasks = int(np.sum(den.sum(axis=0) > 0))
    infl = (num.size * (num - est * den) / tot_den) if tot_den > 0 else None
    return Estimate(float(est), samples, tasks, infl, self.groups)

  def _rows(self, x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x[None] if x.ndim == 1 else x
    if x.ndim != 2 or x.shape[1] != self.num_tasks or x.shape[0] not in (1, self.num_units):
      raise ValueError(f"per-task values must be [{self.num_tasks}] or [{self.num_units}, "
                       f"{self.num_tasks}], got {x.shape}")
    return x


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
  out = np.zeros((idx.shape[0], n))
  np.add.at(out, (np.arange(idx.shape[0])[:, None], idx), 1.0)
  return out


@dataclasses.dataclass(frozen=True)
class Rules:
  """The thresholds every claim is decided with, fixed before the numbers (config.study)."""
  effect: float            # smallest effect of interest (absolute rates and Pass@1)
  non_inferiority: float   # margin of "not worse than" conditions
  loglik_nats: float       # claim 4: log-likelihood gap over the seed-to-seed null (nats)
  confidence: float        # two-sided confidence of intervals; alpha = (1 - confidence) / 2
  min_seeds: int           # fewer seeds per arm: inconclusive
  min_tasks: int           # a statistic on fewer tasks: inconclusive

  @property
  def alpha(self) -> float:
    return (1 - self.confidence) / 2

  def describe(self) -> str:
    return (f"smallest effect of interest {self.effect:g}; non-inferiority margin "
            f"{self.non_inferiority:g}; claim 4 margin {self.loglik_nats:g} nats; "
            f"{self.confidence:.0%} intervals, one-sided alpha {self.alpha:g} per condition "
            f"(Holm-corrected for refutation); at least {self.min_seeds} seeds per arm and "
            f"{self.min_tasks} tasks per statistic")


@dataclasses.dataclass(frozen=True)
class Condition:
  """"X > threshold", named for the report. With influence values (a study's estimates) its
  p-values are the seed-level model's (`seedmodel`), with the exact sign-flip p-values of the
  top-level units beside them; else the bootstrap's."""
  name: str
  stat: Estimate
  threshold: float

  @property
  def degenerate(self) -> bool:
    """No evidence either way: the estimate's variance is 0 or undefined (the resamples do
    not vary, or hold no data)."""
    f = self.stat.fit()
    if f is not None:
      return not (np.isfinite(f.se) and f.se > 0)
    if self.stat.infl is not None:        # influence values but no finite estimate
      return True
    s = self.stat.samples
    return not s.size or not np.all(np.isfinite(s)) or bool(np.all(s == s[0]))

  def p_show(self) -> float:
    return self._p[0]

  def p_refute(self) -> float:
    return self._p[1]

  @functools.cached_property
  def _p(self) -> tuple[float, float]:
    if self.degenerate:
      return 1.0, 1.0
    f = self.stat.fit()
    if f is not None:
      p = float(seedmodel.p_above(self.stat.est, self.threshold, f))
      return p, 1.0 - p
    s = self.stat.samples
    return float(np.mean(~(s > self.threshold))), float(np.mean(~(s < self.threshold)))

  def p_exact(self) -> tuple[float, float, int]:
    """(show, refute, units): the exact sign-flip p-values over the top-level units' estimates
    ((1, 1, 0) without influence values; 1 where degenerate)."""
    f = self.stat.fit()
    if f is None or self.degenerate:
      return 1.0, 1.0, 0 if f is None else f.units
    x = self.stat.est + f.unit_means
    return (float(seedmodel.sign_flip_p(x, self.threshold, above=True)),
            float(seedmodel.sign_flip_p(x, self.threshold, above=False)), f.units)


def holm(pvalues: Sequence[float], alpha: float) -> list[bool]:
  """Holm's step-down procedure: which of the hypotheses are rejected at family-wise `alpha`."""
  p = np.asarray(pvalues, np.float64)
  order = np.argsort(p, kind="stable")
  rejected = np.zeros(p.shape, bool)
  m = p.size
  for j, i in enumerate(order):
    if p[i] < alpha / (m - j):
      rejected[i] = True
    else:
      break
  return rejected.tolist()


def decide(conditions: Sequence[Condition], rules: Rules, num_seeds: int) -> dict:
  """The verdict of one claim's conditions (see the module docstring), with every condition's
  estimate, interval, threshold, p-values and outcome. A condition is shown iff its model
  p-value is below alpha and its exact sign-flip p-value is within `seedmodel.exact_level`
  (alpha, or 2^-G where G units cannot reach alpha: every unit on the claimed side); refuted
  likewise after Holm's correction."""
  a = rules.alpha
  refuted = holm([c.p_refute() for c in conditions], a)
  rows = []
  for c, ref in zip(conditions, refuted):
    ex_show, ex_refute, units = c.p_exact()
    level = seedmodel.exact_level(units, a) if units else 1.0
    p_show, p_refute = c.p_show(), c.p_refute()
    rows.append({"condition": c.name, **c.stat.interval(rules.confidence),
                 "threshold": c.threshold, "tasks": c.stat.tasks,
                 "p_show": p_show, "p_refute": p_refute, "p_exact_show": ex_show,
                 "p_exact_refute": ex_refute, "degenerate": c.degenerate,
                 "shown": bool(p_show < a and ex_show <= level),
                 "refuted": bool(ref and ex_refute <= level)})
  few = []
  if num_seeds < rules.min_seeds:
    few.append(f"{num_seeds} seed(s) per arm (the rules need {rules.min_seeds}: one trained "
               "model says nothing about the method)")
  thin = [c.name for c in conditions if c.stat.tasks < rules.min_tasks]
  if thin:
    few.append(f"fewer than {rules.min_tasks} tasks behind: {', '.join(thin)}")
  if not conditions:
    few.append("no condition could be formed")
  if few:
    verdict = INCONCLUSIVE
  elif all(r["shown"] for r in rows):
    verdict = HELD
  elif any(r["refuted"] for r in rows):
    verdict = NOT_HELD
  else:
    verdict = INCONCLUSIVE
  return {"verdict": verdict, "conditions": rows, **({"note": "; ".join(few)} if few else {})}
