"""Pass@(K,T): the probability that at least one of K independent episodes, each capped at T
turns, solves the task, averaged over tasks (docs/STUDY.md).

Per task, with n sampled episodes of which c_T solved within T turns, the unbiased estimator is

    pass@(K,T) = 1 - C(n - c_T, K) / C(n, K)                      (Chen et al. 2021)

and C(n - c, K) / C(n, K) = prod_{i=0}^{K-1} (n - c - i) / (n - i), which is 0 once n - c < K.
Everything is vectorised over tasks, K = 1..n and T = 1..T_max; the confidence interval is a
percentile bootstrap over tasks.

Modes:
  * truncation (budget hidden): one run per task at T_max; solved within T <=> success_turn <= T,
    so one [tasks, n] array of success turns gives the whole grid;
  * rerun (budget visible): the policy conditions on T, so each T has its own runs:
    success_turn[T, tasks, n], and c_T counts successes of run T.
"""

from __future__ import annotations

import numpy as np


def fail_all_prob(n: int, c: np.ndarray, k_max: int | None = None) -> np.ndarray:
  """C(n - c, K) / C(n, K) for K = 1..k_max: [..., k_max] for counts c [...] (float64)."""
  k_max = n if k_max is None else k_max
  i = np.arange(k_max)
  terms = (n - np.asarray(c, np.float64)[..., None] - i) / (n - i)
  return np.cumprod(np.clip(terms, 0.0, None), axis=-1)


def solved_counts_truncation(success_turn: np.ndarray, t_max: int) -> np.ndarray:
  """c[tasks, T] = #episodes with success_turn <= T, T = 1..t_max. success_turn [tasks, n]."""
  st = np.asarray(success_turn)
  return (st[:, :, None] <= np.arange(1, t_max + 1)).sum(axis=1)


def solved_counts_rerun(success_turn_by_t: np.ndarray) -> np.ndarray:
  """c[tasks, T] from per-budget runs success_turn_by_t [T, tasks, n] (run T capped at T turns)."""
  st = np.asarray(success_turn_by_t)
  t = np.arange(1, st.shape[0] + 1)[:, None, None]
  return (st <= t).sum(axis=2).T


def per_task_pass(counts: np.ndarray, n: int, k_max: int | None = None) -> np.ndarray:
  """pass[tasks, K, T] from counts [tasks, T] of n episodes per task."""
  return 1.0 - np.moveaxis(fail_all_prob(n, counts, k_max), -1, 1)


def pass_at_kt(counts: np.ndarray, n: int, *, k_max: int | None = None, num_bootstrap: int = 1000,
               confidence: float = 0.95, seed: int = 0) -> dict:
  """The Pass@(K,T) grid with bootstrap intervals over tasks.

  Returns a dict of arrays [K, T]: `mean`, `lo`, `hi` (the percentile interval; not widened to
  hold the mean, which a skewed bootstrap may leave outside), and `k`
  (1..k_max), `t` (1..T_max), `num_tasks`, `n`.
  """
  per_task = per_task_pass(counts, n, k_max)            # [tasks, K, T]
  mean = per_task.mean(axis=0)
  rng = np.random.default_rng(seed)
  tasks = per_task.shape[0]
  idx = rng.integers(0, tasks, size=(num_bootstrap, tasks))
  # Bootstrap means without materialising [boot, tasks, K, T]: counts of each task per resample.
  weights = np.zeros((num_bootstrap, tasks))
  np.add.at(weights, (np.arange(num_bootstrap)[:, None], idx), 1.0)
  boot = np.einsum("bn,nkt->bkt", weights / tasks, per_task)
  alpha = (1 - confidence) / 2
  lo, hi = np.quantile(boot, [alpha, 1 - alpha], axis=0)
  return {"mean": mean, "lo": lo, "hi": hi,
          "k": np.arange(1, mean.shape[0] + 1), "t": np.arange(1, mean.shape[1] + 1),
          "num_tasks": tasks, "n": n}


def pass_grid_truncation(success_turn: np.ndarray, t_max: int, **kw) -> dict:
  """Truncation mode from one run per task at T_max: success_turn [tasks, n]."""
  st = np.asarray(success_turn)
  return pass_at_kt(solved_counts_truncation(st, t_max), st.shape[1], **kw)


def pass_grid_rerun(success_turn_by_t: np.ndarray, **kw) -> dict:
  """Rerun mode from per-budget runs: success_turn_by_t [T, tasks, n]."""
  st = np.asarray(success_turn_by_t)
  return pass_at_kt(solved_counts_rerun(st), st.shape[2], **kw)


def per_budget_counts(success_by_t: np.ndarray, budgets) -> np.ndarray:
  """c[tasks, j] = #episodes of run j solved within budgets[j] turns (rerun mode), from success
  turns [len(budgets), tasks, n]."""
  b = np.asarray(budgets)[:, None, None]
  return (np.asarray(success_by_t) <= b).sum(axis=2).T


def per_task_pass1(mode: str, success_by_t: np.ndarray, budgets, t_max: int) -> np.ndarray:
  """Per-task Pass@(1,T) [tasks, len(budgets)] (the grid's K=1 row before averaging), from
  success turns [len(budgets), tasks, n]: truncation mode cuts the last (T_max) run at each T,
  rerun mode takes run j at budgets[j]."""
  st = np.asarray(success_by_t)
  if mode == "truncation":
    counts = solved_counts_truncation(st[-1], t_max)[:, np.asarray(budgets) - 1]
  else:
    counts = per_budget_counts(st, budgets)
  return per_task_pass(counts, st.shape[2], k_max=1)[:, 0, :]
