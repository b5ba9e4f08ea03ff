"""Inference for a study's contrasts that is right for a handful of seeds: a seed-level t model
with crossed task and nested base/seed variance, and an exact sign-flip test on the seeds.

**Design.** Every RL arm is trained with S seeds; seed u starts from SFT base u mod B (B bases),
and every run is evaluated on the same N test tasks. A statistic (a rate, a Pass@1, a log-
likelihood gap, a contrast of such) is linearised into per-(seed, task) influence values
`infl` [S, N] with mean 0 (`evidence.Resampler.ratio`): the estimate's error is, to first order,
the mean of infl. Contrasts add their parts' infl, so tasks and seeds are paired across arms.

**Model.** y[u, t] = theta + a[g(u)] + s[u] + tau[t] + e[u, t], with g(u) the top-level unit of
seed u (its base when 1 < B < S; the seed itself when there is one base or a base per seed),
crossed task effects tau and an interaction/evaluation-noise term e. For this balanced design
the variance of the estimate (the grand mean) has a closed-form moment estimator,

    V = A + T,   A = var_g(m_g) / G,   T = (MS_task - MS_err) / (S N)  (clipped at 0),

with m_g the mean of infl over the seeds and tasks of unit g (A carries base, seed and the
interaction's share; with one base it is conditional on that base), MS_task = S var_t(column
means), MS_err the seed-by-task residual mean square. A has G - 1 degrees of freedom and T about
N - 1. The critical value is Cochran and Cox's: the variance-weighted mean of the two parts'
Student quantiles (`quantile`); the interval is est +/- q se with se = sqrt(A + T), and the
one-sided p-values of "theta > c" invert it. With the task part small this is the Student
interval with G - 1 df (3 units: quantile 4.30, not 1.96). Satterthwaite's degrees of freedom
(lmerTest's default) were tried first: with a 2-df part they are liberal (simulated coverage
0.937-0.949, 3.1-3.4% false "shown" at the margin with 3 units); Cochran-Cox keeps the false
rate at or below alpha there (coverage 0.955-0.975; the test `tests/eval/test_seedmodel.py`).

**Exact test.** `sign_flip_p` compares sum_g (x_g - c) over the G unit estimates x_g = est + m_g
with its 2^G sign flips: exact under symmetry of the unit estimates about c, whatever their
distribution. Its smallest p-value is 2^-G (0.125 for 3 units), so it cannot carry a decision at
alpha = 0.025 below 6 units; `evidence.decide` uses it as a guard at the finest level the units
allow (`exact_level`).

Why not a likelihood-based mixed model (statsmodels MixedLM): its intervals are Wald (normal
quantiles, no small-sample degrees of freedom: the very error this module fixes), crossed effects
need a variance-components workaround, and with 3 seeds its REML fits are often on the boundary;
it also takes about a second per fit, which rules out checking coverage by simulation in a test.
The moment estimator above is exact in expectation for the balanced design, vectorises over
simulated studies (every function here broadcasts over leading batch axes) and has no dependency.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from scipy import stats


def unit_groups(num_seeds: int, num_bases: int) -> np.ndarray:
  """[S] the top-level unit of each seed: its base (u mod B) when 1 < B < S, else the seed."""
  u = np.arange(num_seeds)
  return u % num_bases if 1 < num_bases < num_seeds else u


@dataclasses.dataclass(frozen=True)
class Fit:
  """The model's variance of an estimate (arrays over the batch axes of `fit`'s infl).

  se: standard error sqrt(A + T); var_units: A (top-level units, `df_units` = G - 1 degrees of
  freedom); var_tasks: T (crossed tasks, `df_tasks` = N - 1); unit_means [..., G]: m_g, the
  units' deviations from the estimate.
  """
  se: np.ndarray
  var_units: np.ndarray
  var_tasks: np.ndarray
  df_units: int
  df_tasks: int
  unit_means: np.ndarray

  @property
  def units(self) -> int:
    return int(self.unit_means.shape[-1])

  @property
  def weight(self) -> np.ndarray:
    """A / (A + T): the share of the variance that has only G - 1 degrees of freedom."""
    with np.errstate(invalid="ignore", divide="ignore"):
      return self.var_units / (self.var_units + self.var_tasks)


def fit(infl: np.ndarray, groups: np.ndarray) -> Fit:
  """The variance of the estimate whose influence values are `infl` [..., S, N]; seeds grouped
  into top-level units by `groups` [S] (`unit_groups`). se is NaN with fewer than 2 units."""
  y = np.asarray(infl, np.float64)
  s, n = y.shape[-2:]
  groups = np.asarray(groups)
  ids = np.unique(groups)
  row = y.mean(-1)                                                  # [..., S]
  m = np.stack([row[..., groups == g].mean(-1) for g in ids], -1)   # [..., G]
  big_g = len(ids)
  a = m.var(-1, ddof=1) / big_g if big_g > 1 else np.full(m.shape[:-1], np.nan)
  if s > 1 and n > 1:
    col = y.mean(-2)                                                # [..., N]
    grand = y.mean((-2, -1))
    ms_task = s * ((col - grand[..., None]) ** 2).sum(-1) / (n - 1)
    resid = y - row[..., None] - col[..., None, :] + grand[..., None, None]
    ms_err = (resid ** 2).sum((-2, -1)) / ((s - 1) * (n - 1))
    t_part = np.maximum((ms_task - ms_err) / (s * n), 0.0)
  else:   # one seed: the task part cannot be told from the interaction (and A is undefined)
    t_part = np.zeros(y.shape[:-2])
  return Fit(np.sqrt(a + t_part), a, t_part, max(big_g - 1, 0), max(n - 1, 1), m)


def quantile(f: Fit, p) -> np.ndarray:
  """The upper-p critical value of (est - theta) / se: Cochran and Cox's, the variance-weighted
  mean of the Student quantiles of the two parts, w t_{G-1}(p) + (1 - w) t_{N-1}(p), w =
  `Fit.weight`. With the task part negligible it is the Student quantile with G - 1 df."""
  w = np.nan_to_num(f.weight, nan=1.0)
  dfu = max(f.df_units, 1)
  return w * stats.t.isf(p, dfu) + (1 - w) * stats.t.isf(p, f.df_tasks)


def p_above(est, threshold, f: Fit) -> np.ndarray:
  """One-sided p-value of "theta > threshold" (small: shown): the level p at which
  est - quantile(p) se = threshold (by bisection; `quantile` falls with p). NaN where se is 0 or
  undefined."""
  with np.errstate(invalid="ignore", divide="ignore"):
    z = (np.asarray(est, np.float64) - threshold) / f.se
  ok = np.isfinite(z) & (f.se > 0)
  z = np.where(ok, z, 0.0)
  lo, hi = np.full(z.shape, -40.0), np.full(z.shape, 40.0)       # logit(p)
  for _ in range(64):
    mid = (lo + hi) / 2
    above = quantile(f, 1 / (1 + np.exp(-mid))) > z              # p too small: move up
    lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
  return np.where(ok, 1 / (1 + np.exp(-(lo + hi) / 2)), np.nan)


def p_below(est, threshold, f: Fit) -> np.ndarray:
  """One-sided p-value of "theta < threshold" (small: "theta > threshold" refuted); the quantile
  is odd in p about 1/2, so this is 1 - p_above."""
  return 1 - p_above(est, threshold, f)


def interval(est, f: Fit, confidence: float) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi) of the two-sided `confidence` interval est -/+ quantile((1 - confidence) / 2) se."""
  q = quantile(f, (1 - confidence) / 2)
  return np.asarray(est) - q * f.se, np.asarray(est) + q * f.se


