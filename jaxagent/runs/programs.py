"""`Programs`: the owner of every compiled function of one (model config, environment).

    programs = programs_for(config, policy.config, policy.tokenizer)
    traj = programs.rollouts(params, key, tasks, group_size, budgets, max_turns=8, mesh=mesh)
    optimizer, update = programs.update(learner_config, total_steps)
    optimizer, step = programs.sft_step(sft_config)
    replay = programs.replay(budget_visible)          # env states before every recorded turn
    act = programs.next_action(max_action_tokens)     # one action from a transcript prefix
    programs.compiles                                 # {"rollout": 2, "update": 1, ...}

Built once per run (or once for all runs of a study, which share the model config and the
environment) and handed to whatever needs a compiled function, so nothing is compiled twice and
nothing is cached at module level. Each function is built on first use for its static settings
(a learner config, a T_max, a prefix width is a shape and traced once by jit).
"""

from __future__ import annotations

import collections

import optax

from jaxagent.learners import sft as sft_lib
from jaxagent.learners.update import LearnerConfig, make_optimizer, make_update_fn
from jaxagent.models.config import ModelConfig
from jaxagent.models.lora import LoraConfig
from jaxagent.rollout import replay as replay_lib
from jaxagent.rollout.api import Rollouts
from jaxagent.runs import setup
from jaxagent.runs.config import SFTConfig


class Programs:
  """Compiled rollouts, updates, SFT steps, replays and next-action functions of one (model
  config, environment); see the module docstring."""

  def __init__(self, model_config: ModelConfig, env, env_spec: tuple = ()):
    self.model_config, self.env, self.env_spec = model_config, env, env_spec
    self.rollouts = Rollouts(model_config, env)
    # One function object for the environment's oracle, so forced-oracle rollouts share one
    # program (rollout programs are built per forced-action function).
    self.oracle = lambda state, key: env.oracle_action(state)
    self._fns: dict = {}
    self._built = collections.Counter()

  def serves(self, model_config: ModelConfig, env_spec: tuple) -> bool:
    """Whether these programs are those of a policy with `model_config` in the environment
    `env_spec` (`runs.setup.env_spec`)."""
    return self.model_config == model_config and self.env_spec == env_spec

  @property
  def compiles(self) -> dict[str, int]:
    """Functions built per kind (a rollout per static rollout config; an update per learner
    config and run length; ...). A loop that never recompiles leaves these unchanged."""
    return {"rollout": self.rollouts.compiles, **self._built}

  def _get(self, kind: str, key, build):
    if (kind, key) not in self._fns:
      self._fns[kind, key] = build()
      self._built[kind] += 1
    return self._fns[kind, key]

  def update(self, learner: LearnerConfig, total_steps: int, lora: LoraConfig | None = None):
    """(optimizer, jitted RL update) for `learner` over a run of `total_steps` optimizer steps
    (the cosine schedule needs them); with `lora` enabled it trains adapters on a frozen base
    (`make_update_fn`)."""
    lora = lora if lora is not None and lora.enabled else None
    def build():
      optimizer = learner.make_optimizer(total_steps=total_steps)
      return optimizer, make_update_fn(learner, self.model_config, optimizer, lora)
    return self._get("update", (learner, total_steps, lora), build)

  def sft_step(self, sft: SFTConfig,
               lora: LoraConfig | None = None) -> tuple[optax.GradientTransformation, object]:
    """(optimizer, jitted SFT step): AdamW with linear warmup and cosine decay over sft.steps;
    with `lora` enabled it trains adapters on a frozen base (`make_sft_step`)."""
    lora = lora if lora is not None and lora.enabled else None
    def build():
      optimizer = make_optimizer(
          learning_rate=sft.learning_rate, schedule="cosine", warmup_steps=sft.warmup_steps,
          total_steps=sft.steps, end_lr_ratio=0.0, weight_decay=sft.weight_decay,
          max_grad_norm=sft.max_grad_norm, b1=0.9, b2=0.999, eps=1e-8)
      return optimizer, sft_lib.make_sft_step(self.model_config, optimizer, lora)
    return self._get("sft_step", (sft, lora), build)

  def replay(self, budget_visible: bool):
    """Jitted replay of recorded actions (`jaxagent.rollout.replay.make_replay_fn`)."""
    return self._get("replay", bool(budget_visible),
                     lambda: replay_lib.make_replay_fn(self.env, bool(budget_visible)))

  def next_action(self, max_action_tokens: int):
    """Jitted next action from a prefix (`jaxagent.rollout.replay.make_next_action_fn`)."""
    a = int(max_action_tokens)
    return self._get("next_action", a,
                     lambda: replay_lib.make_next_action_fn(self.model_config, self.env, a))


def programs_for(config, model_config: ModelConfig, tokenizer,
                 programs: Programs | None = None) -> Programs:
  """`programs` when given (checked to serve this model and the config's environment), else new
  ones for them (the environment built from the config with `tokenizer`)."""
  spec = setup.env_spec(config)
  if programs is None:
    return Programs(model_config, setup.make_env(config, tokenizer), env_spec=spec)
  if not programs.serves(model_config, spec):
    raise ValueError(f"the programs given were built for another model or environment "
                     f"({programs.env_spec}); build them with this config's policy and env")
  return programs
