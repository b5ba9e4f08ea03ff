"""The default config's RL step (rollout + update) and the peers' rollout, timed with
launch.benchmark's own functions from whichever checkout is first on PYTHONPATH; run it from an
old and a new checkout in turn (interleaved.txt). Prints one JSON line."""
import json
import jax
from absl import flags
flags.FLAGS(["x"])
import launch.benchmark as B
from jaxagent import envs
from jaxagent.models.policy import from_pretrained
reps = 3
policy = from_pretrained("builtin:micro")
env = envs.make("lookup", policy.tokenizer)
tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 8))
secs, traj = B._timed(B._rollout_fn(policy, env, tasks, 8, 8), reps)
row = B._rollout_row(secs, traj, 64)
up = B.update_step(policy, traj, reps)
res = {"rollout": secs, "tokens": row["generated_tokens"], "update": up["seconds"]}
if hasattr(B, "PEER"):
  p = B.random_policy(policy, seed=0, **B.PEER)
  penv = envs.make("lookup", p.tokenizer, hops=B.PEER_HOPS)
  ptasks = jax.vmap(penv.sample_task)(jax.random.split(jax.random.key(0), B.PEER_EPISODES))
  s2, t2 = B._timed(B._rollout_fn(p, penv, ptasks, 1, B.PEER_TURNS, B.PEER_TOKENS), reps)
  res["peer_rollout"] = s2
print(json.dumps(res))
