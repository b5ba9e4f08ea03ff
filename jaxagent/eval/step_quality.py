"""Step-level action quality: each policy's next action on fixed reference states (STUDY.md).

A *reference state* is a prefix of a recorded episode: for an acted turn t of row b it is

    transcript  tokens[b, :turn_start[b, t]]      (everything before the turn's action), and
    env state   s_t = step(... step(reset(task_b, budget_b), a_0) ..., a_{t-1})

where a_i = action_tokens[b, i, :action_tokens_len[b, i]] are the actions the environment
received. The env state is rebuilt by replaying those actions (a vmapped `lax.scan` over turns;
no model), so any recorded Trajectory — oracle, base policy, a hand-built one — yields states.

A policy's *next action* at a state: prefill the prefix into a fresh KV cache
(`sampler.prefill`), decode one action (`sampler.decode`, stopping at the codec's end-of-turn id
or after `max_action_tokens`), and `env.step(s_t, action)`; the step's info says whether the
action is a valid call and whether it equals the oracle's action in s_t (`info.oracle_match`).
One jitted function does this for a batch of states; greedy (temperature 0) and sampled decoding
share it (the sampling config is traced).

Quality over a set S of states (per policy, per decoding mode):

    valid_rate  = |{s in S : valid_call(s)}| / |S|
    oracle_rate = |{s in S : oracle_match(s)}| / |S|

reported overall, by source of the prefixes (oracle / base) and by environment, each with a
percentile bootstrap interval over states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.rollout import sampler

MODES = ("greedy", "sampled")


# ---- reference states ---------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceStates:
  """N reference states of one environment (host arrays except the env state)."""
  prefix: np.ndarray           # [N, P] int32 transcript prefix (pad after prefix_len)
  prefix_len: np.ndarray       # [N] int32
  env_state: Any               # the env's state pytree, leaves [N, ...]
  row: np.ndarray              # [N] int32 row of the source trajectory
  turn: np.ndarray             # [N] int32 turn t (0-based) whose action the state precedes
  prev_error_kind: np.ndarray  # [N] int32 ErrorKind of turn t-1's action (NONE at t = 0)
  source: np.ndarray           # [N] str where the prefixes come from ("oracle", "base", ...)

  def __len__(self) -> int:
    return int(self.prefix_len.shape[0])


def _where_tree(pred_b, new, old):
  return jax.tree.map(
      lambda x, y: jnp.where(pred_b.reshape(pred_b.shape + (1,) * (x.ndim - 1)), x, y), new, old)


_REPLAY: dict = {}


def _replay_fn(env, budget_visible: bool):
  """jit(fn(tasks [B], budget [B], actions [B,T,A], actions_len [B,T], acted [B,T]) -> states
  [B, T]): states[b, t] is the env state before turn t's action."""
  ck = (id(env), bool(budget_visible))
  if ck in _REPLAY and _REPLAY[ck][0] is env:
    return _REPLAY[ck][1]

  def run(tasks, budget, actions, actions_len, acted):
    b = budget.shape[0]
    reset_budget = budget if budget_visible else jnp.full_like(budget, -1)
    # Environments ignore the key when given a task (the task fixes the episode).
    state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), b), tasks, reset_budget)

    def body(state, x):
      a, n, act = x
      new, _, _ = jax.vmap(env.step)(state, TokenBuffer(tokens=a, length=n))
      return _where_tree(act, new, state), state

    xs = (jnp.swapaxes(actions, 0, 1), actions_len.T, acted.T)
    _, states = jax.lax.scan(body, state, xs)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), states)

  fn = jax.jit(run)
  _REPLAY[ck] = (env, fn)
  return fn


