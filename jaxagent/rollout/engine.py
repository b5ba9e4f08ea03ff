"""Batched multi-turn rollouts: a whole batch of episodes as one compiled program.

For B episodes (tasks x group size), each turn the policy decodes an action until its end-of-turn
token or the per-turn token limit, the environment steps on it, and the observation is prefilled
into the KV cache: history is never re-encoded. With a JAX-native environment the loop over turns
is a `lax.while_loop` inside `jit` (it exits as soon as every row has stopped), so there is no host
round-trip per turn or per token. With a host (Python) environment the same jitted `act` and
`observe` halves run on either side of the host's `step`, and the output is the same.

Budgets are a per-row vector carried in the loop state: row b acts at most budget[b] turns, and
the engine alone ends a row whose budget is spent (status BUDGET_SPENT, whether the budget is
visible to the agent or not; a visible budget is only shown by the environment). Budgets, tasks,
sampling knobs and the key are traced values: changing them never recompiles (this is what makes
BudgetMix free).
Shapes (B, T_max, tokens per turn, context length) and budget visibility are static.

Transcript per row (compact; `Trajectory.tokens[b, :length[b]]`):
  obs_0 | a_0 <eot> obs_1 | a_1 <eot> obs_2 | ...
where a_t are sampled tokens (loss_mask 1, the sampled <eot> included). If a turn hits its token
limit without sampling <eot>, the engine appends <eot> itself (loss_mask 0) before the observation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import StepInfo, TokenBuffer, state_fingerprint
from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.models import sampler
from jaxagent.rollout.trajectory import Status, Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Static rollout settings (changing one compiles a new program)."""
  max_turns: int                 # T_max: the largest budget any row may have
  max_action_tokens: int         # tokens the policy may sample per turn (<eot> included)
  context_len: int               # L: transcript / KV cache capacity per row
  budget_visible: bool = False   # tell the agent its budget and the turns left


@struct.dataclass
class _Buffers:
  tokens: jax.Array       # [B, L] int32
  loss_mask: jax.Array    # [B, L] float32
  logprobs: jax.Array     # [B, L] float32
  turn: jax.Array         # [B, L] int32


@struct.dataclass
class _Records:
  acted: jax.Array          # [B, T] bool
  valid_call: jax.Array     # [B, T] bool
  error_kind: jax.Array     # [B, T] int32
  oracle_match: jax.Array   # [B, T] bool
  reward: jax.Array         # [B, T] float32
  solved: jax.Array         # [B, T] bool
  action_length: jax.Array  # [B, T] int32
  turn_start: jax.Array     # [B, T] int32
  actions: jax.Array        # [B, T, A] int32 (A = the environment's max_action_len)
  actions_len: jax.Array    # [B, T] int32
  state_id: jax.Array       # [B, T, 2] uint32 fingerprint of the state the turn acted in
  obs_truncated: jax.Array  # [B, T] bool the observation after the turn was cut to fit


@struct.dataclass
class _Carry:
  t: jax.Array              # [] int32 turn index
  cache: decoder.KVCache    # cache.length == transcript length per row
  next_logits: jax.Array    # [B, V] float32
  buf: _Buffers
  rec: _Records
  done: jax.Array           # [B] bool the environment ended the episode
  status: jax.Array         # [B] int32 Status
  num_turns: jax.Array      # [B] int32
  budget: jax.Array         # [B] int32 turns row b may take (the one place budgets are enforced)
  key: jax.Array


# Observation tokens per prefill chunk. The observation buffer is as wide as the environment's
# longest possible observation (`max_step_obs_len`), often twice the longest real one in a batch;
# in equal chunks of at most this many (`sampler.chunk_width`) only those up to the batch's longest
# real row run (`sampler.prefill`). Measured on the peers' workload (lookup, 4 hops: a 97-wide
# buffer of <= 50 real tokens with the forced <eot>, so 2 chunks of 25 run; 2026-12-06 and -07).
OBSERVE_CHUNK = 32


def _write(buf, chunk, offset, active):
  """buf[b, offset[b]:offset[b]+C] = chunk[b] for active rows. buf [B, L], chunk [B, C]."""
  upd = jax.vmap(lambda r, c, o: jax.lax.dynamic_update_slice(r, c, (o,)))(
      buf, chunk.astype(buf.dtype), offset)
  return jnp.where(active[:, None], upd, buf)


