"""The FLOP and byte accounting of jaxagent.planning.flops on cases worked out by hand: parameter
counts, model FLOPs of forward passes and updates, the KV bytes and the bandwidth bound of
decoding (the benchmark's measured ratios rest on these)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.planning import flops

# D=8, F=12, H=2, K=1, hd=4, V=10, N=2, float32.
CFG = ModelConfig(
    model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=False, qk_norm=False, max_position_embeddings=64)


def test_matmul_flops():
  assert flops.matmul_flops(2, 3, 4) == 2 * 2 * 3 * 4 == 48.0


def test_param_counts_by_hand():
  params = decoder.init_params(CFG, 0)
  counts = flops.param_counts(CFG, params)
  # Per layer: q 8x2x4, k 8x1x4, v 8x1x4, o 2x4x8, gate/up 8x12, down 12x8; norms are not matmuls.
  per_layer = 64 + 32 + 32 + 64 + 3 * 96
  assert counts["matmul"] == flops.matmul_params(CFG) == 2 * per_layer + 10 * 8   # + LM head
  # + 2 norms of 8 per layer, the (tied) embedding 10x8, the final norm 8.
  assert counts["total"] == 2 * per_layer + 2 * 2 * 8 + 10 * 8 + 8 == CFG.num_params()
  # Shapes suffice: the same counts from the abstract parameters.
  assert flops.param_counts(CFG, decoder.abstract_params(CFG)[1]) == counts


def test_param_counts_exclude_biases_and_count_an_untied_head():
  # Qwen2 q/k/v biases (2x4 + 2x1x4 per layer) are additions, not matmuls; an untied LM head is
  # a second 10x8 matrix in the total, still one matmul per token.
  cfg = dataclasses.replace(CFG, qkv_bias=True, tie_word_embeddings=False)
  counts = flops.param_counts(cfg, decoder.abstract_params(cfg)[1])
  assert counts["matmul"] == flops.matmul_params(CFG)
  assert counts["total"] == cfg.num_params() == CFG.num_params() + 2 * (8 + 8) + 10 * 8


def test_forward_flops_by_hand():
  counts = {"matmul": 100}
  # Two sequences of 2 and 3 tokens: 5 tokens; causal pairs 1+2 and 1+2+3 = 9; attention
  # 4 x N=2 x H=2 x hd=4 = 64 FLOPs per pair.
  got = flops.forward_flops(CFG, counts, [2, 3])
  assert got == 2 * 100 * 5 + 64 * 9 == 1576


def test_update_flops_by_hand():
  counts = {"matmul": 100}
  fwd = flops.forward_flops(CFG, counts, [2, 3])
  # 2 epochs of forward + backward (3 forwards each), plus one reference forward.
  assert flops.update_flops(CFG, counts, [2, 3], epochs=2, reference=True) == 7 * fwd
  assert flops.update_flops(CFG, counts, [2, 3], epochs=1, reference=False) == 3 * fwd


def test_kv_bytes_per_slot_by_hand():
  # k and v x 2 layers x 1 kv head x head_dim 4 x 4 bytes (float32); half in bfloat16.
  assert flops.kv_bytes_per_slot(CFG) == 2 * 2 * 1 * 4 * 4 == 64
  assert flops.kv_bytes_per_slot(dataclasses.replace(CFG, dtype="bfloat16")) == 32


def test_decode_bound_by_hand():
  # Rows with prompts of 2 and 4 tokens decoding 3 and 1 tokens: 3 steps reading the params;
  # KV slots read: row 0 2+3+4 = 9, row 1 4: 13 slots of 64 bytes.
  assert flops.decode_bound_bytes(CFG, 1000, [2, 4], [3, 1]) == 1000 * 3 + 13 * 64 == 3832
  got = flops.decode_bound_seconds(CFG, 1000, [2, 4], [3, 1], bandwidth=2.0)
  assert got == pytest.approx(3832 / 2.0)


def test_tree_bytes():
  tree = {"a": np.zeros((3, 4), np.float32), "b": [jnp.zeros((5,), jnp.bfloat16)]}
  assert flops.tree_bytes(tree) == 3 * 4 * 4 + 5 * 2


def test_utilisation_and_bandwidth_bound():
  assert flops.utilisation(50.0, 200.0) == 0.25
  # 100 tokens in 2 s; the bound reads 300 bytes at 150 B/s: 2 s, 50 tokens/s, at the bound.
  assert flops.bandwidth_bound(100, 2.0, 300.0, 150.0) == {
      "bound_seconds": 2.0, "bound_tokens_per_s": 50.0, "fraction_of_bound": 1.0}
