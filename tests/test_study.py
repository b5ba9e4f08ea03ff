"""The main job end to end: the study pipeline on the smoke variant trains every arm with its
seeds, writes every report file, records every seed, and a finished study is not redone."""

import json

import numpy as np
import pytest

from configs.default import get_config
from jaxagent import study
from jaxagent.eval import evidence
from jaxagent.runs.config import ConfigError


@pytest.mark.slow
def test_study_smoke_end_to_end(tmp_path):
  config = get_config("smoke")
  config.num_devices = 1
  summary = study.run(config, tmp_path)
  report = tmp_path / "report"
  for name in ("comparison.md", "comparison.json"):
    assert (report / name).stat().st_size > 0
  assert list(report.glob("*.png"))
  labels = ["base"] + [f"{arm}_s{u}" for arm in study.ARMS for u in (0, 1)]
  for label in labels:
    run = tmp_path / label
    assert (run / "DONE").exists() and (run / "metrics.jsonl").exists()
    evals = list((run / "eval").glob("*/report.json"))
    assert len(evals) == 1
    ev = evals[0].parent
    for name in ("report.md", "episodes.npz"):
      assert (ev / name).exists()
    eps = np.load(ev / "episodes.npz")
    assert "success_turn" in eps.files
    # The comparison shows each run's own evaluation.
    own = json.loads(evals[0].read_text())
    comp = json.loads((report / "comparison.json").read_text())
    assert comp["pass_at_kt"][label] == own["pass_at_kt"]
  # Seed u of every arm ran with config seed 0 + u from the one base; all recorded.
  for label in labels[1:]:
    u = int(label[-1])
    assert comp["runs"][label]["seed"] == u and comp["runs"][label]["config_seed"] == u
    assert json.loads((tmp_path / label / "config.json").read_text())["seed"] == u
  assert comp["arms"]["budgetmix"] == ["budgetmix_s0", "budgetmix_s1"]
  assert set(comp["claims"]) == {"1", "2", "3", "4", "5"}
  for claim in comp["claims"].values():
    assert claim["verdict"] in (evidence.HELD, evidence.NOT_HELD, evidence.INCONCLUSIVE)
  assert comp["claims"]["3"]["decided_on"] == "budgetmix"
  assert comp["rules"]["margins"]["min_seeds"] == 2
  assert set(summary["claims"]) == set(comp["claims"])
  # Restarting the finished study redoes nothing but the comparison.
  before = {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")}
  study.run(config, tmp_path)
  assert {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")} == before


def test_study_refuses_evaluation_that_hides_a_visible_budget(tmp_path):
  config = get_config("smoke")
  config.rl.budget_visible = True
  with pytest.raises(ConfigError, match="rerun_budget_visible=True"):
    study.run(config, tmp_path)
  assert not list(tmp_path.glob("*/DONE"))


def test_run_configs_pair_seeds_with_bases(tmp_path):
  config = get_config("smoke")
  config.study.seeds, config.study.base_seeds = 3, 2
  runs = study.run_configs(config, tmp_path)
  assert list(runs)[:2] == ["base_s0", "base_s1"]
  assert [runs[f"budgetmix_s{u}"][0].model.init_from for u in range(3)] == [
      str(tmp_path / "base_s0"), str(tmp_path / "base_s1"), str(tmp_path / "base_s0")]
  assert [runs[f"fixed_tight_s{u}"][0].seed for u in range(3)] == [0, 1, 2]
  assert runs["base_s1"][0].seed == 1 and runs["base_s1"][0].rl.steps == 0