def _alive(c: _Carry, cfg: RolloutConfig, obs_len: int):
  """Rows that take turn c.t, and the status of rows that stop before it: a spent budget
  (BUDGET_SPENT) or a context that cannot hold another turn (CONTEXT_FULL)."""
  fits = c.cache.length + cfg.max_action_tokens + 1 + obs_len <= cfg.context_len
  waiting = (~c.done) & (c.status == Status.RUNNING)
  spent = waiting & (c.num_turns >= c.budget)
  full = waiting & ~spent & ~fits
  status = jnp.where(spent, Status.BUDGET_SPENT, jnp.where(full, Status.CONTEXT_FULL, c.status))
  return waiting & ~spent & fits, status


def _act(mcfg: ModelConfig, cfg: RolloutConfig, eot: int, pad: int, action_len: int,
         params, c: _Carry, sc: sampler.SamplingConfig, obs_len: int):
  """Decodes one action per live row. Returns (carry, action TokenBuffer [B], active, stopped)."""
  active, status = _alive(c, cfg, obs_len)
  b = active.shape[0]
  key, sub = jax.random.split(c.key)
  a = cfg.max_action_tokens
  gen = sampler.decode(mcfg, params, c.cache, c.next_logits, sub, sc,
                       max_new=jnp.full((b,), a, jnp.int32),
                       stop_tokens=jnp.full((b, 1), eot, jnp.int32), max_new_tokens=a,
                       pad_id=pad, active=active)
  offset = c.cache.length
  cols = jnp.arange(a)[None, :] < gen.lengths[:, None]
  buf = _Buffers(
      tokens=_write(c.buf.tokens, gen.tokens, offset, active),
      loss_mask=_write(c.buf.loss_mask, cols.astype(jnp.float32), offset, active),
      logprobs=_write(c.buf.logprobs, jnp.where(cols, gen.logprobs, 0.0), offset, active),
      turn=_write(c.buf.turn, jnp.where(cols, c.t, -1), offset, active))
  n_act = gen.lengths - gen.stopped.astype(jnp.int32)     # the action excludes <eot>
  act_tokens = jnp.where(jnp.arange(a)[None, :] < n_act[:, None], gen.tokens, pad)
  act_tokens = jnp.pad(act_tokens, ((0, 0), (0, action_len - a)), constant_values=pad)
  rec = c.rec.replace(acted=c.rec.acted.at[:, c.t].set(active),
                      action_length=c.rec.action_length.at[:, c.t].set(
                          jnp.where(active, gen.lengths, 0)))
  c = c.replace(cache=gen.cache, next_logits=gen.next_logits, buf=buf, rec=rec, key=key,
                status=status)
  return c, TokenBuffer(tokens=act_tokens, length=n_act), active, gen.stopped


def _act_forced(mcfg: ModelConfig, cfg: RolloutConfig, eot: int, pad: int, action_len: int,
                params, c: _Carry, action: TokenBuffer, obs_len: int, temperature):
  """Like `_act`, but the action is given (teacher forcing, e.g. the oracle's): its tokens and
  <eot> are prefilled, marked as agent tokens (loss_mask 1), with the policy's log-probs."""
  active, status = _alive(c, cfg, obs_len)
  b = active.shape[0]
  a = cfg.max_action_tokens
  n = jnp.minimum(action.length, a - 1)
  toks = action.tokens[:, :a]
  toks = jnp.pad(toks, ((0, 0), (0, a - toks.shape[1])), constant_values=pad)
  cols = jnp.arange(a)[None, :]
  toks = jnp.where(cols < n[:, None], toks, jnp.where(cols == n[:, None], eot, pad))
  lens = jnp.where(active, n + 1, 0)
  logits, cache = decoder.apply(mcfg, params, toks, cache=c.cache, chunk_lens=lens)
  prev = jnp.concatenate([c.next_logits[:, None], logits[:, :-1]], axis=1)       # [B, A, V]
  lp = jnp.take_along_axis(sampler.scaled_logprobs(prev, temperature), toks[..., None], -1)[..., 0]
  real = cols < lens[:, None]
  offset = c.cache.length
  buf = _Buffers(
      tokens=_write(c.buf.tokens, toks, offset, active),
      loss_mask=_write(c.buf.loss_mask, real.astype(jnp.float32), offset, active),
      logprobs=_write(c.buf.logprobs, jnp.where(real, lp, 0.0), offset, active),
      turn=_write(c.buf.turn, jnp.where(real, c.t, -1), offset, active))
  last = jnp.take_along_axis(logits, jnp.maximum(lens - 1, 0)[:, None, None], axis=1)[:, 0]
  rec = c.rec.replace(acted=c.rec.acted.at[:, c.t].set(active),
                      action_length=c.rec.action_length.at[:, c.t].set(lens))
  act_tokens = jnp.where(cols < n[:, None], toks, pad)
  act_tokens = jnp.pad(act_tokens, ((0, 0), (0, action_len - a)), constant_values=pad)
  c = c.replace(cache=cache, next_logits=jnp.where(active[:, None], last, c.next_logits),
                buf=buf, rec=rec, status=status)
  return c, TokenBuffer(tokens=act_tokens, length=n), active, jnp.ones((b,), bool)


