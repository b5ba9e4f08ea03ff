"""The comparison classifies each run's arm from its training budget, parsed as a `Budget`."""

import pytest

from jaxagent.eval.compare import run_kind
from jaxagent.rollout.budget import BudgetSpecError


@pytest.mark.parametrize("budget, kind", [
    ("8", "fixed"), ("fixed:8", "fixed"), ("FIXED:8", "fixed"), (" fixed : 8 ", "fixed"),
    ("mix:8", "fixed"), ("schedule:0=8", "fixed"),
    ("mix:2,4,8", "mix"), ("MIX:3,4", "mix"), ("weighted:2=1,8=3", "mix"),
    ("schedule:0=2,100=8", "schedule"), ("schedule:0=8,50=8,60=4", "schedule"),
])
def test_run_kind_from_the_budget_spec(budget, kind):
  assert run_kind("rl", "base", budget) == kind
  assert run_kind("base", "base", budget) == "base"


def test_run_kind_bad_spec_names_the_valid_forms():
  with pytest.raises(BudgetSpecError, match="valid forms"):
    run_kind("rl", "base", "fixed-8")
