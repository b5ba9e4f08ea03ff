"""Compiled programs that revisit recorded episodes: replaying their actions, and acting once.

* Replay (`make_replay_fn`): the environment states of a recorded episode are rebuilt from its
  recorded actions, without a model. For an acted turn t of row b,

      s_t = step(... step(reset(task_b, budget_b), a_0) ..., a_{t-1})

  where a_i = action_tokens[b, i, :action_tokens_len[b, i]] are the actions the environment
  received (a vmapped `lax.scan` over turns), so any recorded Trajectory (oracle, a policy's, a
  hand-built one) yields the state in which each of its actions was taken.

* Next action (`make_next_action_fn`): a policy acts once from a transcript prefix (everything
  before a turn's action): the prefix is prefilled into a fresh KV cache (`sampler.prefill`), one
  action is decoded (`sampler.decode`, stopping at the codec's end-of-turn id or after
  `max_action_tokens`), and the environment steps the replayed state with it; the step's info
  says whether the action is a valid call and whether it equals the oracle's action. The same
  program measures the policy's distribution there (docs/STUDY.md, "the sharpening control"):
  the entropy of each sampled token's distribution, and the log-probability of the oracle's own
  action (its tokens and <eot>, teacher-forced from the same prefilled cache).

With a host environment (`jaxagent.envs.host.HostEnv`: Python episodes, not arrays) both have
host twins with the same signatures. The replay's "state" at (b, t) is then the recipe for it,
as arrays (the task, the reset budget and the actions of turns before t: `HostReplayState`),
and the next action rebuilds each episode from its recipe on the host (reset, then those
actions) before stepping it with the decoded action; the decoding stays jitted.

Each factory returns a freshly jitted function; its owner (`jaxagent.runs.programs.Programs`)
builds it once per (model config, environment, static settings) and hands it to the evaluators.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import TokenBuffer
from jaxagent.envs.host import HostEnv, HostState
from jaxagent.models import decoder, sampler
from jaxagent.models.config import ModelConfig


def _where_tree(pred_b, new, old):
  """Per row b: `new` where pred_b [B] is true, else `old` (leaves [B, ...])."""
  return jax.tree.map(
      lambda x, y: jnp.where(pred_b.reshape(pred_b.shape + (1,) * (x.ndim - 1)), x, y), new, old)


def make_replay_fn(env, budget_visible: bool):
  """jit(fn(tasks [B], budget [B], actions [B,T,A], actions_len [B,T], acted [B,T]) -> states
  [B, T]).

  states[b, t] (the env's state pytree, leaves [B, T, ...]) is the env state before turn t's
  action: the episode is reset with tasks[b] and stepped with the recorded actions of the acted
  turns (a turn with acted[b, t] false leaves the state unchanged). With `budget_visible` the
  reset gets `budget` (as a rollout that told the agent its budget), else -1 (hidden).
  Compiled once per (B, T, A); a new function object on every call (no cache).
  """
  budget_visible = bool(budget_visible)
  if isinstance(env, HostEnv):
    return _host_replay_fn(budget_visible)

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

  return jax.jit(run)


@struct.dataclass
class NextAction:
  """A policy's next action at each of N states and what the environment made of it."""
  tokens: jax.Array        # [N, A_env] int32 the action (no end-of-turn token; pad after length)
  length: jax.Array        # [N] int32
  valid_call: jax.Array    # [N] bool
  oracle_match: jax.Array  # [N] bool
  error_kind: jax.Array    # [N] int32 ErrorKind
  entropy: jax.Array       # [N] float32 sum over the sampled tokens (<eot> included) of the
                           # entropy of softmax(logits / T) each was drawn from (0 when greedy)
  scored: jax.Array        # [N] int32 tokens that sum runs over (the action and its <eot>)
  oracle_logp: jax.Array   # [N] float32 log p(oracle action + <eot>) at T (greedy: 0 if every
                           # token is the arg-max, else -inf)


class NextActionFn:
  """A policy's next action at N states, in two compiled halves so several decodings of the same
  states share one prefill (the bulk of the cost: ~80% of a 32-state call of the quick sokoban
  study's micro model):

      logits, cache = fn.prefill(params, prefix, prefix_len)      # the prefixes, once
      out = fn.act(params, cache, logits, env_state, key, sc)     # per decoding (key, T)
      out = fn(params, prefix, prefix_len, env_state, key, sc)    # both (one decoding)

  `act` does not consume the cache (jit copies what it updates), so it may run many times on one
  prefill: greedy, sampled and every temperature of the sharpening sweep."""

  def __init__(self, prefill, act):
    self.prefill, self.act = prefill, act

  def __call__(self, params, prefix, prefix_len, env_state, key, sc) -> "NextAction":
    logits, cache = self.prefill(params, prefix, prefix_len)
    return self.act(params, cache, logits, env_state, key, sc)


def make_next_action_fn(mcfg: ModelConfig, env, max_action_tokens: int) -> NextActionFn:
  """`NextActionFn`: fn(params, prefix [N,P], prefix_len [N], env_state [N], key, sc) ->
  NextAction, with its halves fn.prefill and fn.act.

  The KV cache holds P + max_action_tokens slots; positions are slot indices, as in a rollout,
  so greedy decoding reproduces the action a greedy rollout took at the same prefix. The action
  the environment receives is the decoded tokens without the end-of-turn token (a turn that hits
  `max_action_tokens` without it is cut there), exactly as the rollout engine does. Each half is
  compiled once per (P, N); params, contents, key and sampling knobs (`sampler.SamplingConfig`)
  are traced. A new function object on every call (no cache): build it once and share it.

  Raises:
    ValueError: unless 2 <= max_action_tokens <= env.max_action_len.
  """
  eot, pad = int(env.codec.end_of_turn_id), int(env.codec.pad_id)
  a, a_env = int(max_action_tokens), int(env.max_action_len)
  if not 2 <= a <= a_env:
    raise ValueError(f"max_action_tokens={a} must be in [2, the environment's max_action_len = "
                     f"{a_env}] (it counts the end-of-turn token)")

  def prefill(params, prefix, prefix_len):
    """(logits [N, V] of each prefix's next token, the KV cache of P + a slots holding them)."""
    n, p = prefix.shape
    cache = decoder.init_cache(mcfg, n, p + a)
    return sampler.prefill(mcfg, params, cache, prefix, prefix_len)

  def decode(params, cache, logits, key, sc, oracle: TokenBuffer):
    """(the action, the policy's distribution at these states measured: the entropy of the
    sampled tokens, how many were scored, and log p(oracle action + <eot>))."""
    n = logits.shape[0]
    gen = sampler.decode(mcfg, params, cache, logits, key, sc,
                         max_new=jnp.full((n,), a, jnp.int32),
                         stop_tokens=jnp.full((n, 1), eot, jnp.int32), max_new_tokens=a,
                         pad_id=pad, entropy=True)
    n_act = gen.lengths - gen.stopped.astype(jnp.int32)
    cols = jnp.arange(a)[None, :]
    toks = jnp.where(cols < n_act[:, None], gen.tokens, pad)
    toks = jnp.pad(toks, ((0, 0), (0, a_env - a)), constant_values=pad)
    measured = dict(entropy=gen.entropy, scored=gen.lengths,
                    oracle_logp=_forced_logp(mcfg, params, cache, logits, oracle, sc, a, eot, pad))
    return TokenBuffer(tokens=toks, length=n_act), measured

  if isinstance(env, HostEnv):
    return NextActionFn(jax.jit(prefill), _host_next_action_fn(env, jax.jit(decode)))

  def act(params, cache, logits, env_state, key, sc):
    action, measured = decode(params, cache, logits, key, sc,
                              jax.vmap(env.oracle_action)(env_state))
    _, _, info = jax.vmap(env.step)(env_state, action)
    return NextAction(tokens=action.tokens, length=action.length, valid_call=info.valid_call,
                      oracle_match=info.oracle_match, error_kind=info.error_kind, **measured)

  return NextActionFn(jax.jit(prefill), jax.jit(act))


# ---- host environments ----------------------------------------------------------------------


@struct.dataclass
class HostReplayState:
  """The recipe of host-environment states (leaves [..., ...]; one state per leading index):
  reset the task with `budget`, then step the actions of the turns where `prior` is set."""
  task: Any                 # the task pytree
  budget: jax.Array         # [] int32 the reset's budget (-1 hidden)
  actions: jax.Array        # [T, A] int32 the episode's recorded actions
  actions_len: jax.Array    # [T] int32
  prior: jax.Array          # [T] bool: the turns taken before this state


def _host_replay_fn(budget_visible: bool):
  """`make_replay_fn` for a host environment: the recipes [B, T] (numpy; nothing is stepped
  here: `_host_next_action_fn` rebuilds the states it needs)."""

  def run(tasks, budget, actions, actions_len, acted):
    budget, acted = np.asarray(budget), np.asarray(acted, bool)
    b, t = acted.shape
    reset_budget = budget if budget_visible else np.full_like(budget, -1)
    earlier = np.arange(t)[None, :] < np.arange(t)[:, None]           # [t, s]: s < t
    per_turn = lambda x: np.broadcast_to(np.asarray(x)[:, None], (b, t) + np.shape(x)[1:])
    return HostReplayState(
        task=jax.tree.map(per_turn, tasks), budget=per_turn(reset_budget),
        actions=per_turn(actions), actions_len=per_turn(actions_len),
        prior=acted[:, None, :] & earlier[None])
  return run


def rebuild_host_states(env: HostEnv, recipe: HostReplayState):
  """The host states of N recipes (leaves [N, ...]): reset, then each earlier turn's actions on
  the episodes that took that turn. Returns a `HostState` of N episodes."""
  recipe = jax.tree.map(np.asarray, recipe)
  state, _ = env.reset(recipe.task, recipe.budget)
  for t in range(recipe.prior.shape[1]):
    rows = np.flatnonzero(recipe.prior[:, t])
    if len(rows):
      sub = HostState(episodes=[state.episodes[i] for i in rows], turn=state.turn[rows],
                      budget=state.budget[rows], done=state.done[rows])
      sub, _, _ = env.step(sub, TokenBuffer(tokens=recipe.actions[rows, t],
                                            length=recipe.actions_len[rows, t]))
      state.turn[rows], state.done[rows] = sub.turn, sub.done
  return state


def _host_next_action_fn(env: HostEnv, decode):
  """`NextActionFn.act` for a host environment: the jitted decode from the prefilled cache, then
  the host step of each state rebuilt from its recipe (`rebuild_host_states`). Returns numpy
  `NextAction`s."""

  def run(params, cache, logits, env_state, key, sc):
    state = rebuild_host_states(env, env_state)
    oracle = env.oracle_action(state)          # before the step: the oracle of this state
    action, measured = jax.device_get(decode(params, cache, logits, key, sc, oracle))
    _, _, info = env.step(state, action)
    return NextAction(tokens=action.tokens, length=action.length, valid_call=info.valid_call,
                      oracle_match=info.oracle_match, error_kind=info.error_kind, **measured)
  return run


def _forced_logp(mcfg: ModelConfig, params, cache, logits, action: TokenBuffer, sc, a: int,
                 eot: int, pad: int):
  """log p(action + <eot>) [N] under the policy at sc.temperature, from a cache holding the
  prefixes and the logits [N, V] of their next token: the action (cut to a - 1 tokens, as the
  engine forces one) and <eot> are appended to the cache in one chunk. Greedy (T = 0): 0 where
  every token is the arg-max of its logits, else -inf (the deterministic policy's probability
  is 1 or 0)."""
  n = jnp.minimum(action.length, a - 1)
  toks = action.tokens[:, :a]
  toks = jnp.pad(toks, ((0, 0), (0, a - toks.shape[1])), constant_values=pad)
  cols = jnp.arange(a)[None, :]
  toks = jnp.where(cols < n[:, None], toks, jnp.where(cols == n[:, None], eot, pad))
  out, _ = decoder.apply(mcfg, params, toks, cache=cache, chunk_lens=n + 1)
  prev = jnp.concatenate([logits[:, None], out[:, :-1]], axis=1)          # [N, a, V]
  lp = jnp.take_along_axis(sampler.scaled_logprobs(prev, sc.temperature), toks[..., None],
                           -1)[..., 0]
  top = sampler.argmax_last(prev) == toks
  lp = jnp.where(sc.temperature > 0, lp, jnp.where(top, 0.0, -jnp.inf))
  return jnp.sum(jnp.where(cols <= n[:, None], lp, 0.0), axis=-1)
