"""The main job end to end: the study pipeline on the smoke variant produces every report file
with sane values, and a finished study is not redone."""

import json

import numpy as np
import pytest

from configs.default import get_config
from jaxagent import study
from jaxagent.eval import report as report_lib


def _rates_in_unit_interval(node, path=""):
  """Every value under a key ending in 'rate' is in [0, 1] (or None: no such states)."""
  if isinstance(node, dict):
    for k, v in node.items():
      if k.endswith("rate") and isinstance(v, (int, float)):
        assert 0.0 <= v <= 1.0, f"{path}/{k} = {v}"
      _rates_in_unit_interval(v, f"{path}/{k}")
  elif isinstance(node, list):
    for i, v in enumerate(node):
      _rates_in_unit_interval(v, f"{path}[{i}]")


@pytest.mark.slow
def test_study_smoke_end_to_end(tmp_path):
  config = get_config("smoke")
  config.num_devices = 1
  summary = study.run(config, tmp_path)
  report = tmp_path / "report"
  for name in ("comparison.md", "comparison.json"):
    assert (report / name).stat().st_size > 0
  assert list(report.glob("*.png"))
  for label in ("base", "fixed_tight", "fixed_generous", "budgetmix"):
    run = tmp_path / label
    assert (run / "DONE").exists() and (run / "metrics.jsonl").exists()
    evals = list((run / "eval").glob("*/report.json"))
    assert len(evals) == 1
    ev = evals[0].parent
    for name in ("report.md", "episodes.npz"):
      assert (ev / name).exists()
    eps = np.load(ev / "episodes.npz")
    assert "success_turn" in eps.files
  comp = json.loads((report / "comparison.json").read_text())
  assert set(comp["claims"]) == {"1", "2", "3", "4", "5"}
  for claim in comp["claims"].values():
    assert claim["verdict"] in (report_lib.HELD, report_lib.NOT_HELD, report_lib.MIXED,
                                report_lib.INCONCLUSIVE)
  # The base policy is not already perfect.
  base = comp["pass_at_kt"]["base"]
  assert base["mean"][0][-1] < 1.0
  _rates_in_unit_interval(comp)
  for grid in comp["pass_at_kt"].values():
    g = grid["grid"] if "grid" in grid else grid
    mean, lo, hi = (np.asarray(g[k], float) for k in ("mean", "lo", "hi"))
    assert np.all(lo <= mean + 1e-9) and np.all(mean <= hi + 1e-9)
    assert np.all((mean >= 0) & (mean <= 1))
  assert set(summary["claims"]) == set(comp["claims"])
  # Restarting the finished study redoes nothing but the comparison.
  before = {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")}
  study.run(config, tmp_path)
  assert {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")} == before
