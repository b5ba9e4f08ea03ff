"""PreemptionGuard: the handler only sets a flag, previous handlers come back, the multi-host path
asks JAX's sync point, and a SIGTERMed training loop leaves a restorable checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from jaxagent.checkpoint import Checkpointer, PreemptionGuard
from jaxagent.checkpoint import preemption


def test_sigterm_sets_flag_and_handlers_come_back():
  before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with PreemptionGuard() as guard:
    assert signal.getsignal(signal.SIGTERM) != before_term
    assert signal.getsignal(signal.SIGINT) == before_int          # SIGINT only when asked
    assert not guard.should_stop(0) and guard.signal_received is None
    os.kill(os.getpid(), signal.SIGTERM)                           # handled in this thread
    assert guard.should_stop(1) and guard.should_stop()           # and stays set
    assert guard.signal_received == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) == before_term
  with pytest.raises(RuntimeError, match="outside the guard"):
    guard.should_stop(2)


def test_sigint_optional_second_one_interrupts():
  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(KeyboardInterrupt):
    with PreemptionGuard(sigint=True) as guard:
      os.kill(os.getpid(), signal.SIGINT)
      assert guard.should_stop(3) and guard.signal_received == signal.SIGINT
      os.kill(os.getpid(), signal.SIGINT)                         # impatient user: abort now
      for _ in range(1000):                                       # the handler raises here
        pass
  assert signal.getsignal(signal.SIGINT) == before


def test_multihost_path_asks_jax_sync_point(monkeypatch):
  """With jax.distributed's preemption service on (stood in here: no cluster in a unit test),
  the guard leaves SIGTERM to JAX and stops exactly where the sync point says."""
  monkeypatch.setattr(preemption, "_jax_preemption_service_active", lambda: True)
  asked = []
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                      lambda step: asked.append(step) or step == 7)
  before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with PreemptionGuard(sigint=True) as guard:
    assert signal.getsignal(signal.SIGTERM) == before              # JAX's notifier keeps it
    assert signal.getsignal(signal.SIGINT) == before_int           # a local stop would hang
    assert [guard.should_stop(s) for s in range(5, 9)] == [False, False, True, False]
    with pytest.raises(ValueError, match="must pass the step"):
      guard.should_stop()
  assert asked == [5, 6, 7, 8]


def test_single_process_sync_point_is_safe():
  """Without jax.distributed the JAX call the guard relies on multi-host is a plain False."""
  assert not jax.distributed.is_initialized()
  assert multihost_utils.reached_preemption_sync_point(0) is False
  assert not preemption._jax_preemption_service_active()


def test_guard_needs_main_thread():
  errors = []

  def enter():
    try:
      with PreemptionGuard():
        pass
    except RuntimeError as e:
      errors.append(str(e))

  t = threading.Thread(target=enter)
  t.start()
  t.join()
  assert errors and "main thread" in errors[0]


LOOP = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from jaxagent.checkpoint import Checkpointer, PreemptionGuard

    @jax.jit
    def update(state, step):
      return {"w": state["w"] + step, "step": step, "rng": jax.random.fold_in(state["rng"], step)}

    ckpt = Checkpointer(sys.argv[1], max_to_keep=2, save_interval_steps=1000)
    state = {"w": jnp.zeros((3,), jnp.float32), "step": jnp.int32(0), "rng": jax.random.key(0)}
    with PreemptionGuard() as guard:
      step = 0
      while step < 3000:                    # ~30 s: the signal never arrived
        step += 1
        state = update(state, jnp.int32(step))
        if step == 2:
          print("RUNNING", flush=True)
        if guard.should_stop(step):
          ckpt.save(step, state, {"step": step, "reason": "preemption"}, force=True)
          ckpt.wait_until_finished()
          print(f"STOPPED {step}", flush=True)
          break
        time.sleep(0.01)
    ckpt.close()
    sys.exit(0 if guard.signal_received is not None else 3)
""")


def test_sigterm_leaves_restorable_checkpoint(tmp_path):
  script = tmp_path / "loop.py"
  script.write_text(LOOP)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    lines = []
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("RUNNING"):
        os.kill(proc.pid, signal.SIGTERM)
        break
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  out = "".join(lines) + rest
  assert proc.returncode == 0, out                   # a clean exit, not death by SIGTERM
  stopped = [int(l.split()[1]) for l in out.splitlines() if l.startswith("STOPPED")]
  assert len(stopped) == 1 and stopped[0] >= 2, out
  step = stopped[0]

  ckpt = Checkpointer.reader(tmp_path / "ckpt")
  assert ckpt.all_steps() == [step]                  # only the preemption save (interval 1000)
  dev = SingleDeviceSharding(jax.devices()[0])
  abstract = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=dev),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev),
              "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=dev)}
  state = ckpt.restore(abstract_state=abstract)
  assert ckpt.restore_meta() == {"step": step, "reason": "preemption"}
  assert int(state["step"]) == step
  np.testing.assert_array_equal(state["w"], np.full(3, step * (step + 1) / 2, np.float32))
  rng = jax.random.key(0)
  for s in range(1, step + 1):
    rng = jax.random.fold_in(rng, s)
  np.testing.assert_array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(rng))
