"""The seed-level model against hand-computed values, the exact sign-flip test, and, by
simulation on data with a known effect and variance components like the committed runs', the
coverage of its 95% intervals and the rate of false "shown" at and below the margin."""

import numpy as np
import pytest
from scipy import stats

from jaxagent.eval import evidence, seedmodel

# Variance components like the measured ones (docs/results/study_default/seed1 and seed0,
# standard arm; `jaxagent.eval.power.MEASURED`): per-seed contrasts of Pass@(1,8) spread with
# sd 0.042 between RL seeds, a task part of about 5.8e-4 at 128 tasks (sd 0.27 per task), and
# per-(seed, task) evaluation noise of a Pass@1 from 8 episodes (sd 0.3). Recovery contrasts:
# seed sd 0.05 with a small task part. Bases: sd 0.03 between SFT bases.
PASS_LIKE = dict(sd_base=0.03, sd_seed=0.042, sd_task=0.27, sd_noise=0.3)
RECOVERY_LIKE = dict(sd_base=0.03, sd_seed=0.05, sd_task=0.05, sd_noise=0.3)


def simulate(rng, m, bases, seeds, tasks, effect, sd_base, sd_seed, sd_task, sd_noise):
  """m studies' per-(seed, task) contrasts [m, S, N]: effect + base + seed + task + noise; seed u
  starts from base u mod B. Returns (estimates [m], `seedmodel.Fit` over the m studies)."""
  b = sd_base * rng.standard_normal((m, bases))[:, np.arange(seeds) % bases]
  y = (effect + b[..., None] + sd_seed * rng.standard_normal((m, seeds, 1))
       + sd_task * rng.standard_normal((m, 1, tasks))
       + sd_noise * rng.standard_normal((m, seeds, tasks)))
  est = y.mean((-2, -1))
  return est, seedmodel.fit(y - est[..., None, None], seedmodel.unit_groups(seeds, bases))


def test_three_seed_contrasts_give_the_student_interval():
  """The issue's example: seed-level contrasts +0.067, +0.014, 0.000 (no task variation) give
  the t interval with 2 df, [-0.061, +0.115], not the bootstrap's range of the three values."""
  r = evidence.Resampler(3, 8, num_bootstrap=0, seed=0)
  i = r.ratio(np.array([0.067, 0.014, 0.0])[:, None] * np.ones((3, 8))).interval(0.95)
  assert i["q"] == pytest.approx(stats.t.ppf(0.975, 2))
  assert (round(i["lo"], 3), round(i["hi"], 3)) == (-0.061, 0.115)


def test_variance_parts_by_hand():
  """A 2-seed x 3-task table: A = var of the seed means / 2; T = (MS_task - MS_err) / (S N)."""
  y = np.array([[0.1, 0.5, 0.3], [0.3, 0.5, 0.7]])
  f = seedmodel.fit(y - y.mean(), np.arange(2))
  rows, cols = y.mean(1), y.mean(0)
  assert f.var_units == pytest.approx(np.var(rows, ddof=1) / 2)
  ms_task = 2 * np.var(cols, ddof=1)
  resid = y - rows[:, None] - cols[None] + y.mean()
  ms_err = (resid ** 2).sum() / 2
  assert f.var_tasks == pytest.approx((ms_task - ms_err) / 6)
  assert f.se == pytest.approx(np.sqrt(f.var_units + f.var_tasks))


def test_bases_are_the_units_when_seeds_share_them():
  """6 seeds on 3 bases (seed u on base u mod 3): 3 units, the bases' means; one base: the
  seeds are the units (conditional on that base); a base per seed: the seeds."""
  assert seedmodel.unit_groups(6, 3).tolist() == [0, 1, 2, 0, 1, 2]
  assert seedmodel.unit_groups(3, 1).tolist() == [0, 1, 2]
  assert seedmodel.unit_groups(3, 3).tolist() == [0, 1, 2]
  rows = np.array([1.0, 2.0, 3.0, 3.0, 4.0, 5.0])
  y = rows[:, None] * np.ones((6, 4))
  f = seedmodel.fit(y - y.mean(), seedmodel.unit_groups(6, 3))
  np.testing.assert_allclose(f.unit_means, np.array([2.0, 3.0, 4.0]) - 3.0)
  assert f.units == 3 and f.var_units == pytest.approx(1.0 / 3)


def test_sign_flip_is_exact():
  """3 units all above c: 1 of 8 flips is as extreme (p = 1/8); one below: the flips whose sum
  reaches the observed one, counted by hand."""
  assert seedmodel.sign_flip_p(np.array([0.3, 0.2, 0.1]), 0.0) == pytest.approx(1 / 8)
  assert seedmodel.sign_flip_p(np.array([0.3, 0.2, -0.1]), 0.0) == pytest.approx(2 / 8)
  assert seedmodel.sign_flip_p(np.array([0.3, 0.2, -0.1]), 0.0, above=False) == pytest.approx(7 / 8)
  six = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.6])
  assert seedmodel.sign_flip_p(six, 0.0) == pytest.approx(1 / 64)
  assert seedmodel.exact_level(3, 0.025) == 1 / 8 and seedmodel.exact_level(6, 0.025) == 0.025


