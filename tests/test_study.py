"""The main job end to end: the study pipeline on the smoke variant trains every arm with its
seeds, writes every report file, records every seed, and a finished study is not redone."""

import json

import numpy as np
import pytest

from configs.default import get_config
from jaxagent import study
from jaxagent.eval import evidence
from jaxagent.runs import config as sections
from jaxagent.runs import setup
from jaxagent.runs.config import ConfigError
from jaxagent.runs.programs import programs_for


@pytest.mark.slow
def test_study_smoke_end_to_end(tmp_path):
  config = get_config("smoke")
  config.num_devices = 1
  # One turn-level credit arm rides along (trained with gigpo through the real rollout's state
  # fingerprints, reported against the standard arm).
  config.study.credit_arms = "gigpo:advantage=gigpo"
  # Evaluation batches of a training batch's shape (2 tasks x 4 episodes): the evaluation runs
  # the program the generous arms' RL compiled (T_max 4) instead of compiling its own.
  config.eval.tasks_per_batch = config.rl.num_tasks
  assert config.eval.num_samples == config.rl.group_size
  # One set of compiled programs for the study and its restart, as one process would hold them.
  programs = programs_for(config, *setup.load_skeleton(config))
  summary = study.run(config, tmp_path, programs=programs)
  print("programs built", programs.compiles)
  report = tmp_path / "report"
  for name in ("comparison.md", "comparison.json"):
    assert (report / name).stat().st_size > 0
  assert list(report.glob("*.png"))
  labels = ["base"] + [f"{arm}_s{u}" for arm in study.ARMS + ("gigpo",) for u in (0, 1)]
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
  assert comp["claims"]["1"]["decided_on"] == "fixed_generous"
  assert comp["runs"]["gigpo_s1"]["kind"] == "credit"
  assert comp["runs"]["gigpo_s1"]["credit"] == "gigpo(gamma=1, step_weight=1)"
  assert comp["credit"]["gigpo"]["against"] == "fixed_generous"
  assert comp["credit"]["gigpo"]["verdict"] in (evidence.HELD, evidence.NOT_HELD,
                                                evidence.INCONCLUSIVE)
  assert "## Turn-level credit against the standard arm" in (report / "comparison.md").read_text()
  metrics = [json.loads(x) for x in
             (tmp_path / "gigpo_s0" / "metrics.jsonl").read_text().splitlines()]
  metrics = [m for m in metrics if m["phase"] == "rl"]
  assert metrics and all("anchor_group_size" in m for m in metrics)
  assert comp["rules"]["margins"]["min_seeds"] == 2
  assert set(summary["claims"]) == set(comp["claims"])
  # Restarting the finished study redoes nothing but the comparison (which builds no program).
  before = {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")}
  compiled = programs.compiles, programs.rollouts.traces
  study.run(config, tmp_path, programs=programs)
  assert {p: p.stat().st_mtime for p in tmp_path.glob("*/eval/*/report.json")} == before
  assert (programs.compiles, programs.rollouts.traces) == compiled


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


def test_credit_arms_train_like_the_generous_arm_with_their_learner_settings(tmp_path):
  config = get_config("smoke")
  config.study.credit_arms = "gigpo:advantage=gigpo,step_weight=0.5; proc:process_error=0.2"
  runs = study.run_configs(config, tmp_path)
  assert [lab for lab in runs if lab.startswith(("gigpo", "proc"))] == [
      "gigpo_s0", "gigpo_s1", "proc_s0", "proc_s1"]
  for u in range(2):
    gen, g, p = (runs[f"{a}_s{u}"][0] for a in ("fixed_generous", "gigpo", "proc"))
    assert g.rl.budget == p.rl.budget == gen.rl.budget == config.study.generous_budget
    assert g.seed == p.seed == gen.seed and g.model.init_from == gen.model.init_from
    assert (g.rl.learner.advantage, g.rl.learner.step_weight) == ("gigpo", 0.5)
    assert p.rl.learner.process_error == 0.2 and p.rl.learner.advantage == "grpo"
    assert gen.rl.learner.advantage == "grpo" and gen.rl.learner.process_error == 0.0
  for bad, message in (("gigpo", "name:key=value"), ("x:nope=1", "learner key"),
                       ("x:gamma=high", "not a float"), ("budgetmix:gamma=0.5", "new arm name")):
    config.study.credit_arms = bad
    with pytest.raises(sections.ConfigError, match=message):
      sections.study_config(config)
