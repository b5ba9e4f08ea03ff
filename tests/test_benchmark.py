"""The benchmark's accounting, on cases worked out by hand: model FLOPs, parameter counts and
the memory-bandwidth bound of decoding (the measured ratios rest on these)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from launch import benchmark

CFG = ModelConfig(
    model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=False, qk_norm=False, max_position_embeddings=64)


def test_param_counts_by_hand():
  params = decoder.init_params(CFG, 0)
  counts = benchmark.param_counts(CFG, params)
  # Per layer: q 8x2x4, k 8x1x4, v 8x1x4, o 2x4x8, gate/up 8x12, down 12x8; norms are not matmuls.
  per_layer = 64 + 32 + 32 + 64 + 3 * 96
  assert counts["matmul"] == 2 * per_layer + 10 * 8            # + the (tied) LM head
  assert counts["total"] == 2 * per_layer + 2 * 2 * 8 + 10 * 8 + 8


def test_forward_flops_by_hand():
  counts = {"matmul": 100}
  # Two sequences of 2 and 3 tokens: 5 tokens; causal pairs 1+2 and 1+2+3 = 9.
  got = benchmark.forward_flops(CFG, counts, [2, 3])
  assert got == 2 * 100 * 5 + 4 * 2 * 2 * 4 * 9


def test_decode_bound_by_hand():
  # Rows with prompts of 2 and 4 tokens decoding 3 and 1 tokens: 3 steps reading the params;
  # KV slots read: row 0 2+3+4, row 1 4.
  per_slot = benchmark.kv_bytes_per_slot(CFG)
  assert per_slot == 2 * 2 * 1 * 4 * 4
  got = benchmark.decode_bound_seconds(CFG, 1000, [2, 4], [3, 1], bandwidth=2.0)
  assert got == pytest.approx((1000 * 3 + 13 * per_slot) / 2.0)


def test_random_policy_sizes():
  class Base:
    config = CFG
    tokenizer = None
  big = benchmark.random_policy(Base, hidden_size=16, num_layers=3, dtype="bfloat16")
  assert big.config.num_layers == 3 and big.config.vocab_size == 10
  leaves = jax.tree.leaves(big.params)
  assert all(x.dtype == np.dtype("bfloat16") for x in leaves)
  assert big.params["embed"].shape == (10, 16)
  assert dataclasses.replace(CFG, hidden_size=16, num_layers=3, dtype="bfloat16",
                             param_dtype="bfloat16") == big.config
