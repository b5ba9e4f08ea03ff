"""The comparison's input checks and arm kinds, on hand-made evaluation records (the comparison
end to end, on a smoke run's checkpoints, is in test_eval_jobs.py)."""

import numpy as np
import pytest

from jaxagent.eval.compare import arm_kinds, check_evaluations


def _eval(budget="fixed:8", arm="fixed", credit="", visible=False, eval_visible=False,
          num_samples=2, tasks=(0, 1, 2)):
  """(report, episodes) as `latest_eval` reads them, with only the fields the checks use."""
  rep = {"run": {"train_budget": budget, "train_arm": arm, "train_credit": credit,
                 "train_budget_visible": visible},
         "eval": {"mode": "rerun", "budgets": [2, 8], "num_samples": num_samples,
                  "budget_visible": eval_visible}}
  return rep, {"task/goal": np.asarray(tasks), "success_turn_by_t": np.zeros((2, 3, 2))}


def test_arm_kinds_reads_the_stored_arm_and_parses_only_t_max():
  # The stored arm is what counts, even where a spec would now parse to another arm: a
  # comparison classifies an arm as its evaluation recorded it.
  evals = {"mixed_s0": _eval("mix:2,4,8", "mix"), "mixed_s1": _eval("mix:2,4,8", "fixed"),
           "sched_s0": _eval("schedule:0=2,100=6", "schedule"),
           "odd_s0": _eval("fixed:5", "schedule"), "cred_s0": _eval("8", "fixed", credit="turn")}
  arms = {"mixed": ["mixed_s0", "mixed_s1"], "sched": ["sched_s0"], "odd": ["odd_s0"],
          "cred": ["cred_s0"]}
  kinds, turns = arm_kinds(evals, arms)
  assert kinds == {"mixed": "mix", "sched": "schedule", "odd": "schedule", "cred": "credit"}
  assert turns == {"mixed": 8, "sched": 6, "odd": 5, "cred": 8}


def test_arm_kinds_without_a_stored_arm_asks_to_evaluate_again():
  rep, eps = _eval()
  del rep["run"]["train_arm"]
  with pytest.raises(ValueError, match="rl_s0.*launch.evaluate"):
    arm_kinds({"rl_s0": (rep, eps)}, {"rl": ["rl_s0"]})


def test_check_evaluations_accepts_runs_evaluated_alike():
  check_evaluations({"base": _eval(visible=True), "rl": _eval(), "rl_s1": _eval()}, ["base"])


@pytest.mark.parametrize("other", [
    _eval(num_samples=4), _eval(tasks=(0, 1, 5)), _eval(tasks=(0, 1)),
])
def test_check_evaluations_refuses_other_tasks_or_settings(other):
  with pytest.raises(ValueError, match="'rl' was evaluated on other tasks or settings than "
                                       "'base'.*same config"):
    check_evaluations({"base": _eval(), "rl": other}, ["base"])


@pytest.mark.parametrize("trained, shown, fix", [
    (True, False, "rerun_budget_visible=True"), (False, True, "mode=truncation"),
])
def test_check_evaluations_refuses_a_budget_shown_otherwise_than_in_training(trained, shown,
                                                                               fix):
  evals = {"base": _eval(eval_visible=shown), "rl": _eval(visible=trained, eval_visible=shown)}
  with pytest.raises(ValueError, match=f"'rl' was trained with the budget.*{fix}"):
    check_evaluations(evals, ["base"])
  check_evaluations({"base": evals["base"]}, ["base"])     # a base is never trained with T
