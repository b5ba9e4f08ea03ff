"""Demonstration sets for supervised fine-tuning, as TFDS datasets (array_record, no TensorFlow).

A demonstration set holds noisy-oracle transcripts (`jaxagent.envs.demos`) of the tasks of a task
set (`jaxagent.data.tasks`): split `train` from its train tasks, `validation` from its validation
tasks (test tasks never get demonstrations). Each example is one episode:

  tokens [L] int32, loss_mask [L] float32 (1 on action tokens and their end-of-turn token),
  turn_of_token [L] int32, length, truncated, per turn [T]: acted, injected, valid_call,
  error_kind, oracle_match, reward, solved, action_length; success_turn, num_turns,
  optimal_turns, task_index (row of the task split), index.

Transcripts are tokenizer-specific, so the config name holds a fingerprint of the tokenizer
(`tokenizer_fingerprint`: a hash of its vocabulary, merges, special tokens and chat template);
building with a different tokenizer under the same name is refused. Episodes are seeded:
episode i of split s uses key fold_in(fold_in(PRNGKey(seed), s), i).

    path = build(data_dir, "grid", tokenizer, error_rate=0.2, recovery_rate=0.7, size=6)
    arrays = load(data_dir, "grid", tokenizer, "train", error_rate=0.2, recovery_rate=0.7, size=6)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

import jaxagent.envs as envs
from jaxagent.data import tasks as task_sets
from jaxagent.envs import demos as env_demos
from jaxagent.envs import host_demos
from jaxagent.envs.host import HostEnv

SPLITS = ("train", "validation")
_CHUNK = 256


def tokenizer_fingerprint(tokenizer) -> str:
  """12 hex digits identifying a Hugging Face tokenizer's behaviour (vocab, merges, normaliser,
  pre-tokeniser, special tokens, chat template); equal tokenizers loaded twice agree."""
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is not None:
    h.update(backend.to_str().encode())
  else:
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
  h.update(json.dumps([str(tokenizer.chat_template), tokenizer.pad_token, tokenizer.eos_token,
                       sorted(tokenizer.all_special_tokens)]).encode())
  return h.hexdigest()[:12]


@dataclasses.dataclass(eq=False)
class DemoSetConfig(tfds.core.BuilderConfig):
  """Which demonstrations a demo set holds (name: see `demo_set_config`)."""
  env_name: str = ""
  difficulty_json: str = "{}"
  task_seed: int = 0
  num_train: int = 1024          # the task set's split sizes (which task set the demos come from)
  num_validation: int = 256
  num_test: int = 256
  tokenizer_name: str = ""
  tokenizer_hash: str = ""
  error_rate: float = 0.2
  recovery_rate: float = 0.7
  max_turns: int = 32
  max_len: int = 2048
  budget: int = -1
  seed: int = 0
  episodes_per_task: int = 1

  @property
  def difficulty(self) -> dict[str, Any]:
    return json.loads(self.difficulty_json)

  def task_set(self) -> task_sets.TaskSetConfig:
    return task_sets.task_set_config(
        self.env_name, seed=self.task_seed, num_train=self.num_train,
        num_validation=self.num_validation, num_test=self.num_test, **self.difficulty)


def demo_set_config(env_name: str, tokenizer, *, task_seed: int = 0, num_train: int = 1024,
                    num_validation: int = 256, num_test: int = 256, error_rate: float = 0.2,
                    recovery_rate: float = 0.7, max_turns: int = 32, max_len: int = 2048,
                    budget: int = -1, seed: int = 0, episodes_per_task: int = 1,
                    **difficulty) -> DemoSetConfig:
  """The config of demonstrations of `env_name` tasks (the task set of `task_seed`, the split
  sizes and `difficulty`) for `tokenizer`. Its name encodes every field (long ones hashed)."""
  fields = dict(task_seed=task_seed, num_train=num_train, num_validation=num_validation,
                num_test=num_test, error_rate=float(error_rate),
                recovery_rate=float(recovery_rate), max_turns=max_turns, max_len=max_len,
                budget=budget, seed=seed, episodes_per_task=episodes_per_task)
  fingerprint = tokenizer_fingerprint(tokenizer)
  spec = json.dumps([env_name, difficulty, fields], sort_keys=True)
  ident = task_sets.ident
  name = (f"{task_sets.env_slug(env_name)}__{task_sets.difficulty_slug(difficulty)}"
          f"__err{ident(f'{error_rate:g}')}__rec{ident(f'{recovery_rate:g}')}__tok{fingerprint}"
          f"__{hashlib.sha256(spec.encode()).hexdigest()[:8]}")
  return DemoSetConfig(
      name=name, description=f"{env_name} noisy-oracle demonstrations: {spec}",
      env_name=env_name, difficulty_json=json.dumps(difficulty, sort_keys=True),
      tokenizer_name=str(getattr(tokenizer, "name_or_path", "")), tokenizer_hash=fingerprint,
      **fields)


def _features(max_len: int, max_turns: int) -> tfds.features.FeaturesDict:
  t = tfds.features.Tensor
  seq, turns = (max_len,), (max_turns,)
  return tfds.features.FeaturesDict({
      "index": t(shape=(), dtype=np.int64),
      "task_index": t(shape=(), dtype=np.int64),
      "tokens": t(shape=seq, dtype=np.int32),
      "loss_mask": t(shape=seq, dtype=np.float32),
      "turn_of_token": t(shape=seq, dtype=np.int32),
      "length": t(shape=(), dtype=np.int32),
      "truncated": t(shape=(), dtype=np.bool_),
      "acted": t(shape=turns, dtype=np.bool_),
      "injected": t(shape=turns, dtype=np.bool_),
      "valid_call": t(shape=turns, dtype=np.bool_),
      "error_kind": t(shape=turns, dtype=np.int32),
      "oracle_match": t(shape=turns, dtype=np.bool_),
      "reward": t(shape=turns, dtype=np.float32),
      "solved": t(shape=turns, dtype=np.bool_),
      "action_length": t(shape=turns, dtype=np.int32),
      "success_turn": t(shape=(), dtype=np.int32),
      "num_turns": t(shape=(), dtype=np.int32),
      "optimal_turns": t(shape=(), dtype=np.int32),
  })


def make_runner(env, config: DemoSetConfig):
  """The jitted noisy-oracle runner of `env` for `config`'s shapes (max_turns, max_len); the
  error / recovery rates are call arguments (`env_demos.noisy_oracle_params`). A host
  environment gets the host twin (`jaxagent.envs.host_demos`): the same noise and arrays."""
  if isinstance(env, HostEnv):
    return host_demos.make_host_episode_runner(env, max_turns=config.max_turns,
                                               max_len=config.max_len)
  policy = env_demos.noisy_oracle_policy(env, 0.0, 1.0)
  return env_demos.make_episode_runner(env, policy, max_turns=config.max_turns,
                                       max_len=config.max_len)


def generate_demos(env, task_arrays: dict[str, np.ndarray], config: DemoSetConfig,
                   split_id: int, run=None) -> dict[str, np.ndarray]:
  """Runs the noisy oracle on every task of a split (`episodes_per_task` times each), in chunks
  of one compiled runner. Returns feature -> [n_tasks * episodes_per_task, ...] numpy arrays.

  `run` is `make_runner(env, config)` (built here if None; pass one to share its compilation
  across the splits of a demo set)."""
  run = make_runner(env, config) if run is None else run
  params = env_demos.noisy_oracle_params(config.error_rate, config.recovery_rate)
  tasks = task_sets.tasks_from_arrays(env, task_arrays)
  n_tasks = int(task_arrays["index"].shape[0])
  task_index = np.repeat(np.arange(n_tasks), config.episodes_per_task)
  split_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), split_id)
  out: dict[str, list[np.ndarray]] = {}
  for lo in range(0, len(task_index), _CHUNK):
    idx = task_index[lo:lo + _CHUNK]
    n = len(idx)
    # One shape: one compilation (a host runner compiles nothing, so it runs only the n).
    width = n if getattr(run, "host", False) else _CHUNK
    padded = np.pad(idx, (0, width - n), mode="edge")
    keys = jax.vmap(lambda i: jax.random.fold_in(split_key, i))(jnp.arange(lo, lo + width))
    chunk = jax.tree.map(lambda x: x[padded], tasks)
    transcript = run(keys, chunk, config.budget, params)
    for field in dataclasses.fields(transcript):
      out.setdefault(field.name, []).append(np.asarray(getattr(transcript, field.name))[:n])
    out.setdefault("task_index", []).append(idx.astype(np.int64))
  arrays = {k: np.concatenate(v) for k, v in out.items()}
  arrays["index"] = np.arange(len(task_index), dtype=np.int64)
  return arrays


class DemoSets(tfds.core.GeneratorBasedBuilder):
  """Noisy-oracle demonstrations of one task set for one tokenizer (see the module docstring).

  Build with a `DemoSetConfig` and the tokenizer; read back with `load` / `tasks.read_split`
  (no builder class, tokenizer or TensorFlow needed).
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  BUILDER_CONFIG_CLASS = DemoSetConfig

  def __init__(self, *, tokenizer=None, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    self._tokenizer = tokenizer
    self._root = os.fspath(kwargs.get("data_dir") or "")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    return tfds.core.DatasetInfo(
        builder=self, description=cfg.description,
        features=_features(cfg.max_len, cfg.max_turns), disable_shuffling=True,
        metadata=tfds.core.MetadataDict(
            env_name=cfg.env_name, difficulty=cfg.difficulty, tokenizer_name=cfg.tokenizer_name,
            tokenizer_hash=cfg.tokenizer_hash, error_rate=cfg.error_rate,
            recovery_rate=cfg.recovery_rate, task_set=cfg.task_set().name))

  def _split_generators(self, dl_manager):
    del dl_manager
    cfg = self.builder_config
    if self._tokenizer is None:
      raise ValueError("building a demo set needs the tokenizer: DemoSets(tokenizer=..., ...)")
    if tokenizer_fingerprint(self._tokenizer) != cfg.tokenizer_hash:
      raise ValueError(f"this tokenizer's fingerprint is {tokenizer_fingerprint(self._tokenizer)}, "
                       f"the config was made for {cfg.tokenizer_hash}: make the config with "
                       "demo_set_config(..., tokenizer) for the tokenizer you build with")
    ts = cfg.task_set()
    task_dir = task_sets.build(self._root, cfg.env_name, seed=ts.seed, num_train=ts.num_train,
                               num_validation=ts.num_validation, num_test=ts.num_test,
                               **cfg.difficulty)
    env = envs.make(cfg.env_name, self._tokenizer, **cfg.difficulty)
    run = make_runner(env, cfg)   # one compiled runner for both splits
    self._arrays = {split: generate_demos(env, task_sets.read_split(task_dir, split), cfg, i, run)
                    for i, split in enumerate(SPLITS)}
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split):
    arrays = self._arrays[split]
    for i in range(len(arrays["index"])):
      yield i, {k: v[i] for k, v in arrays.items()}


