"""Reports: the claim rules on constructed data with known verdicts, JSON conversion, markdown
tables and the PNG plots."""

import json

import numpy as np
import pytest

from jaxagent.eval import pass_at_kt, plots, report
from jaxagent.eval.report import HELD, INCONCLUSIVE, MIXED, NOT_HELD

NB, CONF = 400, 0.95
TASKS = 40


def _w(n=TASKS, seed=0):
  return report.resample_weights(n, NB, np.random.default_rng(seed))


def test_combine_and_tight_generous():
  assert report.combine([HELD, INCONCLUSIVE]) == HELD
  assert report.combine([HELD, NOT_HELD]) == MIXED
  assert report.combine([NOT_HELD, INCONCLUSIVE]) == NOT_HELD
  assert report.combine([INCONCLUSIVE]) == INCONCLUSIVE
  assert report.combine([]) == INCONCLUSIVE
  tight, gen = report.tight_generous(range(1, 9), np.array([2, 3, 3, 9]))
  assert tight.tolist() == [2, 3, 3, 8] and gen == 8
  tight, gen = report.tight_generous([2, 4, 8], np.array([3, 1, 4]))
  assert tight.tolist() == [4, 2, 4] and gen == 8
  p = np.arange(12.0).reshape(4, 3)     # [tasks, T in (2, 4, 8)]
  assert report.at_budget(p, [2, 4, 8], np.array([2, 4, 8, 4])).tolist() == [0, 4, 8, 10]
  assert report.at_budget(p, [2, 4, 8], 8).tolist() == [2, 5, 8, 11]
  assert report.describe_budget(np.array([2, 4, 4])) == {"per_task": True, "mean": 10 / 3,
                                                          "tasks_at": {2: 1, 4: 2}}


def test_resample_weights_are_bootstrap_means():
  w = _w(5)
  assert w.shape == (NB, 5)
  np.testing.assert_allclose(w.sum(1), 1.0)
  assert np.all(np.isclose(w * 5, np.round(w * 5)))        # integer multiplicities / n
  x = np.arange(5.0)
  i = report.paired_diff(x, np.zeros(5), w, CONF)
  assert i["est"] == 2.0 and i["lo"] < 2.0 < i["hi"]


def _const(v_by_t):
  """Per-task Pass@1 [TASKS, T] with every task equal to v_by_t."""
  return np.tile(np.asarray(v_by_t, float), (TASKS, 1))


