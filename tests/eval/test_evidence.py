"""The seed-and-task bootstrap against brute-force resampling, and the decision rule on synthetic
data with a known truth."""

import numpy as np
import pytest

from jaxagent.eval import evidence

RULES = evidence.Rules(effect=0.02, non_inferiority=0.03, loglik_nats=1.0, confidence=0.95,
                       min_seeds=2, min_tasks=10)


def _states(rng, num_units, num_tasks):
  """Per seed: ragged states per task (0-4 each, some tasks empty) with 0/1 outcomes."""
  out = []
  for _ in range(num_units):
    task = np.repeat(np.arange(num_tasks), rng.integers(0, 5, num_tasks))
    out.append((task, (rng.random(task.size) < 0.4).astype(float)))
  return out


def test_ratio_equals_brute_force_resampling():
  rng = np.random.default_rng(0)
  units, tasks = 3, 7
  data = _states(rng, units, tasks)
  base_task = np.repeat(np.arange(tasks), 3)
  base_val = rng.random(base_task.size)
  r = evidence.Resampler(units, tasks, num_bootstrap=50, seed=1)
  per = [evidence.per_task(v, t, tasks) for t, v in data]
  arm = r.ratio(np.stack([p[0] for p in per]), np.stack([p[1] for p in per]))
  base = r.ratio(*evidence.per_task(base_val, base_task, tasks))
  diff = arm - base
  # Brute force: for each resample, concatenate the drawn seeds' states of the drawn tasks.
  for b in range(50):
    vals, bvals = [], []
    for u in r.unit_idx[b]:
      task, v = data[u]
      for t in r.task_idx[b]:
        vals.append(v[task == t])
        bvals.append(base_val[base_task == t])
    vals, bvals = np.concatenate(vals), np.concatenate(bvals)
    want = vals.mean() if vals.size else np.nan
    np.testing.assert_allclose(arm.samples[b], want, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(diff.samples[b], want - bvals.mean(), rtol=1e-12,
                               equal_nan=True)
  all_vals = np.concatenate([v for _, v in data])
  np.testing.assert_allclose(arm.est, all_vals.mean())
  assert arm.tasks == int(np.sum(sum(p[1] for p in per) > 0))


def test_seed_level_enters_the_interval():
  """Two seeds with opposite effects: the model's interval is the Student one with 1 df
  (0 +/- 12.71 x 0.2), not the range of the two; one seed: the tasks' bootstrap only."""
  tasks = 40
  r = evidence.Resampler(2, tasks, num_bootstrap=400, seed=0)
  per_seed = np.stack([np.full(tasks, 0.2), np.full(tasks, -0.2)])
  i = r.ratio(per_seed).interval(0.95)
  assert i["hi"] == pytest.approx(12.7062 * 0.2, rel=1e-4) and i["lo"] == pytest.approx(-i["hi"])
  one = evidence.Resampler(1, tasks, num_bootstrap=400, seed=0)
  j = one.ratio(per_seed[:1]).interval(0.95)
  assert j["lo"] == pytest.approx(0.2) and j["hi"] == pytest.approx(0.2)


def test_bad_shapes_are_refused():
  r = evidence.Resampler(3, 5, num_bootstrap=10, seed=0)
  with pytest.raises(ValueError, match=r"\[5\] or \[3, 5\]"):
    r.ratio(np.zeros((2, 5)))


def _effect(true_diff, units, tasks, noise, seed):
  """Per-seed per-task differences around a true effect, with seed and task noise."""
  rng = np.random.default_rng(seed)
  d = (true_diff + noise * rng.standard_normal((units, 1))
       + noise * rng.standard_normal((units, tasks)))
  r = evidence.Resampler(units, tasks, num_bootstrap=1000, seed=seed)
  return r.ratio(d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_real_effect_held_opposite_not_held(seed):
  held = evidence.decide([evidence.Condition("x > 0.02", _effect(0.3, 3, 100, 0.05, seed),
                                             0.02)], RULES, num_seeds=3)
  assert held["verdict"] == evidence.HELD
  opposite = evidence.decide([evidence.Condition("x > 0.02", _effect(-0.3, 3, 100, 0.05, seed),
                                                 0.02)], RULES, num_seeds=3)
  assert opposite["verdict"] == evidence.NOT_HELD
  assert opposite["conditions"][0]["refuted"] and not opposite["conditions"][0]["shown"]


def test_no_effect_small_n_is_rarely_held():
  """No effect, 3 seeds with seed noise 0.3 and 12 tasks: held in at most 2.5% of 300 studies
  (+ 3 Monte Carlo standard errors, 0.027), and mostly inconclusive. (One of them, seed 1, has
  three seeds whose effects drew 0.10, 0.25 and 0.10: held, rightly by the data's own light.)"""
  out = [evidence.decide([evidence.Condition("x > 0.02", _effect(0.0, 3, 12, 0.3, s), 0.02)],
                         RULES, num_seeds=3)["verdict"] for s in range(300)]
  assert out.count(evidence.HELD) / 300 <= 0.025 + 0.027
  assert out.count(evidence.INCONCLUSIVE) / 300 > 0.5


def test_too_little_data_is_inconclusive_however_clear():
  clear = _effect(0.5, 1, 100, 0.01, 0)
  one_seed = evidence.decide([evidence.Condition("x", clear, 0.0)], RULES, num_seeds=1)
  assert one_seed["verdict"] == evidence.INCONCLUSIVE and "1 seed" in one_seed["note"]
  few_tasks = _effect(0.5, 3, 5, 0.01, 0)
  out = evidence.decide([evidence.Condition("x", few_tasks, 0.0)], RULES, num_seeds=3)
  assert out["verdict"] == evidence.INCONCLUSIVE and "fewer than 10 tasks" in out["note"]


def test_holm_step_down():
  assert evidence.holm([0.01, 0.02, 0.2], 0.05) == [True, True, False]
  # 0.03 > 0.05 / 2 stops the procedure even though 0.04 < 0.05.
  assert evidence.holm([0.03, 0.04], 0.05) == [False, False]
  assert evidence.holm([0.001, 0.04], 0.05) == [True, True]


def test_one_refuted_condition_of_many_needs_the_correction():
  """A refutation that would pass alone at alpha fails once 20 conditions share the family."""
  r = evidence.Resampler(3, 50, num_bootstrap=1000, seed=0)
  weak = evidence.Estimate(-0.01, np.r_[np.full(990, -0.05), np.full(10, 0.1)], tasks=50)
  fine = [evidence.Condition(f"c{i}", r.ratio(np.full(50, 0.5)), 0.0) for i in range(19)]
  alone = evidence.decide([evidence.Condition("weak", weak, 0.0)], RULES, num_seeds=3)
  assert alone["verdict"] == evidence.NOT_HELD             # p_refute 0.01 < 0.025
  family = evidence.decide(fine + [evidence.Condition("weak", weak, 0.0)], RULES, num_seeds=3)
  assert family["verdict"] == evidence.INCONCLUSIVE        # 0.01 > 0.025 / 20
