"""Real checkpoints on accelerators: Qwen2.5-7B-Instruct and Qwen3-8B (8 devices), Qwen2.5-1.5B-
Instruct (one device), bfloat16, FSDP over every device. The study pipeline and environments are those of configs/default.py; only the model, the
dtypes, the mesh, the batch shape and the learning rates change.

    python -m launch.plan --config=configs/qwen.py:qwen2.5-7b \\
        --config.model.path=/models/Qwen2.5-7B-Instruct --num_devices=8 --device_memory_gb=80
    python -m launch.train --config=configs/qwen.py:qwen2.5-7b --workdir=/data/runs/q25 \\
        --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.study --config=configs/qwen.py:qwen3-8b --workdir=/data/study_q3 \\
        --config.model.path=/models/Qwen3-8B

`--config.model.path` is required: a local Hugging Face directory (config.json, *.safetensors,
tokenizer files); nothing is downloaded. The 7B/8B variants are sized for 8 devices of 80 GB
(H100/A100-80G; 128 episodes per RL step in 16 minibatches, one episode per device per optimizer
step), the 1.5B variant for one 80 GB device (32 minibatches of 4 episodes): the decoder keeps
every layer's activations (no remat), so an episode of ~1.6k tokens costs a 7B model ~25 GiB in
the update. Check any other shape with launch/plan.py first. Recipes: launch/recipes/.
"""

import ml_collections

from configs import default

# variant -> (what --config.model.path should point to, learning rates (sft, rl), minibatches
# of the 128 episodes per RL step).
VARIANTS = {
    "qwen2.5-7b": ("Qwen2.5-7B-Instruct", 1e-5, 1e-6, 16),
    "qwen3-8b": ("Qwen3-8B", 1e-5, 1e-6, 16),
    "qwen2.5-1.5b": ("Qwen2.5-1.5B-Instruct", 2e-5, 2e-6, 32),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "qwen2.5-7b"
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
  _, sft_lr, rl_lr, minibatches = VARIANTS[variant]
  c = default.get_config("default")
  # A local Hugging Face directory of the variant's checkpoint (required; see VARIANTS).
  c.model.path = ""
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  # Parameters, gradients and AdamW moments sharded over every device (ZeRO-3 style).
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

  c.sft.batch_size = 32
  c.sft.learning_rate = sft_lr
  c.sft.warmup_steps = 20
  # 16 tasks x 8 episodes, split into minibatches that fit (see the module docstring).
  c.rl.num_tasks = 16
  c.rl.group_size = 8
  c.rl.learner.minibatches = minibatches
  c.rl.learner.learning_rate = rl_lr
  c.rl.learner.warmup_steps = 5
  c.rl.learner.logprob_chunk = 128
  c.progress_bar = False
  return c
