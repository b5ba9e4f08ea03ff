"""The benchmark: throughput of rollouts and updates, side by side in one process, against the
naive way, the `transformers` loop and this machine's own limits (measured in the same run). The
top layer of the library: it imports what it measures; nothing in jaxagent imports it
(`python -m launch.benchmark` parses the flags and calls `run_benchmark`).

  machine   the machine's name and limits (peak matmul FLOP/s, read bandwidth); the clock
  rollouts  jitted rollout vs host environment vs naive loop; the scaling sweep
  hostpath  the host path vs the JAX path: environment steps alone, and a slow tool's threads
  decode    decode with no environment vs its bandwidth bound; a decode step by ablation
  pieces    the rollout's pieces as separate programs (prefills, environment steps)
  update    the RL update's tokens/s and model FLOP/s; turn-level credit's overhead
  models    larger random-weight models and SmolLM2: one model's section
  peers     the peers' workload against the `transformers` generate loop (needs torch)
  accelerator  random SmolLM2/Qwen2-shaped models in bf16 on a GPU or TPU against its datasheet
            limits and the `transformers` loop there (`--preset=accelerator`)
  report    markdown tables and the scaling plot, rendered from the results
  run       `Options`, `preset(name, learner)`, `run_benchmark(options) -> dict`, `write`
"""

from jaxagent.bench.report import markdown, with_limits
from jaxagent.bench.run import Options, run_benchmark, write

__all__ = ["Options", "markdown", "run_benchmark", "with_limits", "write"]
