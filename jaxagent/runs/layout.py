"""A run's workdir layout, and finding and restoring its checkpoints.

    <workdir>/config.json                  the config the run was started with (primary process)
    <workdir>/checkpoints/<phase>/<step>/  orbax checkpoints of each phase (PHASES, in order)
    <workdir>/metrics.jsonl, tb/           per-step metrics (jaxagent.learners.logger)
    <workdir>/data/                        task splits and demonstrations (unless config.data.dir)
    <workdir>/eval/<name>/                 one evaluation per checkpoint (`eval_dir_name`)
    <workdir>/DONE                         written when every phase has finished

A checkpoint holds {"params", "opt_state", "step", "key"}; evaluation restores the params subtree
alone (orbax partial restore), placed as the abstract params' shardings say.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax

from jaxagent.checkpoint import Checkpointer

# The training phases, in training order.
PHASES = ("sft", "rl")


def checkpoint_dir(workdir, phase: str) -> pathlib.Path:
  return pathlib.Path(workdir) / "checkpoints" / phase


def data_dir(data, workdir) -> pathlib.Path:
  """Where task splits and demonstrations are built: config.data.dir (`data`: the data section,
  `jaxagent.runs.config.DataConfig`), else <workdir>/data."""
  return pathlib.Path(data.dir or pathlib.Path(workdir) / "data")


def eval_dir_name(phase: str, step: int) -> str:
  """The eval directory of checkpoint (phase, step): the step for RL, `<phase>_<step>` else."""
  return str(step) if phase == "rl" else f"{phase}_{step}"


def abstract_params(params) -> Any:
  """ShapeDtypeStructs (with shardings) of a params tree, for restoring onto the same layout."""
  return placed(params, jax.tree.map(lambda x: x.sharding, params))


def placed(shapes, shardings) -> Any:
  """ShapeDtypeStructs of `shapes` (anything with .shape and .dtype, e.g. an eval_shape tree)
  placed with the matching leaves of `shardings`: what a checkpoint is restored onto."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                      shardings)


def checkpoint_steps(workdir, phase: str = "") -> list[tuple[str, int]]:
  """All kept (phase, step) of `workdir`, in training order; `phase` "" means every phase."""
  workdir = pathlib.Path(workdir)
  if phase and phase not in PHASES:
    raise ValueError(f"config.eval.phase={phase!r}: use one of {PHASES} or '' (every phase)")
  if not (workdir / "checkpoints").is_dir():
    raise FileNotFoundError(
        f"{workdir} has no checkpoints/ directory: pass the training run's --workdir, or train "
        f"first (python -m launch.train --config=... --workdir={workdir})")
  out = []
  for p in ([phase] if phase else PHASES):
    if checkpoint_dir(workdir, p).is_dir():
      ckpt = Checkpointer.reader(checkpoint_dir(workdir, p))
      out += [(p, s) for s in ckpt.all_steps()]
      ckpt.close()
  return out


def resolve_checkpoint(workdir, phase: str = "", step: int | None = None) -> tuple[str, int]:
  """(phase, step) of a checkpoint of `workdir`: the latest (of the last phase holding one) by
  default, or `step` (of `phase`, or of the last phase holding that step)."""
  have = checkpoint_steps(workdir, phase)
  if not have:
    raise FileNotFoundError(
        f"no checkpoint in {pathlib.Path(workdir) / 'checkpoints'}"
        f"{'/' + phase if phase else ''}: train first, or fix --workdir"
        + (" / config.eval.phase" if phase else ""))
  if step is None:
    return have[-1]
  hits = [ps for ps in have if ps[1] == int(step)]
  if not hits:
    raise FileNotFoundError(f"no checkpoint for step {step} in {workdir}; available (phase, step): "
                            f"{have}; pass one of those steps to --step")
  return hits[-1]


def restore_params(workdir, phase: str, step: int, abstract):
  """Params only of checkpoint (phase, step), placed as `abstract`'s shardings say."""
  ckpt = Checkpointer.reader(checkpoint_dir(workdir, phase))
  try:
    return ckpt.restore_params(step, abstract)
  finally:
    ckpt.close()


def latest_params(workdir, abstract) -> tuple[Any, str, int]:
  """Params of the newest intact checkpoint of the last phase that has one: (params, phase,
  step). Damaged newer checkpoints are skipped with a warning naming them."""
  for phase in reversed(PHASES):
    if not checkpoint_dir(workdir, phase).is_dir():
      continue
    ckpt = Checkpointer.reader(checkpoint_dir(workdir, phase))
    try:
      params, step = ckpt.restore_params_latest(abstract)
    finally:
      ckpt.close()
    if params is not None:
      return params, phase, step
  raise FileNotFoundError(f"{workdir}: no checkpoint under checkpoints/{{{','.join(PHASES)}}}; "
                          "train it first, or fix the path")
