"""Hostile input to runs (issue 37): evaluation trusts the run's own pinned config, a mistyped
workdir is not created, two runs sharing one data directory, and the cheap validations."""

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


# ---- the cheap validations ------------------------------------------------------------------


def _smoke(**overrides):
  c = get_config("smoke")
  c.num_devices = 1
  for k, v in overrides.items():
    section, _, key = k.rpartition(".")
    (c[section] if section else c)[key] = v
  return c


@pytest.mark.parametrize("overrides,message", [
    ({"rl.budget": "fixed:400"}, r"config\.rl\.budget.*a rollout of 400 turns needs"),
    ({"model.path": "builtin:tinyy"}, r"unknown built-in model 'builtin:tinyy'"),
    ({"num_devices": 99}, r"config\.num_devices=99, but this process sees 8 device"),
    ({"rl.temperature": 0.0}, r"config\.rl\.temperature=0\.0: RL needs sampled episodes"),
])
def test_bad_configs_fail_before_compute_and_are_not_pinned(tmp_path, overrides, message):
  from jaxagent import train
  w = tmp_path / "run"
  with pytest.raises(Exception, match=message):
    train.run(_smoke(**overrides), w)
  assert not (w / CONFIG_FILE).exists()     # the corrected rerun is not refused as a change
  assert not (w / "data").exists()           # nothing was built (SFT data, demos)


@pytest.mark.parametrize("env,message", [
    ({"JAXAGENT_CACHE_ATTENTION": "bogus"}, r"JAXAGENT_CACHE_ATTENTION='bogus'.*unset it"),
    ({"JAXAGENT_CACHE_ATTENTION": "kernel", "CXX": "no-such-compiler-xyz"},
     r"no C\+\+ compiler 'no-such-compiler-xyz'"),
])
def test_a_bad_attention_path_fails_before_compute(tmp_path, monkeypatch, env, message):
  """The attention switch's environment default, and "kernel" where the kernel cannot be built,
  are checked before any compute (they used to surface after SFT, at the first rollout)."""
  from jaxagent import train
  from jaxagent.kernels import cpu
  monkeypatch.setattr(cpu, "_STATE", {})
  monkeypatch.setenv("JAXAGENT_KERNEL_DIR", str(tmp_path / "kernels"))
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  w = tmp_path / "run"
  with pytest.raises(Exception, match=message):
    train.run(_smoke(), w)
  assert not (w / CONFIG_FILE).exists() and not (w / "data").exists()


def test_a_workdir_that_is_a_file_is_named(tmp_path):
  from jaxagent import train
  f = tmp_path / "run.txt"
  f.write_text("not a directory")
  with pytest.raises(ConfigError, match=r"is an existing file, not a directory"):
    train.run(_smoke(), f)


def test_sampling_parameters_are_checked():
  import math
  from jaxagent.models.sampler import SamplingConfig
  SamplingConfig.make(0.0, 0, 1.0)             # greedy, no truncation: fine
  SamplingConfig.make(0.7, 5, 0.9)
  for kw, msg in [(dict(temperature=-0.5), "temperature=-0.5"),
                  (dict(temperature=math.nan), "temperature=nan"),
                  (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
                  (dict(top_p=math.nan), "top_p=nan"), (dict(top_k=-1), "top_k=-1")]:
    with pytest.raises(ValueError, match=msg):
      SamplingConfig.make(**kw)
