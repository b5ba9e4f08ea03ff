"""Setting up a run from its config: the policy on its mesh, the environment, the fixed task
splits and the SFT demonstrations. Training, evaluation and the study all start here.

    policy = load_policy(config)                       # config.model, config.mesh, num_devices
    env = make_env(config, policy.tokenizer)           # config.env
    run = run_config(config)                           # the typed sections (runs.config)
    tasks = load_tasks(run.data, run.env, workdir, "test")   # built into the data dir on first use
    demos = load_demos(run.data, run.env, workdir, policy.tokenizer, "train", seed=run.run.seed)
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import jaxagent.envs as envs
from jaxagent.data import demos as demo_data
from jaxagent.data import tasks as task_data
from jaxagent.models import ModelConfig, Policy, attention, from_pretrained, gguf_io
from jaxagent.models.policy import gguf_base_needs_gguf, load_config_and_tokenizer, resolve_path
from jaxagent.rollout.api import max_transcript_len
from jaxagent.runs import layout
from jaxagent.runs.config import ConfigError, DataConfig, EnvConfig, rl_config
from jaxagent.sharding import distributed, make_mesh


def run_mesh(config: ml_collections.ConfigDict):
  """The mesh of `config_devices(config)` with config.mesh's axis sizes."""
  return make_mesh(dict(config.mesh), devices=config_devices(config))


def load_policy(config: ml_collections.ConfigDict) -> Policy:
  """The config's model (config.model.path, dtypes) on `run_mesh(config)`. Damaged checkpoint
  files and non-finite weights raise CheckpointError (config.model.allow_nonfinite_weights: warn
  instead)."""
  mesh = run_mesh(config)
  return from_pretrained(config.model.path, dtype=config.model.dtype, mesh=mesh,
                         param_dtype=config.model.param_dtype,
                         allow_nonfinite=config.model.allow_nonfinite_weights,
                         attention=config.model.get("attention") or None,
                         gguf_blocks=gguf_blocks(config))


def gguf_blocks(config) -> bool:
  """Whether the config holds its LoRA base in a GGUF file's blocks (config.model.lora.base_dtype
  "gguf" with rank > 0); ConfigError naming the fix when config.model.path is no .gguf file."""
  lora = config.model.get("lora")
  if lora is None or not lora.get("rank") or lora.get("base_dtype") != "gguf":
    return False
  if not gguf_io.is_gguf(resolve_path(config.model.path)):
    raise ConfigError(gguf_base_needs_gguf(config.model.path))
  return True


def config_devices(config) -> list:
  """The first config.num_devices devices (0: all); more than there are is a ConfigError (it
  ran on fewer without a word)."""
  n, have = config.num_devices, jax.device_count()
  if n > have:
    raise ConfigError(f"config.num_devices={n}, but this process sees {have} device(s) "
                      f"({jax.devices()[0].platform}); set --config.num_devices={have} or 0 (all)")
  return jax.devices()[:n or None]


def preflight(config) -> None:
  """What needs the model's config and tokenizer (not its weights), checked before any compute
  and before the run's config is pinned: the model path, the device count, the attention path
  (a bad JAXAGENT_CACHE_ATTENTION, or "kernel" where the CPU kernel cannot be built), and that
  the RL budget's rollouts fit the model's context (`check_context`)."""
  config_devices(config)
  model_config, tokenizer = load_skeleton(config)     # a mistyped model path raises here
  gguf_blocks(config)                                 # base_dtype "gguf" on a non-GGUF path
  attention.kernel_enabled(model_config.attention)    # "kernel" without a compiler raises here
  if config.rl.steps > 0:
    c = rl_config(config)
    check_context(model_config, make_env(config, tokenizer), c.budget.max_turns,
                  c.max_action_tokens, "config.rl.budget / config.rl.max_action_tokens")


def load_skeleton(config) -> tuple[ModelConfig, object]:
  """(model config, tokenizer) of the config's model without its weights: what `load_policy`
  gives `policy.config` and `policy.tokenizer`."""
  return load_config_and_tokenizer(config.model.path, dtype=config.model.dtype,
                                   param_dtype=config.model.param_dtype,
                                   attention=config.model.get("attention") or None)


