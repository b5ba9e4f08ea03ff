"""Noisy-oracle demonstrations of a host environment: the host twin of `demos.make_episode_runner`.

`make_host_episode_runner(env, max_turns=, max_len=)` returns `run(keys, tasks, budget, params)
-> Transcript` with the arrays (numpy) and the transcript convention of the JAX runner, driving
`HostEnv.reset` / `step` and each episode's `oracle()` between turns in Python. The noise is the
same, drawn from the same keys: per episode, keys = split(key, max_turns + 1), and at turn t the
three uniforms u = uniform(keys[1 + t], (3,)) decide as in `demos.noisy_oracle_policy`:

  * err = u[0] < (recovery pending ? 1 - recovery_rate : error_rate);
  * the erroneous action: its kind uniform (u[1]) over the kinds that have a candidate, the
    action uniform (u[2]) among that kind's candidates. The candidates are the episode's
    `error_actions() -> [(ErrorKind, text pieces)]` when it defines one (plausible errors of
    the tool: a misspelt column, a syntax slip), else the generic corruptions of the oracle's
    text that `demos.generic_error_actions` makes for JAX environments (the last byte dropped:
    parse_error; the first byte doubled: unknown_tool; ", zz" before the last byte:
    bad_arguments), spelt one token per byte as there.

A host environment whose texts match a JAX twin's (`HostLookupEnv`) therefore gives token-identical
demonstrations to that twin for the same keys and tasks (the tests check it).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxagent.envs import demos
from jaxagent.envs.base import ErrorKind, TokenBuffer
from jaxagent.envs.codec import concat_host
from jaxagent.envs.host import HostEnv, HostState

_KINDS = np.arange(demos.NUM_KINDS)


def _pick(u: np.float32, mask: np.ndarray) -> int:
  """`demos._pick` in numpy (float32, so both pick the same index for the same u)."""
  count = int(np.sum(mask))
  target = min(int(np.float32(u) * np.float32(count)), max(count - 1, 0))
  hits = np.flatnonzero(mask)
  return int(hits[target]) if count else 0


def generic_errors(oracle: np.ndarray, env: HostEnv, table: np.ndarray) -> list:
  """`demos.generic_error_actions` on the host: [(kind, tokens)] for the oracle's tokens."""
  n = env.max_action_len
  data = env.codec.decode_bytes(oracle)
  nb = min(len(data), n)
  data = data[:nb]
  rows = [(ErrorKind.PARSE_ERROR, data[:nb - 1]),
          (ErrorKind.UNKNOWN_TOOL, data[:1] + data),
          (ErrorKind.BAD_ARGUMENTS, data[:nb - 1] + b", zz" + data[nb - 1:])]
  return [(int(k), table[np.frombuffer(r[:n], np.uint8)].astype(np.int32)) for k, r in rows]


