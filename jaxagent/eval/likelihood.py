"""Log-likelihood analysis: trajectories of policy A scored under policy B (docs/STUDY.md).

For a trajectory tau (row b) and parameters theta, with m_l = loss_mask[b, l] (1 exactly on the
tokens the agent sampled; environment tokens and padding are 0):

    sum_ll(tau; theta)  = sum_l m_l * log p_theta(tokens[l] | tokens[:l])
    mean_ll(tau; theta) = sum_ll / sum_l m_l                      (per agent token)

The cross matrix averages over the N_A trajectories of policy A:

    S[A, B] = (1/N_A) sum_tau sum_ll(tau; theta_B),   M[A, B] = (1/N_A') sum_tau mean_ll(tau; theta_B)

(N_A' counts the trajectories with at least one agent token). Log-probabilities are
log_softmax(logits / T) at the scoring temperature T (T = 0 means 1), the convention of
`jaxagent.models.scoring`, so scoring A's trajectories under A at A's sampling temperature
reproduces their behaviour log-probs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.config import ModelConfig
from jaxagent.models.scoring import token_logprobs


def agent_loglik(logprobs: np.ndarray, loss_mask: np.ndarray) -> dict[str, np.ndarray]:
  """Per trajectory: sum and per-token mean of log-probs over agent tokens only.

  Args:
    logprobs: [B, L] float log p(tokens[l] | prefix).
    loss_mask: [B, L] 1 on agent tokens.
  Returns:
    {"sum": [B], "mean": [B] (NaN where a row has no agent token), "count": [B]} float64.
  """
  lp = np.asarray(logprobs, np.float64)
  m = np.asarray(loss_mask, np.float64)
  s = (lp * m).sum(axis=1)
  c = m.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    mean = np.where(c > 0, s / np.maximum(c, 1), np.nan)
  return {"sum": s, "mean": mean, "count": c}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logprobs(cfg, params, tokens, length, temperature):
  return token_logprobs(cfg, params, tokens, length, temperature)


def fit_batch(rows: int, batch_size: int) -> int:
  """The row batch that scores `rows` rows: batch_size, or for fewer rows their count rounded up
  to a multiple of 8 (few compiled shapes, little padding)."""
  return batch_size if rows >= batch_size else min(batch_size, max(8, -(-rows // 8) * 8))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logprobs_at(cfg, params, tokens, length, temperatures):
  # vmap over the temperatures only: the forward pass does not depend on them and runs once.
  return jax.vmap(lambda t: token_logprobs(cfg, params, tokens, length, t))(temperatures)


def score_rows(mcfg: ModelConfig, params, tokens: np.ndarray, length: np.ndarray,
               temperature: float, batch_size: int) -> np.ndarray:
  """log p(tokens[b, l] | tokens[b, :l]) [B, L] under `params`, in fixed-size row batches (the last
  padded with copies of row 0, dropped), so one compiled program serves any B >= batch_size.
  Fewer rows than batch_size go in one batch of B rounded up to a multiple of 8 (`fit_batch`):
  16 rows padded to a batch of 32 cost what 32 do."""
  return score_rows_at(mcfg, params, tokens, length, [temperature], batch_size)[0]


def score_rows_at(mcfg: ModelConfig, params, tokens: np.ndarray, length: np.ndarray,
                  temperatures, batch_size: int) -> np.ndarray:
  """`score_rows` at several temperatures [K, B, L] from one forward pass per batch (a policy
  scored as itself and as its sharpened self: the same params at two temperatures). One
  temperature runs `score_rows`' own program; K > 1 compiles one more per K."""
  tokens = np.asarray(tokens, np.int32)
  length = np.asarray(length, np.int32)
  temps = [float(t) for t in temperatures]
  b, full = tokens.shape
  batch_size = fit_batch(b, batch_size)
  # Score only the used prefix (rounded up to 128 columns so few shapes compile): rollouts
  # reserve room for the longest turns, most of which is padding.
  keep = min(full, max(128, -(-int(length.max(initial=0)) // 128) * 128))
  tokens = tokens[:, :keep]
  out = []
  for start in range(0, b, batch_size):
    idx = np.arange(start, start + batch_size)
    real = idx < b
    idx = np.where(real, idx, 0)
    args = (mcfg, params, jnp.asarray(tokens[idx]), jnp.asarray(length[idx]))
    if len(temps) == 1:
      lp = _logprobs(*args, jnp.float32(temps[0]))[None]
    else:
      lp = _logprobs_at(*args, jnp.asarray(temps, jnp.float32))
    out.append(np.asarray(lp)[:, real])
  if not out:
    return np.zeros((len(temps), b, full), np.float32)
  return np.pad(np.concatenate(out, axis=1), ((0, 0), (0, 0), (0, full - keep)))


def cross_likelihood(mcfg: ModelConfig, trajectories: dict, params: dict, *, temperature: float,
                     batch_size: int) -> dict:
  """The cross matrix: every policy's trajectories scored under every policy's parameters.

  Args:
    trajectories: label A -> {"tokens": [N_A, L], "length": [N_A], "loss_mask": [N_A, L]}.
    params: label B -> parameters.
  Returns:
    {"rows": [A labels] (trajectories), "cols": [B labels] (scoring policies),
     "sum": [[S[A, B]]], "mean": [[M[A, B]]] (lists of floats),
     "per_trajectory": {A: {B: agent_loglik dict}}  (numpy; for paired comparisons)}.
  """
  rows, cols = list(trajectories), list(params)
  per: dict = {}
  scored: dict = {}
  for a in rows:
    t = trajectories[a]
    per[a] = {}
    for b in cols:
      # Labels sharing one trajectory set and one parameter tree (a base evaluated against
      # itself) are scored once.
      key = (id(t), id(params[b]))
      if key not in scored:
        lp = score_rows(mcfg, params[b], t["tokens"], t["length"], temperature, batch_size)
        scored[key] = agent_loglik(lp, t["loss_mask"])
      per[a][b] = scored[key]
  return {"rows": rows, "cols": cols,
          "sum": [[float(np.mean(per[a][b]["sum"])) for b in cols] for a in rows],
          "mean": [[float(np.nanmean(per[a][b]["mean"])) if np.any(per[a][b]["count"] > 0)
                    else None for b in cols] for a in rows],
          "per_trajectory": per}
