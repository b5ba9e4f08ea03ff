"""Fixed, versioned task splits of the JAX-native environments, as TFDS datasets.

One parameterised builder, `TaskSets`, with a `TaskSetConfig` per (environment, difficulty, seed,
split sizes). Each example is one task instance: the leaves of the environment's task pytree
(`env.sample_task(key)`), stored under their field names, plus `index` (position in the split).
Files are array_record, written and read by tensorflow_datasets without TensorFlow:
`GeneratorBasedBuilder(file_format='array_record')` encodes `tfds.features.Tensor` with numpy, and
`builder_from_directory(...).as_data_source()` reads the records back as numpy (so does
`tfds.data_source("task_sets/<config name>", data_dir=..., download=False)` once this module is
imported). `as_dataset` (tf.data) is the one reader that needs TensorFlow; it is not used.

Task instances are token-free (indices into an environment's name tables, grids, numbers), so one
task set serves every tokenizer; the environment used for sampling is built with the built-in
tokenizer.

Sampling is seeded and deduplicated: test, then validation, then train are drawn (key =
fold_in(fold_in(PRNGKey(seed), split), chunk)), and a task already drawn for any split is dropped,
so no evaluation task appears in train.

    path = build(data_dir, "grid", seed=0, num_train=1024, size=6)
    arrays = load(data_dir, "grid", "test", seed=0, num_train=1024, size=6)   # dict of np arrays
    tasks = tasks_from_arrays(env, arrays)                                    # batched task pytree
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
import tensorflow_datasets as tfds

import jaxagent.envs as envs
from jaxagent.models.builtin import BUILTIN_DIRS

SPLITS = ("train", "validation", "test")
_SAMPLE_CHUNK = 512
_MAX_CHUNKS_PER_SPLIT = 64


@dataclasses.dataclass(eq=False)
class TaskSetConfig(tfds.core.BuilderConfig):
  """Which tasks a task set holds (name: see `task_set_config`)."""
  env_name: str = ""
  difficulty_json: str = "{}"   # the env's difficulty knobs, JSON with sorted keys
  seed: int = 0
  num_train: int = 1024
  num_validation: int = 256
  num_test: int = 256

  @property
  def difficulty(self) -> dict[str, Any]:
    return json.loads(self.difficulty_json)

  def split_size(self, split: str) -> int:
    return {"train": self.num_train, "validation": self.num_validation, "test": self.num_test}[split]


def ident(value: Any) -> str:
  """A value as identifier characters: 0.25 -> '0p25', -1 -> 'm1', True -> 'True'."""
  return str(value).replace(".", "p").replace("-", "m")


def difficulty_slug(difficulty: dict[str, Any]) -> str:
  """A short, stable name for a set of knobs made of identifier characters (so config names
  work with `tfds.data_source("task_sets/<name>")`): `k1_v1__k2_v2`, or a hash if long."""
  if not difficulty:
    return "default"
  text = "__".join(f"{k}_{ident(difficulty[k])}" for k in sorted(difficulty))
  if len(text) <= 60 and all(c.isalnum() or c == "_" for c in text):
    return text
  return "h" + hashlib.sha256(json.dumps(difficulty, sort_keys=True).encode()).hexdigest()[:12]


def env_slug(env_name: str) -> str:
  """`env_name` as identifier characters for dataset names: a registered name as it is; an
  importable "package.module:Class" with its dots and colon made underscores and a hash of the
  whole name (so two classes never share a dataset)."""
  if all(c.isalnum() or c == "_" for c in env_name):
    return env_name
  clean = "".join(c if c.isalnum() or c == "_" else "_" for c in env_name)
  return f"{clean[-40:]}_{hashlib.sha256(env_name.encode()).hexdigest()[:8]}"


def task_set_config(env_name: str, *, seed: int = 0, num_train: int = 1024,
                    num_validation: int = 256, num_test: int = 256, **difficulty) -> TaskSetConfig:
  """The config for `env_name` with these knobs; its name encodes every field."""
  name = (f"{env_slug(env_name)}__{difficulty_slug(difficulty)}__seed{seed}"
          f"__n{num_train}_{num_validation}_{num_test}")
  return TaskSetConfig(
      name=name, description=f"{env_name} tasks, knobs {difficulty}, seed {seed}",
      env_name=env_name, difficulty_json=json.dumps(difficulty, sort_keys=True), seed=seed,
      num_train=num_train, num_validation=num_validation, num_test=num_test)


@functools.lru_cache(maxsize=None)
def _builtin_tokenizer():
  from transformers import AutoTokenizer  # heavy, and only needed to build a task set
  return AutoTokenizer.from_pretrained(str(BUILTIN_DIRS["tiny"]))


@functools.lru_cache(maxsize=32)
def _make_env(env_name: str, difficulty_json: str):
  """The env that samples a task set (cached: builds of one family reuse its compiled sampler)."""
  return envs.make(env_name, _builtin_tokenizer(), **json.loads(difficulty_json))


@functools.lru_cache(maxsize=32)
def _batched_sampler(env):
  return jax.jit(jax.vmap(env.sample_task))


def _leaf_names(tree) -> list[str]:
  """Feature names of a task pytree's leaves: their attribute path joined by '__'."""
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path]
    names.append("__".join(parts) or "task")
  return names


