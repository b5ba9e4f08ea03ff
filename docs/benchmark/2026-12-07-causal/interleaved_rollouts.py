"""The peers' rollout (64 x 8 turns x <= 16 tokens, 4 hops) and the default config's rollout
(builtin:micro, 8 tasks x 8, 8 turns), median of 5 after a compile, timed with launch.benchmark's
functions from the checkout in the current directory. Run from an old and a new checkout in turn:
  cd /tmp/old && /path/to/.venv/bin/python /path/to/interleaved_rollouts.py
(interleaved.txt)."""
import os, sys, time, statistics
sys.path.insert(0, os.getcwd())
import jax, numpy as np
from launch import benchmark as bm
import jaxagent.envs as envs
from jaxagent.models import from_pretrained
base = from_pretrained("builtin:micro")
out = []
for name, pol, kw, tpt in [("peers", bm.random_policy(base, seed=0, **bm.PEER), dict(hops=bm.PEER_HOPS), 16), ("micro", base, {}, None)]:
  env = envs.make("lookup", pol.tokenizer, **kw)
  if name == "peers":
    tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 64)); group = 1
  else:
    tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 8)); group = 8
  run = bm._rollout_fn(pol, env, tasks, group, 8, tpt)
  s, _ = bm._timed(run, 5)
  out.append("%s %.3f" % (name, s))
print(os.getcwd(), " ".join(out))
