"""Hostile input to runs (issue 37): evaluation trusts the run's own pinned config, a mistyped
workdir is not created, two runs sharing one data directory, and the cheap validations."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs.default import get_config
from jaxagent.eval import checkpoints
from jaxagent.runs.config import ConfigError
from jaxagent.runs.pinning import CONFIG_FILE, pin_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _trained_workdir(tmp_path, variant="smoke"):
  """A workdir as training leaves it before any checkpoint: its pinned config and checkpoints/."""
  w = tmp_path / "run"
  (w / "checkpoints").mkdir(parents=True)
  c = get_config(variant)
  pin_config(c, w)
  return w


# ---- case 4: evaluation uses the run's own config ---------------------------------------------


def test_evaluate_refuses_a_config_other_than_the_runs(tmp_path):
  w = _trained_workdir(tmp_path, "smoke")
  for fn in (checkpoints.evaluate_checkpoint, checkpoints.evaluate_all):
    with pytest.raises(ConfigError, match=r"(?s)trained with another config.*"
                       r"config\.env\.name: 'lookup' \(the run\) -> 'grid'") as info:
      fn(get_config(), w)          # the default variant: another environment, model, ...
    assert "the run's own config" in str(info.value)
  # Nothing was built inside the run's workdir (no task data, no eval/).
  assert sorted(p.name for p in w.iterdir()) == ["checkpoints", CONFIG_FILE]
  # Keys that only say how to evaluate may differ: the check passes (and the missing
  # checkpoint is what stops this fake run).
  c = get_config("smoke")
  c.eval.num_tasks = 3
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    checkpoints.evaluate_checkpoint(c, w)


def test_launch_evaluate_names_the_differing_keys(tmp_path):
  w = _trained_workdir(tmp_path, "smoke")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, "-m", "launch.evaluate", "--config=configs/default.py",
                         f"--workdir={w}"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode != 0
  assert "differ from its config.json" in proc.stderr and "config.env." in proc.stderr


def test_evaluate_on_a_mistyped_workdir_creates_nothing(tmp_path):
  w = tmp_path / "no_such_run"
  for fn in (checkpoints.evaluate_checkpoint, checkpoints.evaluate_all):
    with pytest.raises(FileNotFoundError, match="no checkpoints/ directory"):
      fn(get_config("smoke"), w)
  assert not w.exists()