def task_features(env) -> dict[str, tfds.features.Tensor]:
  """One `tfds.features.Tensor` per leaf of `env.sample_task`'s output (shape and dtype)."""
  spec = jax.eval_shape(env.sample_task, jax.random.PRNGKey(0))
  leaves = jax.tree_util.tree_leaves(spec)
  return {n: tfds.features.Tensor(shape=tuple(x.shape), dtype=np.dtype(x.dtype))
          for n, x in zip(_leaf_names(spec), leaves)}


def sample_task_splits(env, config: TaskSetConfig) -> dict[str, dict[str, np.ndarray]]:
  """Draws every split of `config` (deduplicated across splits): split -> name -> [n, ...]."""
  sample = _batched_sampler(env)
  spec = jax.eval_shape(env.sample_task, jax.random.PRNGKey(0))
  names = _leaf_names(spec)
  root = jax.random.PRNGKey(config.seed)
  seen: set[bytes] = set()
  out = {}
  # Evaluation splits first, so a collision drops the train copy.
  for split in ("test", "validation", "train"):
    want = config.split_size(split)
    kept: list[list[np.ndarray]] = []
    split_key = jax.random.fold_in(root, SPLITS.index(split))
    for chunk in range(_MAX_CHUNKS_PER_SPLIT):
      if len(kept) >= want:
        break
      keys = jax.random.split(jax.random.fold_in(split_key, chunk), _SAMPLE_CHUNK)
      leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(sample(keys))]
      for i in range(_SAMPLE_CHUNK):
        row = [x[i] for x in leaves]
        digest = hashlib.sha256(b"".join(r.tobytes() for r in row)).digest()
        if digest in seen:
          continue
        seen.add(digest)
        kept.append(row)
        if len(kept) == want:
          break
    if len(kept) < want:
      raise ValueError(
          f"{config.env_name} with knobs {config.difficulty} gave only {len(kept)} distinct "
          f"{split} tasks (wanted {want}) after {_MAX_CHUNKS_PER_SPLIT * _SAMPLE_CHUNK} draws: "
          "ask for fewer tasks or raise the difficulty knobs (the task space is too small).")
    out[split] = {n: np.stack([r[j] for r in kept]) for j, n in enumerate(names)}
  return out


