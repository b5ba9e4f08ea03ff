"""A workdir lock: one writer per workdir at a time.

    with WorkdirLock(workdir, "train"):       # <workdir>/.train.lock
      ...                                      # only this process writes checkpoints and metrics

The lock is an advisory `fcntl.flock` on a file in the workdir, held for the life of the `with`
block (or until `release()`). The kernel drops it when its process dies, so a lock left by a
killed run is never stale: the file stays, but the next run takes the lock at once. While it is
held, the file names the holder (host, pid, command, start time), and a second process that asks
for the same lock fails at once with `WorkdirLockedError` naming that holder. Training and
evaluation take different locks (`train`, `eval`): an evaluator may watch a run while it trains.
On a multi-host job only the primary process writes, so only it locks.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket
import sys
import time


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir's lock; the message names it."""


class WorkdirLock:
  """An exclusive, non-blocking lock on `<workdir>/.<name>.lock` (see the module docstring)."""

  def __init__(self, workdir, name: str, enabled: bool = True):
    self.path = pathlib.Path(workdir) / f".{name}.lock"
    self.name, self.enabled = name, enabled
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    if not self.enabled or self._fd is not None:
      return self
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
      os.close(fd)
      raise WorkdirLockedError(
          f"{self.path.parent} is in use: another {self.name} process holds {self.path} "
          f"({holder or 'holder unknown'}); wait for it to finish or stop it, or use another "
          "--workdir") from None
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
