"""Scripted episodes for demonstrations: the oracle, a noisy oracle, and a jitted episode runner.

A `ScriptedPolicy` acts from the environment state (not from text): `init()` gives its per-episode
carry, `act(key, state, carry) -> (action, carry, injected)`. `oracle_policy` replays the env's
oracle. `noisy_oracle_policy` injects errors: on a turn after a correct action it errs with
probability `error_rate`; after an injected error it recovers (acts as the oracle) with
probability `recovery_rate`, else errs again. Errors are drawn by kind first (uniform over the
kinds possible in that state), then uniformly among candidate actions of that kind:
  * environments that define `error_candidates(state) -> (kind [R], allowed [R])` and
    `error_action(row) -> TokenBuffer` (grid, workshop) supply their own plausible errors: typo'd
    tool names, malformed text, bad arguments, wall moves, precondition violations;
  * for the others, `generic_error_actions` corrupts the oracle's action text: the closing byte
    dropped (parse_error), the first letter doubled (unknown_tool), ", zz" added as an extra
    argument (bad_arguments).
The error actually made is what the environment reports (`Transcript.error_kind`).

`make_episode_runner` runs a batch of scripted episodes inside one jit (`lax.scan` over turns,
`vmap` over episodes) and assembles the transcript for supervised learning, following the
transcript convention of `base.py`:

  tokens[b] = obs_0 + sum over turns t of (action_t + [end_of_turn] + obs_{t+1})

with loss_mask 1 exactly on the action tokens and their end-of-turn token. Rows whose transcript
exceeds max_len are cut at max_len (`truncated`); the episodes themselves still run to the end.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import ErrorKind, TokenBuffer

NUM_KINDS = len(ErrorKind)


class ScriptedPolicy(NamedTuple):
  """A policy that acts from the env state. `act` is pure and vmappable (one episode).

  `params` is a pytree of arrays passed to `act` as a jit argument (not baked into the program),
  so a runner compiled once serves every setting of them (e.g. every error rate).
  """
  init: Callable[[], Any]                     # () -> the per-episode carry
  act: Callable[..., tuple[TokenBuffer, Any, jax.Array]]   # (params, key, state, carry) ->
  params: Any = None                          #   (action, carry, injected [] bool)


@struct.dataclass
class Transcript:
  """A batch of scripted episodes. Token level [B, L], turn level [B, T], episode level [B]."""
  tokens: jax.Array         # [B, L] int32: the transcript, pad after length
  loss_mask: jax.Array      # [B, L] float32: 1 on action tokens and their end-of-turn token
  turn_of_token: jax.Array  # [B, L] int32: turn (0-based) of action + following obs; -1 prompt/pad
  length: jax.Array         # [B] int32: valid tokens (<= L)
  truncated: jax.Array      # [B] bool: the transcript did not fit in L
  acted: jax.Array          # [B, T] bool: the episode was running at this turn
  injected: jax.Array       # [B, T] bool: the policy deliberately erred at this turn
  valid_call: jax.Array     # [B, T] bool
  error_kind: jax.Array     # [B, T] int32 ErrorKind
  oracle_match: jax.Array   # [B, T] bool
  reward: jax.Array         # [B, T] float32
  solved: jax.Array         # [B, T] bool
  action_length: jax.Array  # [B, T] int32: action tokens + the end-of-turn token (0 if not acted)
  success_turn: jax.Array   # [B] int32: first solving turn (1-based), or T + 1
  num_turns: jax.Array      # [B] int32
  optimal_turns: jax.Array  # [B] int32


def oracle_policy(env) -> ScriptedPolicy:
  """The env's oracle, every turn."""
  return ScriptedPolicy(init=lambda: jnp.zeros((), bool),
                        act=lambda params, key, state, carry: (env.oracle_action(state), carry,
                                                               jnp.zeros((), bool)))