class TaskSets(tfds.core.GeneratorBasedBuilder):
  """Task splits (train / validation / test) of one environment at one difficulty."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  BUILDER_CONFIG_CLASS = TaskSetConfig
  BUILDER_CONFIGS = [
      task_set_config("grid", size=6),
      task_set_config("grid", size=8, num_traps=4),
      task_set_config("workshop", depth=1),
      task_set_config("workshop", depth=3),
  ]

  def __init__(self, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    self._env = _make_env(cfg.env_name, cfg.difficulty_json)
    features = {"index": tfds.features.Tensor(shape=(), dtype=np.int64), **task_features(self._env)}
    return tfds.core.DatasetInfo(
        builder=self, description=cfg.description,
        features=tfds.features.FeaturesDict(features), disable_shuffling=True,
        metadata=tfds.core.MetadataDict(env_name=cfg.env_name, difficulty=cfg.difficulty,
                                        seed=cfg.seed))

  def _split_generators(self, dl_manager):
    del dl_manager
    self._arrays = sample_task_splits(self._env, self.builder_config)
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split):
    arrays = self._arrays[split]
    n = len(arrays["index"]) if "index" in arrays else len(next(iter(arrays.values())))
    for i in range(n):
      yield i, {"index": np.int64(i), **{k: v[i] for k, v in arrays.items()}}


def read_split(builder_dir: str | os.PathLike, split: str) -> dict[str, np.ndarray]:
  """Reads one split of any dataset written by these builders: feature -> [n, ...] numpy.

  Uses `tfds.builder_from_directory` (no builder class, no TensorFlow) and the array_record data
  source; examples come back in `index` order.
  """
  builder = tfds.builder_from_directory(os.fspath(builder_dir))
  source = builder.as_data_source(split=split)
  rows = source.__getitems__(list(range(len(source))))
  if not rows:
    return {k: np.zeros((0,) + f.shape, f.np_dtype) for k, f in builder.info.features.items()}
  features = builder.info.features
  out = {k: np.stack([np.asarray(r[k]) for r in rows]).astype(features[k].np_dtype) for k in rows[0]}
  order = np.argsort(out["index"], kind="stable")
  return {k: v[order] for k, v in out.items()}


def build(data_dir: str | os.PathLike, env_name: str, **config_kwargs) -> str:
  """Builds (or reuses) the task set of `task_set_config(env_name, **config_kwargs)`.

  Returns the builder directory (`data_dir/task_sets/<config name>/<version>`).
  """
  config = task_set_config(env_name, **config_kwargs)
  with build_lock(data_dir, "task_sets", config.name):
    builder = TaskSets(data_dir=os.fspath(data_dir), config=config)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS))
  return os.fspath(builder.data_dir)


@contextlib.contextmanager
def build_lock(data_dir: str | os.PathLike, kind: str, name: str):
  """Holds an exclusive lock (`flock`, released if the holder dies) on building one dataset in
  `data_dir`: runs that share a data dir (the seeds of a study started together) build it once,
  one after the other, and the later ones reuse it (TFDS's own temp-dir-and-rename build races:
  FileExistsError)."""
  lock_dir = os.path.join(os.fspath(data_dir), ".locks")
  try:
    os.makedirs(lock_dir, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, f"{kind}-{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise OSError(f"cannot create the build lock in the data dir {os.fspath(data_dir)} ({e}); "
                  "pass a writable --config.data.dir") from e
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)      # releases the lock


def builder_dir(data_dir: str | os.PathLike, env_name: str, **config_kwargs) -> str:
  """Where `build` writes that task set (without building or importing the environment)."""
  name = task_set_config(env_name, **config_kwargs).name
  return os.path.join(os.fspath(data_dir), "task_sets", name, str(TaskSets.VERSION))


def load(data_dir: str | os.PathLike, env_name: str, split: str,
         **config_kwargs) -> dict[str, np.ndarray]:
  """Reads one split of a built task set: leaf name -> [n, ...] numpy arrays (plus `index`)."""
  path = builder_dir(data_dir, env_name, **config_kwargs)
  if not os.path.isdir(path):
    raise FileNotFoundError(
        f"no task set at {path}: build it first with "
        f"jaxagent.data.tasks.build({os.fspath(data_dir)!r}, {env_name!r}, ...) with the same knobs")
  return read_split(path, split)


def tasks_from_arrays(env, arrays: dict[str, np.ndarray]):
  """The batched task pytree (leading axis n) of `env` from `load`'s arrays."""
  spec = jax.eval_shape(env.sample_task, jax.random.PRNGKey(0))
  treedef = jax.tree_util.tree_structure(spec)
  names = _leaf_names(spec)
  missing = [n for n in names if n not in arrays]
  if missing:
    raise ValueError(f"these arrays are not tasks of {env.name}: missing fields {missing}")
  return jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(arrays[n]) for n in names])
