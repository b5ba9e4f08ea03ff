"""The CPU kernel's softmax partials (cache_attention_partials) for one layer of 64 rows x 2 kv
heads, head size 32, 2 / 50 / 98 queries per kv head (a decode step of 2 query heads; chunks of
25 and 49) over 450 valid slots: median of 20 calls (interleaved.txt, kernel rounds)."""
import sys, time, os
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from jaxagent.kernels import cpu
B, K, HD, S, NL = 64, 2, 32, 1152, 4
key = jax.random.key(0)
k_all = jax.random.normal(key, (NL, B, K, HD, S)); v_all = jax.random.normal(key, (NL, B, K, S, HD))
for L_q in [2, 50, 98]:
  for ln in [450]:
    q = jax.random.normal(key, (B, K, L_q, HD))
    length = jnp.full((B,), ln, jnp.int32)
    f = jax.jit(lambda q, k, v, l: cpu.cache_attention_partials(q, k, v, 1, l))
    jax.block_until_ready(f(q, k_all, v_all, length))
    ts = []
    for _ in range(20):
      t0 = time.perf_counter(); jax.block_until_ready(f(q, k_all, v_all, length)); ts.append(time.perf_counter() - t0)
    t = np.median(ts)
    flops = B * K * L_q * HD * 4 * ln
    byt = B * K * ln * HD * 2 * 4
    print("queries/kvhead %3d len %4d: %.3f ms  %.0f GFLOP/s  %.1f GB/s" % (L_q, ln, t * 1e3, flops / t / 1e9, byt / t / 1e9))
