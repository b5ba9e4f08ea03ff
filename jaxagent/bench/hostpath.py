"""The host path against the JAX path: `lookup` (pure JAX) and `host_lookup` (the same tool in
Python, `jaxagent.envs.host`) stepping the same tasks with the same (oracle) actions, no model.

  * jax:          reset, then every turn the oracle's action and a step, as one jitted program
                  (`lax.scan` over turns, `vmap` over episodes);
  * host:         `HostEnv.reset`, then per turn `oracle_action` and `step` on the host, its
                  episodes on the env's thread pool (`num_threads`);
  * host_serial:  the same with one thread;
  * slow tool:    the host path on a tool that waits `sleep_ms` per call (a database, a
                  sandbox), with the thread pool and serially: what the threads buy.

Turns are the episode steps actually taken (done episodes stop counting). Methods run
interleaved, `repeats` rounds after an untimed one (compilation), and each reports its median.
The rollouts' episodes/s (model included) are the rollout section's jax and host rows.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.envs.host import HostEnv, HostLookupEnv, HostLookupEpisode


class _SlowEpisode:
  """A `HostLookupEpisode` whose tool waits `sleep` seconds per call."""

  def __init__(self, episode, sleep: float):
    self.episode, self.sleep = episode, sleep
    self.optimal_turns = episode.optimal_turns

  def prompt(self):
    return self.episode.prompt()

  def act(self, call):
    time.sleep(self.sleep)
    return self.episode.act(call)

  def oracle(self):
    return self.episode.oracle()


def slow_lookup(host: HostLookupEnv, sleep: float, num_threads: int) -> HostEnv:
  """`host`'s tool (same buffers) waiting `sleep` seconds per call, on `num_threads` threads."""
  j, hops = host.jax_env, host.jax_env.hops
  return HostEnv(host.codec, lambda task: _SlowEpisode(HostLookupEpisode(task, hops), sleep),
                 max_obs_len=j.max_obs_len, max_action_len=j.max_action_len,
                 max_action_bytes=j.max_action_bytes, name="slow_lookup",
                 max_step_obs_len=j.max_step_obs_len, num_threads=num_threads)


def jax_steps(env, tasks, turns: int):
  """A jitted run of the oracle's episodes of `tasks` (leading axis B) for `turns` turns;
  returns () -> turns taken."""

  @jax.jit
  def run(tasks):
    b = jax.tree.leaves(tasks)[0].shape[0]
    state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), b), tasks,
                                   jnp.full((b,), -1, jnp.int32))

    def turn(state, _):
      live = ~state.done
      state, _, _ = jax.vmap(env.step)(state, jax.vmap(env.oracle_action)(state))
      return state, jnp.sum(live)
    return jnp.sum(jax.lax.scan(turn, state, None, length=turns)[1])

  return lambda: int(run(tasks))


def host_steps(host: HostEnv, tasks, turns: int):
  """The host twin of `jax_steps`: () -> turns taken."""
  tasks = jax.tree.map(np.asarray, tasks)

  def run():
    state, _ = host.reset(tasks, -1)
    taken = 0
    for _ in range(turns):
      taken += int(np.sum(~state.done))
      state, _, _ = host.step(state, host.oracle_action(state))
    return taken
  return run


def interleaved(fns: dict, repeats: int) -> dict:
  """{name: (median seconds, output)} of each function, run in interleaved rounds after one
  untimed round."""
  outs = {k: f() for k, f in fns.items()}
  times = {k: [] for k in fns}
  for _ in range(max(1, repeats)):
    for k, f in fns.items():
      t0 = time.perf_counter()
      outs[k] = f()
      times[k].append(time.perf_counter() - t0)
  return {k: (statistics.median(times[k]), outs[k]) for k in fns}


def host_path(env, host: HostLookupEnv, tasks, group: int, turns: int, repeats: int,
              sleep_ms: float = 2.0) -> dict:
  """The section: environment steps of jax / host / host_serial, and the slow tool's host /
  host_serial, each {"seconds", "turns", "turns_per_s"}, on `tasks` x `group` episodes of
  `turns` turns (`host` and its serial twin built with `env`'s knobs)."""
  tasks = jax.tree.map(lambda x: np.repeat(np.asarray(x), group, axis=0), tasks)
  serial = HostLookupEnv(host.codec, num_threads=1, hops=host.jax_env.hops,
                         distractor_entities=host.jax_env.num_entities - host.jax_env.hops - 1,
                         num_relations=host.jax_env.num_relations, density=host.jax_env.density)
  sleep = sleep_ms / 1e3
  runs = interleaved({
      "jax": jax_steps(env, tasks, turns), "host": host_steps(host, tasks, turns),
      "host_serial": host_steps(serial, tasks, turns),
      "slow_host": host_steps(slow_lookup(host, sleep, host.num_threads), tasks, turns),
      "slow_host_serial": host_steps(slow_lookup(host, sleep, 1), tasks, turns)}, repeats)
  row = lambda k: {"seconds": runs[k][0], "turns": runs[k][1],
                   "turns_per_s": runs[k][1] / runs[k][0]}
  return {"episodes": int(jax.tree.leaves(tasks)[0].shape[0]), "turns": turns,
          "threads": host.num_threads,
          "env_steps": {k: row(k) for k in ("jax", "host", "host_serial")},
          "slow_tool": {"sleep_ms": sleep_ms, "host": row("slow_host"),
                        "host_serial": row("slow_host_serial")}}
