"""Reports: JSON conversion, markdown tables and the PNG plots (the claim rules: test_claims.py)."""

import json

import numpy as np

from jaxagent.eval import pass_at_kt, plots, report

TASKS = 40


def test_claim1_from_episodes_matches_grid():
  """Per-task Pass@1 from success turns averages to the grid's K=1 row (the estimator's)."""
  st = np.random.default_rng(2).integers(1, 6, (TASKS, 5))
  counts = pass_at_kt.solved_counts_truncation(st, 4)
  per = pass_at_kt.per_task_pass(counts, 5, k_max=1)[:, 0, :]
  grid = pass_at_kt.pass_grid_truncation(st, 4, num_bootstrap=10)
  np.testing.assert_allclose(per.mean(0), grid["mean"][0])
  np.testing.assert_allclose(per, (st[:, :, None] <= np.arange(1, 5)).mean(1))


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
  assert report.fmt_interval({"est": 0.1, "lo": None, "hi": None}).endswith("no resample holds data]")
  assert report.describe_budget(np.array([2, 4, 4])) == {"per_task": True, "mean": 10 / 3,
                                                          "tasks_at": {2: 1, 4: 2}}


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
