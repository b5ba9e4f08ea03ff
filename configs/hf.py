"""Real Hugging Face checkpoints on accelerators: Qwen2.5 Instruct (0.5B, 1.5B, 7B), Qwen3 (1.7B,
8B) and Llama 3.2 Instruct (1B, 3B), bfloat16, FSDP over every device. The study pipeline and
environments are those of configs/default.py; only the model, the dtypes, the mesh, the batch
shape and the learning rates change.

    python -m launch.plan --config=configs/hf.py:qwen2.5-7b \\
        --config.model.path=/models/Qwen2.5-7B-Instruct --num_devices=8 --device_memory_gb=80
    python -m launch.train --config=configs/hf.py:qwen2.5-7b --workdir=/data/runs/q25 \\
        --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.study --config=configs/hf.py:llama3.2-1b --workdir=/data/study_l1 \\
        --config.model.path=/models/Llama-3.2-1B-Instruct

`--config.model.path` is required: a local Hugging Face directory (config.json, *.safetensors,
tokenizer files with a chat template); nothing is downloaded. The 7B/8B variants are sized for 8
devices of 80 GB (H100/A100-80G; 128 episodes per RL step in 16 minibatches, one episode per
device per optimizer step), the others for one 80 GB device (4 episodes per minibatch; 2 for
Llama-3.2-3B): the decoder keeps every layer's activations (no remat), so an episode of ~1.6k
tokens costs a 7B model ~25 GiB in the update. Check any other shape with launch/plan.py first.
Recipes: launch/recipes/.

Learning rates: the SFT rate is the usual full fine-tuning rate of the size (1e-5 to 2e-5); the
RL rate is a tenth of it, with the default's k3 KL of 0.05 to the SFT base (configs/default.py
records what a too-large RL rate without KL does).
"""

import ml_collections

from configs import default

# variant -> (the checkpoint --config.model.path should point to, learning rates (sft, rl),
# minibatches of the 128 episodes per RL step).
VARIANTS = {
    "qwen2.5-0.5b": ("Qwen2.5-0.5B-Instruct", 2e-5, 2e-6, 32),
    "qwen2.5-1.5b": ("Qwen2.5-1.5B-Instruct", 2e-5, 2e-6, 32),
    "qwen2.5-7b": ("Qwen2.5-7B-Instruct", 1e-5, 1e-6, 16),
    "qwen3-1.7b": ("Qwen3-1.7B", 2e-5, 2e-6, 32),
    "qwen3-8b": ("Qwen3-8B", 1e-5, 1e-6, 16),
    "llama3.2-1b": ("Llama-3.2-1B-Instruct", 2e-5, 2e-6, 32),
    "llama3.2-3b": ("Llama-3.2-3B-Instruct", 1e-5, 1e-6, 64),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "qwen2.5-7b"
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)} "
                     f"(configs/hf.py:<variant>)")
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
