"""Metrics for people watching long jobs: one JSON line per step in `metrics.jsonl`, TensorBoard
event files, and a progress bar.

`metrics.jsonl` is append-only and resume-safe: `MetricsLog(path, resume_step=s)` first repairs
it: a partial last line (what a crash in mid-write leaves) is dropped, and so are lines of the
same phase with step > s (written after the checkpoint a resumed run restarts from), so a
killed-and-resumed run leaves the same file as an uninterrupted one. A damaged line before the
last is not guessed at: it raises `ValueError` naming the file and the line. Only the process
holding the workdir's train lock (`jaxagent.runs.lock`) writes it.

On a multi-host job every process computes the same (global) metrics; only the primary process
(`jax.process_index() == 0`) writes them, so each line and event is written once.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np
from absl import logging

from jaxagent.sharding import distributed


def _clean(v):
  v = float(np.asarray(v))
  return None if math.isnan(v) else v


class MetricsLog:
  def __init__(self, workdir: str | os.PathLike, phase: str, resume_step: int = 0,
               tensorboard: bool = True, primary: bool | None = None):
    """primary: whether this process writes (default: it is process 0 of the job)."""
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self.phase = phase
    self.primary = distributed.is_primary() if primary is None else primary
    self._tb = None
    if not self.primary:
      return
    if self.path.exists():
      kept = [json.dumps(d) for d in read_metrics(self.path)
              if not (d["phase"] == phase and d["step"] > resume_step)]
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text("".join(l + "\n" for l in kept))
      os.replace(tmp, self.path)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard" / phase))

  def write(self, step: int, metrics: dict, timing: dict | None = None) -> dict:
    """Appends one line {phase, step, **metrics, **timing}; returns it. Timing values (wall
    clock, throughput) go to TensorBoard too but are kept apart so equality checks can skip them."""
    line = {"phase": self.phase, "step": int(step)}
    line.update({k: _clean(v) for k, v in sorted(metrics.items())})
    if timing:
      line["timing"] = {k: round(float(v), 4) for k, v in sorted(timing.items())}
    if not self.primary:
      return line
    with open(self.path, "a") as f:
      f.write(json.dumps(line) + "\n")
    if self._tb is not None:
      for k, v in {**metrics, **(timing or {})}.items():
        v = _clean(v)
        if v is not None:
          self._tb.add_scalar(f"{self.phase}/{k}", v, step)
    return line

  def close(self):
    if self._tb is not None:
      self._tb.close()


def read_metrics(path) -> list[dict]:
  """The lines of a metrics.jsonl as dicts; a partial last line (a crash in mid-write) is
  dropped with a warning; any other unreadable line raises ValueError naming file and line."""
  path = pathlib.Path(path)
  text = path.read_text()
  lines = text.split("\n")
  out = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      d = json.loads(line)
      if not isinstance(d, dict) or "phase" not in d or "step" not in d:
        raise ValueError("not a metrics line")
    except ValueError as e:
      last = i == len(lines) - 1 or all(not l.strip() for l in lines[i + 1:])
      if last:
        logging.warning("%s: dropping a partial last line (%d characters; a run stopped in "
                        "mid-write)", path, len(line))
        continue
      raise ValueError(f"{path}, line {i + 1}: unreadable ({e}): {line[:80]!r}; fix or delete "
                       "that line, then rerun") from None
    out.append(d)
  return out


def check_finite(step: int, metrics: dict, keys=("loss",)) -> None:
  """Raises FloatingPointError naming the step and the metric if a loss is NaN or infinite."""
  for k in keys:
    if k in metrics and not np.isfinite(np.asarray(metrics[k])):
      raise FloatingPointError(f"step {step}: {k} is {float(np.asarray(metrics[k]))}; lower the "
                               "learning rate or check the data (the last checkpoint is intact)")
