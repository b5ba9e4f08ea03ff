"""A checkpoint whose writer dies mid-save is never picked up as complete.

The real case: a subprocess saves step 1, then starts an async save of step 2 and is SIGKILLed
after every array is written but before orbax commits (renames) the step directory. The commit is
held back by replacing orbax's finalize with a wait, so the kill lands at that point every time.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxagent.checkpoint import Checkpointer

TMP_SUFFIX = ".orbax-checkpoint-tmp"   # orbax's in-progress marker (atomicity_types.TMP_DIR_SUFFIX)

WRITER = textwrap.dedent("""
    import asyncio, sys, time
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from jaxagent.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], max_to_keep=3, save_interval_steps=1)
    ckpt.save(1, {"w": jnp.full((4,), 1.0), "step": jnp.int32(1)}, {"step": 1})
    ckpt.wait_until_finished()

    async def never_commit(self, *args, **kwargs):
      print("COMMITTING", flush=True)     # every array of step 2 is on disk by now
      await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = never_commit
    atomicity.CommitFileTemporaryPath.finalize = never_commit
    ckpt.save(2, {"w": jnp.full((4,), 2.0), "step": jnp.int32(2)}, {"step": 2})
    time.sleep(60)                          # killed long before, unless the patch missed
    print("FINALIZE_NOT_REACHED", flush=True)
    sys.exit(1)
""")


def subprocess_env() -> dict[str, str]:
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONUNBUFFERED="1")
  return env


def wait_for_line(proc: subprocess.Popen, marker: str) -> list[str]:
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith(marker):
      return lines
  raise AssertionError(f"subprocess exited before {marker!r}:\n{''.join(lines)}")


def abstract_w():
  dev = SingleDeviceSharding(jax.devices()[0])
  return {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=dev),
          "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev)}


def test_killed_mid_save_is_not_a_checkpoint(tmp_path):
  script = tmp_path / "writer.py"
  script.write_text(WRITER)
  ckpt_dir = tmp_path / "ckpt"
  proc = subprocess.Popen([sys.executable, str(script), str(ckpt_dir)], env=subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_for_line(proc, "COMMITTING")
  finally:
    proc.kill()                                   # SIGKILL: no handler, no cleanup
    proc.wait(timeout=30)

  # What the dead writer left: step 1 committed, step 2 only as a tmp dir holding written data.
  names = sorted(p.name for p in ckpt_dir.iterdir())
  assert "1" in names and "2" not in names, names
  tmp = [ckpt_dir / n for n in names if n.startswith("2" + TMP_SUFFIX)]
  assert len(tmp) == 1, names
  assert sum(1 for p in tmp[0].rglob("*") if p.is_file()) > 3   # the arrays were written

  # A reader (e.g. the eval job) sees only step 1 and leaves the tmp dir alone.
  reader = Checkpointer.reader(ckpt_dir)
  assert reader.latest_step() == 1 and reader.all_steps() == [1]
  restored = reader.restore(abstract_state=abstract_w())
  np.testing.assert_array_equal(restored["w"], np.full((4,), 1.0, np.float32))
  assert int(restored["step"]) == 1 and reader.restore_meta() == {"step": 1}
  assert tmp[0].exists()

  # The restarted writer resumes from step 1, cleans up, and can write step 2 again.
  with Checkpointer(ckpt_dir, max_to_keep=3, save_interval_steps=1) as writer:
    assert writer.latest_step() == 1
    assert writer.save(2, {"w": jnp.full((4,), 5.0), "step": jnp.int32(2)}, {"step": 2})
  assert not tmp[0].exists()
  again = Checkpointer.reader(ckpt_dir)
  assert again.all_steps() == [1, 2]
  np.testing.assert_array_equal(again.restore(abstract_state=abstract_w())["w"], np.full(4, 5.0))


def test_handmade_tmp_layout_is_ignored(tmp_path):
  """The same with the on-disk layout built by hand: a full copy of a step, uncommitted."""
  with Checkpointer(tmp_path, max_to_keep=3, save_interval_steps=1) as ckpt:
    ckpt.save(3, {"w": jnp.full((4,), 3.0), "step": jnp.int32(3)}, {"step": 3})
  shutil.copytree(tmp_path / "3", tmp_path / f"9{TMP_SUFFIX}-1700000000")
  shutil.copytree(tmp_path / "3", tmp_path / f"10{TMP_SUFFIX}")
  reader = Checkpointer.reader(tmp_path)
  assert reader.all_steps() == [3]
  assert int(reader.restore(abstract_state=abstract_w())["step"]) == 3
  assert pathlib.Path(tmp_path / f"10{TMP_SUFFIX}").exists()
