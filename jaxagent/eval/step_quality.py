"""Step-level action quality: each policy's next action on fixed reference states (docs/STUDY.md).

A *reference state* is a prefix of a recorded episode: for an acted turn t of row b it is

    transcript  tokens[b, :turn_start[b, t]]      (everything before the turn's action), and
    env state   s_t = step(... step(reset(task_b, budget_b), a_0) ..., a_{t-1})

where a_i = action_tokens[b, i, :action_tokens_len[b, i]] are the actions the environment
received. The env state is rebuilt by replaying those actions (no model), so any recorded
Trajectory — oracle, base policy, a hand-built one — yields states.

A policy's *next action* at a state: prefill the prefix into a fresh KV cache, decode one action
and step the env state with it; the step's info says whether the action is a valid call and
whether it equals the oracle's action in s_t (`info.oracle_match`). Greedy (temperature 0) and
sampled decoding share one compiled function (the sampling config is traced).

The compiled functions are not built here: the caller passes them in, built once by their owner
(`jaxagent.runs.programs.Programs`) from the rollout layer's factories,
`jaxagent.rollout.replay.make_replay_fn(env, budget_visible)` (the replay; budget visibility is
baked in) and `jaxagent.rollout.replay.make_next_action_fn(model_config, env, max_action_tokens)`
(the next action). This module batches states through them and computes the rates.

Quality over a set S of states (per policy, per decoding mode):

    valid_rate  = |{s in S : valid_call(s)}| / |S|
    oracle_rate = |{s in S : oracle_match(s)}| / |S|
    oracle_prob = sum_{s in S} p_policy(oracle action + <eot> | s) / |S|   (expected match)
    entropy     = sum_{s in S} sum_i H_i(s) / sum_{s in S} (tokens sampled at s)   (nats/token)

reported overall, by source of the prefixes (oracle / base) and by environment, each with a
percentile bootstrap interval that resamples tasks (`jaxagent.eval.evidence`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.envs.base import ErrorKind
from jaxagent.eval import evidence
from jaxagent.models import sampler
from jaxagent.rollout.replay import NextActionFn

MODES = ("greedy", "sampled")
# The next-action outcomes `next_actions` returns, with their dtypes.
FIELDS = {"valid_call": bool, "oracle_match": bool, "error_kind": np.int32, "length": np.int32,
          "tokens": np.int32, "entropy": np.float32, "scored": np.int32,
          "oracle_logp": np.float32}


# ---- reference states ---------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceStates:
  """N reference states of one environment (host arrays; the env state's PRNG keys, if any, are
  jax arrays)."""
  prefix: np.ndarray           # [N, P] int32 transcript prefix (pad after prefix_len)
  prefix_len: np.ndarray       # [N] int32
  env_state: Any               # the env's state pytree, leaves [N, ...]
  row: np.ndarray              # [N] int32 row of the source trajectory
  turn: np.ndarray             # [N] int32 turn t (0-based) whose action the state precedes
  prev_error_kind: np.ndarray  # [N] int32 ErrorKind of turn t-1's action (NONE at t = 0)
  source: np.ndarray           # [N] str where the prefixes come from ("oracle", "base", ...)
  task: np.ndarray             # [N] int32 task of the source row (traj.task_id): the unit
                               # every interval resamples

  def __len__(self) -> int:
    return int(self.prefix_len.shape[0])


def replay_env_states(replay_fn, tasks, traj, row_batch: int = 0):
  """Env states before every turn of `traj`, rebuilt from its recorded actions (no model).

  Args:
    replay_fn: `jaxagent.rollout.replay.make_replay_fn(env, budget_visible)`, the env and budget
      visibility of the rollout that recorded `traj` (a visible budget resets with traj.budget).
    tasks: the task pytree of each row (leaves [B, ...]), i.e. the tasks the rollout used,
      repeated per episode.
    traj: a Trajectory (numpy or jax leaves).
    row_batch: replay rows in batches of this many (the last padded with row 0), so any B uses
      one compiled program; 0 = all rows at once.
  Returns:
    the env state pytree with leaves [B, T_max, ...]; entry [b, t] is the state in which turn t's
    action was taken (meaningful where traj.acted[b, t]).
  """
  b = int(np.asarray(traj.budget).shape[0])
  r = row_batch or b
  arrays = (np.asarray(traj.budget), np.asarray(traj.action_tokens),
            np.asarray(traj.action_tokens_len), np.asarray(traj.acted))
  parts = []
  for start in range(0, b, r):
    idx = np.arange(start, start + r)
    real = idx < b
    idx = np.where(real, idx, 0)
    got = replay_fn(jax.tree.map(lambda x: x[jnp.asarray(idx)], tasks),
                    *[jnp.asarray(a[idx]) for a in arrays])
    parts.append(_take_rows(_to_host(got), np.nonzero(real)[0]))
  return parts[0] if len(parts) == 1 else _concat(parts)


def _to_host(tree):
  """`tree` with its leaves fetched to host numpy arrays (PRNG key leaves stay jax arrays), so
  selecting states is numpy indexing: eager device gathers compiled a program per leaf shape and
  index count (40 of the quick sokoban study's comparison's 136 compiles, 2.5 s)."""
  return jax.tree.map(
      lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x), tree)


def _take_rows(tree, *idx):
  """Leaves indexed by `idx` (numpy index arrays) on the host (jax for PRNG key leaves)."""
  return jax.tree.map(lambda x: x[idx] if isinstance(x, np.ndarray)
                      else x[tuple(jnp.asarray(i) for i in idx)], tree)


def _concat(parts):
  """Leaves concatenated along axis 0 (numpy for host leaves, jax for PRNG key leaves)."""
  return jax.tree.map(lambda *xs: np.concatenate(xs) if isinstance(xs[0], np.ndarray)
                      else jnp.concatenate(xs), *parts)


def _bucket(n: int, multiple: int = 64) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def reference_states(replay_fn, tasks, traj, mask, *, source: str, max_states: int = 0,
                     seed: int = 0, row_batch: int = 0, replayed=None) -> ReferenceStates:
  """Reference states at the turns where `mask` [B, T] is true (and the row acted).

  Args:
    replay_fn: see `replay_env_states`.
    tasks: task pytree per row (leaves [B, ...]).
    traj: the source Trajectory.
    mask: [B, T] bool, e.g. `traj.acted` (every state) or `stats.error_states(traj)`.
    source: a label stored with every state.
    max_states: keep a seeded random subset of at most this many states (0 = all), in the
      original (row, turn) order.
    row_batch: see `replay_env_states`.
    replayed: `replay_env_states(replay_fn, tasks, traj, row_batch)` if already computed (the
      reference and the error states of one trajectory set replay it once).
  The prefix width P is the longest prefix rounded up to a multiple of 64 (`pad_prefix` widens).
  """
  mask = np.asarray(mask, bool) & np.asarray(traj.acted, bool)
  rows, turns = np.nonzero(mask)
  if max_states and len(rows) > max_states:
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), max_states, replace=False))
    rows, turns = rows[keep], turns[keep]
  states = (replay_env_states(replay_fn, tasks, traj, row_batch) if replayed is None
            else replayed)
  env_state = _take_rows(_to_host(states), rows, turns)
  turn_start = np.asarray(traj.turn_start)
  prefix_len = turn_start[rows, turns].astype(np.int32)
  p = _bucket(int(prefix_len.max()) if len(rows) else 1)
  tokens = np.asarray(traj.tokens)
  prefix = np.zeros((len(rows), p), np.int32)
  width = min(p, tokens.shape[1])
  prefix[:, :width] = tokens[rows, :width]
  prefix = np.where(np.arange(p)[None, :] < prefix_len[:, None], prefix, 0).astype(np.int32)
  kind = np.asarray(traj.error_kind)
  prev = np.where(turns > 0, kind[rows, np.maximum(turns - 1, 0)], ErrorKind.NONE).astype(np.int32)
  return ReferenceStates(prefix=prefix, prefix_len=prefix_len, env_state=env_state,
                         row=rows.astype(np.int32), turn=turns.astype(np.int32),
                         prev_error_kind=prev, source=np.full((len(rows),), source),
                         task=np.asarray(traj.task_id, np.int32)[rows])


def pad_prefix(refs: ReferenceStates, width: int) -> ReferenceStates:
  """`refs` with prefixes padded to `width` columns (one next-action program for several sets)."""
  if width < refs.prefix.shape[1]:
    raise ValueError(f"width {width} < the prefixes' width {refs.prefix.shape[1]}")
  return dataclasses.replace(refs, prefix=np.pad(refs.prefix,
                                                 ((0, 0), (0, width - refs.prefix.shape[1]))))


def concat_states(parts: Sequence[ReferenceStates]) -> ReferenceStates:
  """One ReferenceStates from several of the same environment (prefixes padded to one width)."""
  p = max(r.prefix.shape[1] for r in parts)
  return ReferenceStates(
      prefix=np.concatenate([pad_prefix(r, p).prefix for r in parts]),
      prefix_len=np.concatenate([r.prefix_len for r in parts]),
      env_state=_concat([_to_host(r.env_state) for r in parts]),
      row=np.concatenate([r.row for r in parts]), turn=np.concatenate([r.turn for r in parts]),
      prev_error_kind=np.concatenate([r.prev_error_kind for r in parts]),
      source=np.concatenate([r.source for r in parts]),
      task=np.concatenate([r.task for r in parts]))


# ---- next action --------------------------------------------------------------------------------


def next_actions(fn: NextActionFn, params, refs: ReferenceStates, key, temperature: float,
                 batch_size: int, order: bool = True) -> dict[str, np.ndarray]:
  """Runs `fn` (from `jaxagent.rollout.replay.make_next_action_fn`) over all states in
  fixed-size batches: `next_actions_at` with one decoding (key, temperature).

  The last batch is padded with copies of state 0 (dropped from the output), so every call has
  the shape [batch_size, P]. Batch i uses fold_in(key, i). order: batch the states by prefix
  length (stable; outputs in the states' order), so a batch's prefill runs only to its own
  longest prefix: 512 states of the default config (prefixes of 307-902 tokens, 8-token actions)
  took 7.67 s instead of 11.18 (best of 7 interleaved rounds, 2-core AMD EPYC shared, load 9-13,
  2026-12-07). Greedy outcomes do not depend on it; sampled ones are other draws of the same
  distribution.

  Returns host arrays [N]: valid_call, oracle_match (bool), error_kind, length, scored (int32),
  entropy, oracle_logp (float32; `jaxagent.rollout.replay.NextAction`), and tokens [N, A_env].
  """
  return next_actions_at(fn, params, refs, [(key, temperature)], batch_size, order)[0]


def next_actions_at(fn: NextActionFn, params, refs: ReferenceStates,
                    decodings: Sequence[tuple[Any, float]], batch_size: int,
                    order: bool = True) -> list[dict[str, np.ndarray]]:
  """`next_actions` of one policy on the same states for several decodings (key, temperature):
  each batch is prefilled once (`NextActionFn.prefill`) and decoded once per decoding
  (`NextActionFn.act`, batch i with fold_in(key, i) as `next_actions`), so outcome j equals
  next_actions(fn, params, refs, *decodings[j], batch_size, order), at the cost of one prefill
  for all (greedy and sampled share it, and so does the sharpening sweep's every temperature).
  Returns one outcome dict per decoding, in their order.
  """
  n = len(refs)
  outs: list[dict[str, list]] = [{k: [] for k in FIELDS} for _ in decodings]
  if n == 0:
    return [{k: np.zeros((0,), FIELDS[k]) for k in FIELDS if k != "tokens"} | {
        "tokens": np.zeros((0, 0), np.int32)} for _ in decodings]
  scs = [sampler.SamplingConfig.make(t) for _, t in decodings]
  # Batches are gathered on the host: eager device gathers compiled a program per state leaf
  # shape (10 of the smoke study's comparison's 160 compiles).
  states = jax.tree.map(
      lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x),
      refs.env_state)
  perm = np.argsort(refs.prefix_len, kind="stable") if order else np.arange(n)
  for i, start in enumerate(range(0, n, batch_size)):
    idx = np.arange(start, start + batch_size)
    real = idx < n
    idx = perm[np.where(real, idx, 0)]
    logits, cache = fn.prefill(params, jnp.asarray(refs.prefix[idx]),
                               jnp.asarray(refs.prefix_len[idx]))
    batch_states = jax.tree.map(lambda x: jnp.asarray(x[idx]), states)
    for out, (key, _), sc in zip(outs, decodings, scs):
      got = jax.device_get(fn.act(params, cache, logits, batch_states,
                                  jax.random.fold_in(key, i), sc))
      for k in out:
        out[k].append(np.asarray(getattr(got, k))[real])
  inv = np.argsort(perm)
  return [{k: np.concatenate(v)[inv] for k, v in out.items()} for out in outs]


# ---- rates --------------------------------------------------------------------------------------


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, task: np.ndarray, num_bootstrap: int,
                    confidence: float, rng: np.random.Generator) -> dict:
  """sum(num) / sum(den) over N states (num, den [N]) with a percentile bootstrap interval that
  resamples the states' tasks `task` [N] (all states of a drawn task come with it: states of one
  episode or task are not independent), the pooled ratio of each resample.

  Returns {"rate", "lo", "hi", "n", "tasks"}; rate/lo/hi are None when N == 0 ("no such states")
  or sum(den) == 0. The interval is not widened to hold the rate (a skewed bootstrap may leave it
  outside).
  """
  num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
  n = int(num.shape[0])
  if n == 0 or not den.sum() > 0:
    return {"rate": None, "lo": None, "hi": None, "n": n, "tasks": 0}
  ids, t = np.unique(np.asarray(task), return_inverse=True)
  tn, _ = evidence.per_task(num, t, len(ids))
  td, _ = evidence.per_task(den, t, len(ids))
  r = evidence.Resampler(1, len(ids), num_bootstrap, int(rng.integers(2**31)))
  i = r.ratio(tn, td).interval(confidence)
  return {"rate": i["est"], "lo": i["lo"], "hi": i["hi"], "n": n, "tasks": int(len(ids))}


def bootstrap_rate(x: np.ndarray, task: np.ndarray, num_bootstrap: int, confidence: float,
                   rng: np.random.Generator) -> dict:
  """The mean of x [N] over N states (0/1 outcomes: a rate; probabilities: their mean), with
  `bootstrap_ratio`'s interval over tasks."""
  x = np.asarray(x, np.float64)
  return bootstrap_ratio(x, np.ones_like(x), task, num_bootstrap, confidence, rng)


def oracle_prob(o: dict) -> np.ndarray:
  """[N] the probability each state's policy gives the oracle's action (its tokens and <eot>):
  exp of `next_actions`' oracle_logp."""
  return np.exp(np.asarray(o["oracle_logp"], np.float64))


def entropy_rate(o: dict, sel: np.ndarray | None = None) -> float:
  """The policy's mean per-token action entropy (nats) over the states of `next_actions`'
  outcomes `o` (or those where sel [N] holds): sum of the per-token entropies of the sampled
  actions over the tokens sampled, pooled over the states (docs/STUDY.md, "the sharpening
  control"). NaN when no token was sampled."""
  ent, scored = np.asarray(o["entropy"], np.float64), np.asarray(o["scored"], np.float64)
  if sel is not None:
    ent, scored = ent[sel], scored[sel]
  return float(ent.sum() / scored.sum()) if scored.sum() > 0 else float("nan")


def quality_rates(valid: np.ndarray, match: np.ndarray, task: np.ndarray,
                  groups: dict[str, np.ndarray], *, num_bootstrap: int, confidence: float,
                  seed: int, prob: np.ndarray | None = None, entropy: np.ndarray | None = None,
                  scored: np.ndarray | None = None) -> dict:
  """valid_rate and oracle_rate of N states, overall and per label of each grouping; with `prob`
  [N] also the expected oracle-match probability (the mean of the probabilities the policy gives
  the oracle's action), with `entropy` and `scored` [N] also the per-token action entropy.

  Args:
    valid, match: [N] bool outcomes.
    task: [N] the task of each state (the unit intervals resample).
    groups: grouping name -> labels [N] (e.g. {"source": ..., "env": ...}).
  Returns:
    {"overall": {"valid": r, "oracle": r[, "oracle_prob": r, "entropy": r]},
     "<grouping>": {label: {...}}} with each r = `bootstrap_ratio`'s dict.
  """
  rng = np.random.default_rng(seed)
  valid, match = np.asarray(valid, bool), np.asarray(match, bool)
  task = np.asarray(task)

  def rates(sel):
    out = {"valid": bootstrap_rate(valid[sel], task[sel], num_bootstrap, confidence, rng),
           "oracle": bootstrap_rate(match[sel], task[sel], num_bootstrap, confidence, rng)}
    if prob is not None:
      out["oracle_prob"] = bootstrap_rate(np.asarray(prob)[sel], task[sel], num_bootstrap,
                                          confidence, rng)
    if entropy is not None:
      out["entropy"] = bootstrap_ratio(np.asarray(entropy)[sel], np.asarray(scored)[sel],
                                       task[sel], num_bootstrap, confidence, rng)
    return out

  out = {"overall": rates(np.ones_like(valid))}
  for name, labels in groups.items():
    labels = np.asarray(labels)
    out[name] = {str(v): rates(labels == v) for v in sorted(set(labels.tolist()))}
  return out
