"""Policy-gradient losses, registered by name, with optional KL and entropy terms.

Per agent token (loss_mask 1) with current log-prob logp, behaviour log-prob (the rollout's)
logp_old, the advantage A of its episode (or of its turn, with turn-level credit), and ratio rho = exp(logp - logp_old):

    reinforce   l = -A * logp
    ppo_clip    l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
                (eps_low != eps_high is the asymmetric "clip-higher" variant)

Optional terms, per token, against a frozen reference policy's log-prob ref:

    k1  kl = logp - ref                                (unbiased for KL(pi || ref), can be < 0)
    k3  kl = exp(ref - logp) - (ref - logp) - 1        (unbiased, always >= 0; GRPO's choice)
    l_total = l + kl_coef * kl - entropy_coef * H      (H: entropy of the token's distribution)

Aggregation over a minibatch of B episodes, with m[b, t] = loss_mask[b, t] and an optional
per-episode weight w[b] (the equal-group filter):

    token     sum_{b,t} w_b m_bt l_bt / sum_{b,t} w_b m_bt          (every agent token counts 1)
    sequence  sum_b w'_b mean_t(l_b) / sum_b w'_b,   mean_t(l_b) = sum_t m_bt l_bt / sum_t m_bt,
              w'_b = w_b [sum_t m_bt > 0]                           (every episode counts 1)

An empty denominator (no agent token, or every weight 0) gives 0, not NaN.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token", "sequence")


class PolicyLossFn(Protocol):
  def __call__(self, logp: jax.Array, behaviour_logp: jax.Array, adv: jax.Array, *,
               clip_eps_low: float, clip_eps_high: float) -> tuple[jax.Array, jax.Array]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}
KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
  """Decorator: registers a per-token loss
  `fn(logp, behaviour_logp, adv, *, clip_eps_low, clip_eps_high) -> (loss [B, L], clipped [B, L])`
  (`clipped`: 1.0 where the token's gradient was cut by clipping, for the clip fraction)."""
  def deco(fn):
    if name in POLICY_LOSSES:
      raise ValueError(f"policy loss {name!r} is already registered")
    POLICY_LOSSES[name] = fn
    return fn
  return deco


def _lookup(table: dict, kind: str, name: str):
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}")
  return table[name]


def get_policy_loss(name: str) -> PolicyLossFn:
  return _lookup(POLICY_LOSSES, "policy loss", name)


def get_kl_estimator(name: str):
  return _lookup(KL_ESTIMATORS, "KL estimator", name)


@register_policy_loss("reinforce")
def reinforce_loss(logp, behaviour_logp, adv, *, clip_eps_low, clip_eps_high):
  """l = -A * logp (on-policy; the behaviour log-probs are not used)."""
  del behaviour_logp, clip_eps_low, clip_eps_high
  return -adv * logp, jnp.zeros_like(logp)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp, behaviour_logp, adv, *, clip_eps_low, clip_eps_high):
  """l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - logp_old).

  The clipped branch is the minimum exactly when rho > 1 + eps_high with A > 0, or
  rho < 1 - eps_low with A < 0; there the gradient is 0 (`clipped` = 1).
  """
  ratio = jnp.exp(logp - behaviour_logp)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
  return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


def _register_kl(name):
  def deco(fn):
    KL_ESTIMATORS[name] = fn
    return fn
  return deco


@_register_kl("k1")
def kl_k1(logp, ref_logp):
  """k1 = logp - ref."""
  return logp - ref_logp


@_register_kl("k3")
def kl_k3(logp, ref_logp):
  """k3 = exp(ref - logp) - (ref - logp) - 1 >= 0."""
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def aggregate(x_bl: jax.Array, loss_mask_bl: jax.Array, episode_weight_b: jax.Array | None,
              aggregation: str) -> jax.Array:
  """Masked mean [] of per-token values x [B, L] ("token" or "sequence"; module docstring)."""
  m = loss_mask_bl.astype(jnp.float32)
  w = jnp.ones(m.shape[:1], jnp.float32) if episode_weight_b is None else episode_weight_b
  if aggregation == "token":
    wm = m * w[:, None]
    return jnp.sum(x_bl * wm) / jnp.maximum(jnp.sum(wm), 1e-8)
  if aggregation == "sequence":
    n_b = jnp.sum(m, axis=1)
    per_episode = jnp.sum(x_bl * m, axis=1) / jnp.maximum(n_b, 1.0)
    w = w * (n_b > 0)
    return jnp.sum(per_episode * w) / jnp.maximum(jnp.sum(w), 1e-8)
  raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")


def policy_loss(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                loss_mask: jax.Array, *, loss: str, aggregation: str, clip_eps_low: float,
                clip_eps_high: float, kl_coef: float, kl_estimator: str, entropy_coef: float,
                ref_logp: jax.Array | None = None, entropy: jax.Array | None = None,
                episode_weight: jax.Array | None = None):
  """The total loss [] and its metrics.

  The knobs (loss .. entropy_coef) are required: their defaults live in the config
  (LearnerConfig, configs/default.py).

  Args:
    logp, behaviour_logp, loss_mask: [B, L] float32 (current / rollout log-probs, agent tokens).
    advantages: [B] float32, one per episode, broadcast to its tokens; or [B, L], one per token
      (turn-level credit: each turn's action tokens carry their turn's advantage).
    loss: a registered policy loss ("reinforce", "ppo_clip").
    aggregation: "token" or "sequence".
    clip_eps_low, clip_eps_high: the clip range [1 - low, 1 + high] (ppo_clip).
    kl_coef, kl_estimator: weight and registered estimator ("k1", "k3") of the KL term.
    entropy_coef: weight of the entropy bonus.
    ref_logp: [B, L] reference log-probs; the KL term is added (kl_coef * kl) when given.
    entropy: [B, L] per-token entropy; the bonus (-entropy_coef * H) is added when given.
    episode_weight: [B] float32 (e.g. `rewards.equal_group_mask`), default all 1.

  Returns:
    (loss [], metrics): pg_loss, kl (0 without ref_logp), entropy (0 without entropy),
    clip_fraction (share of agent tokens whose gradient clipping cut), approx_kl (k3 estimate of
    KL(behaviour || current) = mean(rho - 1 - log rho)), ratio_mean; each aggregated like the loss.
  """
  pg_fn = get_policy_loss(loss)
  agg = lambda x: aggregate(x, loss_mask, episode_weight, aggregation)
  adv_bl = advantages[:, None] if advantages.ndim == 1 else advantages
  pg_bl, clipped_bl = pg_fn(logp, behaviour_logp, adv_bl,
                            clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
  pg = agg(pg_bl)
  total = pg
  kl = jnp.float32(0.0)
  if ref_logp is not None:
    kl = agg(get_kl_estimator(kl_estimator)(logp, ref_logp))
    total = total + kl_coef * kl
  ent = jnp.float32(0.0)
  if entropy is not None:
    ent = agg(entropy)
    total = total - entropy_coef * ent
  log_ratio = jax.lax.stop_gradient(logp - behaviour_logp)
  ratio = jnp.exp(log_ratio)
  metrics = dict(pg_loss=pg, kl=kl, entropy=ent, clip_fraction=agg(clipped_bl),
                 approx_kl=agg(ratio - 1.0 - log_ratio), ratio_mean=agg(ratio))
  return total, metrics
