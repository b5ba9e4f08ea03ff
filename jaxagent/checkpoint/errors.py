"""The checkpoint errors a caller can catch, and the helpers that word their messages.

    CheckpointMismatchError       a checkpoint that reads but does not fit the request (structure,
                                  shapes): the fix is another config or a new workdir
    IncompatibleCheckpointError   a checkpoint of another model (model fingerprint)
    CheckpointDamagedError        files missing, truncated or garbled: restore an older step
    CheckpointSaveError           a save that cannot be written (unwritable directory, full disk)

`save_error` builds the `CheckpointSaveError` of a failed save from the OS error behind it;
`error_chain`, `clean` and `os_errno` pick apart the (often TensorStore) errors behind a failure.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any, Iterator, Mapping, Sequence


class CheckpointMismatchError(ValueError):
  """A checkpoint that does not fit what the caller asked for; the message names the fix."""


class IncompatibleCheckpointError(CheckpointMismatchError):
  """The workdir holds a checkpoint of another model."""


class CheckpointDamagedError(RuntimeError):
  """Checkpoints that cannot be read: files missing, truncated or garbled.

  Attributes:
    directory: the checkpoint directory.
    reasons: {step: why it is damaged}, newest step first.
  """

  def __init__(self, directory: Any, reasons: Mapping[int, str], *, every: bool = False):
    self.directory = str(directory)
    self.reasons = dict(sorted(reasons.items(), reverse=True))
    listing = "\n".join(f"  step {step}: {why}" for step, why in self.reasons.items())
    if every:
      message = (
          f"every checkpoint in {self.directory} is damaged, none can be restored:\n{listing}\n"
          "Restore the directory from a backup, or move these step directories away (or use a "
          "new --workdir) to start over")
    else:
      (step, why), = self.reasons.items()
      message = (
          f"checkpoint {self.directory}/{step} is damaged: {why}\nRestore an older step "
          "(Checkpointer.restore_latest skips damaged steps), or move the step directory away")
    super().__init__(message)


class CheckpointSaveError(OSError):
  """A checkpoint could not be written (unwritable directory, full disk, ...).

  An `OSError`: `errno` is the underlying OS error number when one is known (EACCES, ENOSPC, ...),
  else None; `str()` is the full message (directory, step, OS error and the fix).

  Attributes:
    directory: the checkpoint directory.
    step: the step whose save failed.
  """

  def __init__(self, message: str, *, directory: Any, step: int, os_errno: int | None):
    super().__init__(message)
    self.message = message
    self.directory = str(directory)
    self.step = step
    self.errno = os_errno
    self.strerror = os.strerror(os_errno) if os_errno is not None else None

  def __str__(self) -> str:
    return self.message


# ---------------------------------------------------------------------------------------------
# Reading the errors behind a failure

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# TensorStore appends its whole spec to a message; a person needs neither.
_NOISE = (re.compile(r"\s*\[tensorstore_spec[^\]]*\].*", re.S),
          re.compile(r"\s*See full TensorStore details.*", re.S))


def error_chain(exc: BaseException) -> Iterator[BaseException]:
  """`exc` and its causes / contexts, outermost first."""
  seen: set[int] = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    yield exc
    exc = exc.__cause__ or exc.__context__


def clean(text: str, limit: int = 400) -> str:
  """An error message on one line, without TensorStore's spec, at most `limit` characters."""
  for pattern in _NOISE:
    text = pattern.sub("", text)
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def os_errno(exc: BaseException) -> int | None:
  """The OS error number behind a failed write (an OSError, or TensorStore's os_error_code)."""
  for e in error_chain(exc):
    if isinstance(e, OSError) and e.errno:
      return e.errno
    if m := _OS_ERROR_CODE.search(str(e)):
      return int(m.group(1))
  return None


# ---------------------------------------------------------------------------------------------
# Failed saves


def _save_fix(code: int | None, directory: str) -> str:
  if code in (errno.EACCES, errno.EPERM, errno.EROFS):
    return (f"Make {directory} writable by this user (check its owner and permissions, e.g. "
            "`chmod u+w`, and that the file system is not mounted read-only), or use another "
            "--workdir.")
  if code in (errno.ENOSPC, errno.EDQUOT):
    return (f"Free space (or raise the quota) on the file system holding {directory}, lower "
            "max_to_keep, or use a --workdir on a larger disk.")
  if code == errno.EFBIG:
    return ("Raise the file size limit (`ulimit -f`) or the file system's maximum file size, or "
            "use a --workdir on another file system.")
  if code in (errno.ENOENT, errno.ENOTDIR):
    return (f"{directory} (or a directory above it) was removed or replaced while the run was "
            "going; recreate it, or use another --workdir.")
  return f"Check that {directory} is writable and its disk has free space."


def save_error(directory: str, step: int, error: BaseException, kept: Sequence[int],
               doing: str = "") -> CheckpointSaveError:
  """The `CheckpointSaveError` for the save of `step` that failed with `error`.

  Args:
    directory: the checkpoint directory.
    kept: the steps still in the directory (ascending); the message names the latest to resume.
    doing: what failed, when `error` does not say it (e.g. "cannot create files in it").
  """
  code = os_errno(error)
  what = clean(str(error)) or type(error).__name__
  if doing:
    what = f"{doing} ({what})"
  if code is not None:
    what = f"{os.strerror(code)} ({errno.errorcode.get(code, code)}): {what}"
  resume = (f"the checkpoints kept there (latest: step {kept[-1]}) are intact; rerun the same "
            "command to resume from it" if kept else "rerun the same command to start again")
  return CheckpointSaveError(
      f"could not save checkpoint step {step} to {directory}: {what}\n"
      f"{_save_fix(code, directory)} Training stopped here; once this is fixed, {resume}.",
      directory=directory, step=step, os_errno=code)