def replay_env_states(env, tasks, traj, budget_visible: bool, row_batch: int = 0):
  """Env states before every turn of `traj`, rebuilt from its recorded actions (no model).

  Args:
    tasks: the task pytree of each row (leaves [B, ...]), i.e. the tasks the rollout used,
      repeated per episode.
    traj: a Trajectory (numpy or jax leaves).
    budget_visible: whether the rollout told the agent its budget (reset then gets traj.budget).
    row_batch: replay rows in batches of this many (the last padded with row 0), so any B uses
      one compiled program; 0 = all rows at once.
  Returns:
    the env state pytree with leaves [B, T_max, ...]; entry [b, t] is the state in which turn t's
    action was taken (meaningful where traj.acted[b, t]).
  """
  fn = _replay_fn(env, budget_visible)
  b = int(np.asarray(traj.budget).shape[0])
  r = row_batch or b
  arrays = (np.asarray(traj.budget), np.asarray(traj.action_tokens),
            np.asarray(traj.action_tokens_len), np.asarray(traj.acted))
  parts = []
  for start in range(0, b, r):
    idx = np.arange(start, start + r)
    real = idx < b
    idx = np.where(real, idx, 0)
    got = fn(jax.tree.map(lambda x: x[jnp.asarray(idx)], tasks),
             *[jnp.asarray(a[idx]) for a in arrays])
    parts.append(jax.tree.map(lambda x: x[jnp.asarray(np.nonzero(real)[0])], got))
  return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _bucket(n: int, multiple: int = 64) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def reference_states(env, tasks, traj, mask, *, source: str, budget_visible: bool,
                     max_states: int = 0, seed: int = 0, row_batch: int = 0) -> ReferenceStates:
  """Reference states at the turns where `mask` [B, T] is true (and the row acted).

  Args:
    tasks: task pytree per row (leaves [B, ...]).
    traj: the source Trajectory.
    mask: [B, T] bool, e.g. `traj.acted` (every state) or `stats.error_states(traj)`.
    source: a label stored with every state.
    max_states: keep a seeded random subset of at most this many states (0 = all), in the
      original (row, turn) order.
    row_batch: see `replay_env_states`.
  The prefix width P is the longest prefix rounded up to a multiple of 64 (`pad_prefix` widens).
  """
  mask = np.asarray(mask, bool) & np.asarray(traj.acted, bool)
  rows, turns = np.nonzero(mask)
  if max_states and len(rows) > max_states:
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), max_states, replace=False))
    rows, turns = rows[keep], turns[keep]
  states = replay_env_states(env, tasks, traj, budget_visible, row_batch)
  env_state = jax.tree.map(lambda x: x[jnp.asarray(rows), jnp.asarray(turns)], states)
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
                         prev_error_kind=prev, source=np.full((len(rows),), source))


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
      env_state=jax.tree.map(lambda *xs: jnp.concatenate(xs), *[r.env_state for r in parts]),
      row=np.concatenate([r.row for r in parts]), turn=np.concatenate([r.turn for r in parts]),
      prev_error_kind=np.concatenate([r.prev_error_kind for r in parts]),
      source=np.concatenate([r.source for r in parts]))


# ---- next action --------------------------------------------------------------------------------


@struct.dataclass
class NextAction:
  """A policy's next action at each of N states and what the environment made of it."""
  tokens: jax.Array        # [N, A_env] int32 the action (no end-of-turn token; pad after length)
  length: jax.Array        # [N] int32
  valid_call: jax.Array    # [N] bool
  oracle_match: jax.Array  # [N] bool
  error_kind: jax.Array    # [N] int32 ErrorKind


_NEXT: dict = {}


def make_next_action_fn(mcfg: ModelConfig, env, max_action_tokens: int):
  """jit(fn(params, prefix [N,P], prefix_len [N], env_state [N], key, sc) -> NextAction).

  The KV cache holds P + max_action_tokens slots; positions are slot indices, as in a rollout,
  so greedy decoding reproduces the action a greedy rollout took at the same prefix. The action
  the environment receives is the decoded tokens without the end-of-turn token (a turn that hits
  `max_action_tokens` without it is cut there), exactly as the rollout engine does. Compiled once
  per (P, N); params, contents, key and sampling knobs are traced. One function object per
  (model config, environment, max_action_tokens), so evaluators share its compilations.
  """
  ck = (mcfg, id(env), int(max_action_tokens))
  if ck in _NEXT and _NEXT[ck][0] is env:
    return _NEXT[ck][1]
  eot, pad = int(env.codec.end_of_turn_id), int(env.codec.pad_id)
  a, a_env = int(max_action_tokens), int(env.max_action_len)
  if not 2 <= a <= a_env:
    raise ValueError(f"max_action_tokens={a} must be in [2, the environment's max_action_len = "
                     f"{a_env}] (it counts the end-of-turn token)")

  def run(params, prefix, prefix_len, env_state, key, sc):
    n, p = prefix.shape
    cache = decoder.init_cache(mcfg, n, p + a)
    logits, cache = sampler.prefill(mcfg, params, cache, prefix, prefix_len)
    gen = sampler.decode(mcfg, params, cache, logits, key, sc,
                         max_new=jnp.full((n,), a, jnp.int32),
                         stop_tokens=jnp.full((n, 1), eot, jnp.int32), max_new_tokens=a,
                         pad_id=pad)
    n_act = gen.lengths - gen.stopped.astype(jnp.int32)
    cols = jnp.arange(a)[None, :]
    toks = jnp.where(cols < n_act[:, None], gen.tokens, pad)
    toks = jnp.pad(toks, ((0, 0), (0, a_env - a)), constant_values=pad)
    action = TokenBuffer(tokens=toks, length=n_act)
    _, _, info = jax.vmap(env.step)(env_state, action)
    return NextAction(tokens=toks, length=n_act, valid_call=info.valid_call,
                      oracle_match=info.oracle_match, error_kind=info.error_kind)

  fn = jax.jit(run)
  _NEXT[ck] = (env, fn)
  return fn


