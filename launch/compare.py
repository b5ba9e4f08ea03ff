"""Compare several evaluated runs side by side and decide the claims of docs/STUDY.md.

    python -m launch.compare --config=configs/default.py:smoke --run base=W0 \\
        --run fixed_generous_s0=W1 --run fixed_generous_s1=W2 \\
        --run budgetmix_s0=W3 --run budgetmix_s1=W4 --out D

A label ARM_sN is seed N of arm ARM; every arm needs the same seeds, and the claims need at least
config.study.min_seeds of them. Each workdir must have been evaluated first (python -m
launch.evaluate ...). Writes
D/{comparison.json, comparison.md, *.png} (see jaxagent.eval.compare).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from launch._flags import check_config_overrides

# Before the flag is defined: defining it applies the overrides (and fails on a wrong key).
if __name__ == "__main__":
  check_config_overrides(sys.argv, None)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file the runs share.",
                                          lock_config=True)
_RUNS = flags.DEFINE_multi_string("run", [], "label=workdir (repeat per run).")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_BASE = flags.DEFINE_string("base", "base", "Arm name of the base policy's run(s) (base, or "
                            "base_s0, base_s1, ...).")
flags.mark_flags_as_required(["config", "out"])


def parse_runs(specs) -> dict[str, str]:
  runs = {}
  for spec in specs:
    label, sep, workdir = spec.partition("=")
    if not sep or not label or not workdir:
      raise app.UsageError(f"--run {spec!r}: write --run label=workdir")
    if label in runs:
      raise app.UsageError(f"--run label {label!r} given twice")
    runs[label] = workdir
  return runs


def main(argv):
  del argv
  from launch._logs import quiet_libraries
  quiet_libraries()
  from jaxagent.eval import compare
  comp = compare.compare(parse_runs(_RUNS.value), _OUT.value, _CONFIG.value, base=_BASE.value)
  for num, c in comp["claims"].items():
    print(f"claim {num}: {c['verdict']} (decided on {c['decided_on']})")
  print(comp["dir"])


if __name__ == "__main__":
  app.run(main)
