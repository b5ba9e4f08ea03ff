"""The accelerator preset's section: random-weight models of real models' shapes in bf16, their
rollout at several batches, decode against the device's HBM bandwidth bound, the update's MFU
over the device's bf16 peak, the `transformers` generate loop on the same device, and the peak
memory against the planner's plan.

    python -m launch.benchmark --preset=accelerator   # sized for one GPU in <= 8 minutes

Not yet run on a GPU or TPU (docs/benchmark/accelerator.md records the runs). A model the
planner says the device cannot hold, or that would pass the time budget, is skipped and says why.

The models (SHAPES) are SmolLM2-135M's layers (llama) and Qwen2-0.5B's and Qwen2-1.5B's layers
with random weights on the built-in tokenizer's 720-token vocabulary: no download, and every id
a sampler draws is one the environments decode (so the embedding and unembedding are smaller
than the real models'; the parameter count of each row is the one measured). Per model, in one
process (`model_rows`):
  * the jitted rollout at each of `batches` episodes (`rollouts.scaling`'s batch axis, one
    timed run after compilation), `lookup` with `turns` turns;
  * at `detail_batch` episodes: decode-only against its bandwidth bound and the RL update
    against the peak (`models.model_section`, rendered by `report.with_limits` over DEVICE
    limits, not the float32 matmul the CPU sections use);
  * the naive loop with the `transformers` model (`peers.load_hf`, `peers.hf_generate`) on the
    same tasks, device and dtype (`rollouts.naive_row`): the ratio of the two;
  * the process's peak device memory (`memory_stats()["peak_bytes_in_use"]`, a high-water mark:
    models run smallest first) against `planning.memory.plan`.

The limits (`device_limits`): a table of known devices' HBM bandwidth and dense bf16 FLOP/s
(vendors' datasheets), else measured here as on a CPU (`machine.read_bandwidth`, a bf16
`machine.peak_matmul_flops`), and each row says which.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from absl import logging

from jaxagent.bench import machine, report
from jaxagent.bench.models import model_section, random_policy
from jaxagent.bench.peers import hf_generate, load_hf
from jaxagent.bench.rollouts import naive_row, scaling
from jaxagent.learners.update import LearnerConfig
from jaxagent.planning import memory
from jaxagent.rollout.api import default_context_len

# (lower-case substring of jax's device_kind, HBM bytes/s, dense bf16 FLOP/s), first match wins
# (so "h100 pcie" before "h100", "l40s" before "l4"). NVIDIA's and Google's datasheets; the
# H100 SXM's device_kind is "NVIDIA H100 80GB HBM3".
DEVICES = (
    ("h200", 4.8e12, 989e12),
    ("h100 pcie", 2.0e12, 756e12),
    ("h100 nvl", 3.9e12, 835e12),
    ("h100", 3.35e12, 989e12),
    ("a100-sxm4-80gb", 2.039e12, 312e12),
    ("a100 80gb", 1.935e12, 312e12),
    ("a100", 1.555e12, 312e12),
    ("l40s", 0.864e12, 362e12),
    ("l4", 0.3e12, 121e12),
    ("tpu v4", 1.2e12, 275e12),
    ("tpu v5 lite", 0.819e12, 197e12),
    ("tpu v5", 2.765e12, 459e12),
    ("tpu v6 lite", 1.64e12, 918e12),
)

# Layer shapes of real models (random weights; the vocabulary stays the built-in tokenizer's).
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         tie_word_embeddings=True, qkv_bias=False, rope_theta=1e5),
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                       num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                       tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6),
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                       num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                       tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6),
    "tiny": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True,
                 qkv_bias=True, rope_theta=1e6),      # the suite's check that the section runs
}
MODELS = ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b")


def device_limits(kind: str, matmul_size: int = 4096, bandwidth_mib: int = 1024,
                  repeats: int = 5) -> dict:
  """The device's HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s): from DEVICES where
  `kind` (jax's device_kind) matches, else measured on the default device (a large read, a bf16
  matmul). Each with its source ("table" or "measured")."""
  for name, bandwidth, peak in DEVICES:
    if name in kind.lower():
      return {"device": kind, "bandwidth": bandwidth, "bandwidth_source": "table",
              "peak_bf16_flops": peak, "peak_source": "table"}
  return {"device": kind, "bandwidth": machine.read_bandwidth(bandwidth_mib, repeats),
          "bandwidth_source": "measured",
          "peak_bf16_flops": machine.peak_matmul_flops(matmul_size, repeats, jnp.bfloat16),
          "peak_source": "measured"}


def peak_bytes_in_use(device=None) -> int | None:
  """The process's high-water mark of device memory (`memory_stats()`), None where the backend
  does not report it (CPU)."""
  device = device if device is not None else jax.local_devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:   # backends without the call
    return None
  peak = stats.get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


def planned_bytes(cfg, env, learner: LearnerConfig, batches, detail_batch: int,
                  turns: int) -> int:
  """The planner's bytes for what `model_rows` runs on one device: the parameters and the
  rollout's peak at the largest batch, or the whole RL step (rollout, update with its optimizer
  and reference) at `detail_batch`, whichever is larger."""
  seq = default_context_len(env, turns, env.max_action_len)
  ref = "device" if learner.kl_coef > 0 else "none"
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}

  def plan(g, optimizer):
    mb = learner.minibatches if g % learner.minibatches == 0 else 1
    return memory.plan(cfg, mesh, global_batch=g, seq_len=seq,
                       prefill_len=int(env.max_obs_len), optimizer=optimizer, minibatches=mb,
                       reference_policy=ref, logprob_chunk=learner.logprob_chunk)
  rollout = plan(max(batches), "none")
  return max(rollout.params + rollout.rollout_peak, plan(detail_batch, "adamw").total)


def torch_device() -> str | None:
  """The torch device on the same kind of device as jax's default backend ("cpu" on CPU, "cuda"
  on a GPU), or None where torch has none (a CPU-only torch beside a GPU, a TPU): the
  transformers row must not run on another device than the jax rows."""
  import torch   # noqa: PLC0415 (optional: the transformers row)
  backend = jax.default_backend()
  if backend == "cpu":
    return "cpu"
  return "cuda" if backend == "gpu" and torch.cuda.is_available() else None


def model_rows(base, env, host, learner: LearnerConfig, shape: str, dtype: str, batches,
               detail_batch: int, turns: int, hf: bool, workdir, limits: dict,
               repeats: int = 1) -> dict:
  """One model of SHAPES[shape] in `dtype`: its rollout at each of `batches`, its decode, update
  and (hf) `transformers` loop at `detail_batch`, and its memory (see the module docstring).
  A model the planner says the device cannot hold (`limits["device_bytes"]`) is skipped, so an
  out-of-memory error does not lose the other models' rows: {"shape", "skipped", ...}."""
  t0 = time.perf_counter()
  if shape not in SHAPES:
    raise ValueError(f"accelerator model {shape!r}: pick from {', '.join(SHAPES)}")
  policy = random_policy(base, dtype=dtype, **SHAPES[shape])
  planned = planned_bytes(policy.config, env, learner, batches, detail_batch, turns)
  device_bytes = limits.get("device_bytes")
  if device_bytes is not None and planned > device_bytes:
    return {"shape": shape, "params": policy.config.num_params(), "planned_bytes": planned,
            "skipped": f"the planner's {memory.format_bytes(planned)} exceed the device's "
                       f"{memory.format_bytes(device_bytes)}"}
  group = min(8, detail_batch)
  sec = {"shape": shape, **model_section(policy, env, learner, detail_batch, group, turns)}
  report.with_limits(sec, limits["peak_bf16_flops"], limits["bandwidth"])
  rows = scaling(policy, env, repeats, detail_batch, turns,
                 [b for b in batches if b != sec["episodes"]], (), (), batch_turns=turns)
  rows.append({"episodes": sec["episodes"], "turns": turns, **sec["rollout"]})
  sec["batches"] = sorted(({k: v for k, v in r.items() if k not in ("axis", "tokens_per_turn")}
                           for r in rows), key=lambda r: r["episodes"])
  device = hf and torch_device()
  if hf and not device:
    sec["hf_skipped"] = f"torch has no device for jax's {jax.default_backend()}"
  if device:
    model = load_hf(policy, pathlib.Path(workdir) / f"hf_{shape}", dtype, device)
    tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0),
                                                       max(1, detail_batch // group)))
    gen = hf_generate(model, int(env.codec.end_of_turn_id), int(env.codec.pad_id))
    sec["hf"] = {"device": device, **naive_row(None, host, tasks, group, turns,
                                               env.max_action_len, repeats, generate=gen)}
    sec["hf_ratio"] = sec["hf"]["seconds"] / sec["rollout"]["seconds"]
    del model
  sec["peak_bytes"] = peak_bytes_in_use()
  sec["planned_bytes"] = planned
  sec["seconds"] = time.perf_counter() - t0
  logging.info("accelerator %s: %s", shape, sec)
  return sec


def versions() -> dict:
  """Versions of what the section runs on (absent packages: None)."""
  out = {"jax": jax.__version__}
  for pkg in ("jaxlib", "flax", "torch", "transformers"):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def accelerator_section(base, env, host, learner: LearnerConfig, shapes, dtype: str, batches,
                        detail_batch: int, turns: int, hf: bool, workdir, limit_args,
                        budget_s: float | None = None) -> dict:
  """Every model of `shapes` (give them smallest first: the memory is a high-water mark) on the
  default device, with the device, its limits, the date and the versions. `env` is `lookup` and
  `host` its host twin (the transformers loop's environment).

  budget_s: the section's seconds; a model is skipped (and says so) where the time spent plus
  1.5x the last model's seconds would pass it, so a time-limited device call ends with its
  tables. After each model the section so far is written to `workdir`/accelerator_partial.json
  (what a killed run leaves)."""
  t0 = time.perf_counter()
  limits = {**device_limits(jax.devices()[0].device_kind, *limit_args),
            "device_bytes": memory.device_memory_bytes()}
  res = {"date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
         "versions": versions(), "limits": limits, "dtype": dtype, "turns": turns,
         "batches": list(batches), "detail_batch": detail_batch, "models": []}
  out = pathlib.Path(workdir)
  out.mkdir(parents=True, exist_ok=True)
  last = 0.0
  for s in shapes:
    spent = time.perf_counter() - t0
    if budget_s is not None and spent + 1.5 * last > budget_s:
      res["models"].append({"shape": s, "params": None, "skipped": (
          f"out of time: {spent:.0f} s spent, the last model took {last:.0f} s, budget "
          f"{budget_s:.0f} s")})
    else:
      res["models"].append(model_rows(base, env, host, learner, s, dtype, batches,
                                      detail_batch, turns, hf, workdir, limits))
      last = res["models"][-1].get("seconds", 0.0)
    (out / "accelerator_partial.json").write_text(json.dumps(res, indent=2))
  return res
