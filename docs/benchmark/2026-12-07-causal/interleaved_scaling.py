"""The scaling sweep's batch-256 point (256 episodes x 4 turns x 32 tokens) and 2x the context
(64 x 8 turns x 32 tokens) of builtin:micro on lookup, median of 3 after a compile, from the
checkout in the current directory (run old and new in turn; interleaved.txt)."""
import os, sys
sys.path.insert(0, os.getcwd())
import jax
from launch import benchmark as bm
import jaxagent.envs as envs
from jaxagent.models import from_pretrained
pol = from_pretrained("builtin:micro")
env = envs.make("lookup", pol.tokenizer)
a = env.max_action_len
out = []
for name, b, t in [("b256x4", 256, 4), ("b64x8", 64, 8)]:
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), b // 8))
  s, _ = bm._timed(bm._rollout_fn(pol, env, tasks, 8, t, a), 3)
  out.append("%s %.3f" % (name, s))
print(os.getcwd(), " ".join(out), flush=True)
