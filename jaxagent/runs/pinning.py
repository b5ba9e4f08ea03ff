"""The run's config, pinned in its workdir.

The first run in a workdir writes `<workdir>/config.json`. A later run in the same workdir (a
resume, a rerun) is compared with it key by key:
  * keys that change what the steps already taken computed or what the next ones would mean
    (model, environment, data, seeds, learner, budgets, ...) must not change silently: the run
    refuses, listing each differing key with both values, unless it is started with
    `allow_change=True` (`--allow_config_change`);
  * keys that only say how long to run or how to watch it (the phases' steps, logging,
    checkpoint cadence, devices and mesh, evaluation and study settings) may change freely.
Every change, allowed or free, is appended to `<workdir>/config_changes.jsonl` with the steps
each phase had reached, and config.json then holds the config in force.
"""

from __future__ import annotations

import json
import pathlib
import time

from jaxagent.runs import layout
from jaxagent.runs.config import ConfigError

CONFIG_FILE, CHANGES_FILE = "config.json", "config_changes.jsonl"
# Keys (or section prefixes, ending in ".") that may change between runs of one workdir.
FREE = ("sft.steps", "rl.steps", "log_every", "checkpoint_every", "max_to_keep", "progress_bar",
        "num_devices", "mesh.", "data.dir", "eval.", "study.", "guard.",
        "model.allow_nonfinite_weights", "model.attention")


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _free(key: str) -> bool:
  return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


# Keys added after runs were pinned, with the value that behaves as those runs did: a config
# pinned without the key equals one with this value (resuming such a workdir is not a change).
ADDED = {"model.lora.base_dtype": "float"}


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
  """{key: (old value, new value)} of every key that differs (missing: None; a missing `ADDED`
  key: its value there)."""
  a, b = flatten(old), flatten(new)
  for key, value in ADDED.items():
    section = key.rsplit(".", 1)[0] + "."
    if any(k.startswith(section) for k in (*a, *b)):     # only where its section exists
      a.setdefault(key, value)
      b.setdefault(key, value)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def pin_config(config, workdir, *, allow_change: bool = False) -> dict[str, tuple]:
  """Checks `config` against the workdir's pinned config (module docstring), records changes
  and writes config.json. Returns the changes. Raises ConfigError on a pinned key's change
  without `allow_change`, before anything is written."""
  workdir = pathlib.Path(workdir)
  path = workdir / CONFIG_FILE
  new = json.loads(config.to_json_best_effort())
  changes: dict = {}
  if path.exists():
    try:
      old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path} is not valid JSON ({e}); restore it, or delete it to pin this "
                        "run's config") from None
    changes = config_diff(old, new)
    pinned = {k: v for k, v in changes.items() if not _free(k)}
    if pinned and not allow_change:
      lines = "\n".join(f"  config.{k}: {a!r} -> {b!r}" for k, (a, b) in pinned.items())
      raise ConfigError(
          f"{workdir} was started with another config; these keys differ from its "
          f"{CONFIG_FILE}:\n{lines}\nrerun with the original values, use a new --workdir, or "
          f"pass --allow_config_change to continue with the change (recorded in {CHANGES_FILE})")
  if changes:
    kept = layout.checkpoint_steps(workdir) if (workdir / "checkpoints").is_dir() else []
    reached = {phase: max((s for p, s in kept if p == phase), default=0)
               for phase in layout.PHASES}
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "steps_reached": reached,
              "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()},
              "pinned": sorted(k for k in changes if not _free(k))}
    with open(workdir / CHANGES_FILE, "a") as f:
      f.write(json.dumps(record) + "\n")
  tmp = path.with_suffix(".tmp")
  tmp.write_text(config.to_json_best_effort(indent=2))
  tmp.replace(path)
  return changes


def check_pinned(config, workdir, *, job: str = "evaluation") -> None:
  """Refuses a `config` that differs from the workdir's pinned config.json in a key that says
  what the run is (model, environment, tasks, learner, budgets, seeds; the `FREE` keys may
  differ): the pinned config is the source of truth for what a job reading the run (an
  evaluation) works on. No config.json (a run not started yet): nothing to check.
  Raises ConfigError listing each differing key with both values."""
  workdir = pathlib.Path(workdir)
  path = workdir / CONFIG_FILE
  if not path.is_file():
    return
  try:
    old = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); restore it (the {job} reads what the "
                      "run is from it)") from None
  pinned = {k: v for k, v in config_diff(old, json.loads(config.to_json_best_effort())).items()
            if not _free(k)}
  if pinned:
    lines = "\n".join(f"  config.{k}: {a!r} (the run) -> {b!r} (given)"
                      for k, (a, b) in pinned.items())
    raise ConfigError(
        f"{workdir} was trained with another config; these keys of --config differ from its "
        f"{CONFIG_FILE}:\n{lines}\nthe {job} must use the run's own config: pass the --config "
        f"(and overrides) the run was trained with, or --workdir of a run of this config")
