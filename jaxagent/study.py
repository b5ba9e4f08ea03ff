"""The study of docs/STUDY.md, end to end: datasets -> SFT base -> three RL arms (fixed-T at a
tight and at a generous budget, BudgetMix; optionally more arms at the generous budget with other
learner settings, `config.study.credit_arms`, e.g. turn-level credit), each trained with
`config.study.seeds` seeds ->
evaluation of every run on the same fixed test tasks -> the comparison report with the claims
decided (markdown, JSON, PNG plots).

    python -m launch.study --config=configs/default.py[:quick|:smoke] --workdir=DIR

Layout of DIR: `data/` (task splits and demonstrations, shared), one workdir per run (`base/`, or
`base_s0/`, `base_s1/`, ... with several base seeds; `fixed_tight_s0/`, `fixed_tight_s1/`, ...,
`fixed_generous_sN/`, `budgetmix_sN/`: checkpoints, metrics.jsonl, TensorBoard, `eval/`), and
`report/` (the comparison). Seed u of every arm uses the run seed config.seed + u (the same
rollout keys in every arm: paired) and starts from base u mod base_seeds (seed config.seed + i).
A phase already done is not redone: training resumes from checkpoints and finished runs are
skipped, evaluated checkpoints are not re-evaluated, so a killed study restarted with the same
command continues.
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


ARMS = ("fixed_tight", "fixed_generous", "budgetmix")


def base_labels(config) -> list[str]:
  n = sections.study_config(config).base_seeds
  return [BASE] if n == 1 else [f"{BASE}_s{i}" for i in range(n)]


def run_configs(config, workdir) -> dict[str, tuple[object, pathlib.Path]]:
  """label -> (training config, workdir) of every run: the bases, then each arm's seeds."""
  workdir = pathlib.Path(workdir)
  st = sections.study_config(config)
  data = str(pathlib.Path(config.data.dir or workdir / "data"))
  bases = base_labels(config)
  runs = {}
  for i, label in enumerate(bases):
    base = copy.deepcopy(config)
    with base.unlocked():
      base.seed = config.seed + i
      base.data.dir = data
      base.rl.steps = 0
      # The base run's evaluation compares it with itself (not with the untrained model).
      base.eval.base_workdir = str(workdir / label)
    runs[label] = (base, workdir / label)
  for arm, budget in zip(ARMS, (st.tight_budget, st.generous_budget, st.mix_budget)):
    for u in range(st.seeds):
      c = copy.deepcopy(config)
      with c.unlocked():
        c.seed = config.seed + u
        c.data.dir = data
        c.sft.steps = 0
        c.rl.budget = budget
        c.model.init_from = str(workdir / bases[u % len(bases)])
      runs[f"{arm}_s{u}"] = (c, workdir / f"{arm}_s{u}")
  for arm, overrides in st.credit_overrides().items():
    for u in range(st.seeds):
      c, _ = runs[f"fixed_generous_s{u}"]
      c = copy.deepcopy(c)
      with c.unlocked():
        c.rl.learner.update(overrides)
      runs[f"{arm}_s{u}"] = (c, workdir / f"{arm}_s{u}")
  return runs


def _evaluated(run_dir: pathlib.Path) -> bool:
  """The run's latest checkpoint has a finished evaluation."""
  phase, step = layout.resolve_checkpoint(run_dir)
  return (run_dir / "eval" / layout.eval_dir_name(phase, step) / "report.json").exists()


def run(config, workdir, *, programs=None) -> dict:
  """Runs (or continues) the whole study in `workdir`; returns the comparison summary.

  programs: compiled functions to reuse (`jaxagent.runs.programs.Programs` of the config's model
    and environment, e.g. those of an earlier `run` in the same process); default new ones.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  sections.validate(config)
  st = sections.study_config(config)
  e = sections.eval_config(config)
  if e.budget_visible != sections.rl_config(config).budget_visible:
    raise sections.ConfigError(
        f"config.rl.budget_visible={config.rl.budget_visible} but the evaluation "
        f"{'shows' if e.budget_visible else 'hides'} the budget; evaluate as the arms are trained: "
        "config.eval.mode=rerun with config.eval.rerun_budget_visible=True for visible budgets, "
        "truncation (or rerun_budget_visible=False) for hidden ones")
  runs = run_configs(config, workdir)
  for c, _ in runs.values():
    sections.validate(c)
  logging.info("study: %d bases, %d arms x %d seeds", st.base_seeds,
               len(ARMS) + len(st.credit_overrides()), st.seeds)
  (workdir / "study_config.json").write_text(config.to_json_best_effort(indent=2))
  timings = {}
  # One set of compiled functions for every run: they share the model config and environment.
  first_base = base_labels(config)[0]
  base_config = runs[first_base][0]
  programs = programs_for(base_config, *setup.load_skeleton(base_config), programs)
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
      evaluator = evaluator or Evaluator(base_config, runs[first_base][1], programs=programs)
      # Rollouts only: the comparison computes every policy-level analysis on common states.
      checkpoints.evaluate_checkpoint(c, run_dir, evaluator=evaluator, analyses=False)
    timings[f"eval_{label}"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  summary = compare.compare({label: str(d) for label, (_, d) in runs.items()},
                            workdir / "report", base_config, base=BASE, programs=programs)
  timings["compare"] = time.perf_counter() - t0
  (workdir / "study_timing.json").write_text(json.dumps(timings, indent=2) + "\n")
  return summary