def _record_action(c: _Carry, action: TokenBuffer, active, start, state_id):
  """Records the turn's action, its prefix length and the fingerprint [B, 2] of the state it was
  taken in (`jaxagent.envs.base.state_fingerprint`)."""
  r = c.rec
  return c.replace(rec=r.replace(
      state_id=r.state_id.at[:, c.t].set(jnp.where(active[:, None], state_id, 0)),
      turn_start=r.turn_start.at[:, c.t].set(jnp.where(active, start, 0)),
      actions=r.actions.at[:, c.t].set(jnp.where(active[:, None], action.tokens, 0)),
      actions_len=r.actions_len.at[:, c.t].set(jnp.where(active, action.length, 0))))


def _fit_obs(obs: TokenBuffer, n: int, tail: np.ndarray, info: StepInfo):
  """The observations [B, >= n] cut to the turn's n tokens, and which were cut ([B] bool).

  An environment cuts an observation that is too long itself, as text (`HostEnv`, which sets
  `info.obs_truncated`); the JAX environments' buffers hold every observation they can print.
  This is the backstop for any other: a row longer than n keeps its first n - len(tail) tokens
  and ends with `tail` (`codec.truncation_tail`: the marker, then the template's text to the next
  assistant header), so the transcript keeps its chat wrapping and the cache never runs past
  the tokens written. Jittable (numpy or jax inputs)."""
  over = jnp.asarray(obs.length) > n
  keep = n - tail.shape[0]
  tail_row = jnp.asarray(np.concatenate([np.zeros((keep,), np.int32), tail]))
  cut = (jnp.arange(n) >= keep)[None, :] & over[:, None]
  tokens = jnp.where(cut, tail_row[None, :], jnp.asarray(obs.tokens)[:, :n])
  truncated = over if info.obs_truncated is None else over | jnp.asarray(info.obs_truncated)
  return TokenBuffer(tokens=tokens, length=jnp.minimum(jnp.asarray(obs.length), n)), truncated


def _observe(mcfg: ModelConfig, eot: int, params, c: _Carry, obs: TokenBuffer, info: StepInfo,
             active, stopped, truncated):
  """Appends (<eot> if it was not sampled) + observation for live rows and records the step
  (truncated [B]: the observation was cut to fit, `_fit_obs`)."""
  b, n = obs.tokens.shape
  forced = active & ~stopped
  eot_col = jnp.full((b, 1), eot, jnp.int32)
  pad_col = jnp.zeros((b, 1), jnp.int32)
  chunk = jnp.where(forced[:, None], jnp.concatenate([eot_col, obs.tokens], 1),
                    jnp.concatenate([obs.tokens, pad_col], 1))
  chunk_len = jnp.where(active, obs.length + forced, 0)
  offset = c.cache.length
  real = jnp.arange(n + 1)[None, :] < chunk_len[:, None]
  buf = _Buffers(
      tokens=_write(c.buf.tokens, chunk, offset, active),
      loss_mask=_write(c.buf.loss_mask, jnp.zeros((b, n + 1)), offset, active),
      logprobs=_write(c.buf.logprobs, jnp.zeros((b, n + 1)), offset, active),
      turn=_write(c.buf.turn, jnp.where(real, c.t, -1), offset, active))
  logits, cache = sampler.prefill(mcfg, params, c.cache, chunk, chunk_len, OBSERVE_CHUNK)
  t = c.t
  r = c.rec
  rec = r.replace(
      valid_call=r.valid_call.at[:, t].set(active & info.valid_call),
      error_kind=r.error_kind.at[:, t].set(jnp.where(active, info.error_kind, 0)),
      oracle_match=r.oracle_match.at[:, t].set(active & info.oracle_match),
      reward=r.reward.at[:, t].set(jnp.where(active, info.reward, 0.0)),
      solved=r.solved.at[:, t].set(active & info.solved),
      obs_truncated=r.obs_truncated.at[:, t].set(active & truncated))
  ended = active & info.done
  status = jnp.where(ended, jnp.where(info.solved, Status.SOLVED, Status.ENDED), c.status)
  return c.replace(t=t + 1, cache=cache, buf=buf, rec=rec,
                   next_logits=jnp.where(active[:, None], logits, c.next_logits),
                   done=c.done | ended, status=status, num_turns=c.num_turns + active)