def byte_tokens(codec) -> np.ndarray:
  """Host: [256] int32, a token id whose text is exactly that byte (-1 if the vocab has none)."""
  out = np.full((256,), -1, np.int32)
  for i in np.nonzero(codec.token_nbytes == 1)[0][::-1]:   # lowest id wins
    out[int(codec.token_bytes[i, 0])] = int(i)
  return out


def generic_error_actions(codec, oracle: TokenBuffer, table: np.ndarray) -> tuple[TokenBuffer, jax.Array]:
  """Three corruptions of an action `name(args)`, one token per byte. Jittable.

  Args:
    codec: the env's codec. oracle: the action, tokens [N]. table: `byte_tokens(codec)`.
  Returns:
    (TokenBuffer tokens [3, N] lengths [3]: the last byte dropped, the first byte doubled,
    ", zz" inserted before the last byte; kind [3] int32: the error kind each aims at).
  """
  n = oracle.tokens.shape[-1]
  data, nb = codec.to_bytes(oracle, n)
  nb = jnp.minimum(nb, n)
  i = jnp.arange(n, dtype=jnp.int32)
  drop_last = jnp.where(i < nb - 1, data, 0)
  doubled = jnp.where(i == 0, data[0], data[jnp.maximum(i - 1, 0)])
  extra = jnp.asarray(np.frombuffer(b", zz", np.uint8))
  j = i - (nb - 1)
  inserted = jnp.where(i < nb - 1, data, jnp.where(
      j < 4, extra[jnp.clip(j, 0, 3)], data[jnp.clip(i - 4, 0, n - 1)]))
  rows = jnp.stack([drop_last, doubled, inserted]).astype(jnp.int32)           # [3, N] bytes
  lengths = jnp.minimum(jnp.stack([nb - 1, nb + 1, nb + 4]), n).astype(jnp.int32)
  tokens = jnp.asarray(table)[rows]
  tokens = jnp.where(i[None, :] < lengths[:, None], tokens, codec.pad_id)
  kind = jnp.asarray([ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS],
                     jnp.int32)
  return TokenBuffer(tokens=tokens, length=lengths), kind


def _pick(u, mask):
  """A uniformly random index where mask ([K] bool) is True, from one uniform u in [0, 1)
  (0 if mask is all False)."""
  count = jnp.sum(mask)
  target = jnp.minimum((u * count).astype(jnp.int32), jnp.maximum(count - 1, 0))
  return jnp.argmax(mask & (jnp.cumsum(mask) - 1 == target)).astype(jnp.int32)


def make_error_sampler(env) -> Callable[[jax.Array, Any], tuple[TokenBuffer, jax.Array]]:
  """`sample(u, state) -> (action, kind)`: a plausible erroneous action for this state and the
  error kind it aims at (NONE if the env offers no candidate: then the action is the oracle's),
  from two uniforms u [2] in [0, 1). The kind is uniform over the kinds with a candidate, the
  action uniform within the kind."""
  kinds = jnp.arange(NUM_KINDS)
  if hasattr(env, "error_candidates"):
    def candidates(state):
      kind, allowed = env.error_candidates(state)
      return kind, allowed, env.error_action
  else:
    table = byte_tokens(env.codec)
    # Actions are printable ASCII (tool names, entity names, numbers, punctuation), and so are
    # their corruptions: only those bytes need a single-byte token (byte-level BPE vocabularies
    # such as SmolLM2's lack some control and invalid UTF-8 bytes, which no action contains).
    missing = [b for b in range(32, 127) if table[b] < 0]
    if missing:
      raise ValueError(
          f"{env.name} has no error_candidates() and its tokenizer lacks single-byte tokens for "
          f"the printable bytes {''.join(map(chr, missing))!r}, so errors cannot be spelled; "
          "give the env error_candidates/error_action.")

    def candidates(state):
      bufs, kind = generic_error_actions(env.codec, env.oracle_action(state), table)
      return kind, jnp.ones((3,), bool), lambda r: jax.tree.map(lambda x: x[r], bufs)

  def sample(u, state):
    kind, allowed, action_of = candidates(state)
    present = jnp.any((kind[None, :] == kinds[:, None]) & allowed[None, :], axis=1)
    present = present & (kinds != ErrorKind.NONE)
    chosen = _pick(u[0], present)
    row = _pick(u[1], allowed & (kind == chosen))
    any_ = jnp.any(present)
    bad = action_of(jnp.maximum(row, 0))
    good = env.oracle_action(state)
    action = jax.tree.map(lambda b, g: jnp.where(any_, b, g), bad, good)
    return action, jnp.where(any_, chosen, ErrorKind.NONE).astype(jnp.int32)

  return sample


