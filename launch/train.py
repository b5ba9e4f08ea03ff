"""Train: the phases of a config (SFT, then RL) in one workdir; resumes where it stopped.

    python -m launch.train --config=configs/default.py[:variant] --workdir=DIR [--config.k=v ...]

On several hosts run it once per process (launch/recipes/); `jaxagent.sharding.distributed`
initialises the multi-process runtime first.
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
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go.")
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Continue a workdir started with another config (the changed "
    "keys and the steps reached are recorded in <workdir>/config_changes.jsonl).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  # Multi-host: joins the job from JAXAGENT_* variables, SLURM or a TPU pod (no-op alone).
  from jaxagent.sharding import distributed
  distributed.initialize()
  from launch._logs import quiet_libraries
  quiet_libraries()
  from jaxagent import train
  train.run(_CONFIG.value, _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value)


if __name__ == "__main__":
  app.run(main)
