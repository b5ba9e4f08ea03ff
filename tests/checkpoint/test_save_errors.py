"""A checkpoint that cannot be written stops the run at once with `CheckpointSaveError` (naming the
directory, the step, the OS error and the fix) and leaves no temporary directory behind, instead
of being logged while training goes on and then hanging for orbax's 5-minute timeout.

Two ways a save fails:
  * the directory is not writable or the disk is full before the save starts: `save` itself
    raises (tested in-process: chmod, or an emulated OS error where root ignores chmod);
  * a write fails in orbax's background thread (the disk fills up mid-save): the next call
    raises (tested in a subprocess with a real kernel error, RLIMIT_FSIZE's EFBIG, raised inside
    TensorStore's own writes).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jaxagent.checkpoint import CheckpointSaveError, Checkpointer

TMP_SUFFIX = ".orbax-checkpoint-tmp"   # orbax's in-progress marker (atomicity_types.TMP_DIR_SUFFIX)
ORBAX_TIMEOUT_S = 300                   # what a failed save used to cost
PROMPT_S = 60


def state(step: int) -> dict:
  return {"w": jnp.full((256,), float(step)), "step": jnp.int32(step)}


def can_write(directory: pathlib.Path) -> bool:
  """Whether this process can still create a file in `directory` (root ignores chmod)."""
  probe = directory / ".probe"
  try:
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600))
  except OSError:
    return False
  probe.unlink()
  return True


def emulate_os_error(monkeypatch, directory: pathlib.Path, code: int) -> None:
  """Makes creating anything inside `directory` fail with `code`, as the kernel would for a
  read-only directory (EACCES) or a full disk (ENOSPC): os.open for writing and os.mkdir, which
  the Checkpointer's write probe and orbax's directory creation go through."""
  real_open, real_mkdir = os.open, os.mkdir
  inside = str(directory) + os.sep

  def refuse(path) -> None:
    if os.fspath(path).startswith(inside):
      raise OSError(code, os.strerror(code), os.fspath(path))

  def fake_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      refuse(path)
    return real_open(path, flags, *args, **kwargs)

  def fake_mkdir(path, *args, **kwargs):
    refuse(path)
    return real_mkdir(path, *args, **kwargs)

  monkeypatch.setattr(os, "open", fake_open)
  monkeypatch.setattr(os, "mkdir", fake_mkdir)


def leftovers(directory: pathlib.Path) -> list[str]:
  """Everything but checkpoint 1: a temporary directory, a probe file, ..."""
  names = sorted(p.name for p in directory.iterdir() if p.name != "1")
  assert not [n for n in names if TMP_SUFFIX in n], names
  return names


@pytest.mark.parametrize("code", [errno.EACCES, errno.ENOSPC], ids=["read_only", "disk_full"])
def test_save_into_unwritable_directory_raises_at_once(tmp_path, monkeypatch, code):
  directory = tmp_path / "ckpt"
  ckpt = Checkpointer(directory, max_to_keep=3, save_interval_steps=1)
  assert ckpt.save(1, state(1), {"step": 1})
  ckpt.wait_until_finished()
  try:
    if code == errno.EACCES:
      os.chmod(directory, 0o500)              # the run's checkpoint dir made read-only mid-run
      if can_write(directory):                # root: permission bits do not stop it
        emulate_os_error(monkeypatch, directory, code)
    else:
      emulate_os_error(monkeypatch, directory, code)
    assert not can_write(directory)
    start = time.monotonic()
    with pytest.raises(CheckpointSaveError) as err:
      ckpt.save(2, state(2), {"step": 2})
    assert time.monotonic() - start < PROMPT_S
    # Stays stopped: every later call says the same (also the ones the interval would skip).
    with pytest.raises(CheckpointSaveError, match="step 2"):
      ckpt.save(3, state(3), {"step": 3})
    with pytest.raises(CheckpointSaveError, match="step 2"):
      ckpt.wait_until_finished()
    ckpt.close()                              # already reported: closes without raising again
  finally:
    monkeypatch.undo()
    os.chmod(directory, 0o700)
  msg = str(err.value)
  assert isinstance(err.value, OSError) and err.value.errno == code
  assert f"could not save checkpoint step 2 to {directory}: {os.strerror(code)}" in msg
  assert ("Make" in msg and "writable" in msg) if code == errno.EACCES else "Free space" in msg
  assert "latest: step 1" in msg and "rerun the same command to resume" in msg
  assert err.value.step == 2 and err.value.directory == str(directory)
  # Nothing of step 2 (no temporary directory, no probe file); step 1 intact.
  assert leftovers(directory) == []
  dev = SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                          state(0))
  restored, step = Checkpointer.reader(directory).restore_latest(abstract)
  assert step == 1
  np.testing.assert_array_equal(restored["w"], np.full((256,), 1.0, np.float32))


WRITER = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    import jax, jax.numpy as jnp
    from jaxagent.checkpoint import CheckpointSaveError, Checkpointer

    directory = sys.argv[1]
    ckpt = Checkpointer(directory, max_to_keep=3, save_interval_steps=2)
    ckpt.save(2, {"w": jnp.zeros((16,))}, {"step": 2})
    ckpt.wait_until_finished()
    big = jax.block_until_ready(jax.random.normal(jax.random.key(0), (512, 512)))  # 1 MiB
    # Files may not grow past 256 KiB from now on: writes fail with EFBIG ("File too large"), a
    # real kernel error raised inside TensorStore's writes, like ENOSPC on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (256 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    start = time.monotonic()
    report = {"started": ckpt.save(4, {"w": big}, {"step": 4})}  # async: returns at once
    step = 4
    try:
      while time.monotonic() - start < 120:   # the training loop: save() every step
        step += 1
        ckpt.save(step, {"w": big}, {"step": step})
        time.sleep(0.01)
    except CheckpointSaveError as e:
      report.update(message=str(e), errno=e.errno, step=e.step, raised_at=step)
    report["seconds"] = time.monotonic() - start
    report["listing"] = sorted(os.listdir(directory))
    ckpt.close()
    print("REPORT " + json.dumps(report), flush=True)
""")


def test_background_write_failure_stops_the_run(tmp_path):
  script = tmp_path / "writer.py"
  script.write_text(WRITER)
  directory = tmp_path / "ckpt"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)      # no cache writes under the file size limit
  start = time.monotonic()
  proc = subprocess.run([sys.executable, str(script), str(directory)], env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
  wall = time.monotonic() - start
  lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
  assert proc.returncode == 0 and lines, proc.stdout[-5000:]
  report = json.loads(lines[-1][len("REPORT "):])
  assert report["started"] is True
  assert "message" in report, report
  # Raised by the next save() calls after the failure (here within the first few steps), not
  # after orbax's timeout; and the process exits without waiting on orbax threads.
  assert report["seconds"] < PROMPT_S and wall < ORBAX_TIMEOUT_S / 2, (report, wall)
  msg = report["message"]
  assert report["errno"] == errno.EFBIG and report["step"] == 4
  assert f"could not save checkpoint step 4 to {directory}: File too large (EFBIG)" in msg
  assert "ulimit -f" in msg and "latest: step 2" in msg
  # The temporary directory of step 4 is gone; step 2 is all there is.
  assert report["listing"] == ["2"], report
  assert sorted(p.name for p in directory.iterdir()) == ["2"]
