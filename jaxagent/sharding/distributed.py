"""Multi-process start-up: `jax.distributed.initialize` from flags, environment or the cluster.

    from jaxagent.sharding import distributed
    distributed.initialize()            # before anything touches jax devices; no-op alone
    if distributed.is_primary():        # process 0 writes metrics, reports, exports
      ...
    distributed.barrier("step done")    # wait for every process (no-op alone)

Resolution, first match wins:
  1. explicit arguments (coordinator_address, num_processes, process_id);
  2. the environment: JAXAGENT_COORDINATOR (host:port of process 0), JAXAGENT_NUM_PROCESSES,
     JAXAGENT_PROCESS_ID -- for launchers that know the job layout (see launch/recipes/);
  3. a cluster JAX detects on its own: a SLURM job step with more than one task (SLURM_NTASKS
     > 1), or JAXAGENT_DISTRIBUTED=auto (TPU pods, where JAX reads the layout from the TPU
     metadata; the TPU recipe sets it) -> `jax.distributed.initialize()` with no arguments;
  4. otherwise one process: nothing to do.
One process (num_processes == 1) is always a no-op. A partial explicit layout (say a
coordinator but no process id) raises ValueError naming what is missing.

Local devices: JAX gives a SLURM task only the GPU of its SLURM_LOCALID (one process per GPU).
For one process per node, list the node's devices: local_device_ids=[0, ..., 7] or
JAXAGENT_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_COORDINATOR = "JAXAGENT_COORDINATOR"
ENV_NUM_PROCESSES = "JAXAGENT_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXAGENT_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXAGENT_LOCAL_DEVICE_IDS"
ENV_MODE = "JAXAGENT_DISTRIBUTED"     # "auto": let JAX detect the cluster; "off": never initialise


@dataclasses.dataclass(frozen=True)
class Layout:
  """What `initialize` will do: mode "single" (nothing), "explicit" (the three values) or "auto"
  (`jax.distributed.initialize()` detects them); source says where the decision came from."""
  mode: str
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  source: str = ""
  local_device_ids: tuple[int, ...] | None = None   # None: JAX's default for the cluster


def _int(name: str, value) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name}={value!r} is not an integer") from None


def _device_ids(value) -> tuple[int, ...] | None:
  if value is None or value == "":
    return None
  if isinstance(value, str):
    try:
      return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
      raise ValueError(f"{ENV_LOCAL_DEVICES}={value!r}: give comma-separated device ids, "
                       "e.g. 0,1,2,3") from None
  return tuple(int(v) for v in value)


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, environ: Mapping[str, str] | None = None,
            local_device_ids=None) -> Layout:
  """The layout `initialize` would use (pure: reads `environ`, default os.environ)."""
  env = os.environ if environ is None else environ
  layout = _resolve(coordinator_address, num_processes, process_id, env)
  if layout.mode == "single":
    return layout
  ids = _device_ids(local_device_ids if local_device_ids is not None
                    else env.get(ENV_LOCAL_DEVICES))
  return dataclasses.replace(layout, local_device_ids=ids)


def _resolve(coordinator_address, num_processes, process_id, env) -> Layout:
  if env.get(ENV_MODE, "").lower() == "off":
    return Layout("single", source=f"{ENV_MODE}=off")
  given = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in given):
    source = "arguments"
    coord, n, pid = coordinator_address, _int("num_processes", num_processes), \
        _int("process_id", process_id)
  else:
    source = f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}"
    coord = env.get(ENV_COORDINATOR) or None
    n = _int(ENV_NUM_PROCESSES, env.get(ENV_NUM_PROCESSES))
    pid = _int(ENV_PROCESS_ID, env.get(ENV_PROCESS_ID))
  if n is not None and n < 1:
    raise ValueError(f"num_processes must be >= 1, got {n} (from {source})")
  if n == 1:
    if pid not in (None, 0):
      raise ValueError(f"process_id {pid} with num_processes 1 (from {source}); use 0")
    return Layout("single", coord, 1, 0, source)
  if any(v is not None for v in (coord, n, pid)):
    missing = [name for name, v in (("coordinator_address", coord), ("num_processes", n),
                                    ("process_id", pid)) if v is None]
    if missing:
      raise ValueError(f"incomplete multi-process layout from {source}: missing {missing}; give "
                       f"all three (flags, or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
                       f"{ENV_PROCESS_ID}), or none to let JAX detect the cluster")
    if not 0 <= pid < n:
      raise ValueError(f"process_id {pid} out of range for {n} processes (from {source})")
    if ":" not in coord:
      raise ValueError(f"coordinator address {coord!r} (from {source}) needs a port: host:port")
    return Layout("explicit", coord, n, pid, source)
  if env.get(ENV_MODE, "").lower() == "auto":
    return Layout("auto", source=f"{ENV_MODE}=auto")
  slurm_tasks = _int("SLURM_NTASKS", env.get("SLURM_NTASKS"))
  if slurm_tasks is not None and slurm_tasks > 1 and "SLURM_PROCID" in env:
    return Layout("auto", source=f"SLURM job step with {slurm_tasks} tasks")
  return Layout("single", source="no multi-process layout given or detected")


def _client():
  """The coordination service's client, or None before `jax.distributed.initialize`."""
  from jax._src import distributed as _dist   # no public query in this jax version
  return getattr(_dist.global_state, "client", None)


def _already_initialized() -> bool:
  return _client() is not None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None) -> Layout:
  """Initialises the multi-process runtime when the layout (see `resolve`) has more than one
  process; a no-op for one process or when already initialised. Call it before any other jax
  call that touches devices. Returns the layout used."""
  layout = resolve(coordinator_address, num_processes, process_id,
                   local_device_ids=local_device_ids)
  if layout.mode == "single" or _already_initialized():
    return layout
  ids = list(layout.local_device_ids) if layout.local_device_ids is not None else None
  if layout.mode == "explicit":
    jax.distributed.initialize(coordinator_address=layout.coordinator_address,
                               num_processes=layout.num_processes, process_id=layout.process_id,
                               local_device_ids=ids)
  else:
    jax.distributed.initialize(local_device_ids=ids)
  _join_cpu_collectives()
  return layout


def _join_cpu_collectives() -> None:
  """On CPU, sets up the processes' gloo context now, while they are in step.

  Gloo builds its context at the first cross-process collective and gives the other processes
  only 30 s to join it ("Gloo context initialization failed: DEADLINE_EXCEEDED"); once built,
  collectives wait as long as they need. A first collective inside a compiled program (a
  rollout's loop condition over a batch split across processes) comes after each process's
  own compile, which can differ by more than 30 s on a loaded machine."""
  if jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
    return
  barrier("gloo context")
  multihost_utils.process_allgather(np.zeros((1,), np.int32))


def is_primary() -> bool:
  """True on process 0: the one process that writes metrics, reports and exports."""
  return jax.process_index() == 0


_BARRIERS = {"count": 0}


def barrier(name: str, timeout_s: float = 600.0) -> None:
  """Blocks until every process reaches this call, for up to `timeout_s` (a no-op for one
  process), on the coordination service: no device work. `initialize` uses it to put the
  processes in step before joining gloo's context. Every process must make the same sequence
  of barrier calls."""
  client = _client()
  if client is None or jax.process_count() == 1:
    return
  _BARRIERS["count"] += 1
  client.wait_at_barrier(f"jaxagent/{_BARRIERS['count']}/{name}", int(timeout_s * 1000))
