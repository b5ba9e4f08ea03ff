"""The power calculation on hand-checkable inputs, and the plan it prints."""

import math

import pytest
from scipy import stats

from jaxagent.eval import power


def test_power_by_hand():
  """Seed variance only, 1 base of 4 seeds: V = 0.04 / 4 = 0.01 (se 0.1), effect 0.3 over a
  threshold 0: ncp 3 with 3 df; no effect: the power is alpha (the test's size)."""
  comps = {"base": 0.0, "seed": 0.04, "task": 0.0}
  crit = stats.t.ppf(0.975, 3)
  assert power.power(0.3, 0.0, comps, 1, 4) == pytest.approx(stats.nct.sf(crit, 3, 3.0))
  assert power.power(0.0, 0.0, comps, 1, 4) == pytest.approx(0.025)
  # Bases are the units with 1 < B: 3 bases x 2 seeds, base variance 0.02: V = 0.02/3 + 0.04/6.
  comps = {"base": 0.02, "seed": 0.04, "task": 0.0}
  v = 0.02 / 3 + 0.04 / 6
  assert power.power(0.3, 0.0, comps, 3, 2) == pytest.approx(
      stats.nct.sf(stats.t.ppf(0.975, 2), 2, 0.3 / math.sqrt(v)))
  # More tasks shrink only the task part.
  comps = {"base": 0.0, "seed": 0.0, "task": 0.01}
  assert power.power(0.3, 0.0, comps, 3, 1, task_factor=4) > power.power(0.3, 0.0, comps, 3, 1)


def test_components_by_hand():
  m = power.Measured("x", 0.0, ((0.1, 0.2, 0.3), (0.3, 0.4, 0.5)), (0.2, 0.4),
                     ((0.0, 0.392), (0.2, 0.592)), "")
  c = power.components(m)
  assert c["seed"] == pytest.approx(0.01)                  # var(0.1, 0.2, 0.3), ddof 1
  boot = (0.392 / (2 * stats.norm.ppf(0.975))) ** 2        # about 0.01
  assert c["task"] == pytest.approx(boot - 0.01 * 2 / 9)
  assert c["base"] == pytest.approx(0.02 - 0.01 / 3)       # var(0.2, 0.4) - seed / 3
  assert c["delta"] == pytest.approx(0.3)


def test_smallest_design_reaches_the_target_and_is_minimal():
  comps = {"base": 0.0, "seed": 0.04, "task": 0.0}
  d = power.smallest_design(0.3, 0.0, comps)
  assert d["power"] >= 0.8
  b, r = d["bases"], d["seeds_per_base"]
  assert power.power(0.3, 0.0, comps, b - 1, r) < 0.8 or b == 3
  assert power.smallest_design(0.0, 0.02, comps) is None     # no effect: no design


def test_plan_lines_and_achieved():
  lines = power.plan_lines()
  assert lines[2].startswith("| claim | primary statistic"), lines[:3]
  assert sum(line.startswith("| ") for line in lines) == 1 + len(power.MEASURED)
  assert power.achieved(0.3, 0.0, 0.1, 4) == pytest.approx(
      stats.nct.sf(stats.t.ppf(0.975, 3), 3, 3.0))
  assert power.achieved(0.3, 0.0, None, 4) is None
