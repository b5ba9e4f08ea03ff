"""The jitted policy-gradient update: `(train_state, trajectory, ref_params) -> (train_state, metrics)`.

    cfg = LearnerConfig.from_config(config.rl.learner)      # unknown keys / names: ValueError
    optimizer = cfg.make_optimizer()
    state = init_train_state(policy.params, optimizer, jax.random.key(0))
    update = make_update_fn(cfg, policy.config, optimizer)
    state, metrics = update(state, trajectory, ref_params)  # ref_params may be None (no KL)

One call: episode rewards -> (optional) equal-group filter -> advantages over the whole batch
(per episode, or per turn with a turn-level estimator of `credit.py`: each turn's action tokens
get their turn's advantage) ->
reference log-probs (once, if a reference is given) -> `lax.scan` over epochs, each a fresh
permutation of the episodes from the state's key, and inside a `lax.scan` over `minibatches`
fixed-size minibatches of B / minibatches episodes: loss and gradient through
`token_logprobs_and_entropy`, optimizer step. The state is donated; nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxagent.learners import credit
from jaxagent.learners.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from jaxagent.learners.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, policy_loss
from jaxagent.learners.rewards import episode_rewards, equal_group_mask
from jaxagent.models import lora as lora_lib
from jaxagent.models.config import ModelConfig
from jaxagent.models.scoring import token_logprobs, token_logprobs_and_entropy
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.sharding import batch_sharding
from jaxagent.sharding.mesh import mesh_context

LR_SCHEDULES = ("constant", "cosine")


@struct.dataclass
class TrainState:
  step: jax.Array    # [] int32 optimizer steps taken (epochs x minibatches per update call)
  params: Any        # pytree of the policy's parameters
  opt_state: Any     # optax state of `params`
  key: jax.Array     # PRNG key; split once per update call (minibatch permutations)


def init_train_state(params, optimizer: optax.GradientTransformation, key: jax.Array,
                     mesh: jax.sharding.Mesh | None = None) -> TrainState:
  """A fresh train state. With a mesh every leaf lives on it: params and the optimizer's moments
  keep the params' shardings, scalars (step, key, counts) are replicated."""
  state = TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params), key=key)
  if mesh is None:
    return state
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  on_mesh = lambda x: (isinstance(x, jax.Array) and hasattr(x.sharding, "mesh")
                       and x.sharding.mesh == mesh)
  return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, rep), state)


