"""Planning: what a run will cost before it runs. Near the top of the library: one planning
module above what it measures, importing the models, learners, rollout and sharding code it
accounts for; only the benchmark (jaxagent.bench, which measures what this accounts) imports it
in jaxagent (launch scripts and tests do too).

  memory  bytes per device of an RL step (params, optimizer, KV cache, activations) on a mesh
  flops   model FLOPs of forward passes and updates; the bandwidth bound of decoding
"""

from jaxagent.planning import flops, memory
from jaxagent.planning.flops import (decode_bound_seconds, forward_flops, kv_bytes_per_slot,
                                     param_counts, update_flops)
from jaxagent.planning.memory import (GIB, MemoryPlan, check_fits, device_memory_bytes, plan,
                                      plan_for_config)

__all__ = ["GIB", "MemoryPlan", "check_fits", "decode_bound_seconds", "device_memory_bytes",
           "flops", "forward_flops", "kv_bytes_per_slot", "memory", "param_counts", "plan",
           "plan_for_config", "update_flops"]
