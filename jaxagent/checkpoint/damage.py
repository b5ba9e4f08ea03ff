"""Telling a damaged checkpoint from one that does not fit, and moving damaged steps aside.

A committed step can still be damaged afterwards (a file deleted or truncated by a full disk, a
copy interrupted, garbled metadata). Restoring it raises `CheckpointDamagedError` (never
`CheckpointMismatchError`, whose advice is a new workdir), and `Checkpointer.restore_latest` /
`restore_params_latest` skip it with a warning and use the newest intact step:

    state, step = ckpt.restore_latest(abstract_state)    # (None, None) for an empty directory
    params, step = reader.restore_params_latest(abstract_params)

A writer's `restore_latest` renames the damaged steps it skipped to `<workdir>/<step>.damaged`
(not listed as steps; kept for inspection), so training can write those steps again.

A checkpoint counts as damaged when one of its files is missing or cannot be read or decoded
(metadata JSON, the OCDBT index, array data). A checkpoint that reads but has another structure or
shapes (`CheckpointMismatchError`) or another model fingerprint (`IncompatibleCheckpointError`) is
not damaged: those are raised at once, never skipped. Array data is only checked by reading it (a
restore); tensorstore keeps no checksums, so a bit flip inside a compressed chunk is not detected.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from typing import Any, Iterator

from etils import epath

from jaxagent.checkpoint.errors import (CheckpointDamagedError, CheckpointMismatchError,
                                        CheckpointSaveError, clean, error_chain)

log = logging.getLogger(__name__)

# A damaged step that `restore_latest` skipped is renamed to "N<DAMAGED_SUFFIX>" (orbax does not
# list it as a step), so that training can write step N again.
DAMAGED_SUFFIX = ".damaged"

# TensorStore status codes and messages that mean the stored bytes are missing or unreadable.
_DAMAGE_MARKERS = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "Error reading",
                   "Error opening", "Error decoding", "truncated", "corrupt", "checksum")
# Failures of the machine, not of the files: never a reason to skip a checkpoint.
_NOT_DAMAGE_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def _says_damage(e: BaseException) -> bool:
  """Whether this one error (not its causes) is a read or decode failure of the stored bytes."""
  return isinstance(e, (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError)) or any(
      m.lower() in str(e).lower() for m in _DAMAGE_MARKERS)


def is_damage(exc: BaseException) -> bool:
  """Whether a read failure means the checkpoint's files are missing, truncated or garbled."""
  if isinstance(exc, (CheckpointMismatchError, CheckpointSaveError)):
    return False
  chain = list(error_chain(exc))
  if any(m in str(e) for e in chain for m in _NOT_DAMAGE_MARKERS):
    return False
  return any(_says_damage(e) for e in chain)


def reason(exc: BaseException, item: str = "") -> str:
  """One line saying why a checkpoint could not be read: the innermost informative error."""
  best = exc
  for e in error_chain(exc):
    if _says_damage(e):
      best = e
  text = clean(str(best)) or repr(best)
  if not isinstance(best, ValueError) or isinstance(best, json.JSONDecodeError):
    text = f"{type(best).__name__}: {text}"
  return f"{item}: {text}" if item else text


@contextlib.contextmanager
def damage_raised(directory: Any, step: int, item: str) -> Iterator[None]:
  """Turns a failure to read `item` of checkpoint `step` that means damage (`is_damage`) into a
  `CheckpointDamagedError` naming the reason; any other error passes through unchanged."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if is_damage(e):
      raise CheckpointDamagedError(directory, {step: reason(e, item)}) from e
    raise


@contextlib.contextmanager
def quiet_orbax_leftovers() -> Iterator[None]:
  """While skipping damaged checkpoints: orbax's read coroutines that a failed restore left
  un-awaited raise again when collected, and Python would print each with its full TensorStore
  spec to stderr; log those at debug level instead (the warning already names the damage)."""
  previous = sys.unraisablehook

  def hook(unraisable: Any) -> None:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
      log.debug("ignored after a failed restore: %s", clean(str(unraisable.exc_value)))
    else:
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    sys.unraisablehook = previous


def move_aside(directory: epath.Path, step: int) -> epath.Path:
  """Renames the damaged step directory `<directory>/<step>` to `<step>.damaged` (or
  `<step>.damaged-2`, ... if taken), where orbax no longer lists it; returns the new path.

  Raises:
    CheckpointDamagedError: the rename failed (the message says to move it by hand).
  """
  path = directory / str(step)
  target = directory / f"{step}{DAMAGED_SUFFIX}"
  n = 1
  while target.exists():
    n += 1
    target = directory / f"{step}{DAMAGED_SUFFIX}-{n}"
  try:
    path.rename(target)
  except OSError as e:
    raise CheckpointDamagedError(directory, {
        step: f"damaged, and could not be moved to {target} ({e}); move or delete it by hand, "
              "then rerun"}) from e
  return target