def _start(mcfg: ModelConfig, cfg: RolloutConfig, pad: int, action_len: int, params,
           obs0: TokenBuffer, budget, key):
  b, n0 = obs0.tokens.shape
  cache = decoder.init_cache(mcfg, b, cfg.context_len)
  logits, cache = sampler.prefill(mcfg, params, cache, obs0.tokens, obs0.length)
  l, tm = cfg.context_len, cfg.max_turns
  all_rows = jnp.ones((b,), bool)
  zeros_l = jnp.zeros((b, l))
  buf = _Buffers(tokens=_write(jnp.full((b, l), pad, jnp.int32), obs0.tokens, jnp.zeros((b,), jnp.int32), all_rows),
                 loss_mask=zeros_l, logprobs=zeros_l,
                 turn=jnp.full((b, l), -1, jnp.int32))
  fb = jnp.zeros((b, tm), bool)
  zi = jnp.zeros((b, tm), jnp.int32)
  rec = _Records(acted=fb, valid_call=fb, error_kind=zi, oracle_match=fb,
                 reward=jnp.zeros((b, tm)), solved=fb, action_length=zi, turn_start=zi,
                 actions=jnp.zeros((b, tm, action_len), jnp.int32), actions_len=zi,
                 state_id=jnp.zeros((b, tm, 2), jnp.uint32), obs_truncated=fb)
  return _Carry(t=jnp.int32(0), cache=cache, next_logits=logits, buf=buf, rec=rec,
                done=jnp.zeros((b,), bool), status=jnp.zeros((b,), jnp.int32),
                num_turns=jnp.zeros((b,), jnp.int32), budget=budget.astype(jnp.int32), key=key)


def _finish(cfg: RolloutConfig, pad: int, c: _Carry, task_id, group_id, optimal_turns,
            obs_len: int) -> Trajectory:
  _, status = _alive(c, cfg, obs_len)
  status = jnp.where(status == Status.RUNNING, Status.BUDGET_SPENT, status)
  length = c.cache.length
  b, l = c.buf.tokens.shape
  inside = jnp.arange(l)[None, :] < length[:, None]
  tm = cfg.max_turns
  first = jnp.argmax(c.rec.solved, axis=1) + 1
  return Trajectory(
      tokens=jnp.where(inside, c.buf.tokens, pad),
      positions=jnp.where(inside, jnp.arange(l)[None, :], 0).astype(jnp.int32),
      loss_mask=jnp.where(inside, c.buf.loss_mask, 0.0),
      behaviour_logprobs=jnp.where(inside, c.buf.logprobs, 0.0),
      turn_of_token=jnp.where(inside, c.buf.turn, -1),
      length=length,
      acted=c.rec.acted, valid_call=c.rec.valid_call, error_kind=c.rec.error_kind,
      oracle_match=c.rec.oracle_match, reward=c.rec.reward, solved=c.rec.solved,
      action_length=c.rec.action_length, turn_start=c.rec.turn_start,
      action_tokens=c.rec.actions, action_tokens_len=c.rec.actions_len, state_id=c.rec.state_id,
      obs_truncated=c.rec.obs_truncated,
      success_turn=jnp.where(jnp.any(c.rec.solved, axis=1), first, tm + 1).astype(jnp.int32),
      num_turns=c.num_turns, budget=c.budget, task_id=task_id.astype(jnp.int32),
      group_id=group_id.astype(jnp.int32), status=status.astype(jnp.int32),
      optimal_turns=optimal_turns.astype(jnp.int32))


def _where_tree(pred_b, new, old):
  return jax.tree.map(
      lambda x, y: jnp.where(pred_b.reshape(pred_b.shape + (1,) * (x.ndim - 1)), x, y), new, old)