class _Runner:
  """The runner `make_host_episode_runner` returns (a callable; `host` marks it for callers
  that batch differently for host runners, e.g. no padding to a compiled chunk)."""
  host = True

  def __init__(self, env: HostEnv, params: Any, max_turns: int, max_len: int):
    self.env, self.params, self.max_turns, self.max_len = env, params, max_turns, max_len
    self.table = demos.byte_tokens(env.codec)
    self.uniforms = jax.jit(jax.vmap(lambda k: jax.vmap(
        lambda kk: jax.random.uniform(kk, (3,)))(jax.random.split(k, max_turns + 1)[1:])))

  def _tokens(self, pieces: list[str]) -> np.ndarray:
    """An action's text pieces as tokens, the way `HostEnv.oracle_action` tokenises them."""
    return concat_host([self.env.codec.encode_text(p) for p in pieces])[:self.env.max_action_len]

  def _candidates(self, ep, oracle: np.ndarray) -> list:
    if hasattr(ep, "error_actions"):
      return [(int(k), self._tokens(p)) for k, p in ep.error_actions()]
    missing = [b for b in range(32, 127) if self.table[b] < 0]
    if missing:
      raise ValueError(
          f"{self.env.name}'s episodes have no error_actions() and the tokenizer lacks "
          f"single-byte tokens for the printable bytes {''.join(map(chr, missing))!r}, so "
          "errors cannot be spelled; give the episodes error_actions()")
    return generic_errors(oracle, self.env, self.table)

  def _act(self, ep, u: np.ndarray, in_error: bool, rates) -> tuple[np.ndarray, bool]:
    """One episode's action at one turn (tokens) and whether it is an injected error."""
    oracle = self._tokens(ep.oracle())
    err_rate, rec_rate = rates
    p_err = np.float32(1.0) - rec_rate if in_error else err_rate
    if not np.float32(u[0]) < p_err:
      return oracle, False
    cands = self._candidates(ep, oracle)
    kinds = np.asarray([k for k, _ in cands], np.int64)
    present = np.isin(_KINDS, kinds) & (_KINDS != ErrorKind.NONE)
    if not present.any():
      return oracle, False
    chosen = _pick(u[1], present)
    row = _pick(u[2], kinds == chosen)
    return cands[row][1], True

  def __call__(self, keys, tasks=None, budget=-1, params=None) -> demos.Transcript:
    if tasks is None:
      raise ValueError(f"{self.env.name}: a host environment's demonstrations need tasks "
                       "(the runner cannot sample them from keys)")
    env, tm, max_len = self.env, self.max_turns, self.max_len
    p = self.params if params is None else params
    rates = (np.float32(p["error_rate"]), np.float32(p["recovery_rate"]))
    b = int(keys.shape[0])
    budget = np.broadcast_to(np.asarray(budget, np.int32), (b,)).copy()
    u_all = np.asarray(self.uniforms(keys))                     # [B, T, 3]
    state, obs = env.reset(jax.tree.map(np.asarray, tasks), budget)
    step_len = int(getattr(env, "max_step_obs_len", env.max_obs_len))
    eot = int(env.codec.end_of_turn_id)
    seqs = [[(obs.tokens[i, :obs.length[i]], 0.0, -1)] for i in range(b)]
    rec = {k: np.zeros((b, tm), t) for k, t in [
        ("acted", bool), ("injected", bool), ("valid_call", bool), ("error_kind", np.int32),
        ("oracle_match", bool), ("reward", np.float32), ("solved", bool),
        ("action_length", np.int32)]}
    in_error = np.zeros((b,), bool)
    for t in range(tm):
      live = np.flatnonzero(~state.done & ((budget < 0) | (t < budget)))
      if not len(live):
        break
      acts = np.full((len(live), env.max_action_len), env.codec.pad_id, np.int32)
      lens = np.zeros((len(live),), np.int32)
      for j, i in enumerate(live):
        a, in_error[i] = self._act(state.episodes[i], u_all[i, t], bool(in_error[i]), rates)
        acts[j, :len(a)], lens[j] = a, len(a)
      sub = HostState(episodes=[state.episodes[i] for i in live], turn=state.turn[live],
                      budget=state.budget[live], done=state.done[live])
      sub, obs, info = env.step(sub, TokenBuffer(tokens=acts, length=lens))
      state.turn[live], state.done[live] = sub.turn, sub.done
      for j, i in enumerate(live):
        n_obs = min(int(obs.length[j]), step_len)
        seqs[i].append((np.append(acts[j, :lens[j]], eot), 1.0, t))
        seqs[i].append((obs.tokens[j, :n_obs], 0.0, t))
        rec["acted"][i, t] = True
        rec["injected"][i, t] = in_error[i]
        rec["action_length"][i, t] = lens[j] + 1
        for k in ("valid_call", "error_kind", "oracle_match", "reward", "solved"):
          rec[k][i, t] = getattr(info, k)[j]
    return self._transcript(seqs, rec, [ep.optimal_turns for ep in state.episodes])

  def _transcript(self, seqs, rec, optimal) -> demos.Transcript:
    b, tm, max_len = len(seqs), self.max_turns, self.max_len
    tokens = np.full((b, max_len), self.env.codec.pad_id, np.int32)
    mask = np.zeros((b, max_len), np.float32)
    tot = np.full((b, max_len), -1, np.int32)
    total = np.zeros((b,), np.int32)
    for i, parts in enumerate(seqs):
      toks = np.concatenate([x for x, _, _ in parts]).astype(np.int32)
      loss = np.concatenate([np.full(len(x), m, np.float32) for x, m, _ in parts])
      turn = np.concatenate([np.full(len(x), t, np.int32) for x, _, t in parts])
      n = min(len(toks), max_len)
      tokens[i, :n], mask[i, :n], tot[i, :n], total[i] = toks[:n], loss[:n], turn[:n], len(toks)
    turns = np.arange(1, tm + 1, dtype=np.int32)
    success = np.min(np.where(rec["solved"], turns, tm + 1), axis=1).astype(np.int32)
    return demos.Transcript(
        tokens=tokens, loss_mask=mask, turn_of_token=tot, length=np.minimum(total, max_len),
        truncated=total > max_len, success_turn=success,
        num_turns=rec["acted"].sum(axis=1).astype(np.int32),
        optimal_turns=np.asarray(optimal, np.int32), **rec)


def make_host_episode_runner(env: HostEnv, *, max_turns: int, max_len: int,
                             error_rate: float = 0.0, recovery_rate: float = 1.0) -> _Runner:
  """`run(keys [B], tasks (leading axis B), budget=-1, params=None) -> Transcript` (numpy) of
  noisy-oracle episodes of the host environment `env` (see the module docstring); `params` are
  `demos.noisy_oracle_params` (default: these rates)."""
  return _Runner(env, demos.noisy_oracle_params(error_rate, recovery_rate), max_turns, max_len)

