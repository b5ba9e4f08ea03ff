"""Damaged checkpoints: `restore_latest` / `restore_params_latest` fall back to the newest intact
step, a run whose last checkpoint is damaged is still seen as finished, and a checkpoint of
another structure or model is a mismatch, never damage.

Each test saves three small checkpoints (random arrays, large enough that orbax writes them to
data files rather than inlining them in the index) and damages some on disk.
"""

from __future__ import annotations

import gc
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jaxagent.checkpoint import (CheckpointDamagedError, CheckpointMismatchError, Checkpointer,
                                 IncompatibleCheckpointError)

# A failed restore leaves orbax read coroutines that raise again when collected; Python reports
# them as unraisable (noise, expected on damaged data; `restore_latest` logs them at debug level).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

FP = "fingerprint-a"
STEPS = (1, 2, 3)
SHAPE = (64, 64)        # 16 KiB of random float32: a separate data file, not inlined
LOGGER = "jaxagent.checkpoint.manager"


@pytest.fixture(autouse=True)
def collect_orbax_leftovers():
  """Collects those coroutines here, under this module's filter, not in a later test."""
  yield
  gc.collect()


def make_state(step: int) -> dict:
  return {"params": {"w": jax.random.normal(jax.random.key(step), SHAPE),
                     "b": jnp.full((8,), float(step))},
          "opt": {"mu": jax.random.normal(jax.random.key(100 + step), SHAPE)},
          "step": jnp.int32(step), "key": jax.random.key(step)}


def abstract_state() -> dict:
  dev = SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                      make_state(0))


def assert_state_of(restored: dict, step: int) -> None:
  expected = make_state(step)
  for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      assert r.dtype == e.dtype
      r, e = jax.random.key_data(r), jax.random.key_data(e)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(e))


@pytest.fixture
def ckpt_dir(tmp_path) -> pathlib.Path:
  directory = tmp_path / "ckpt"
  with Checkpointer(directory, max_to_keep=3, save_interval_steps=1) as ckpt:
    for step in STEPS:
      ckpt.save(step, make_state(step), {"step": step, "model_fingerprint": FP})
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "3"]
  return directory


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  """The files holding the 16 KiB arrays' bytes (OCDBT packs values into data files next to its
  small b-tree nodes; which value lands in which file varies, so all large ones)."""
  files = [p for p in (step_dir / "state").rglob("*")
           if p.is_file() and p.parent.name == "d" and "ocdbt.process_" in str(p)
           and p.stat().st_size > 4096]
  assert files, list((step_dir / "state").rglob("*"))
  return files


def delete_data_file(step_dir: pathlib.Path) -> None:
  for path in data_files(step_dir):
    path.unlink()


def truncate_data_file(step_dir: pathlib.Path) -> None:
  """Cut each data file to 1 KiB: no array's bytes survive (a file may hold several arrays)."""
  for path in data_files(step_dir):
    os.truncate(path, 1024)


