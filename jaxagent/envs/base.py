"""The JAX-native environment contract (gymnax style: pure functions, vmappable, jittable).

An environment is a Python object built once on the host (from a tokenizer, through a
`TextCodec`) that holds static tables as arrays; its methods are pure functions of their inputs:

    state, obs = env.reset(key)                 # a random task
    state, obs = env.reset(key, task)           # a given task instance (a pytree of arrays)
    state, obs, info = env.step(state, action)
    action = env.oracle_action(state)           # the expert's next action, as tokens

`obs` and `action` are `TokenBuffer`s: fixed-size int32 token arrays plus a length, so a batch of
episodes has static shapes and `jit(vmap(env.step))` compiles once.

Transcript convention (what the rollout engine and the demonstration builder rely on):
  * the first observation is the whole prompt: chat-template system turn (tools + task), the user
    turn, and the assistant header, e.g. for ChatML
    "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n";
  * an action is the text the agent generated for one turn, *without* the end-of-turn token; in the
    transcript the action is always followed by `env.codec.end_of_turn_id` (sampled by the policy,
    or appended by the engine when the turn hit its token limit);
  * every later observation continues the transcript right after that end-of-turn token: the
    template's text between turns, the tool/user turn with the result or error message, and the
    next assistant header.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct


class ErrorKind(enum.IntEnum):
  """What went wrong with an action. Stored as int32 in `StepInfo.error_kind`."""
  NONE = 0
  PARSE_ERROR = 1          # the text is not `name(args)`: empty, garbage, unbalanced, bad UTF-8
  UNKNOWN_TOOL = 2         # well formed, but names no tool of this environment
  BAD_ARGUMENTS = 3        # known tool, wrong number / type / range of arguments
  TOOL_FAILURE = 4         # valid call that the tool rejects (no such entry, a wall in the way)
  PRECONDITION_FAILED = 5  # valid call not possible in the current state (door locked, ...)
  WRONG_ANSWER = 6         # a final answer that is wrong (ends the episode unsolved)
  IRREVERSIBLE = 7         # an executed, valid action after which the task cannot be solved any
                           # more (sokoban: a push into a deadlock); valid_call is True


ERROR_KIND_NAMES = tuple(k.name.lower() for k in ErrorKind)


@struct.dataclass
class TokenBuffer:
  """A fixed-size token buffer: tokens[..., N] int32 (padding after `length` is ignored)."""
  tokens: jax.Array  # [..., N] int32
  length: jax.Array  # [...] int32


@struct.dataclass
class StepInfo:
  """Per-step outcome. All fields are arrays (scalars per episode; vmapped: [B])."""
  reward: jax.Array         # float32: 1.0 on the solving step, else 0.0 (shaping is the learner's)
  done: jax.Array           # bool: the episode ended (solved, final answer given, or failed)
  solved: jax.Array         # bool: the task is solved at this step
  final_answer: jax.Array   # bool: the action was a final answer (right or wrong)
  valid_call: jax.Array     # bool: the action parsed and named a tool with valid arguments
  error_kind: jax.Array     # int32: an `ErrorKind`
  oracle_match: jax.Array   # bool: the action equals the oracle's action in the pre-step state
  optimal_turns: jax.Array  # int32: the task's optimal number of turns (from the reset state)
  # bool: the observation was cut to fit `max_step_obs_len` (as text, with
  # `codec.TRUNCATION_MARKER` and the chat wrapping kept; host environments, whose tools print
  # any length). None: the environment's observations always fit (the JAX environments size
  # their buffers from their fragments' capacities).
  obs_truncated: Any = None


class Environment(Protocol):
  """What every JAX-native environment provides (see the module docstring)."""
  name: str
  codec: Any            # the `TextCodec` it renders and parses with
  max_obs_len: int      # N of every observation TokenBuffer
  max_step_obs_len: int  # observations after the first fit in their first this-many tokens
  max_action_len: int   # N of action TokenBuffers (longer actions are a parse error)

  def sample_task(self, key: jax.Array) -> Any: ...
  def reset(self, key: jax.Array, task: Any = None, budget: jax.Array | int = -1) -> tuple[Any, TokenBuffer]: ...
  def step(self, state: Any, action: TokenBuffer) -> tuple[Any, TokenBuffer, StepInfo]: ...
  def oracle_action(self, state: Any) -> TokenBuffer: ...


def empty_buffer(n: int) -> TokenBuffer:
  return TokenBuffer(tokens=jnp.zeros((n,), jnp.int32), length=jnp.zeros((), jnp.int32))


# ---- state identity -----------------------------------------------------------------------------

# Bookkeeping fields of a state dataclass that do not make two states different for credit
# assignment: the turn counter and the budget (two episodes that reach the same position at
# different turns are at the same anchor state).
IDENTITY_EXCLUDED = ("turn", "budget")


def _mix32(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: every input bit affects every output bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def identity_words(state: Any) -> jax.Array:
  """The state's content as one uint32 vector [S] (one episode; the fields in
  `IDENTITY_EXCLUDED` left out): equal vectors <=> identical states."""
  if dataclass_fields := getattr(state, "__dataclass_fields__", None):
    state = {k: getattr(state, k) for k in dataclass_fields if k not in IDENTITY_EXCLUDED}
  words = []
  for leaf in jax.tree.leaves(state):
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
      leaf = leaf.astype(jnp.uint32)
    elif jnp.issubdtype(leaf.dtype, jnp.floating):
      leaf = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32)
    else:
      leaf = leaf.astype(jnp.int32).view(jnp.uint32) if leaf.dtype != jnp.uint32 else leaf
    words.append(leaf.reshape(-1))
  return jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)


def state_fingerprint(state: Any) -> jax.Array:
  """[2] uint32: a 64-bit hash of `identity_words(state)` (one episode; vmap for a batch).

  Two hashes with different seeds, each sum_i mix(w_i ^ mix(i + seed)) over the words: identical
  states always get the same fingerprint; different ones collide with probability ~2^-64 per pair.
  """
  w = identity_words(state)
  i = jnp.arange(w.shape[0], dtype=jnp.uint32)
  out = []
  for seed in (jnp.uint32(0x9E3779B9), jnp.uint32(0x7F4A7C15)):
    out.append(jnp.sum(_mix32(w ^ _mix32(i * jnp.uint32(2654435761) + seed)), dtype=jnp.uint32)
               ^ _mix32(jnp.uint32(w.shape[0]) + seed))
  return jnp.stack(out)