_MAX_EXACT = 16


def _signs(g: int) -> np.ndarray:
  """[F, g] sign vectors: all 2^g of them up to 16 units, else 65536 fixed random ones (the
  identity first, so the p-value is never 0)."""
  if g <= _MAX_EXACT:
    return np.array(list(itertools.product([1.0, -1.0], repeat=g)))
  rng = np.random.default_rng(0)
  return np.concatenate([np.ones((1, g)), rng.choice([1.0, -1.0], (2 ** _MAX_EXACT - 1, g))])


def sign_flip_p(unit_values: np.ndarray, threshold: float, above: bool = True) -> np.ndarray:
  """Exact one-sided sign-flip p-value of "theta > threshold" (above) or "theta < threshold"
  from the top-level unit estimates [..., G]: the share of the 2^G sign flips of
  d_g = x_g - threshold whose sum is at least (above) / at most the observed sum."""
  d = np.asarray(unit_values, np.float64) - threshold
  signs = _signs(d.shape[-1])                                  # [F, G]
  obs = d.sum(-1)
  flipped = np.einsum("...g,fg->...f", d, signs)
  tol = 1e-12 * (1 + np.abs(d).sum(-1))[..., None]
  hit = flipped >= obs[..., None] - tol if above else flipped <= obs[..., None] + tol
  return hit.mean(-1)


def exact_level(units: int, alpha: float) -> float:
  """The level the sign-flip guard is held to: alpha, or 2^-G where G units cannot reach it."""
  return max(alpha, 2.0 ** -units)
