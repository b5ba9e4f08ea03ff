"""Rollout throughput: the fully jitted multi-turn rollout against the naive way, side by side.

    python -m launch.benchmark [--model=builtin:tiny] [--env=lookup] [--tasks=8] [--group=8]
                               [--turns=8] [--out=workdirs/benchmark]

Measured in one process, same model, same tasks, same budgets:
  * jax:   `jaxagent.rollout.rollout` with the JAX-native environment (one compiled program);
  * host:  the same engine with the host (Python) environment between jitted turn halves;
  * naive: what users write today: a Python loop over turns that re-encodes the whole history
           with `policy.generate` each turn and steps a Python environment.
Each is run once to compile, then timed over --repeats runs (median). Writes benchmark.json and
benchmark.md. (Issue 9 extends this with update-step MFU and scaling curves.)
"""

import json
import pathlib
import statistics
import time

import jax
import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "builtin:tiny", "builtin:NAME or a local HF directory.")
_ENV = flags.DEFINE_string("env", "lookup", "Environment (the host path exists for lookup).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks per batch.")
_GROUP = flags.DEFINE_integer("group", 8, "Episodes per task.")
_TURNS = flags.DEFINE_integer("turns", 8, "Budget (turns) of every episode.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per method (median reported).")
_OUT = flags.DEFINE_string("out", "workdirs/benchmark", "Output directory.")


def _timed(fn, repeats):
  fn()                                          # compile / warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def naive_rollout(policy, host_env, tasks, budget: int, max_new: int, seed: int):
  """Python loop over turns; each turn re-encodes the full history of every episode."""
  state, obs = host_env.reset(tasks, -1)
  b = len(obs.length)
  history = [list(obs.tokens[i, :obs.length[i]]) for i in range(b)]
  eot = host_env.codec.end_of_turn_id
  done = np.zeros(b, bool)
  generated = 0
  for t in range(budget):
    live = np.flatnonzero(~done)
    if not len(live):
      break
    outs = policy.generate([history[i] for i in live], max_new, temperature=1.0, seed=seed + t,
                           stop_tokens=[eot])
    actions = np.full((b, host_env.max_action_len), host_env.codec.pad_id, np.int32)
    lengths = np.zeros(b, np.int32)
    for i, o in zip(live, outs):
      generated += len(o)
      act = o[:-1] if o and o[-1] == eot else o
      actions[i, :len(act)] = act
      lengths[i] = len(act)
      history[i] = history[i] + list(o) + ([] if o and o[-1] == eot else [eot])
    from jaxagent.envs.base import TokenBuffer
    state, obs, info = host_env.step(state, TokenBuffer(actions, lengths))
    for i in live:
      history[i] += list(obs.tokens[i, :obs.length[i]])
    done |= np.asarray(info.done)
  return generated


def main(argv):
  del argv
  import jaxagent.envs as envs
  from jaxagent.envs.host import HostLookupEnv
  from jaxagent.models import from_pretrained
  from jaxagent.rollout import rollout
  policy = from_pretrained(_MODEL.value)
  env = envs.make(_ENV.value, policy.tokenizer)
  host = HostLookupEnv(env.codec)
  n, g, turns = _TASKS.value, _GROUP.value, _TURNS.value
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), n))
  a = env.max_action_len
  results = {}

  def run(e):
    traj = rollout(policy, e, jax.random.key(1), tasks, g, turns, max_turns=turns,
                   max_action_tokens=a)
    jax.block_until_ready(traj.tokens)
    return traj

  for name, e in (("jax", env), ("host", host)):
    secs, traj = _timed(lambda: run(e), _REPEATS.value)
    toks = float(np.asarray(traj.loss_mask).sum())
    results[name] = {"seconds": secs, "episodes_per_s": n * g / secs,
                     "generated_tokens_per_s": toks / secs,
                     "turns": int(np.asarray(traj.num_turns).sum())}
  rep_tasks = jax.tree.map(lambda x: np.repeat(np.asarray(x), g, axis=0), tasks)
  secs, toks = _timed(lambda: naive_rollout(policy, host, rep_tasks, turns, a, 0), _REPEATS.value)
  results["naive"] = {"seconds": secs, "episodes_per_s": n * g / secs,
                      "generated_tokens_per_s": toks / secs}
  for k in ("host", "naive"):
    results[k]["jax_speedup"] = results[k]["seconds"] / results["jax"]["seconds"]
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  meta = {"model": _MODEL.value, "env": _ENV.value, "episodes": n * g, "turns": turns,
          "devices": [str(d) for d in jax.devices()][:1], "results": results}
  (out / "benchmark.json").write_text(json.dumps(meta, indent=2))
  lines = ["| method | seconds | episodes/s | generated tokens/s | jax speed-up |",
           "|---|---|---|---|---|"]
  for k, r in results.items():
    lines.append(f"| {k} | {r['seconds']:.2f} | {r['episodes_per_s']:.1f} | "
                 f"{r['generated_tokens_per_s']:.0f} | {r.get('jax_speedup', 1.0):.1f}x |")
  (out / "benchmark.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
