"""Memory plan of a training config: bytes per device of one RL step on the config's mesh.

    python -m launch.plan --config=configs/default.py:smoke
    python -m launch.plan --config=configs/hf.py:qwen2.5-7b \\
        --config.model.path=/models/Qwen2.5-7B-Instruct --num_devices=8 --device_memory_gb=80
    python -m launch.plan --lora_table      # Qwen2.5-1.5B/7B: full vs LoRA vs int8-base LoRA

Prints the table of `jaxagent.planning.memory.plan_for_config` and exits 1 (with the changes
that would fit) when the total exceeds --device_memory_gb, or else the memory of this machine's
first device where the backend reports it (GPU, TPU). Reads only the model's config.json and
tokenizer (for the rollout context); no weights are loaded and nothing is compiled.
`--lora_table` prints instead the markdown table of `jaxagent.planning.lora_table` (no config:
the two Qwen2.5 models' sizes are constants there), as committed in
docs/benchmark/2026-12-07-lora-memory/README.md.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from launch._flags import check_config_overrides

from jaxagent.planning import lora_table, memory

# Before the flag is defined: defining it applies the overrides (and fails on a wrong key).
if __name__ == "__main__":
  check_config_overrides(sys.argv, None)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).",
                                          lock_config=True)
_NUM_DEVICES = flags.DEFINE_integer(
    "num_devices", None, "Devices the mesh spans (default: config.num_devices, else the devices "
    "of this machine).")
_MEMORY_GB = flags.DEFINE_float(
    "device_memory_gb", None, "Memory per device in GiB (default: detected from the device; "
    "unknown on CPU).")
_CONTEXT_LEN = flags.DEFINE_integer(
    "context_len", None, "Rollout context tokens per episode (default: from the environment, "
    "which needs the model's tokenizer files).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", None,
                                   "Prompt tokens (default: the environment's max_obs_len).")
_LORA_TABLE = flags.DEFINE_bool(
    "lora_table", False, "Print the planned memory of Qwen2.5-1.5B/7B RL on one 80 GB GPU, full "
    "fine-tuning vs LoRA vs LoRA on an int8 base (a markdown table; no --config needed).")


def main(argv):
  del argv
  if _LORA_TABLE.value:
    print(lora_table.render())
    return
  config = _CONFIG.value
  if config is None:
    sys.exit("pass --config=configs/FILE.py[:VARIANT] (the run to plan), or --lora_table")
  p = memory.plan_for_config(config, _NUM_DEVICES.value, context_len=_CONTEXT_LEN.value,
                             prompt_len=_PROMPT_LEN.value)
  if _MEMORY_GB.value is not None:
    device_bytes, source = int(_MEMORY_GB.value * memory.GIB), "--device_memory_gb"
  else:
    device_bytes, source = memory.device_memory_bytes(), "detected"
  print(p.table(device_bytes))
  if device_bytes is None:
    print("device memory unknown (this backend does not report it): pass --device_memory_gb to "
          "check the plan against it")
    return
  try:
    memory.check_fits(p, device_bytes)
  except ValueError as e:
    print(f"DOES NOT FIT ({source} memory): {str(e).splitlines()[0]}", file=sys.stderr)
    sys.exit(1)
  print(f"fits ({source} memory)")


if __name__ == "__main__":
  app.run(main)
