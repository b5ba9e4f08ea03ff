"""Runs that cannot be corrupted, unit by unit: the workdir lock (two real processes, and a
holder killed with SIGKILL), metrics.jsonl repair, the pinned config, range checks with the key
named, the stall guard, the context check, and unknown command-line overrides."""

import json
import os
import signal
import subprocess
import sys

import pytest

from configs.default import get_config
from jaxagent import envs
from jaxagent.learners.logger import MetricsLog, read_metrics
from jaxagent.models.policy import load_config_and_tokenizer
from jaxagent.runs import config as sections
from jaxagent.runs import setup
from jaxagent.runs.lock import WorkdirLock, WorkdirLockedError
from jaxagent.runs.pinning import CHANGES_FILE, pin_config
from jaxagent.train import DivergenceError, StallGuard
from launch._flags import unknown_override

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD = ("import sys, time; from jaxagent.runs.lock import WorkdirLock; "
        "WorkdirLock(sys.argv[1], 'train').acquire(); print('held', flush=True); time.sleep(60)")


def test_lock_refuses_a_second_process_and_survives_a_killed_holder(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  try:
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(WorkdirLockedError, match=f'"pid": {proc.pid}.*another --workdir'):
      WorkdirLock(tmp_path, "train").acquire()
    # Another kind of lock (an evaluator beside the trainer) is free.
    with WorkdirLock(tmp_path, "eval"):
      pass
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # The holder died without releasing: its lock file remains, the lock does not.
  assert (tmp_path / ".train.lock").exists()
  with WorkdirLock(tmp_path, "train") as lock:
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
  assert lock.path.read_text() == ""     # released: the holder's line is cleared


def _line(phase, step):
  return json.dumps({"phase": phase, "step": step, "loss": step / 10}) + "\n"


def test_metrics_repair_on_resume(tmp_path):
  path = tmp_path / "metrics.jsonl"
  full = "".join(_line("sft", s) for s in (1, 2)) + "".join(_line("rl", s) for s in (1, 2))
  path.write_text(full + "".join(_line("rl", s) for s in (3, 4)) + '{"phase": "rl", "st')
  MetricsLog(tmp_path, "rl", resume_step=2, tensorboard=False).close()
  assert path.read_text() == full
  # A damaged line that is not the last is not guessed at.
  path.write_text(_line("sft", 1) + "garbage\n" + _line("sft", 2))
  with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: unreadable"):
    read_metrics(path)


def test_pinned_config_refuses_a_changed_key_and_records_allowed_changes(tmp_path):
  c = get_config("smoke")
  assert pin_config(c, tmp_path) == {}
  changed = get_config("smoke")
  changed.rl.learner.learning_rate, changed.rl.budget = 1e-4, "fixed:2"
  with pytest.raises(sections.ConfigError) as e:
    pin_config(changed, tmp_path)
  assert "config.rl.budget: 'mix:1,2' -> 'fixed:2'" in str(e.value)
  assert "config.rl.learner.learning_rate: 0.0005 -> 0.0001" in str(e.value)
  assert "--allow_config_change" in str(e.value)
  assert not (tmp_path / CHANGES_FILE).exists()
  assert json.loads((tmp_path / "config.json").read_text())["rl"]["budget"] == "mix:1,2"
  # Allowed: recorded with the steps reached, and pinned from now on.
  pin_config(changed, tmp_path, allow_change=True)
  rec = json.loads((tmp_path / CHANGES_FILE).read_text())
  assert rec["pinned"] == ["rl.budget", "rl.learner.learning_rate"]
  assert rec["steps_reached"] == {"sft": 0, "rl": 0}
  assert rec["changes"]["rl.budget"] == {"old": "mix:1,2", "new": "fixed:2"}
  # Run length and logging change freely (still recorded).
  longer = get_config("smoke")
  longer.rl.learner.learning_rate, longer.rl.budget, longer.rl.steps = 1e-4, "fixed:2", 9
  assert pin_config(longer, tmp_path) == {"rl.steps": (2, 9)}
  assert len((tmp_path / CHANGES_FILE).read_text().splitlines()) == 2


def test_pinned_before_a_key_was_added(tmp_path):
  """A workdir pinned before config.model.lora.base_dtype existed resumes with its default
  ("float"), and is refused, naming the key, with "int8"."""
  c = get_config("smoke")
  pin_config(c, tmp_path)
  old = json.loads((tmp_path / "config.json").read_text())
  del old["model"]["lora"]["base_dtype"]
  (tmp_path / "config.json").write_text(json.dumps(old))
  assert pin_config(c, tmp_path) == {}
  c.model.lora.rank, c.model.lora.base_dtype = 0, "int8"
  with pytest.raises(sections.ConfigError, match=r"config\.model\.lora\.base_dtype: 'float' -> "
                     "'int8'"):
    pin_config(c, tmp_path)


@pytest.mark.parametrize("key, value, message", [
    ("sft.batch_size", 0, "config.sft.batch_size must be >= 1, got 0"),
    ("sft.steps", -3, "config.sft.steps must be >= 0, got -3"),
    ("sft.steps", 1, "config.sft.warmup_steps (1) must be < config.sft.steps (1)"),
    ("sft.learning_rate", 1e6, "config.sft.learning_rate must be in (0, 1], got 1000000.0"),
    ("sft.learning_rate", -3e-3, "config.sft.learning_rate must be in (0, 1], got -0.003"),
    ("rl.learner.learning_rate", 1e6, "config.rl.learner.learning_rate must be in (0, 1]"),
    ("rl.num_tasks", 0, "config.rl.num_tasks must be >= 1, got 0"),
    ("rl.group_size", 0, "config.rl.group_size must be >= 1, got 0"),
    ("rl.learner.minibatches", 3, "config.rl.learner.minibatches (3) must divide"),
    ("data.demo_max_turns", 0, "config.data.demo_max_turns must be >= 1, got 0"),
    ("checkpoint_every", 0, "config.checkpoint_every must be >= 1, got 0"),
    ("eval.max_turns", 0, "config.eval.max_turns must be >= 1, got 0"),
    ("model.dtype", "fp8", "config.model.dtype must be one of"),
    ("guard.stall_steps", 0, "config.guard.stall_steps must be >= 1, got 0"),
])
def test_every_value_is_checked_with_its_key(key, value, message):
  c = get_config("smoke")
  node = c
  *path, last = key.split(".")
  for p in path:
    node = node[p]
  node[last] = value
  with pytest.raises(sections.ConfigError) as e:
    sections.validate(c)
  assert message in str(e.value)


def test_unknown_keys_suggest_the_nearest():
  c = get_config("smoke")
  with c.unlocked():
    c.rl.learner.learnig_rate = 1e-3
  with pytest.raises(sections.ConfigError, match=r"did you mean config.rl.learner.learning_rate"):
    sections.validate(c)
  c = get_config("smoke")
  with c.unlocked():
    c.chekpoint_every = 3
  with pytest.raises(sections.ConfigError, match=r"did you mean config.checkpoint_every"):
    sections.validate(c)
  # On the command line, before ml_collections' own parser.
  c = get_config("smoke")
  assert "did you mean --config.rl.learner.learning_rate" in unknown_override(c, "rl.learner.lr")
  assert "did you mean --config.rl.budget" in unknown_override(c, "rl.budgte")
  assert "config.rl.steps is a value" in unknown_override(c, "rl.steps.x")
  assert unknown_override(c, "rl.learner.learning_rate") is None


def test_stall_guard():
  c = sections.guard_config(get_config("smoke"))
  sft = StallGuard(c, "sft")
  for s in range(1, 5):
    sft.check(s, {"loss": 6.5, "grad_norm": 0.0})
  with pytest.raises(DivergenceError, match="exactly zero for 5 steps.*learning_rate"):
    sft.check(5, {"loss": 6.5, "grad_norm": 0.0})
  up = StallGuard(c, "sft")
  up.check(1, {"loss": 6.5, "grad_norm": 1.0})
  for s, loss in enumerate([80.0, 90.0, 7.0, 80.0, 90.0, 100.0, 110.0], start=2):
    up.check(s, {"loss": loss, "grad_norm": 1.0})      # the dip back to 7 resets the count
  with pytest.raises(DivergenceError, match="above 10 x its first value"):
    up.check(9, {"loss": 836.0, "grad_norm": 1.0})
  # RL: zero gradients with all-zero advantages (every group tied) are not a stall.
  rl = StallGuard(c, "rl")
  for s in range(1, 20):
    rl.check(s, {"loss": 0.0, "grad_norm": 0.0, "advantage_abs_mean": 0.0})


def test_context_must_fit_the_models_positions():
  model_config, tokenizer = load_config_and_tokenizer("builtin:micro")
  env = envs.make("grid", tokenizer)
  need = setup.check_context(model_config, env, 8, 0, "config.rl.budget")
  assert need <= model_config.max_position_embeddings
  with pytest.raises(sections.ConfigError, match=r"config.rl.budget: a rollout of 60 turns needs "
                     r"up to \d+ tokens of context, more than the model's max_position_embeddings"):
    setup.check_context(model_config, env, 60, 0, "config.rl.budget")