def make_rollout_fn(mcfg: ModelConfig, env, cfg: RolloutConfig, forced_action=None,
                    on_trace=None):
  """Compiles the JAX-native rollout for one (model config, environment, static config).

  Returns `fn(params, key, tasks, budget[B], task_id[B], group_id[B], sampling) -> Trajectory`
  where `tasks` is a batch [B] of task pytrees; jitted once, reused for any traced inputs.

  forced_action: optional `(env_state, key) -> TokenBuffer` (one episode; vmapped here) whose
    actions replace sampling (teacher forcing: the oracle, a noisy oracle, replayed prefixes).
    They are recorded as agent tokens with the policy's log-probs at `sampling.temperature`.
  on_trace: optional `() -> None` called each time the program is traced (a recompile counter).
  """
  _check(env, cfg)
  codec = env.codec
  eot, pad = int(codec.end_of_turn_id), int(codec.pad_id)
  obs_len, action_len = step_obs_len(env), env.max_action_len
  tail = codec.truncation_tail

  def run(params, key, tasks, budget, task_id, group_id, sc):
    if on_trace is not None:
      on_trace()
    b = budget.shape[0]
    params = decoder.for_decode(mcfg, params)      # once, outside the turn loop
    k_reset, k_run = jax.random.split(key)
    reset_budget = budget if cfg.budget_visible else jnp.full_like(budget, -1)
    state, obs0 = jax.vmap(env.reset)(jax.random.split(k_reset, b), tasks, reset_budget)
    c = _start(mcfg, cfg, pad, action_len, params, obs0, budget, k_run)
    optimal = jnp.zeros((b,), jnp.int32)

    def cond(x):
      c, _, _ = x
      active, _ = _alive(c, cfg, obs_len)
      return (c.t < cfg.max_turns) & jnp.any(active)

    def body(x):
      c, state, optimal = x
      start = c.cache.length
      if forced_action is None:
        c, action, active, stopped = _act(mcfg, cfg, eot, pad, action_len, params, c, sc, obs_len)
      else:
        key, sub = jax.random.split(c.key)
        given = jax.vmap(forced_action)(state, jax.random.split(sub, b))
        c, action, active, stopped = _act_forced(mcfg, cfg, eot, pad, action_len, params,
                                                 c.replace(key=key), given, obs_len,
                                                 sc.temperature)
      c = _record_action(c, action, active, start, jax.vmap(state_fingerprint)(state))
      new_state, obs, info = jax.vmap(env.step)(state, action)
      obs, truncated = _fit_obs(obs, obs_len, tail, info)
      state = _where_tree(active, new_state, state)
      optimal = jnp.where(c.t == 0, info.optimal_turns, optimal)
      return _observe(mcfg, eot, params, c, obs, info, active, stopped, truncated), state, optimal

    c, _, optimal = jax.lax.while_loop(cond, body, (c, state, optimal))
    return _finish(cfg, pad, c, task_id, group_id, optimal, obs_len)

  return jax.jit(run)


def step_obs_len(env) -> int:
  """Width of the observations after the first (`max_step_obs_len` of the environment contract):
  later observations are far shorter than the prompt, so the engine reserves and writes only
  that much per turn."""
  return int(env.max_step_obs_len)


def _check(env, cfg: RolloutConfig):
  if not 2 <= cfg.max_action_tokens <= env.max_action_len:
    raise ValueError(f"max_action_tokens={cfg.max_action_tokens} must be in [2, the "
                     f"environment's max_action_len = {env.max_action_len}] (it counts <eot>)")
  tail = env.codec.truncation_tail.shape[0]
  if step_obs_len(env) <= tail:
    raise ValueError(f"the environment's max_step_obs_len={step_obs_len(env)} cannot hold a "
                     f"truncated observation's marker and wrapping ({tail} tokens); raise it")
  need = env.max_obs_len + cfg.max_action_tokens + 1 + step_obs_len(env)
  if cfg.context_len < need:
    raise ValueError(f"context_len={cfg.context_len} cannot hold the prompt and one turn "
                     f"(needs >= {need}); raise rollout context_len")