BEHAVIOUR_LOGPROBS = ("auto", "rollout", "recompute")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Every knob of the RL update (hashable: a static argument of the jitted update)."""
  # Rewards (rewards.episode_rewards) and the filter of groups whose rewards are all equal.
  success_reward: float = 1.0
  invalid_call_penalty: float = 0.0
  turn_cost: float = 0.0
  filter_equal_groups: bool = False
  # Process rewards per turn (credit.py; 0 = off): a valid call, the oracle's action, an error.
  process_valid_call: float = 0.0
  process_oracle_match: float = 0.0
  process_error: float = 0.0
  # Advantages: a registered estimator, per episode (advantages.py: grpo, rloo, reinforce) or per
  # turn (credit.py: gigpo, per_turn); std normalisation (grpo, reinforce and the turn-level ones).
  advantage: str = "grpo"
  normalize_std: bool = True
  advantage_eps: float = 1e-6
  # Turn-level estimators: discount of the reward-to-go per turn, and gigpo's weight of the
  # step (anchor-state) advantage added to the episode advantage.
  gamma: float = 1.0
  step_weight: float = 1.0
  # Policy loss (losses.py): a registered loss, clip range [1 - low, 1 + high], aggregation.
  loss: str = "ppo_clip"
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  aggregation: str = "token"
  # KL to the frozen reference (used when the update is given ref_params) and entropy bonus.
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  # Passes over each batch and minibatches per pass (B must be divisible by minibatches).
  epochs: int = 1
  minibatches: int = 1
  # Temperature of the recomputed log-probs (the rollout's sampling temperature) and the
  # sequence chunk of the log-softmax (memory: B x chunk x V logits at a time).
  temperature: float = 1.0
  logprob_chunk: int = 128
  # The old log-probs of the PPO ratio: "rollout" (the rollout's behaviour log-probs), "recompute"
  # (the update's own forward with the parameters the batch was sampled with, so the ratio starts
  # at exactly 1) or "auto" (recompute where the compute dtype is not float32: in bfloat16 the
  # rollout's cached decode and the update's full forward round differently, e.g. up to 5e-3
  # nats per token on builtin:micro, and the ratio would start off 1 by that much).
  behaviour_logprobs: str = "auto"
  # Optimizer (make_optimizer): AdamW, linear warmup then constant or cosine, global-norm clip.
  # The run's total optimizer steps (for the cosine decay) is the loop's to give:
  # `make_optimizer(total_steps=rl_steps * optimizer_steps_per_update)`.
  learning_rate: float = 1e-5
  schedule: str = "constant"
  warmup_steps: int = 0
  end_lr_ratio: float = 0.0     # cosine: final lr = learning_rate * end_lr_ratio
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0    # 0 disables clipping
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8

  def __post_init__(self):
    estimators = {**ADVANTAGE_ESTIMATORS, **credit.TURN_ADVANTAGE_ESTIMATORS}
    for field, table in (("advantage", estimators), ("loss", POLICY_LOSSES),
                         ("kl_estimator", KL_ESTIMATORS), ("aggregation", AGGREGATIONS),
                         ("schedule", LR_SCHEDULES)):
      value = getattr(self, field)
      if value not in table:
        raise ValueError(f"learner config: unknown {field} {value!r}; valid: "
                         f"{', '.join(sorted(table))}")
    if self.behaviour_logprobs not in BEHAVIOUR_LOGPROBS:
      raise ValueError(f"learner config: unknown behaviour_logprobs {self.behaviour_logprobs!r}; "
                       f"valid: {', '.join(BEHAVIOUR_LOGPROBS)}")
    for field in ("epochs", "minibatches", "logprob_chunk"):
      if getattr(self, field) < 1:
        raise ValueError(f"learner config: {field} must be >= 1, got {getattr(self, field)}")
    if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
      raise ValueError(f"learner config: need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got "
                       f"{self.clip_eps_low}, {self.clip_eps_high}")
    if self.warmup_steps < 0:
      raise ValueError(f"learner config: warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0.0 <= self.gamma <= 1.0:
      raise ValueError(f"learner config: gamma must be in [0, 1], got {self.gamma}")

  @property
  def turn_level(self) -> bool:
    """Whether the advantage estimator gives one value per turn (credit.py)."""
    return self.advantage in credit.TURN_ADVANTAGE_ESTIMATORS

  @property
  def process(self) -> dict:
    return dict(process_valid_call=self.process_valid_call,
                process_oracle_match=self.process_oracle_match, process_error=self.process_error)

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> "LearnerConfig":
    """From a dict or ml_collections ConfigDict of any subset of the fields (the rest keep
    their defaults). Unknown keys, wrongly typed values and unknown registry names raise
    ValueError naming the valid ones."""
    items = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(items) - set(fields))
    if unknown:
      raise ValueError(f"learner config: unknown keys {unknown}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, value in items.items():
      kind = type(fields[name].default)
      ok = (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            or kind is float and isinstance(value, int) and not isinstance(value, bool))
      if not ok:
        raise ValueError(f"learner config: {name} must be a {kind.__name__}, got {value!r}")
      kwargs[name] = kind(value)
    return cls(**kwargs)

  @property
  def optimizer_steps_per_update(self) -> int:
    """Optimizer steps one update call takes: epochs x minibatches."""
    return self.epochs * self.minibatches

  def make_optimizer(self, total_steps: int = 0) -> optax.GradientTransformation:
    """`make_optimizer` with this config's knobs; total_steps: the run's optimizer steps
    (needed by the cosine schedule only)."""
    return make_optimizer(learning_rate=self.learning_rate, schedule=self.schedule,
                          warmup_steps=self.warmup_steps, total_steps=total_steps,
                          end_lr_ratio=self.end_lr_ratio, weight_decay=self.weight_decay,
                          max_grad_norm=self.max_grad_norm, b1=self.adam_b1, b2=self.adam_b2,
                          eps=self.adam_eps)


def lr_schedule_fn(learning_rate: float, *, schedule: str, warmup_steps: int,
                   total_steps: int, end_lr_ratio: float):
  """Step t (0-based optimizer step) -> learning rate:

      warmup  lr_t = lr * (t + 1) / warmup_steps                      for t < warmup_steps
      constant lr_t = lr                                               after the warmup
      cosine   lr_t = lr * (e + (1 - e) * (1 + cos(pi * p)) / 2),      p = min(1, (t - w) / (N - w))
               e = end_lr_ratio, w = warmup_steps, N = total_steps (lr_t = lr * e from t = N on)
  """
  if schedule not in LR_SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  if schedule == "cosine" and total_steps <= warmup_steps:
    raise ValueError(f"the cosine schedule needs total_steps > warmup_steps (optimizer steps of "
                     f"the run), got total_steps={total_steps}, warmup_steps={warmup_steps}")

  def lr_at(t):
    t = jnp.asarray(t, jnp.float32)
    warm = jnp.minimum(1.0, (t + 1.0) / max(warmup_steps, 1)) if warmup_steps else 1.0
    if schedule == "constant":
      return learning_rate * jnp.asarray(warm, jnp.float32)
    p = jnp.clip((t - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
    cos = end_lr_ratio + (1.0 - end_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p))
    return learning_rate * jnp.where(t < warmup_steps, warm, cos)

  return lr_at


def decay_mask(params):
  """True on parameters that get weight decay: all but norms and biases."""
  def keep(path, _):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return not ("norm" in name or "bias" in name)
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(*, learning_rate: float, schedule: str, warmup_steps: int, total_steps: int,
                   end_lr_ratio: float, weight_decay: float, max_grad_norm: float, b1: float,
                   b2: float, eps: float) -> optax.GradientTransformation:
  """AdamW (decoupled weight decay, not on norms/biases) after global-norm gradient clipping,
  with the schedule of `lr_schedule_fn` (total_steps: the run's optimizer steps, cosine only).
  Every argument is required (the defaults live in the config: LearnerConfig.make_optimizer, or
  configs/default.py's sections).
  The current learning rate lives in the state (`current_learning_rate(opt_state)`), so the
  jitted update can report it.

      g <- g * min(1, max_grad_norm / ||g||);  u = adam(g) + weight_decay * p;  p <- p - lr_t * u
  """
  lr_fn = lr_schedule_fn(learning_rate, schedule=schedule, warmup_steps=warmup_steps,
                         total_steps=total_steps, end_lr_ratio=end_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(max_grad_norm) if max_grad_norm > 0 else optax.identity(),
      optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=lr_fn),
  )


def current_learning_rate(opt_state) -> jax.Array:
  """The learning rate of the last step taken (0 before any) from a `make_optimizer` state."""
  return optax.tree_utils.tree_get(opt_state, "learning_rate",
                                   filtering=lambda _, v: isinstance(v, jax.Array))


@struct.dataclass
class _Batch:
  """What the loss needs of each episode; row-gathered into minibatches."""
  tokens: jax.Array              # [B, L] int32
  length: jax.Array              # [B] int32
  loss_mask: jax.Array           # [B, L] float32
  behaviour_logprobs: jax.Array  # [B, L] float32
  advantages: jax.Array          # [B] float32 per episode, or [B, L] per token (turn-level)
  weight: jax.Array              # [B] float32 (equal-group filter; all 1 without it)
  ref_logprobs: jax.Array | None  # [B, L] float32, or None without a reference


def make_update_fn(cfg: LearnerConfig, model_cfg: ModelConfig,
                   optimizer: optax.GradientTransformation,
                   lora: lora_lib.LoraConfig | None = None):
  """The jitted update `(train_state, trajectory, ref_params_or_None) -> (train_state, metrics)`.

  With `lora` enabled (rank > 0) the train state's params are the adapters only
  (`lora.init_adapters`) and every call takes the frozen base: `update(state, traj, base=base)`;
  gradients and optimizer state exist for the adapters alone, and the base is read in place,
  never donated or copied. The KL reference is then the base itself, adapters off (pass no
  ref_params): RL with LoRA holds one copy of the base. Adapter dropout draws from the state's
  key per minibatch.

  The train state is donated, so ref_params must not share buffers with it (keep the
  reference, train a copy: `init_train_state(jax.tree.map(jnp.copy, params), ...)`).
  Each call takes `cfg.epochs * cfg.minibatches` optimizer steps (B must be divisible by
  `cfg.minibatches`). With ref_params, the reference log-probs are computed once and the KL
  term (kl_coef) enters the loss; without, kl_coef must be 0.
  Metrics [] float32: the loss metrics (`losses.policy_loss`) and loss, grad_norm (before
  clipping), averaged over the steps; learning_rate of the last step; reward_mean, reward_std,
  advantage_mean, advantage_abs_mean and kept_fraction (episode weight mean) of the batch;
  behaviour_logprob_gap (mean |rollout - recomputed| old log-prob per agent token) where the old
  log-probs are recomputed (`LearnerConfig.behaviour_logprobs`). Deterministic given the state's
  key.

  On a mesh (the trajectory's or else the parameters' NamedSharding), every minibatch is split
  over (data, fsdp) by the `batch` rule: the random-permutation gather that forms it would
  otherwise leave it replicated, and every device would run the whole minibatch.
  """

  adapters_only = lora is not None and lora.enabled
  # The forward's parameters: the adapters joined to the frozen base, or the params themselves.
  forward_params = ((lambda p, base, key=None: lora_lib.attach(base, p, lora, key))
                    if adapters_only else (lambda p, base, key=None: p))
  recompute_behaviour = cfg.behaviour_logprobs == "recompute" or (
      cfg.behaviour_logprobs == "auto" and model_cfg.jnp_dtype != jnp.float32)

  def loss_fn(params, mb: _Batch, base, key):
    logp, entropy = token_logprobs_and_entropy(model_cfg, forward_params(params, base, key),
                                               mb.tokens, mb.length,
                                               cfg.temperature, cfg.logprob_chunk)
    loss, metrics = policy_loss(
        logp, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, loss=cfg.loss,
        aggregation=cfg.aggregation, clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high, ref_logp=mb.ref_logprobs, kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator, entropy=entropy, entropy_coef=cfg.entropy_coef,
        episode_weight=mb.weight)
    return loss, dict(metrics, loss=loss)

  def update(state: TrainState, traj: Trajectory, ref_params=None, mesh=None, ref_on_host=False,
             base=None):
    b = traj.batch_size
    if adapters_only != (base is not None):
      raise ValueError("LoRA training takes the frozen base (update(state, traj, base=params), "
                       "with adapters as the state's params); full fine-tuning takes no base")
    if adapters_only and ref_params is None and cfg.kl_coef != 0:
      ref_params = base                   # the reference for free: the base, adapters off
    if b % cfg.minibatches:
      raise ValueError(f"batch of {b} episodes is not divisible into {cfg.minibatches} "
                       "minibatches; change learner.minibatches or the batch size")
    if ref_params is None and cfg.kl_coef != 0:
      raise ValueError(f"kl_coef={cfg.kl_coef} needs reference parameters; pass ref_params "
                       "or set kl_coef=0")
    outcome = dict(success_reward=cfg.success_reward,
                   invalid_call_penalty=cfg.invalid_call_penalty, turn_cost=cfg.turn_cost)
    extra_metrics = {}
    if cfg.turn_level:
      r_bt = credit.turn_rewards(traj, **outcome, **cfg.process)                      # [B, T]
      rewards = jnp.sum(r_bt, axis=1)                                                  # [B]
    else:
      rewards = episode_rewards(traj, **outcome)                                       # [B]
      if any(cfg.process.values()):
        rewards = rewards + credit.process_rewards(traj, **cfg.process)
    weight = (equal_group_mask(rewards, traj.group_id, b) if cfg.filter_equal_groups
              else jnp.ones((b,), jnp.float32))                                          # [B]
    if cfg.turn_level:
      adv_bt, extra_metrics = credit.compute_turn_advantages(
          cfg.advantage, r_bt, traj.acted, traj.state_id, traj.group_id, num_groups=b,
          normalize_std=cfg.normalize_std, eps=cfg.advantage_eps, gamma=cfg.gamma,
          step_weight=cfg.step_weight)                                                 # [B, T]
      adv = credit.token_advantages(adv_bt, traj.turn_of_token)                        # [B, L]
      steps = jnp.maximum(jnp.sum(traj.acted), 1)
      adv_mean = jnp.sum(adv_bt) / steps
      adv_abs_mean = jnp.sum(jnp.abs(adv_bt)) / steps
    else:
      adv = compute_advantages(cfg.advantage, rewards, traj.group_id, num_groups=b,
                               normalize_std=cfg.normalize_std, eps=cfg.advantage_eps)   # [B]
      adv_mean, adv_abs_mean = jnp.mean(adv), jnp.mean(jnp.abs(adv))
    ref_logp = None
    if ref_params is not None:
      if ref_on_host:       # offloaded to host memory between updates: to the device for the pass
        ref_params = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), ref_params)
      ref_logp = jax.lax.stop_gradient(token_logprobs(
          model_cfg, ref_params, traj.tokens, traj.length, cfg.temperature, cfg.logprob_chunk))
    behaviour = traj.behaviour_logprobs
    if recompute_behaviour:        # the same forward as the loss's, before any step
      behaviour = jax.lax.stop_gradient(token_logprobs(
          model_cfg, forward_params(state.params, base), traj.tokens, traj.length,
          cfg.temperature, cfg.logprob_chunk))
      mask = traj.loss_mask.astype(jnp.float32)
      extra_metrics["behaviour_logprob_gap"] = jnp.sum(
          jnp.abs(behaviour - traj.behaviour_logprobs) * mask) / jnp.maximum(jnp.sum(mask), 1)
    batch = _Batch(tokens=traj.tokens, length=traj.length,
                   loss_mask=traj.loss_mask.astype(jnp.float32),
                   behaviour_logprobs=behaviour, advantages=adv, weight=weight,
                   ref_logprobs=ref_logp)
    key, perm_key = jax.random.split(state.key)
    mb_size = b // cfg.minibatches

    def minibatch_step(carry, idx_key):                  # idx [mb_size] episode rows
      params, opt_state = carry
      idx, drop_key = idx_key
      mb = jax.tree.map(lambda x: x[idx], batch)
      if mesh is not None:
        mb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, batch_sharding(mesh, x.ndim, mb_size)), mb)
      (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, base,
                                                                       drop_key)
      metrics["grad_norm"] = optax.tree.norm(grads)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), metrics

    def epoch(carry, ekey):
      perm = jax.random.permutation(ekey, b).reshape(cfg.minibatches, mb_size)
      drop_keys = jax.random.split(jax.random.fold_in(ekey, 1), cfg.minibatches)
      return jax.lax.scan(minibatch_step, carry, (perm, drop_keys))

    (params, opt_state), metrics = jax.lax.scan(
        epoch, (state.params, state.opt_state), jax.random.split(perm_key, cfg.epochs))
    metrics = jax.tree.map(jnp.mean, metrics)             # [epochs, minibatches] -> []
    metrics.update(
        learning_rate=current_learning_rate(opt_state).astype(jnp.float32),
        reward_mean=jnp.mean(rewards), reward_std=jnp.std(rewards),
        advantage_mean=adv_mean, advantage_abs_mean=adv_abs_mean,
        kept_fraction=jnp.mean(weight), **extra_metrics)
    new_state = TrainState(step=state.step + cfg.epochs * cfg.minibatches, params=params,
                           opt_state=opt_state, key=key)
    return new_state, metrics

  return _MeshUpdate(jax.jit(update, donate_argnums=0, static_argnums=(3, 4)))


HOST_MEMORY = "pinned_host"


def offload_to_host(tree):
  """The arrays of `tree` moved to host memory (pinned_host), each keeping its sharding's layout
  over devices: the frozen reference policy of the KL term costs no device memory between
  updates, and the update moves it back for its reference pass."""
  return jax.tree.map(
      lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY)), tree)


def on_host(tree) -> bool:
  """Whether the arrays of `tree` live in host memory (see `offload_to_host`)."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(
      getattr(getattr(x, "sharding", None), "memory_kind", None) == HOST_MEMORY for x in leaves)


def _mesh_of(*trees):
  """The mesh of the first leaf (in order) with a multi-device NamedSharding, or None."""
  for tree in trees:
    for x in jax.tree.leaves(tree):
      s = getattr(x, "sharding", None)
      if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
        return s.mesh
  return None


class _MeshUpdate:
  """The jitted update, called with the mesh of its inputs as a static argument (one compiled
  program per mesh)."""

  def __init__(self, jitted):
    self._jitted = jitted

  def _args(self, state, traj, ref_params=None, base=None):
    return (state, traj, ref_params, _mesh_of(traj.tokens, state.params, base),
            on_host(ref_params), base)

  def __call__(self, state: TrainState, traj: Trajectory, ref_params=None, base=None):
    args = self._args(state, traj, ref_params, base)
    with mesh_context(args[3]):          # the decoder keeps activations split over the batch
      return self._jitted(*args)

  def lower(self, state: TrainState, traj: Trajectory, ref_params=None, base=None):
    args = self._args(state, traj, ref_params, base)
    with mesh_context(args[3]):
      return self._jitted.lower(*args)

  def _cache_size(self) -> int:
    return self._jitted._cache_size()