def test_p_values_invert_the_interval():
  rng = np.random.default_rng(3)
  est, f = simulate(rng, 50, 3, 3, 64, 0.1, **PASS_LIKE)
  lo, hi = seedmodel.interval(est, f, 0.95)
  np.testing.assert_allclose(seedmodel.p_above(est, lo, f), 0.025, rtol=1e-6)
  np.testing.assert_allclose(seedmodel.p_below(est, hi, f), 0.025, rtol=1e-6)


# 4000 simulated studies per design: the Monte Carlo standard error of a coverage near 0.95 is
# sqrt(0.95 * 0.05 / 4000) = 0.0034, and of a false rate near 0.025 it is 0.0025 (the bound
# 0.025 + 0.0075 at the margin is 3 of them). Measured with seeds 0-4 (AMD EPYC, this test's
# code): recovery-like coverage 0.946-0.957, margin false rate 0.020-0.028; pass-like coverage
# 0.960-0.973, margin false rate 0.012-0.022. The pass-like upper bound is 0.975, not 0.97:
# Cochran-Cox is conservative when the seed and task parts are of one size (Satterthwaite's df,
# the alternative, gives 0.937-0.949 there but 3.1-3.4% false "shown" at the margin).
M = 4000
DESIGNS = [(1, 3), (3, 3), (3, 9), (1, 5)]     # (bases, RL seeds per arm)


@pytest.mark.parametrize("bases,seeds", DESIGNS)
@pytest.mark.parametrize("comps,upper", [(PASS_LIKE, 0.975), (RECOVERY_LIKE, 0.97)],
                         ids=["pass", "recovery"])
def test_coverage_and_false_held_by_simulation(bases, seeds, comps, upper):
  rng = np.random.default_rng(0)
  # With one base the base effect is part of the truth the interval is about (conditional on the
  # base): simulate none, the method's effect is then that base's.
  comps = dict(comps, sd_base=comps["sd_base"] if bases > 1 else 0.0)
  effect, margin, alpha = 0.06, 0.02, 0.025
  est, f = simulate(rng, M, bases, seeds, 128, effect, **comps)
  lo, hi = seedmodel.interval(est, f, 0.95)
  coverage = np.mean((lo < effect) & (effect < hi))
  assert 0.93 <= coverage <= upper, coverage

  def held(est, f, c):
    """The decision rule of `evidence.decide` for one condition 'theta > c'."""
    exact = seedmodel.sign_flip_p(est[:, None] + f.unit_means, c)
    return (seedmodel.p_above(est, c, f) < alpha) & (
        exact <= seedmodel.exact_level(f.units, alpha))
  # At the margin (the hardest null) and with no effect at all (the brief's case).
  assert np.mean(held(*simulate(rng, M, bases, seeds, 128, margin, **comps), margin)) <= (
      alpha + 0.0075)
  assert np.mean(held(*simulate(rng, M, bases, seeds, 128, 0.0, **comps), margin)) <= alpha
  # And it can decide: an effect of 0.2 is shown in most studies (measured 0.69-0.997).
  assert np.mean(held(*simulate(rng, M, bases, seeds, 128, 0.2, **comps), margin)) > 0.6


def test_end_to_end_through_ratios():
  """Binomial outcomes on states (rates pooled per seed over ragged tasks, base shared by the
  seeds, a 0.08 gain): the ratio's linearisation feeds the model; 95% intervals cover the true
  difference of pooled rates 93-97% of 600 studies (MC standard error 0.009, the window
  +/- 2.2 of them)."""
  rng = np.random.default_rng(1)
  tasks, seeds, hits = 60, 3, 0
  n_states = rng.integers(1, 8, tasks)
  p_task = rng.beta(2, 3, tasks)
  task = np.repeat(np.arange(tasks), n_states)
  truth = 0.08
  for _ in range(600):
    p_t = np.clip(p_task + 0.2 * rng.standard_normal(tasks), 0.02, 0.98)[task]
    base = rng.random(task.size) < p_t
    r = evidence.Resampler(seeds, tasks, num_bootstrap=0, seed=0)
    arms = [rng.random(task.size) < np.clip(p_t + truth + 0.04 * rng.standard_normal(), 0, 1)
            for _ in range(seeds)]
    per = [evidence.per_task(a.astype(float), task, tasks) for a in arms]
    arm = r.ratio(np.stack([p[0] for p in per]), np.stack([p[1] for p in per]))
    diff = arm - r.ratio(*evidence.per_task(base.astype(float), task, tasks))
    i = diff.interval(0.95)
    hits += i["lo"] < truth < i["hi"]
  assert 0.93 <= hits / 600 <= 0.97, hits / 600
