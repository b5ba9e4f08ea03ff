"""Train: the phases of a config (SFT, then RL) in one workdir; resumes where it stopped.

    python -m launch.train --config=configs/default.py[:variant] --workdir=DIR [--config.k=v ...]

On several hosts run it once per process (launch/recipes/); `jaxagent.sharding.distributed`
initialises the multi-process runtime first.
"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  # Multi-host: joins the job from JAXAGENT_* variables, SLURM or a TPU pod (no-op alone).
  from jaxagent.sharding import distributed
  distributed.initialize()
  from launch._logs import quiet_libraries
  quiet_libraries()
  from jaxagent import train
  train.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