def next_actions(fn, params, refs: ReferenceStates, key, temperature: float,
                 batch_size: int) -> dict[str, np.ndarray]:
  """Runs `fn` (from `make_next_action_fn`) over all states in fixed-size batches.

  The last batch is padded with copies of state 0 (dropped from the output), so every call has
  the shape [batch_size, P]. Batch i uses fold_in(key, i).

  Returns host arrays [N]: valid_call, oracle_match (bool), error_kind, length (int32), and
  tokens [N, A_env].
  """
  n = len(refs)
  out: dict[str, list] = {k: [] for k in ("valid_call", "oracle_match", "error_kind", "length",
                                          "tokens")}
  if n == 0:
    return {k: np.zeros((0,), np.int32 if k in ("error_kind", "length") else bool)
            for k in out if k != "tokens"} | {"tokens": np.zeros((0, 0), np.int32)}
  sc = sampler.SamplingConfig.make(temperature)
  for i, start in enumerate(range(0, n, batch_size)):
    idx = np.arange(start, start + batch_size)
    real = idx < n
    idx = np.where(real, idx, 0)
    got = fn(params, jnp.asarray(refs.prefix[idx]), jnp.asarray(refs.prefix_len[idx]),
             jax.tree.map(lambda x: x[jnp.asarray(idx)], refs.env_state),
             jax.random.fold_in(key, i), sc)
    got = jax.device_get(got)
    for k in out:
      out[k].append(np.asarray(getattr(got, k))[real])
  return {k: np.concatenate(v) for k, v in out.items()}


# ---- rates --------------------------------------------------------------------------------------


def bootstrap_rate(x: np.ndarray, num_bootstrap: int, confidence: float,
                   rng: np.random.Generator) -> dict:
  """Mean of the 0/1 outcomes x [N] with a percentile bootstrap interval over the N states.

  Returns {"rate", "lo", "hi", "n"}; rate/lo/hi are None when N == 0 ("no such states").
  """
  x = np.asarray(x, np.float64)
  n = int(x.shape[0])
  if n == 0:
    return {"rate": None, "lo": None, "hi": None, "n": 0}
  rate = float(x.mean())
  idx = rng.integers(0, n, size=(num_bootstrap, n))
  boot = x[idx].mean(axis=1)
  alpha = (1 - confidence) / 2
  lo, hi = np.quantile(boot, [alpha, 1 - alpha])
  return {"rate": rate, "lo": float(min(lo, rate)), "hi": float(max(hi, rate)), "n": n}


def quality_rates(valid: np.ndarray, match: np.ndarray, groups: dict[str, np.ndarray], *,
                  num_bootstrap: int, confidence: float, seed: int) -> dict:
  """valid_rate and oracle_rate of N states, overall and per label of each grouping.

  Args:
    valid, match: [N] bool outcomes.
    groups: grouping name -> labels [N] (e.g. {"source": ..., "env": ...}).
  Returns:
    {"overall": {"valid": r, "oracle": r}, "<grouping>": {label: {"valid": r, "oracle": r}}}
    with each r = `bootstrap_rate`'s dict.
  """
  rng = np.random.default_rng(seed)
  valid, match = np.asarray(valid, bool), np.asarray(match, bool)

  def rates(sel):
    return {"valid": bootstrap_rate(valid[sel], num_bootstrap, confidence, rng),
            "oracle": bootstrap_rate(match[sel], num_bootstrap, confidence, rng)}

  out = {"overall": rates(np.ones_like(valid))}
  for name, labels in groups.items():
    labels = np.asarray(labels)
    out[name] = {str(v): rates(labels == v) for v in sorted(set(labels.tolist()))}
  return out
