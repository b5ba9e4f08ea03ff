"""Evaluate checkpoints of a training run: Pass@(K,T), step quality, recovery, likelihoods.

    python -m launch.evaluate --config=configs/default.py:smoke --workdir=W            # latest
    python -m launch.evaluate --config=configs/default.py:smoke --workdir=W --step=2
    python -m launch.evaluate --config=configs/default.py:smoke --workdir=W --all
    python -m launch.evaluate --config=configs/default.py:smoke --workdir=W --watch \\
        --poll_seconds=60 --timeout_seconds=3600

Writes W/eval/<step>/{report.json, report.md, *.png, episodes.npz} (see jaxagent.eval.checkpoints).
Rerun mode: --config.eval.mode=rerun --config.eval.rerun_budgets=2,4,8.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from launch._flags import check_config_overrides

# Before the flag is defined: defining it applies the overrides (and fails on a wrong key).
if __name__ == "__main__":
  check_config_overrides(sys.argv, None)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir.")
_STEP = flags.DEFINE_integer("step", None, "Evaluate this checkpoint step (default: the latest).")
_ALL = flags.DEFINE_bool("all", False, "Evaluate every kept checkpoint.")
_WATCH = flags.DEFINE_bool("watch", False, "Evaluate each new checkpoint as it lands.")
_POLL = flags.DEFINE_float("poll_seconds", 60.0, "--watch: seconds between polls.")
_TIMEOUT = flags.DEFINE_float("timeout_seconds", 3600.0,
                              "--watch: stop after this long without a new checkpoint.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from launch._logs import quiet_libraries
  quiet_libraries()
  from jaxagent.eval import checkpoints
  if sum([_STEP.value is not None, _ALL.value, _WATCH.value]) > 1:
    raise app.UsageError("give at most one of --step, --all, --watch")
  config, workdir = _CONFIG.value, _WORKDIR.value
  if _WATCH.value:
    reps = checkpoints.watch(config, workdir, poll_seconds=_POLL.value, timeout_seconds=_TIMEOUT.value)
  elif _ALL.value:
    reps = checkpoints.evaluate_all(config, workdir)
  else:
    reps = [checkpoints.evaluate_checkpoint(config, workdir, _STEP.value)]
  for r in reps:
    print(r["dir"])


if __name__ == "__main__":
  app.run(main)
