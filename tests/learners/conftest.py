"""Shared helpers for the learner tests: a hand-built `Trajectory` and a very small decoder."""

import dataclasses

import numpy as np
import jax.numpy as jnp
import pytest

from jaxagent.models.config import ModelConfig
from jaxagent.models.scoring import token_logprobs
from jaxagent.rollout.trajectory import Status, Trajectory


def build_trajectory(*, tokens, length, loss_mask, acted, valid_call, solved, num_turns,
                     group_id, behaviour_logprobs=None, turn_of_token=None, oracle_match=None,
                     error_kind=None, state_id=None) -> Trajectory:
  """A Trajectory from numpy arrays; every field gets a value consistent with the given ones."""
  tokens = np.asarray(tokens, np.int32)
  b, l = tokens.shape
  acted = np.asarray(acted, bool)
  t = acted.shape[1]
  solved = np.asarray(solved, bool)
  length = np.asarray(length, np.int32)
  success_turn = np.where(solved.any(1), solved.argmax(1) + 1, t + 1).astype(np.int32)
  status = np.where(solved.any(1), Status.SOLVED, Status.BUDGET_SPENT).astype(np.int32)
  slot = np.arange(l)[None, :]
  fields = dict(
      tokens=jnp.asarray(tokens),
      positions=jnp.asarray(np.where(slot < length[:, None], slot, 0).astype(np.int32)),
      loss_mask=jnp.asarray(np.asarray(loss_mask, np.float32)),
      behaviour_logprobs=jnp.asarray(np.zeros((b, l), np.float32) if behaviour_logprobs is None
                                     else np.asarray(behaviour_logprobs, np.float32)),
      turn_of_token=jnp.asarray(np.full((b, l), -1, np.int32) if turn_of_token is None
                                else np.asarray(turn_of_token, np.int32)),
      length=jnp.asarray(length),
      acted=jnp.asarray(acted),
      valid_call=jnp.asarray(np.asarray(valid_call, bool)),
      error_kind=jnp.asarray(np.where(np.asarray(valid_call, bool), 0, 1).astype(np.int32)
                             if error_kind is None else np.asarray(error_kind, np.int32)),
      oracle_match=jnp.asarray(np.zeros((b, t), bool) if oracle_match is None
                               else np.asarray(oracle_match, bool)),
      reward=jnp.asarray(solved.astype(np.float32)),
      solved=jnp.asarray(solved),
      action_length=jnp.asarray(np.where(acted, 3, 0).astype(np.int32)),
      success_turn=jnp.asarray(success_turn),
      num_turns=jnp.asarray(np.asarray(num_turns, np.int32)),
      budget=jnp.asarray(np.full((b,), t, np.int32)),
      task_id=jnp.asarray(np.asarray(group_id, np.int32)),
      group_id=jnp.asarray(np.asarray(group_id, np.int32)),
      status=jnp.asarray(status),
      optimal_turns=jnp.asarray(np.full((b,), 2, np.int32)),
      turn_start=jnp.asarray(np.zeros((b, t), np.int32)),
      action_tokens=jnp.asarray(np.zeros((b, t, 4), np.int32)),
      action_tokens_len=jnp.asarray(np.where(acted, 3, 0).astype(np.int32)),
      state_id=jnp.asarray(np.zeros((b, t, 2), np.uint32) if state_id is None
                           else np.asarray(state_id, np.uint32)),
      obs_truncated=jnp.zeros((b, t), bool),
  )
  # The Trajectory grows fields over time; give the ones it has (the constructor rejects a
  # missing one, so this never silently leaves a field out).
  names = {f.name for f in dataclasses.fields(Trajectory)}
  return Trajectory(**{k: v for k, v in fields.items() if k in names})


@pytest.fixture
def make_trajectory():
  return build_trajectory


BATCH, LENGTH, TURNS = 8, 16, 2


def build_batch(cfg, params, seed, solved_rows) -> Trajectory:
  """8 episodes in 4 groups of 2 with random tokens; agent tokens at slots 4..7 and 10..length-1;
  behaviour log-probs from `params` (ratio 1 at the start, as after a real rollout); rows
  `solved_rows` solve on their second turn."""
  b, l, t = BATCH, LENGTH, TURNS
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.vocab_size, (b, l)).astype(np.int32)
  length = rng.integers(12, l + 1, (b,)).astype(np.int32)
  slot = np.arange(l)[None, :]
  mask = (((slot >= 4) & (slot < 8)) | (slot >= 10)) & (slot < length[:, None])
  behaviour = np.asarray(token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(length)))
  solved = np.zeros((b, t), bool)
  solved[list(solved_rows), 1] = True
  return build_trajectory(tokens=tokens, length=length, loss_mask=mask.astype(np.float32),
                          acted=np.ones((b, t), bool), valid_call=np.ones((b, t), bool),
                          solved=solved, num_turns=np.full((b,), t),
                          group_id=np.repeat(np.arange(b // 2), 2),
                          behaviour_logprobs=behaviour * mask)


@pytest.fixture
def make_batch():
  return build_batch


# A decoder small enough that its gradient compiles in a second or two on CPU.
SMALL_MODEL = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=True, qk_norm=False, max_position_embeddings=256)


@pytest.fixture(scope="session")
def small_model():
  return SMALL_MODEL
