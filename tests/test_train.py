"""The training loop: end to end, exact resume, preemption, bad config."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs.default import get_config
from jaxagent import train
from jaxagent.runs import layout, setup
from jaxagent.runs.config import run_config
from jaxagent.runs.lock import WorkdirLockedError
from jaxagent.runs.programs import programs_for

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rl_only(steps, **over):
  c = get_config("smoke")
  c.sft.steps = 0
  c.rl.steps = steps
  c.checkpoint_every = 1
  c.num_devices = 1
  c.update_from_flattened_dict(over)
  return c


def _params(workdir, config):
  policy = setup.load_policy(config)
  params, _, _ = layout.latest_params(workdir, layout.abstract_params(policy.params))
  return jax.tree.map(np.asarray, params)


def test_resume_is_exact(tmp_path, metrics_lines):
  data = tmp_path / "data"
  full, split = tmp_path / "full", tmp_path / "split"
  config = _rl_only(4, **{"data.dir": str(data)})
  programs = programs_for(config, *setup.load_skeleton(config))
  train.run(config, full, programs=programs)
  train.run(_rl_only(2, **{"data.dir": str(data)}), split, programs=programs)
  # Same run, continued: a config with more steps resumes from the step-2 checkpoint.
  train.run(_rl_only(4, **{"data.dir": str(data)}), split, programs=programs)
  # Ten RL steps over three runs, one rollout program traced once (budgets drawn from mix:1,2
  # never recompile); one update per run length (the schedule's total steps are static).
  assert programs.compiles == {"rollout": 1, "update": 2}
  assert programs.rollouts.traces == 1
  other = _rl_only(1, **{"env.difficulty.hops": 2})
  with pytest.raises(ValueError, match="another model or environment"):
    train.run(other, tmp_path / "other", programs=programs)
  a, b = metrics_lines(full), metrics_lines(split)
  assert [l["step"] for l in a] == [1, 2, 3, 4]
  assert a == b
  pa, pb = _params(full, _rl_only(4)), _params(split, _rl_only(4))
  jax.tree.map(np.testing.assert_array_equal, pa, pb)
  # A finished phase is not redone.
  before = (full / "metrics.jsonl").read_text()
  train.run(_rl_only(4, **{"data.dir": str(data)}), full)
  assert (full / "metrics.jsonl").read_text() == before
  # Its final checkpoint damaged (every data file truncated): the rerun resumes from step 3, the
  # newest intact one, and redoes step 4 exactly.
  for f in (full / "checkpoints" / "rl" / "4" / "state").rglob("d/*"):
    os.truncate(f, 16)
  train.run(_rl_only(4, **{"data.dir": str(data)}), full)
  assert metrics_lines(full) == a
  jax.tree.map(np.testing.assert_array_equal, _params(full, _rl_only(4)), pb)
  assert (full / "checkpoints" / "rl" / "4.damaged").is_dir()     # set aside, not deleted


def test_bad_config_fails_before_compute(tmp_path):
  with pytest.raises(ValueError, match="budget"):
    train.run(_rl_only(1, **{"rl.budget": "mix:2,x"}), tmp_path / "a")
  with pytest.raises(ValueError, match="unknown advantage"):
    train.run(_rl_only(1, **{"rl.learner.advantage": "ppo2"}), tmp_path / "b")
  with pytest.raises(ValueError, match="not an environment"):
    train.run(_rl_only(1, **{"env.name": "chess"}), tmp_path / "c")
  assert not (tmp_path / "a" / "checkpoints").exists()


def _launch(workdir, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env["XLA_FLAGS"] = ""
  return subprocess.Popen(
      [sys.executable, "-m", "launch.train", "--config=configs/default.py:smoke",
       f"--workdir={workdir}", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_launch_smoke_end_to_end_and_sigterm(tmp_path):
  # SIGTERM after the first RL step: a checkpoint is saved, the process exits cleanly, and the
  # same command resumes and finishes.
  work = tmp_path / "w"
  flags = ["--config.rl.steps=6", "--config.checkpoint_every=100"]
  proc = _launch(work, *flags)
  metrics = work / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and any('"phase": "rl"' in l for l in metrics.read_text().splitlines()):
      break
    time.sleep(0.5)
  assert proc.poll() is None, proc.communicate()[0][-3000:]
  # A second trainer on the same workdir (this process) refuses at once, naming the holder, and
  # writes nothing.
  before = metrics.read_text()
  config = get_config("smoke")
  config.rl.steps, config.checkpoint_every = 6, 100
  t0 = time.time()
  with pytest.raises(WorkdirLockedError, match=f'"pid": {proc.pid}'):
    train.run(config, work)
  assert time.time() - t0 < 5
  assert metrics.read_text().startswith(before)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=300)[0]
  assert "preempted" in out, out[-3000:]
  steps = sorted(int(p.name) for p in (work / "checkpoints" / "rl").iterdir() if p.name.isdigit())
  assert steps and steps[-1] < 6            # saved at the step it stopped, not at an interval
  # What a crash in mid-write leaves: the resume drops the partial line.
  with open(metrics, "a") as f:
    f.write('{"phase": "rl", "step": 9, "loss": 0.1')
  proc = _launch(work, *flags)
  out = proc.communicate(timeout=900)[0]
  assert proc.returncode == 0, out[-3000:]
  rl = [json.loads(l) for l in metrics.read_text().splitlines() if '"phase": "rl"' in l]
  assert [l["step"] for l in rl] == [1, 2, 3, 4, 5, 6]
  assert (work / "DONE").exists()


def test_only_the_primary_process_writes_metrics_and_markers(tmp_path, monkeypatch):
  """On a multi-host job every process runs the loop (and saves its shards of each checkpoint);
  metrics, TensorBoard events, config.json and DONE are written once, by process 0."""
  from jaxagent.sharding import distributed
  data = tmp_path / "data"
  cfg = run_config(_rl_only(2, **{"data.dir": str(data)}))
  setup.load_tasks(cfg.data, cfg.env, tmp_path, "train")                         # built once
  monkeypatch.setattr(distributed, "is_primary", lambda: False)
  other = tmp_path / "other"
  train.run(_rl_only(2, **{"data.dir": str(data)}), other)
  assert sorted(p.name for p in other.iterdir()) == ["checkpoints"]
  assert sorted(int(p.name) for p in (other / "checkpoints" / "rl").iterdir()
                if p.name.isdigit()) == [1, 2]
  # The primary process writes all of them: test_resume_is_exact and the launch test read them.