def env_spec(config) -> tuple[str, tuple]:
  """(name, sorted knobs): what identifies the config's environment for one tokenizer."""
  return config.env.name, tuple(sorted(dict(config.env.difficulty).items()))


def make_env(config, tokenizer):
  """A new environment of the config (config.env.name with config.env.difficulty's knobs; the
  name is checked with the rest of the config, `jaxagent.runs.config.validate`)."""
  return envs.make(config.env.name, tokenizer, **dict(config.env.difficulty))


def check_context(model_config: ModelConfig, env, max_turns: int, max_action_tokens: int,
                  what: str) -> int:
  """The most tokens a rollout of `max_turns` turns can hold (the prompt and every turn at its
  longest; the KV capacity, `default_context_len`, rounds this up); raises ConfigError when it
  exceeds the model's max_position_embeddings (positions past it were never trained). `what`
  names the keys that set it."""
  need = max_transcript_len(env, max_turns, max_action_tokens or env.max_action_len)
  have = model_config.max_position_embeddings
  if need > have:
    raise ConfigError(f"{what}: a rollout of {max_turns} turns needs up to {need} tokens of "
                      f"context, more than the model's max_position_embeddings ({have}); lower "
                      "the budget or the tokens per turn, or use a model with a longer context")
  return need


def build_once(name: str, build) -> None:
  """Runs `build()` (writing a dataset into the shared data dir) on the primary process only;
  on a multi-host job the others wait for it at a barrier, then read what it wrote."""
  if jax.process_count() > 1:
    if distributed.is_primary():
      build()
    multihost_utils.sync_global_devices(f"jaxagent data: {name}")
  else:
    build()


def task_kwargs(data: DataConfig, env: EnvConfig) -> dict:
  """The keyword arguments that name a task set (`jaxagent.data.tasks.task_set_config`)."""
  return dict(seed=data.seed, num_train=data.num_train, num_validation=data.num_validation,
              num_test=data.num_test, **env.knobs)


def load_tasks(data: DataConfig, env: EnvConfig, workdir, split: str) -> dict[str, np.ndarray]:
  """The fixed task split of config.data's sizes and seed in config.env's environment, as numpy
  arrays (built into the data dir, `layout.data_dir`, on first use)."""
  d = layout.data_dir(data, workdir)
  build_once("tasks", lambda: task_data.build(d, env.name, **task_kwargs(data, env)))
  return task_data.load(d, env.name, split, **task_kwargs(data, env))


def demo_kwargs(data: DataConfig, env: EnvConfig, seed: int) -> dict:
  """The keyword arguments that name a demonstration set (`jaxagent.data.demos`); `seed` is the
  run's (config.seed), which draws the demonstrations' noise."""
  return dict(task_seed=data.seed, num_train=data.num_train, num_validation=data.num_validation,
              num_test=data.num_test, error_rate=data.demo_error_rate,
              recovery_rate=data.demo_recovery_rate, max_turns=data.demo_max_turns,
              max_len=data.demo_max_len, seed=seed,
              episodes_per_task=data.demo_episodes_per_task, **env.knobs)


def load_demos(data: DataConfig, env: EnvConfig, workdir, tokenizer, split: str, *,
               seed: int) -> dict[str, np.ndarray]:
  """Noisy-oracle demonstrations (built on first use), token arrays cut to the longest one
  (rounded up to a multiple of 64). seed: the run's seed (config.seed)."""
  d = layout.data_dir(data, workdir)
  kwargs = demo_kwargs(data, env, seed)
  build_once("demos", lambda: demo_data.build(d, env.name, tokenizer, **kwargs))
  arrays = demo_data.load(d, env.name, tokenizer, split, **kwargs)
  keep = -(-int(arrays["length"].max()) // 64) * 64
  for k in ("tokens", "loss_mask", "turn_of_token"):
    arrays[k] = arrays[k][:, :keep]
  return arrays
