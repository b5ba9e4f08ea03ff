"""Compare several evaluated runs side by side and decide the claims of docs/STUDY.md.

    python -m launch.compare --config=configs/default.py:smoke \\
        --run base=W0 --run fixed_tight=W1 --run fixed_generous=W2 --run budgetmix=W3 --out D

Each workdir must have been evaluated first (python -m launch.evaluate ...). Writes
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
_BASE = flags.DEFINE_string("base", "base", "Label of the base policy's run.")
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
    print(f"claim {num}: {c['verdict']}")
  print(comp["dir"])


if __name__ == "__main__":
  app.run(main)