def test_claim1_budget_gain_rules():
  t_values = [1, 2, 3, 4]
  base = _const([0, 0, 0.2, 0.2])
  pass1 = {"base": base,
           "gen_only": _const([0, 0, 0.2, 0.9]),       # gain only at the generous budget
           "tight_more": _const([0, 0, 0.8, 0.4]),     # gain larger when tight
           "noise": base + np.random.default_rng(1).normal(0, 0.3, (TASKS, 4))}
  r = report.claim_budget_gain(pass1, t_values, 3, 4, "base", ["gen_only", "tight_more", "noise"],
                               _w(), CONF)
  assert r["T_tight"] == 3 and r["T_gen"] == 4
  p = r["per_run"]
  assert p["gen_only"]["verdict"] == HELD
  assert p["gen_only"]["gain_generous"]["est"] == pytest.approx(0.7)
  assert p["gen_only"]["gain_tight"]["est"] == pytest.approx(0.0)
  assert p["gen_only"]["D"]["est"] == pytest.approx(0.7)
  assert p["tight_more"]["verdict"] == NOT_HELD and p["tight_more"]["D"]["est"] == pytest.approx(-0.4)
  assert p["noise"]["verdict"] == INCONCLUSIVE
  assert p["noise"]["D"]["lo"] < 0 < p["noise"]["D"]["hi"]
  assert p["gen_only"]["pass_base_generous"] == pytest.approx(0.2)
  # Per-task tight budgets: each task read at its own T.
  half = np.where(np.arange(TASKS) % 2 == 0, 3, 2)
  r2 = report.claim_budget_gain(pass1, t_values, half, 4, "base", ["gen_only"], _w(), CONF)
  assert r2["per_run"]["gen_only"]["gain_tight"]["est"] == pytest.approx(0.0)
  assert r2["per_run"]["gen_only"]["pass_base_tight"] == pytest.approx(0.1)   # 0.2 and 0 halves
  assert r2["T_tight"]["tasks_at"] == {2: TASKS // 2, 3: TASKS - TASKS // 2}
  same_t = report.claim_budget_gain(pass1, t_values, 4, 4, "base", ["gen_only"], _w(), CONF)
  assert same_t["per_run"]["gen_only"]["verdict"] == INCONCLUSIVE
  claim = report.finish_claim(1, r)
  assert claim["verdict"] == MIXED and claim["rule"] == report.RULES[1]


def test_claim1_from_episodes_matches_grid():
  """Per-task Pass@1 from success turns averages to the grid's K=1 row (the estimator's)."""
  st = np.random.default_rng(2).integers(1, 6, (TASKS, 5))
  counts = pass_at_kt.solved_counts_truncation(st, 4)
  per = pass_at_kt.per_task_pass(counts, 5, k_max=1)[:, 0, :]
  grid = pass_at_kt.pass_grid_truncation(st, 4, num_bootstrap=10)
  np.testing.assert_allclose(per.mean(0), grid["mean"][0])
  np.testing.assert_allclose(per, (st[:, :, None] <= np.arange(1, 5)).mean(1))


def _ones(k, n=100):
  return np.r_[np.ones(k), np.zeros(n - k)]


def test_claim2_recovery_vs_step_rules():
  step = {"base": _ones(80), "rl_rec": _ones(80), "rl_step": _ones(100), "rl_drop": _ones(40)}
  rec = {"base": _ones(20), "rl_rec": _ones(60), "rl_step": _ones(20), "rl_drop": _ones(60)}
  r = report.claim_recovery_vs_step(step, rec, "base", ["rl_rec", "rl_step", "rl_drop"], NB,
                                    CONF, 0)["per_run"]
  assert r["rl_rec"]["verdict"] == HELD
  assert r["rl_rec"]["d_rec"]["est"] == pytest.approx(0.4)
  assert r["rl_rec"]["d_step"]["est"] == 0.0 and not r["rl_rec"]["step_quality_dropped"]
  assert r["rl_step"]["verdict"] == NOT_HELD and r["rl_step"]["D"]["est"] == pytest.approx(-0.2)
  assert r["rl_drop"]["verdict"] == HELD and r["rl_drop"]["step_quality_dropped"]
  assert r["rl_drop"]["D"]["est"] == pytest.approx(0.8)


def test_claim3_budgetmix_rules():
  t_values = [2, 4]
  pass1 = {"base": _const([0.1, 0.2]), "mix": _const([0.5, 0.8]), "fixed": _const([0.3, 0.8]),
           "fixed_tight": _const([0.9, 0.5])}
  step = {"base": _ones(50), "mix": _ones(50), "fixed": _ones(50), "fixed_tight": _ones(50),
          "mix_drop": _ones(10)}
  r = report.claim_budgetmix(pass1, t_values, 2, 4, step, "base", ["mix"], ["fixed"], _w(), NB,
                             CONF, 0)
  assert r["per_run"]["mix"]["verdict"] == HELD
  assert r["per_run"]["mix"]["gain_vs_base"]["tight"]["est"] == pytest.approx(0.4)
  # A fixed-T run significantly better at the tight budget: not robust.
  r = report.claim_budgetmix(pass1, t_values, 2, 4, step, "base", ["mix"],
                             ["fixed", "fixed_tight"], _w(), NB, CONF, 0)
  assert r["per_run"]["mix"]["verdict"] == NOT_HELD
  # Step quality significantly dropped: not kept.
  pass1["mix_drop"] = pass1["mix"]
  r = report.claim_budgetmix(pass1, t_values, 2, 4, step, "base", ["mix_drop"], ["fixed"], _w(),
                             NB, CONF, 0)
  assert r["per_run"]["mix_drop"]["verdict"] == NOT_HELD
  assert r["per_run"]["mix_drop"]["d_step"]["hi"] < 0


def _lik(sum_rr, sum_rb, count):
  mk = lambda s: {"sum": np.asarray(s, float), "count": np.asarray(count, float),
                  "mean": np.asarray(s, float) / np.maximum(count, 1)}
  return {"rr": mk(sum_rr), "base": mk(sum_rb)}


def test_claim4_likelihood_rules():
  rng = np.random.default_rng(0)
  s = -50 + rng.normal(0, 1, 30)
  per = {"up": {"up": _lik(s + 10, s, [5] * 30)["rr"], "base": _lik(s + 10, s, [5] * 30)["base"]},
         "down": {"down": _lik(s - 3, s, [5] * 30)["rr"], "base": _lik(s - 3, s, [5] * 30)["base"]},
         "flat": {"flat": _lik(s + rng.normal(0, 1, 30), s, [5] * 30)["rr"],
                  "base": _lik(s, s, [5] * 30)["base"]}}
  r = report.claim_likelihood(per, "base", ["up", "down", "flat"], NB, CONF, 0)["per_run"]
  assert r["up"]["verdict"] == HELD and r["up"]["log_ratio"]["est"] == pytest.approx(10.0)
  assert r["up"]["per_token_diff"] == pytest.approx(2.0)
  assert r["down"]["verdict"] == NOT_HELD
  assert r["flat"]["verdict"] == INCONCLUSIVE
  # Trajectories without agent tokens are left out.
  per = {"x": {"x": _lik([1.0, 99.0], [0.0, 0.0], [1, 0])["rr"],
               "base": _lik([1.0, 99.0], [0.0, 0.0], [1, 0])["base"]}}
  r = report.claim_likelihood(per, "base", ["x"], NB, CONF, 0)["per_run"]["x"]
  assert r["num_trajectories"] == 1 and r["log_ratio"]["est"] == 1.0


def test_claim5_recovery_rule():
  rec = {"base": _ones(27), "rl": _ones(41), "same": _ones(27)}
  r = report.claim_recovery(rec, "base", ["rl", "same"], NB, CONF, 0)["per_run"]
  assert r["rl"]["rate_rl"] == 0.41 and r["rl"]["rate_base"] == 0.27
  assert r["rl"]["verdict"] == HELD and r["rl"]["D"]["est"] == pytest.approx(0.14)
  assert r["same"]["verdict"] == INCONCLUSIVE
  empty = report.claim_recovery({"base": np.zeros(0), "rl": np.zeros(0)}, "base", ["rl"], NB,
                                CONF, 0)
  assert empty["per_run"]["rl"]["verdict"] == INCONCLUSIVE
  assert report.finish_claim(5, {"per_run": {}})["note"]


def test_json_and_markdown_helpers(tmp_path):
  obj = {"a": np.float32(0.5), "b": np.array([1, 2]), "c": float("nan"), "d": (np.bool_(True),),
         1: {"e": np.int64(3)}}
  report.write_json(obj, tmp_path / "x.json")
  assert json.loads((tmp_path / "x.json").read_text()) == {"a": 0.5, "b": [1, 2], "c": None,
                                                           "d": [True], "1": {"e": 3}}
  grid = report.grid_json(pass_at_kt.pass_grid_truncation(np.array([[1, 3], [5, 5]]), 4,
                                                          num_bootstrap=20))
  lines = report.grid_table(grid)
  assert lines[0] == "|  | T=1 | T=2 | T=3 | T=4 |"
  assert lines[2].startswith("| K=1 | 0.250 ")
  assert report.fmt_rate({"rate": None, "lo": None, "hi": None, "n": 0}) == "- (n=0)"
  assert report.fmt_interval({"est": 0.1, "lo": -0.2, "hi": 0.3}) == "+0.100 [-0.200, +0.300]"


def _is_png(path) -> bool:
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_write_pngs(tmp_path):
  grid = report.grid_json(pass_at_kt.pass_grid_truncation(
      np.random.default_rng(0).integers(1, 6, (10, 4)), 5, num_bootstrap=20))
  r = {"rate": 0.4, "lo": 0.3, "hi": 0.5, "n": 10}
  none = {"rate": None, "lo": None, "hi": None, "n": 0}
  paths = [plots.pass_heatmap(grid, tmp_path / "h.png"),
           plots.pass_curves(grid, [1, 2, 4, 99], tmp_path / "c.png"),
           plots.pass_curves_runs({"a": grid, "b": grid}, 1, tmp_path / "r.png"),
           plots.rate_bars({"p": {"x": r, "y": none}, "q": {"x": r}}, tmp_path / "b.png", "t"),
           plots.matrix([[-1.0, None], [-2.0, -3.0]], ["a", "b"], ["a", "b"], tmp_path / "m.png",
                        "t")]
  for p in paths:
    assert _is_png(p)
