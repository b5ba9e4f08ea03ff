"""One arm of the SmolLM2 RL-step comparison (full fine-tuning vs LoRA vs LoRA on an int8 base):
run it once per arm, alternating arms, one process each (peak resident memory is per process).

    python docs/benchmark/2026-12-07-lora-memory/measure.py full|lora|lora8 WORKDIR DATA_DIR

RL only (no SFT), 3 steps of 2 tasks x 4 episodes, 4 minibatches, SmolLM2-135M (GGUF, float32)
through `jaxagent.train.run`; prints one JSON line: per-step rollout and update seconds (step 1
includes the compiles), the wall time and the process's peak resident memory (ru_maxrss)."""

import json
import resource
import sys
import time

from configs.smollm2 import get_config
from jaxagent import train

arm, workdir, data = sys.argv[1:4]
c = get_config("cpu" if arm == "full" else "lora")
c.sft.steps, c.rl.steps = 0, 3
c.rl.num_tasks, c.rl.group_size, c.rl.learner.minibatches = 2, 4, 4
c.checkpoint_every, c.log_every, c.progress_bar = 100, 1, False
c.data.dir = data
if arm == "lora8":
  c.model.lora.base_dtype = "int8"
t0 = time.perf_counter()
train.run(c, workdir)
wall = time.perf_counter() - t0
lines = [json.loads(l) for l in open(f"{workdir}/metrics.jsonl")]
rl = [l for l in lines if l.get("phase") == "rl"]
print(json.dumps({"arm": arm, "wall_s": round(wall, 1),
                  "rollout_s": [round(l["timing"]["rollout_seconds"], 2) for l in rl],
                  "update_s": [round(l["timing"]["update_seconds"], 2) for l in rl],
                  # ru_maxrss is in KiB on Linux: / 1e6 is units of 1.024e9 bytes (x 0.954 = GiB)
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                                       2)}))
