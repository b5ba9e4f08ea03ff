"""Failed saves: checking the directory can be written, surfacing a failed background write, and
removing what a failed save left.

`Checkpointer.save` first checks that it can create a file in the directory, so an unwritable
directory or a full disk raises `CheckpointSaveError` at once; a write that fails later in the
background (disk filling up mid-save) raises it from the next call into the Checkpointer (`save`,
even one skipped by the interval, `wait_until_finished`, `close`, a restore). The step's
temporary directory is removed, so the directory holds only complete checkpoints.

`SaveTracker` holds that state for one Checkpointer: the async save in flight and the failure
that stopped saving (raised again from every later call).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import NoReturn

import orbax.checkpoint as ocp
from etils import epath

from jaxagent.checkpoint.errors import CheckpointSaveError, save_error

log = logging.getLogger(__name__)

# Orbax writes step N under "N<TMP_SUFFIX>" (item directories likewise) and renames it to "N" when
# complete (orbax.checkpoint._src.path.atomicity_types.TMP_DIR_SUFFIX).
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class SaveTracker:
  """The saves of one `ocp.CheckpointManager` writing `directory`: which async save is in flight
  (`pending_step`, set by the caller once orbax started it) and the failure that stopped saving
  (`failure`, None while none did)."""

  def __init__(self, manager: ocp.CheckpointManager, directory: epath.Path):
    self._manager = manager
    self.directory = directory
    self.pending_step: int | None = None       # the async save started last, until checked
    self.failure: CheckpointSaveError | None = None

  def check(self, *, block: bool) -> None:
    """Raises `CheckpointSaveError` if a save failed. With `block`, waits for the pending save;
    without, only looks at a pending save that has finished (no waiting)."""
    if self.failure is not None:
      raise self.failure
    if self.pending_step is None and not block:
      return
    if not block and self._manager.is_saving_in_progress():
      return
    step = self.pending_step
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      self.pending_step = None
      if step is None:
        raise
      self.fail(step, e)
    self.pending_step = None

  def probe(self, step: int) -> None:
    """Creates, syncs and removes a 1-byte file in the directory, so that an unwritable directory
    or a full disk fails here, before orbax starts writing (a step directory orbax cannot create
    would leave its writer threads waiting minutes for it)."""
    if "://" in os.fspath(self.directory):
      return                     # object stores: no local probe; failures surface from orbax
    probe = os.path.join(os.fspath(self.directory),
                         f".write-probe-{socket.gethostname()}-{os.getpid()}")
    fd = None
    try:
      fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      os.write(fd, b"\0")
      os.fsync(fd)
    except OSError as e:
      self.fail(step, e, doing="cannot create files in it")
    finally:
      if fd is not None:
        os.close(fd)
        try:
          os.unlink(probe)
        except OSError:
          pass

  def fail(self, step: int, error: BaseException, doing: str = "") -> NoReturn:
    """Removes what the failed save of `step` left behind and raises `CheckpointSaveError` (kept
    as `failure`, so that every later call raises it again)."""
    remove_tmp_dirs(self.directory, step)
    kept = [s for s in sorted(self._manager.all_steps()) if s != step]
    self.failure = save_error(os.fspath(self.directory), step, error, kept, doing)
    raise self.failure from error


def remove_tmp_dirs(directory: epath.Path, step: int) -> None:
  """Deletes `<step>.orbax-checkpoint-tmp*` (what a failed save of `step` left)."""
  prefix = f"{step}{TMP_SUFFIX}"
  for attempt in range(20):   # a writer thread still unwinding may recreate a file
    try:
      leftovers = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    except OSError:
      return
    if not leftovers:
      return
    for path in leftovers:
      try:
        if path.is_dir():
          path.rmtree()
        else:
          path.unlink()
      except OSError as e:
        if attempt == 19:
          log.warning("could not remove %s left by the failed save: %s", path, e)
    time.sleep(0.05)
