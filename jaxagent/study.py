"""The study of docs/STUDY.md, end to end: datasets -> SFT base -> fixed-T RL at a tight and at a
generous budget -> BudgetMix RL -> evaluation of all four on the same fixed test tasks ->
the comparison report (markdown, JSON, PNG plots).

    python -m launch.study --config=configs/default.py[:quick|:smoke] --workdir=DIR

Layout of DIR: `data/` (task splits and demonstrations, shared), one workdir per run (`base/`,
`fixed_tight/`, `fixed_generous/`, `budgetmix/`: checkpoints, metrics.jsonl, TensorBoard,
`eval/`), and `report/` (the comparison). A phase already done is not redone: training resumes
from checkpoints and finished runs are skipped, evaluated checkpoints are not re-evaluated, so a
killed study restarted with the same command continues.
"""

from __future__ import annotations

import copy
import json
import pathlib
import time

from absl import logging

from jaxagent import train
from jaxagent.eval import checkpoints, compare
from jaxagent.eval.evaluator import Evaluator
from jaxagent.runs import config as sections
from jaxagent.runs import layout, setup
from jaxagent.runs.programs import programs_for

BASE = "base"


def run_configs(config, workdir) -> dict[str, tuple[object, pathlib.Path]]:
  """label -> (training config, workdir) of the four runs."""
  workdir = pathlib.Path(workdir)
  data = str(pathlib.Path(config.data.dir or workdir / "data"))
  runs = {}
  base = copy.deepcopy(config)
  with base.unlocked():
    base.data.dir = data
    base.rl.steps = 0
    # The base run's evaluation compares it with itself (not with the untrained model), which
    # also lets its rollouts serve as the base rollouts of every RL run's evaluation.
    base.eval.base_workdir = str(workdir / BASE)
  runs[BASE] = (base, workdir / BASE)
  for label, budget in (("fixed_tight", config.study.tight_budget),
                        ("fixed_generous", config.study.generous_budget),
                        ("budgetmix", config.study.mix_budget)):
    c = copy.deepcopy(config)
    with c.unlocked():
      c.data.dir = data
      c.sft.steps = 0
      c.rl.budget = budget
      c.model.init_from = str(workdir / BASE)
    runs[label] = (c, workdir / label)
  return runs


def _evaluated(run_dir: pathlib.Path) -> bool:
  """The run's latest checkpoint has a finished evaluation."""
  phase, step = layout.resolve_checkpoint(run_dir)
  return (run_dir / "eval" / layout.eval_dir_name(phase, step) / "report.json").exists()


def run(config, workdir) -> dict:
  """Runs (or continues) the whole study in `workdir`; returns the comparison summary."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  runs = run_configs(config, workdir)
  for c, _ in runs.values():
    sections.validate(c)
  (workdir / "study_config.json").write_text(config.to_json_best_effort(indent=2))
  timings = {}
  # One set of compiled functions for every run: they share the model config and environment.
  base_config = runs[BASE][0]
  programs = programs_for(base_config, *setup.load_skeleton(base_config))
  for label, (c, run_dir) in runs.items():
    t0 = time.perf_counter()
    if (run_dir / "DONE").exists():
      logging.info("study: %s already trained", label)
    else:
      logging.info("study: training %s", label)
      train.run(c, run_dir, programs=programs)
    timings[f"train_{label}"] = time.perf_counter() - t0
  evaluator = None   # one for all runs: compiled programs and the base's rollouts are shared
  for label, (c, run_dir) in runs.items():
    t0 = time.perf_counter()
    if not _evaluated(run_dir):
      logging.info("study: evaluating %s", label)
      evaluator = evaluator or Evaluator(base_config, runs[BASE][1], programs=programs)
      checkpoints.evaluate_checkpoint(c, run_dir, evaluator=evaluator)
    timings[f"eval_{label}"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  summary = compare.compare({label: str(d) for label, (_, d) in runs.items()},
                            workdir / "report", base_config, base=BASE, programs=programs)
  timings["compare"] = time.perf_counter() - t0
  (workdir / "study_timing.json").write_text(json.dumps(timings, indent=2) + "\n")
  return summary