def noisy_oracle_params(error_rate: float, recovery_rate: float) -> dict[str, jax.Array]:
  """The `params` of `noisy_oracle_policy`: {error_rate, recovery_rate} as float32 scalars."""
  if not (0.0 <= error_rate <= 1.0 and 0.0 <= recovery_rate <= 1.0):
    raise ValueError(f"error_rate and recovery_rate must be in [0, 1], got {error_rate}, "
                     f"{recovery_rate}")
  return {"error_rate": jnp.float32(error_rate), "recovery_rate": jnp.float32(recovery_rate)}


def noisy_oracle_policy(env, error_rate: float, recovery_rate: float) -> ScriptedPolicy:
  """The oracle with injected errors (see the module docstring). The carry is `in_error`; the
  rates are `params` (a runner can be called with other `noisy_oracle_params`)."""
  sample_error = make_error_sampler(env)

  def act(params, key, state, in_error):
    u = jax.random.uniform(key, (3,))   # one PRNG call per turn keeps the program small
    p_err = jnp.where(in_error, 1.0 - params["recovery_rate"], params["error_rate"])
    err = u[0] < p_err
    bad, kind = sample_error(u[1:], state)
    err = err & (kind != ErrorKind.NONE)
    good = env.oracle_action(state)
    action = jax.tree.map(lambda b, g: jnp.where(err, b, g), bad, good)
    return action, err, err

  return ScriptedPolicy(init=lambda: jnp.zeros((), bool), act=act,
                        params=noisy_oracle_params(error_rate, recovery_rate))


def _write(buf, mask, tot, length, seg_tokens, seg_valid, seg_loss, seg_turn, max_len):
  """Appends the valid entries of a segment at `length` (one episode); entries past max_len drop."""
  pos = length + jnp.cumsum(seg_valid) - 1
  pos = jnp.where(seg_valid, pos, max_len)   # out of range: dropped
  buf = buf.at[pos].set(seg_tokens, mode="drop")
  mask = mask.at[pos].set(seg_loss, mode="drop")
  tot = tot.at[pos].set(seg_turn, mode="drop")
  return buf, mask, tot, length + jnp.sum(seg_valid).astype(jnp.int32)


