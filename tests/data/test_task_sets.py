"""Tests of the task-set TFDS builder (data/tasks.py): array_record, no TensorFlow."""

import hashlib
import os
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

import jaxagent.envs as envs
from jaxagent.data import tasks

SIZES = dict(num_train=48, num_validation=16, num_test=16)
GRID = dict(size=4, num_traps=1)


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tasks")
  return root, tasks.build(root, "grid", seed=0, **SIZES, **GRID)


def _digests(arrays):
  names = sorted(k for k in arrays if k != "index")
  n = len(arrays["index"])
  return {hashlib.sha256(b"".join(arrays[k][i].tobytes() for k in names)).hexdigest()
          for i in range(n)}


def test_round_trip_gives_back_the_sampled_tasks(grid_dir, builtin_tokenizer):
  root, path = grid_dir
  assert path == tasks.builder_dir(root, "grid", seed=0, **SIZES, **GRID)
  assert any(f.endswith("array_record-00000-of-00001") for f in os.listdir(path))
  env = envs.make("grid", builtin_tokenizer, **GRID)
  expected = tasks.sample_task_splits(env, tasks.task_set_config("grid", seed=0, **SIZES, **GRID))
  for split in tasks.SPLITS:
    got = tasks.load(root, "grid", split, seed=0, **SIZES, **GRID)
    assert set(got) == {"index", "walls", "traps", "start", "goal"}
    np.testing.assert_array_equal(got["index"], np.arange(SIZES[f"num_{split}"]))
    for k, v in expected[split].items():
      assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
      np.testing.assert_array_equal(got[k], v)
  # The registered builder reads back through tfds.data_source too (array_record, numpy).
  name = os.path.basename(os.path.dirname(path))
  source = tfds.data_source(f"task_sets/{name}", data_dir=root, split="test", download=False)
  assert len(source) == 16
  np.testing.assert_array_equal(source[3]["walls"], expected["test"]["walls"][3])
  assert "tensorflow" not in sys.modules


def test_splits_are_disjoint_and_seeds_reproducible(grid_dir, tmp_path):
  root, _ = grid_dir
  digests = {s: _digests(tasks.load(root, "grid", s, seed=0, **SIZES, **GRID)) for s in tasks.SPLITS}
  assert [len(d) for d in digests.values()] == [48, 16, 16]           # no duplicates inside
  assert not (digests["train"] & digests["test"]) and not (digests["train"] & digests["validation"])
  assert not (digests["validation"] & digests["test"])
  tasks.build(tmp_path / "again", "grid", seed=0, **SIZES, **GRID)
  again = tasks.load(tmp_path / "again", "grid", "test", seed=0, **SIZES, **GRID)
  assert _digests(again) == digests["test"]
  tasks.build(tmp_path / "other", "grid", seed=1, **SIZES, **GRID)
  other = tasks.load(tmp_path / "other", "grid", "test", seed=1, **SIZES, **GRID)
  assert len(_digests(other) & digests["test"]) < 4


def test_loaded_tasks_drive_the_environment(grid_dir, tmp_path, builtin_tokenizer):
  root, _ = grid_dir
  env = envs.make("grid", builtin_tokenizer, **GRID)
  arrays = tasks.load(root, "grid", "validation", seed=0, **SIZES, **GRID)
  batch = tasks.tasks_from_arrays(env, arrays)
  assert batch.walls.shape == (16, 4, 4) and batch.start.dtype == np.int32
  opt = np.asarray(jax.jit(jax.vmap(env.optimal_turns))(batch))
  assert np.all((opt >= 1) & (opt <= 15))
  with pytest.raises(ValueError, match="missing fields"):
    tasks.tasks_from_arrays(env, {"index": arrays["index"], "walls": arrays["walls"]})
  # Workshop tasks round-trip too (another task pytree).
  tasks.build(tmp_path, "workshop", seed=3, num_train=8, num_validation=4, num_test=4, depth=1)
  ws = envs.make("workshop", builtin_tokenizer, depth=1)
  loaded = tasks.tasks_from_arrays(
      ws, tasks.load(tmp_path, "workshop", "train", seed=3, num_train=8, num_validation=4,
                     num_test=4, depth=1))
  assert np.all(np.asarray(jax.jit(jax.vmap(ws.optimal_turns))(loaded)) == 6)


def test_errors_name_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="build it first"):
    tasks.load(tmp_path, "grid", "train", seed=5, **GRID)
  with pytest.raises(ValueError, match="task space is too small"):
    tasks.build(tmp_path, "grid", seed=0, num_train=4000, num_validation=4, num_test=4, size=2,
                num_traps=0, wall_density=0.0)


def test_config_names_encode_the_knobs():
  a = tasks.task_set_config("grid", seed=0, **SIZES, size=6, num_traps=2)
  b = tasks.task_set_config("grid", seed=0, **SIZES, num_traps=2, size=6)
  c = tasks.task_set_config("grid", seed=1, **SIZES, size=6, num_traps=2)
  assert a.name == b.name == "grid__num_traps_2__size_6__seed0__n48_16_16" and a.name != c.name
  assert tasks.task_set_config("grid", wall_density=0.25).name.startswith("grid__wall_density_0p25__")
  assert a.difficulty == {"size": 6, "num_traps": 2}


BUILD_ONE = """
import sys, time
import numpy as np
from jaxagent.data import tasks
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))       # every process starts building at once
tasks.build(sys.argv[1], "lookup", seed=0, num_train=64, num_validation=8, num_test=8, hops=1)
a = tasks.load(sys.argv[1], "lookup", "test", seed=0, num_train=64, num_validation=8, num_test=8,
               hops=1)
print("ok", int(np.asarray(a["index"]).sum()), flush=True)
"""


def test_runs_sharing_a_data_dir_build_each_set_once(tmp_path):
  """Issue 37 case 5: runs started together on one --config.data.dir (a study's seeds) raced in
  TFDS's build (a raw FileExistsError); the build is locked, so all succeed with the same set."""
  import os
  import pathlib
  import subprocess
  import sys
  import time
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  start = time.time() + 25          # after every process has imported jax and TFDS
  procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONE, str(tmp_path), str(start)],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(4)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert len({out.strip().splitlines()[-1] for out, _ in outs}) == 1
