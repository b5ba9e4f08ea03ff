"""BudgetMix samplers: spec parsing, bad specs, empirical distributions, the schedule, per-batch
vs per-group draws, determinism and jit-friendliness."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxagent.rollout.budget import Budget, BudgetSpecError, budget_distribution

parse_budget = Budget.parse


@pytest.mark.parametrize("spec, kind, budgets, probs, steps", [
    ("fixed:8", "fixed", (8,), (1.0,), ()),
    ("8", "fixed", (8,), (1.0,), ()),
    ("mix:2,4,8,12", "mix", (2, 4, 8, 12), (0.25,) * 4, ()),
    (" mix: 2, 4 ", "mix", (2, 4), (0.5, 0.5), ()),
    ("weighted:2=0.5,8=0.5", "weighted", (2, 8), (0.5, 0.5), ()),
    ("weighted:2=1,8=3", "weighted", (2, 8), (0.25, 0.75), ()),
    ("schedule:0=2,100=8,200=2", "schedule", (2, 8, 2), (), (0, 100, 200)),
    ("MIX:3", "mix", (3,), (1.0,), ()),
])
def test_parse(spec, kind, budgets, probs, steps):
  s = parse_budget(spec)
  assert (s.kind, s.budgets, s.steps, s.per, s.spec) == (kind, budgets, steps, "batch", spec)
  np.testing.assert_allclose(s.probs, probs)
  assert s.max_turns == max(budgets)
  hash(s)                                     # a static jit argument
  assert parse_budget(spec, per="group").per == "group"


@pytest.mark.parametrize("spec, why", [
    ("", "missing 'kind:'"),
    ("uniform:2,4", "unknown kind 'uniform'"),
    ("mix:", "nothing after the colon"),
    ("mix:2,,4", "budget '' is not an integer"),
    ("mix:2,x", "budget 'x' is not an integer"),
    ("mix:2,2,4", "repeat a value"),
    ("fixed:0", "budget 0 must be >= 1"),
    ("fixed:2,4", "budget '2,4' is not an integer"),
    ("fixed:-3", "budget -3 must be >= 1"),
    ("weighted:2=0.5,8", "item '8' is not of the form key=value"),
    ("weighted:2=0,8=1", "weight '0' must be a finite number > 0"),
    ("weighted:2=abc", "weight 'abc' must be a finite number > 0"),
    ("weighted:2=inf", "weight 'inf' must be a finite number > 0"),
    ("schedule:10=2,20=4", "must start at step 0"),
    ("schedule:0=2,50=4,50=8", "strictly increasing"),
    ("schedule:0=2,x=4", "step 'x' is not an integer"),
    ("2.5", "missing 'kind:'"),
])
def test_bad_specs_name_the_valid_forms(spec, why):
  with pytest.raises(BudgetSpecError, match="valid forms: 'fixed:T'") as e:
    parse_budget(spec)
  assert why in str(e.value)
  assert isinstance(e.value, ValueError)


def test_bad_per():
  with pytest.raises(ValueError, match="per 'batch' or per 'group'"):
    parse_budget("fixed:4", per="episode")


def _draws(sampler, num_steps, num_groups, seed=0):
  fn = jax.jit(jax.vmap(sampler.sample, in_axes=(0, None, None)), static_argnums=2)
  return np.asarray(fn(jnp.arange(num_steps), jax.random.key(seed), num_groups))  # [steps, G]


def test_mix_and_weighted_empirical_distribution():
  n = 4000
  for spec, expected in (("mix:2,4,8,12", {2: .25, 4: .25, 8: .25, 12: .25}),
                         ("weighted:2=1,8=3", {2: .25, 8: .75})):
    s = parse_budget(spec)
    assert budget_distribution(s, 0) == pytest.approx(expected)
    draws = _draws(s, n, 3)[:, 0]
    freq = {t: np.mean(draws == t) for t in expected}
    assert set(np.unique(draws)) == set(expected)
    for t, p in expected.items():   # 4 binomial standard deviations
      assert abs(freq[t] - p) < 4 * np.sqrt(p * (1 - p) / n), (spec, freq)


def test_per_batch_shares_one_budget_per_group_draws_independently():
  batch = _draws(parse_budget("mix:2,4,8,12"), 300, 6)
  assert batch.dtype == np.int32 and batch.shape == (300, 6)
  assert np.all(batch == batch[:, :1])                   # every group shares the batch's T
  assert len(np.unique(batch[:, 0])) == 4                # ... which varies across batches
  group = _draws(parse_budget("mix:2,4,8,12", per="group"), 300, 6)
  assert np.mean(np.all(group == group[:, :1], axis=1)) < 0.05   # P(all 6 equal) = 4^-5
  freq = np.mean(group == 12)
  assert abs(freq - 0.25) < 4 * np.sqrt(0.25 * 0.75 / group.size)


def test_schedule_is_piecewise_constant_over_steps():
  s = parse_budget("schedule:0=2,100=8,200=3", per="group")
  assert s.max_turns == 8
  steps = np.array([0, 1, 99, 100, 150, 199, 200, 10_000])
  fn = jax.jit(s.sample, static_argnums=2)
  got = [np.asarray(fn(t, jax.random.key(t), 2)) for t in steps]
  np.testing.assert_array_equal([g[0] for g in got], [2, 2, 2, 8, 8, 8, 3, 3])
  assert all(g[0] == g[1] for g in got)
  assert fn._cache_size() == 1                            # the step is traced: no recompiles
  assert budget_distribution(s, 150) == {8: 1.0}


def test_fixed_and_deterministic_given_step_and_key():
  np.testing.assert_array_equal(parse_budget("fixed:5").sample(7, jax.random.key(0), 3), [5, 5, 5])
  s = parse_budget("mix:1,2,3,4,5,6,7,8", per="group")
  a = np.asarray(s.sample(3, jax.random.key(1), 16))
  np.testing.assert_array_equal(a, s.sample(3, jax.random.key(1), 16))
  assert not np.array_equal(a, s.sample(4, jax.random.key(1), 16))   # P(equal) = 8^-16
  assert not np.array_equal(a, s.sample(3, jax.random.key(2), 16))
  assert isinstance(s, Budget)