def make_episode_runner(env, policy: ScriptedPolicy, *, max_turns: int, max_len: int):
  """`run(keys, tasks=None, budget=-1, params=None) -> Transcript` for a batch of scripted
  episodes, jitted.

  Args (of run):
    keys: [B] PRNG keys (one per episode: reset when tasks is None, and the policy's noise).
    tasks: a batched task pytree (leading axis B), or None to sample tasks from the keys.
    budget: [B] (or scalar) int32 interaction budgets (-1: hidden, else shown to the agent);
      an episode stops acting once it has taken `budget` turns (as in the rollout engine).
    params: the policy's params (default `policy.params`), shared by all episodes.
  Each call with the same shapes reuses one compiled program (`run.traces` counts the traces):
  reset, then a `lax.scan` over max_turns turns of (policy act, env step, transcript append), all
  vmapped over B.
  """
  eot = env.codec.end_of_turn_id
  pad = env.codec.pad_id
  step_obs_len = int(getattr(env, "max_step_obs_len", env.max_obs_len))

  def one_episode(params, key, task, budget):
    keys = jax.random.split(key, max_turns + 1)   # reset, then one per turn
    state, obs = env.reset(keys[0], task, budget)
    n0 = obs.tokens.shape[0]
    buf = jnp.full((max_len,), pad, jnp.int32)
    mask = jnp.zeros((max_len,), jnp.float32)
    tot = jnp.full((max_len,), -1, jnp.int32)
    valid0 = jnp.arange(n0) < obs.length
    buf, mask, tot, length = _write(buf, mask, tot, jnp.int32(0), obs.tokens, valid0,
                                    jnp.zeros((n0,), jnp.float32), jnp.full((n0,), -1, jnp.int32),
                                    max_len)

    def turn(carry, xs):
      t, k_turn = xs
      state, pcarry, buf, mask, tot, length = carry
      live = ~state.done & ((budget < 0) | (t < budget))
      action, pcarry, injected = policy.act(params, k_turn, state, pcarry)
      state, obs, info = env.step(state, action)
      # Later observations of envs that declare `max_step_obs_len` fit in that prefix.
      obs = obs.replace(tokens=obs.tokens[:step_obs_len])
      a, n = action.tokens.shape[0], obs.tokens.shape[0]
      seg_tokens = jnp.concatenate([action.tokens, jnp.asarray([eot], jnp.int32), obs.tokens])
      seg_valid = jnp.concatenate([jnp.arange(a) < action.length, jnp.ones((1,), bool),
                                   jnp.arange(n) < obs.length]) & live
      seg_loss = jnp.concatenate([jnp.ones((a + 1,), jnp.float32), jnp.zeros((n,), jnp.float32)])
      seg_turn = jnp.full((a + 1 + n,), t, jnp.int32)
      buf, mask, tot, length = _write(buf, mask, tot, length, seg_tokens, seg_valid, seg_loss,
                                      seg_turn, max_len)
      record = dict(acted=live, injected=injected & live, valid_call=info.valid_call & live,
                    error_kind=jnp.where(live, info.error_kind, ErrorKind.NONE),
                    oracle_match=info.oracle_match & live, reward=jnp.where(live, info.reward, 0.0),
                    solved=info.solved & live,
                    action_length=jnp.where(live, action.length + 1, 0).astype(jnp.int32),
                    optimal_turns=info.optimal_turns)   # the task's, also after done
      return (state, pcarry, buf, mask, tot, length), record

    init = (state, policy.init(), buf, mask, tot, length)
    (state, _, buf, mask, tot, length), rec = jax.lax.scan(
        turn, init, (jnp.arange(max_turns, dtype=jnp.int32), keys[1:]))
    turns = jnp.arange(1, max_turns + 1, dtype=jnp.int32)
    success = jnp.min(jnp.where(rec["solved"], turns, max_turns + 1))
    return Transcript(
        tokens=buf, loss_mask=mask, turn_of_token=tot, length=jnp.minimum(length, max_len),
        truncated=length > max_len, acted=rec["acted"], injected=rec["injected"],
        valid_call=rec["valid_call"], error_kind=rec["error_kind"],
        oracle_match=rec["oracle_match"], reward=rec["reward"], solved=rec["solved"],
        action_length=rec["action_length"], success_turn=success.astype(jnp.int32),
        num_turns=jnp.sum(rec["acted"]).astype(jnp.int32),
        optimal_turns=rec["optimal_turns"][0].astype(jnp.int32))

  traces = []

  @jax.jit
  def run(params, keys, tasks, budget):
    traces.append(1)   # runs once per trace
    return jax.vmap(one_episode, in_axes=(None, 0, 0, 0))(params, keys, tasks, budget)

  def run_episodes(keys, tasks=None, budget=-1, params=None) -> Transcript:
    b = keys.shape[0]
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), (b,))
    return run(policy.params if params is None else params, keys, tasks, budget)

  run_episodes.traces = traces
  return run_episodes
