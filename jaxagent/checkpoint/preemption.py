"""Preemption: notice SIGTERM (and optionally SIGINT), let the loop save and exit cleanly.

    with PreemptionGuard() as guard:
      for step in range(start, num_steps):
        state, metrics = update(state, batch)
        if guard.should_stop(step):
          ckpt.save(step, state, meta, force=True)
          ckpt.wait_until_finished()
          break

Single process: a Python signal handler sets a flag (no I/O, no allocation beyond that) and
`should_stop` reads it; the previous handlers come back when the guard exits.

Multi-process (`jax.distributed` initialised): JAX's preemption service already owns SIGTERM (its
C++ notifier is installed by `jax.distributed.initialize`, and a Python handler would silently
replace it), so the guard installs no SIGTERM handler and asks
`jax.experimental.multihost_utils.reached_preemption_sync_point(step)` instead, which is True on
every host at the same step, so all hosts save the same checkpoint. Orbax's own preemption
policy (`CheckpointManager.reached_preemption`) is this same call. SIGINT, a local signal, is
left to Python's default in that mode: stopping one host alone would hang the others.
"""

from __future__ import annotations

import logging
import signal
import threading
import types
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

_Handler = Callable[[int, types.FrameType | None], Any] | int | None


def _jax_preemption_service_active() -> bool:
  """True when `jax.distributed` runs with its preemption service (it then owns SIGTERM)."""
  return bool(jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service)


class PreemptionGuard:
  """Context manager turning SIGTERM (and SIGINT if asked) into a flag the training loop polls.

  Args:
    sigint: also catch SIGINT (Ctrl-C) in single-process runs: the first one asks for a clean
      stop, a second one raises KeyboardInterrupt as usual.
  """

  def __init__(self, *, sigint: bool = False):
    self.sigint = sigint
    self._signum: int | None = None      # first signal received (written by the handler)
    self._count = 0
    self._previous: dict[int, _Handler] = {}
    self._multihost = False
    self._logged = False
    self._active = False

  # The handler runs in the main thread between bytecodes: it only assigns attributes.
  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    self._count += 1
    if self._signum is None:
      self._signum = signum
    if signum == signal.SIGINT and self._count > 1:
      raise KeyboardInterrupt

  def __enter__(self) -> "PreemptionGuard":
    if self._active:
      raise RuntimeError("PreemptionGuard is already active; use one guard per loop")
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError("PreemptionGuard must be entered in the main thread (Python delivers "
                         "signals there); run the training loop in the main thread")
    self._multihost = _jax_preemption_service_active()
    if not self._multihost and jax.distributed.is_initialized() and jax.process_count() > 1:
      raise RuntimeError(
          "multi-host run without JAX's preemption service: hosts could stop at different "
          "steps. Leave jax_enable_preemption_service=True (the default) before "
          "jax.distributed.initialize")
    self._signum, self._count, self._logged = None, 0, False
    wanted = [] if self._multihost else [signal.SIGTERM] + ([signal.SIGINT] if self.sigint else [])
    for sig in wanted:
      self._previous[sig] = signal.signal(sig, self._handle)
    self._active = True
    return self

  def __exit__(self, *exc) -> None:
    for sig, prev in reversed(list(self._previous.items())):
      # None: the previous handler was not installed from Python; the default is the best we
      # can restore.
      signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    self._previous.clear()
    self._active = False

  @property
  def signal_received(self) -> int | None:
    """The first signal caught (a `signal.Signals` value), or None."""
    return self._signum

  def should_stop(self, step: int | None = None) -> bool:
    """Whether the loop should save a checkpoint at `step` and exit.

    Call it once per step on every host. `step` is required in multi-host runs (the hosts agree
    on the step to stop at); single-process runs may omit it.
    """
    if not self._active:
      raise RuntimeError("should_stop() outside the guard: use `with PreemptionGuard() as g:`")
    if self._multihost:
      if step is None:
        raise ValueError("should_stop(step): multi-host runs must pass the step so that all "
                         "hosts stop at the same one")
      stop = bool(multihost_utils.reached_preemption_sync_point(int(step)))
    else:
      stop = self._signum is not None
    if stop and not self._logged:
      self._logged = True
      what = (signal.Signals(self._signum).name if self._signum is not None
              else "JAX preemption sync point")
      log.warning("preemption (%s): stopping at step %s after saving a checkpoint", what, step)
    return stop