def build(data_dir: str | os.PathLike, env_name: str, tokenizer, **config_kwargs) -> str:
  """Builds (or reuses) the demo set of `demo_set_config(env_name, tokenizer, **config_kwargs)`,
  building its task set under the same data_dir first if needed. Returns the builder directory."""
  config = demo_set_config(env_name, tokenizer, **config_kwargs)
  with task_sets.build_lock(data_dir, "demo_sets", config.name):   # runs sharing the data dir
    builder = DemoSets(data_dir=os.fspath(data_dir), tokenizer=tokenizer, config=config)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS))
  return os.fspath(builder.data_dir)


def builder_dir(data_dir: str | os.PathLike, env_name: str, tokenizer, **config_kwargs) -> str:
  """Where `build` writes that demo set."""
  name = demo_set_config(env_name, tokenizer, **config_kwargs).name
  return os.path.join(os.fspath(data_dir), "demo_sets", name, str(DemoSets.VERSION))


def load(data_dir: str | os.PathLike, env_name: str, tokenizer, split: str,
         **config_kwargs) -> dict[str, np.ndarray]:
  """Reads one split of a built demo set: feature -> [n, ...] numpy arrays, in episode order."""
  path = builder_dir(data_dir, env_name, tokenizer, **config_kwargs)
  if not os.path.isdir(path):
    raise FileNotFoundError(
        f"no demo set at {path}: build it first with jaxagent.data.demos.build("
        f"{os.fspath(data_dir)!r}, {env_name!r}, tokenizer, ...) with the same arguments")
  return task_sets.read_split(path, split)
