"""FLOP and byte accounting of the decoder: model FLOPs of forward passes and updates, and the
memory-bandwidth bound of decoding. Pure arithmetic on a ModelConfig and token counts; the
measurements these are compared with (peak FLOP/s, read bandwidth, timed rollouts and updates)
are `jaxagent.bench`'s.

    counts = flops.param_counts(cfg, params)           # {"total": ..., "matmul": ...}
    fwd = flops.forward_flops(cfg, counts, lengths)    # lengths [B]: real tokens per sequence
    upd = flops.update_flops(cfg, counts, lengths, epochs=1, reference=True)
    secs = flops.decode_bound_seconds(cfg, param_bytes, prompt_lens, new_tokens, bandwidth)

Notation: D hidden, F intermediate, H heads, K kv heads, hd head_dim, V vocab, N layers, c the
compute dtype's bytes; a sequence of L real tokens; a decoded row with a prompt of P tokens that
generates n tokens.

  matmul params  M = N * (2*D*H*hd + 2*D*K*hd + 3*D*F) + V*D   (q, o; k, v; gate, up, down;
                 the LM head, tied or not). Norms and biases are not matmuls.
  forward FLOPs  = 2 * M * sum_b L_b  +  4 * N * H * hd * sum_b L_b * (L_b + 1) / 2
                 (2 FLOPs per matmul parameter per token; causal attention: QK^T and PV each
                 2 * H * hd FLOPs per (query, earlier-or-same key) pair per layer)
  update FLOPs   = (3 * epochs + [reference]) * forward FLOPs   (forward + backward = 3 forwards
                 per epoch over the batch; one forward for the reference log-probs)
  KV bytes/slot  = 2 * N * K * hd * c   (k and v of one token in every layer)
  decode bound   = (param_bytes * max_b n_b + kv_bytes_per_slot * sum_b (n_b * P_b
                 + n_b * (n_b - 1) / 2)) / bandwidth
                 (each of the max_b n_b decode steps reads the parameters once; row b's step t
                 reads its P_b + t cached slots)
  MFU            = achieved model FLOP/s / peak FLOP/s
  bound fraction = decode bound seconds / measured decode seconds (1 = at the bandwidth limit)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxagent.models.config import ModelConfig


def matmul_flops(m: int, k: int, n: int) -> float:
  """FLOPs of an [m, k] x [k, n] matmul: 2 * m * k * n (one multiply and one add per term)."""
  return 2.0 * m * k * n


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters used in matmuls per token: N * (2*D*H*hd + 2*D*K*hd + 3*D*F) + V*D (the
  attention projections, the MLP and the LM head; norms and q/k/v biases excluded)."""
  d, f, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  layer = 2 * d * h * hd + 2 * d * k * hd + 3 * d * f
  return cfg.num_layers * layer + cfg.vocab_size * d


def param_counts(cfg: ModelConfig, params: Any) -> dict[str, int]:
  """{"total": elements of every leaf of `params` (arrays or ShapeDtypeStructs), "matmul":
  `matmul_params(cfg)`}."""
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return {"total": total, "matmul": matmul_params(cfg)}


def tree_bytes(tree: Any) -> int:
  """Bytes of every leaf of a tree of arrays (global sizes, not per device)."""
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def forward_flops(cfg: ModelConfig, counts: dict, lengths) -> float:
  """Model FLOPs of one forward pass over sequences of these lengths (real tokens only):
  2 * counts["matmul"] * sum(L) + 4 * N * H * hd * sum(L * (L + 1) / 2)."""
  lengths = np.asarray(lengths, np.float64)
  tokens = lengths.sum()
  pairs = (lengths * (lengths + 1) / 2).sum()
  attention = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
  return 2.0 * counts["matmul"] * tokens + attention


def update_flops(cfg: ModelConfig, counts: dict, lengths, *, epochs: int,
                 reference: bool) -> float:
  """Model FLOPs of one RL update over sequences of these lengths: (3 * epochs + reference) *
  `forward_flops` (forward and backward of every epoch, plus the reference model's forward)."""
  passes = 3 * epochs + (1 if reference else 0)
  return passes * forward_flops(cfg, counts, lengths)


def kv_bytes_per_slot(cfg: ModelConfig) -> int:
  """Bytes of one token's k and v over all layers: 2 * N * K * hd * c (compute dtype)."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.itemsize


def decode_bound_bytes(cfg: ModelConfig, param_bytes: int, prompt_lens, new_tokens) -> float:
  """Bytes decoding must read: the parameters once per decode step (max n steps) plus, per row
  and step, the row's KV cache so far: sum_b n_b * P_b + n_b * (n_b - 1) / 2 slots."""
  prompt_lens = np.asarray(prompt_lens, np.float64)
  n = np.asarray(new_tokens, np.float64)
  kv_slots = (n * prompt_lens + n * (n - 1) / 2).sum()
  return float(param_bytes * n.max() + kv_slots * kv_bytes_per_slot(cfg))


def decode_bound_seconds(cfg: ModelConfig, param_bytes: int, prompt_lens, new_tokens,
                         bandwidth: float) -> float:
  """Time to read `decode_bound_bytes` at `bandwidth` bytes/s: no decode can be faster."""
  return decode_bound_bytes(cfg, param_bytes, prompt_lens, new_tokens) / bandwidth


def utilisation(flops_per_s: float, peak_flops_per_s: float) -> float:
  """Model FLOP utilisation: achieved model FLOP/s over the peak FLOP/s."""
  return flops_per_s / peak_flops_per_s


def bandwidth_bound(tokens: int, seconds: float, bound_bytes: float,
                    bandwidth: float) -> dict[str, float]:
  """A decode of `tokens` tokens that took `seconds` against its bandwidth bound:
  bound_seconds = bound_bytes / bandwidth, bound_tokens_per_s = tokens / bound_seconds, and
  fraction_of_bound = bound_seconds / seconds (1 = at the bound)."""
  bound_seconds = bound_bytes / bandwidth
  return {"bound_seconds": bound_seconds, "bound_tokens_per_s": tokens / bound_seconds,
          "fraction_of_bound": bound_seconds / seconds}