class HostRollout:
  """The same rollout with a host (Python) environment stepped between jitted halves.

  `env` follows `jaxagent.envs.host.HostEnv`: `reset(tasks, budget) -> (state, obs)` and
  `step(state, action) -> (state, obs, info)` on numpy arrays, plus `codec`, `max_obs_len`,
  `max_action_len`. Per turn: one jitted `act` (decode), the host `step`, one jitted `observe`
  (prefill); the output equals the JAX-native path's for the same environment and key.

  forced_action: optional `(host_state, key) -> TokenBuffer [B, A]` (numpy, the whole batch:
  e.g. `lambda s, k: env.oracle_action(s)`) whose actions replace sampling, as in
  `make_rollout_fn` (recorded as agent tokens with the policy's log-probs); the key is split
  from the rollout's key as there, so the oracle's rollouts equal the JAX path's.
  """

  def __init__(self, mcfg: ModelConfig, env, cfg: RolloutConfig, forced_action=None):
    _check(env, cfg)
    self.mcfg, self.env, self.cfg, self.forced_action = mcfg, env, cfg, forced_action
    eot, pad = int(env.codec.end_of_turn_id), int(env.codec.pad_id)
    obs_len = self.obs_len = step_obs_len(env)
    self._start = jax.jit(functools.partial(_start, mcfg, cfg, pad, env.max_action_len))

    def act(params, c, sc, state_id):
      start = c.cache.length
      c, action, active, stopped = _act(mcfg, cfg, eot, pad, env.max_action_len, params, c, sc,
                                        obs_len)
      return _record_action(c, action, active, start, state_id), action, active, stopped

    self._act = jax.jit(act)

    def act_forced(params, c, sc, state_id, given, key):
      start = c.cache.length
      c, action, active, stopped = _act_forced(mcfg, cfg, eot, pad, env.max_action_len, params,
                                               c.replace(key=key), given, obs_len,
                                               sc.temperature)
      return _record_action(c, action, active, start, state_id), action, active, stopped

    self._act_forced = jax.jit(act_forced)
    self._observe = jax.jit(functools.partial(_observe, mcfg, eot))
    tail = env.codec.truncation_tail
    self._fit = jax.jit(lambda obs, info: _fit_obs(obs, obs_len, tail, info))
    self._alive = jax.jit(lambda c: _alive(c, cfg, obs_len)[0])
    self._finish = jax.jit(lambda c, task_id, group_id, optimal: _finish(
        cfg, pad, c, task_id, group_id, optimal, obs_len))

  def __call__(self, params, key, tasks, budget, task_id, group_id, sc) -> Trajectory:
    b = budget.shape[0]
    _, k_run = jax.random.split(key)     # same key use as the JAX path (k_reset unused here)
    reset_budget = np.asarray(budget) if self.cfg.budget_visible else np.full((b,), -1, np.int32)
    state, obs0 = self.env.reset(jax.tree.map(np.asarray, tasks), reset_budget)
    c = self._start(params, _device(obs0), jnp.asarray(budget), k_run)
    optimal = np.zeros((b,), np.int32)
    for t in range(self.cfg.max_turns):
      if not bool(jnp.any(self._alive(c))):
        break
      sid = jnp.asarray(self._state_id(state, t, b))
      if self.forced_action is None:
        c, action, active, stopped = self._act(params, c, sc, sid)
      else:
        key, sub = jax.random.split(c.key)
        given = _device(self.forced_action(state, sub))
        c, action, active, stopped = self._act_forced(params, c, sc, sid, given, key)
      # Rows that are not active never act again, so stepping them too is harmless (their
      # records are masked by `active`).
      state, obs, info = self.env.step(state, jax.tree.map(np.asarray, action))
      if t == 0:
        optimal = np.asarray(info.optimal_turns)
      info = _device(info)
      obs, truncated = self._fit(_device(obs), info)
      c = self._observe(params, c, obs, info, active, stopped, truncated)
    return self._finish(c, task_id, group_id, jnp.asarray(optimal))

  def _state_id(self, state, t: int, b: int) -> np.ndarray:
    """[B, 2] uint32: the host environment's `state_fingerprint(state)` when it has one; else an
    id unique to each (row, turn), so no two steps share an anchor state (step-level credit
    then reduces to the per-turn baseline)."""
    fp = getattr(self.env, "state_fingerprint", None)
    if fp is not None:
      return np.asarray(fp(state), np.uint32)
    return np.stack([np.arange(b, dtype=np.uint32) * np.uint32(self.cfg.max_turns) + np.uint32(t),
                     np.full((b,), 0xFFFFFFFF, np.uint32)], axis=1)


def _device(tree):
  return jax.tree.map(jnp.asarray, tree)
