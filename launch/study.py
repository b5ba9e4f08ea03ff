"""The whole study on one config: SFT base, fixed-T RL (tight and generous), BudgetMix RL,
evaluation of all four, and the comparison report. Continues a killed run.

    python -m launch.study --config=configs/default.py[:quick|:smoke] --workdir=DIR
"""

import json
import pathlib
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from launch._flags import check_config_overrides

# Before the flag is defined: defining it applies the overrides (and fails on a wrong key).
if __name__ == "__main__":
  check_config_overrides(sys.argv, "configs/default.py")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs, evaluations and report go.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  from launch._logs import quiet_libraries
  quiet_libraries()
  from jaxagent import study
  start = time.perf_counter()
  summary = study.run(_CONFIG.value, _WORKDIR.value)
  report = pathlib.Path(_WORKDIR.value) / "report"
  print(f"\nstudy finished in {(time.perf_counter() - start) / 60:.1f} min")
  print(f"report: {report / 'comparison.md'} (JSON: comparison.json, plots: *.png)")
  for num, claim in summary["claims"].items():
    arms = ", ".join(f"{arm}: {p['verdict']}" for arm, p in claim["per_arm"].items())
    print(f"  claim {num}: {claim['verdict']} on {claim['decided_on']} ({arms})")
  (report / "summary.json").write_text(json.dumps(
      {"minutes": (time.perf_counter() - start) / 60, "report": str(report)}, indent=2))


if __name__ == "__main__":
  app.run(main)