def truncate_index(step_dir: pathlib.Path) -> None:
  """The OCDBT root node (state/d/*): every array's metadata is read through it."""
  for path in (step_dir / "state" / "d").iterdir():
    os.truncate(path, path.stat().st_size // 2)


def garble_tree_metadata(step_dir: pathlib.Path) -> None:
  (step_dir / "state" / "_METADATA").write_text("{garbage")


def garble_meta(step_dir: pathlib.Path) -> None:
  (step_dir / "meta" / "metadata").write_text("{not json")


def delete_prng_keys(step_dir: pathlib.Path) -> None:
  (step_dir / "prng_keys" / "metadata").unlink()


DAMAGE = {f.__name__: f for f in (delete_data_file, truncate_data_file, truncate_index,
                                  garble_tree_metadata, garble_meta, delete_prng_keys)}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_restore_latest_skips_damaged_latest(ckpt_dir, damage, caplog):
  DAMAGE[damage](ckpt_dir / "3")
  # Reading the damaged step itself fails, as damage (never a mismatch advising a new workdir).
  with pytest.raises(CheckpointDamagedError, match=r"checkpoint .*/3 is damaged") as err:
    direct = Checkpointer.reader(ckpt_dir)
    direct.restore(3, abstract_state=abstract_state())
    direct.restore_meta(3)                  # restore() reads the state only, not the meta
  assert not isinstance(err.value, CheckpointMismatchError)
  assert list(err.value.reasons) == [3]

  # A reader (evaluation) falls back and leaves the directory as it is.
  reader = Checkpointer.reader(ckpt_dir)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    state, step = reader.restore_latest(abstract_state(), fingerprint=FP)
  assert step == 2
  assert_state_of(state, 2)
  skipped = [r.getMessage() for r in caplog.records if "step 3 is damaged" in r.getMessage()]
  assert skipped and "trying step 2" in skipped[0], caplog.text
  assert reader.all_steps() == [1, 2, 3]
  params, step = reader.restore_params_latest(abstract_state()["params"])
  assert step == 2
  np.testing.assert_array_equal(params["w"], make_state(2)["params"]["w"])
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["1", "2", "3"]

  # A writer (resuming training) also moves the damaged step aside, so step 3 can be written
  # again (else save(3) would be skipped as existing, and a preemption save at step 2.x refused).
  writer = Checkpointer(ckpt_dir, max_to_keep=3, save_interval_steps=1)
  state, step = writer.restore_latest(abstract_state())
  assert step == 2
  assert_state_of(state, 2)
  assert writer.all_steps() == [1, 2] and writer.latest_step() == 2
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["1", "2", "3.damaged"]
  assert writer.save(3, make_state(30), {"step": 3, "model_fingerprint": FP})
  writer.close()
  again = Checkpointer.reader(ckpt_dir)
  assert again.all_steps() == [1, 2, 3]
  assert_state_of(again.restore_latest(abstract_state())[0], 30)


def test_restore_latest_intact_and_empty(tmp_path, ckpt_dir, caplog):
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    state, step = Checkpointer.reader(ckpt_dir).restore_latest(abstract_state())
  assert step == 3 and not [r for r in caplog.records if r.name == LOGGER]
  assert_state_of(state, 3)
  empty = Checkpointer(tmp_path / "empty", max_to_keep=2, save_interval_steps=1)
  assert empty.restore_latest(abstract_state()) == (None, None)
  assert empty.restore_params_latest(abstract_state()["params"]) == (None, None)
  assert empty.latest_intact_step() is None
  empty.close()


def test_two_damaged_steps_fall_back_to_the_first(ckpt_dir, caplog):
  truncate_data_file(ckpt_dir / "3")
  garble_meta(ckpt_dir / "2")
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    state, step = Checkpointer.reader(ckpt_dir).restore_latest(abstract_state())
  assert step == 1
  assert_state_of(state, 1)
  assert "step 3 is damaged" in caplog.text and "step 2 is damaged" in caplog.text


def test_every_checkpoint_damaged_is_a_clear_error(ckpt_dir):
  truncate_data_file(ckpt_dir / "3")
  garble_tree_metadata(ckpt_dir / "2")
  delete_prng_keys(ckpt_dir / "1")
  for ckpt in (Checkpointer.reader(ckpt_dir),
               Checkpointer(ckpt_dir, max_to_keep=3, save_interval_steps=1)):
    with pytest.raises(CheckpointDamagedError) as err:
      ckpt.restore_latest(abstract_state())
    msg = str(err.value)
    assert f"every checkpoint in {ckpt_dir} is damaged" in msg
    assert list(err.value.reasons) == [3, 2, 1]
    for step in (3, 2, 1):
      assert f"\n  step {step}: " in msg
    assert "Requested byte range" in err.value.reasons[3]       # the truncated data file
    assert "JSONDecodeError" in err.value.reasons[2]
    assert "prng_keys" in err.value.reasons[1] and "not found" in err.value.reasons[1]
    assert "new --workdir" in msg and "backup" in msg
    with pytest.raises(CheckpointDamagedError, match="every checkpoint"):
      ckpt.restore_params_latest(abstract_state()["params"])
    assert ckpt.all_steps() == [1, 2, 3]          # nothing moved when nothing could be restored


def test_mismatch_is_not_damage(ckpt_dir):
  truncate_data_file(ckpt_dir / "3")
  other = abstract_state()
  other["params"]["w"] = jax.ShapeDtypeStruct((32, 64), jnp.float32,
                                               sharding=other["params"]["b"].sharding)
  writer = Checkpointer(ckpt_dir, max_to_keep=3, save_interval_steps=1)
  # Another structure: raised at once, from step 3's intact metadata, before its damaged data
  # is read; not skipped as damage.
  with pytest.raises(CheckpointMismatchError, match=r"/3 does not match.*shapes differ.*'w'"):
    writer.restore_latest(other)
  with pytest.raises(CheckpointMismatchError, match=r"new --workdir"):
    writer.restore(2, abstract_state={**abstract_state(), "extra": other["step"]})
  # Another model: the fingerprint of the newest readable meta decides, no fallback.
  with pytest.raises(IncompatibleCheckpointError, match=r"step 3\) of another model"):
    writer.restore_latest(abstract_state(), fingerprint="fingerprint-b")
  garble_meta(ckpt_dir / "3")
  with pytest.raises(IncompatibleCheckpointError, match=r"step 2\) of another model"):
    writer.restore_latest(abstract_state(), fingerprint="fingerprint-b")
  with pytest.raises(IncompatibleCheckpointError, match=r"step 2\).*use a new --workdir"):
    writer.check_compatible("fingerprint-b")
  with pytest.raises(CheckpointMismatchError, match="not requested"):
    writer.restore_params_latest({"w": abstract_state()["params"]["w"]})
  assert writer.all_steps() == [1, 2, 3]           # a mismatch moves nothing aside
  writer.close()


def test_finished_run_with_damaged_last_checkpoint(ckpt_dir, caplog):
  """`latest_step()` (the trainer's "phase finished?") reads only the listing."""
  garble_meta(ckpt_dir / "3")
  truncate_data_file(ckpt_dir / "3")
  total_steps = 3
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    writer = Checkpointer(ckpt_dir, max_to_keep=3, save_interval_steps=1)
    assert writer.check_compatible(FP) == 3     # fingerprint read from step 2, with a warning
  assert "step 3 is damaged" in caplog.text
  assert writer.latest_step() == 3 >= total_steps
  reader = Checkpointer.reader(ckpt_dir)
  assert reader.latest_step() == 3 and reader.all_steps() == [1, 2, 3]
  # The done phase's params come from the newest intact step.
  params, step = reader.restore_params_latest(abstract_state()["params"], fingerprint=FP)
  assert step == 2
  np.testing.assert_array_equal(params["w"], make_state(2)["params"]["w"])
  writer.close()


def test_latest_intact_step_and_damage(ckpt_dir, caplog):
  reader = Checkpointer.reader(ckpt_dir)
  assert reader.latest_intact_step() == 3 and reader.damage(3) is None
  garble_tree_metadata(ckpt_dir / "3")
  garble_meta(ckpt_dir / "2")
  reader = Checkpointer.reader(ckpt_dir)
  assert reader.damage(3).startswith("state: JSONDecodeError")
  assert reader.damage(2).startswith("meta: JSONDecodeError")
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    assert reader.latest_intact_step() == 1
  assert "step 3 is damaged" in caplog.text and "step 2 is damaged" in caplog.text
  # Damaged array data shows only when read: latest_intact_step checks metadata.
  truncate_data_file(ckpt_dir / "1")
  assert reader.damage(1) is None
  with pytest.raises(CheckpointDamagedError, match="Requested byte range"):
    reader.restore_params(1, abstract_state()["params"])
