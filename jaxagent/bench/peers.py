"""The peers' workload: jaxagent's jitted rollout against the `transformers` generate loop on the
same weights, tasks and environment.

The shared peers' workload (../shared/peers: the `transformers` generate loop, Tunix and jaxagent
on the same weights) is a tiny Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 384, untied,
qkv bias, rope theta 1e6), 64 episodes x 8 turns x <= 16 tokens per turn, temperature 1, `lookup`
with 4 hops. Here it runs on the built-in tokenizer (vocabulary 720 against the peers' 512) and
random weights, written as a Hugging Face directory that transformers loads. The baseline is the
loop users write with transformers: history re-encoded every turn (`rollouts.naive_rollout`),
PyTorch on CPU. Needs torch (an optional dependency), imported only here.
"""

from __future__ import annotations

import pathlib
import statistics
import time

import jax
import numpy as np

import jaxagent.envs as envs
from jaxagent.bench.machine import timed
from jaxagent.bench.models import random_policy
from jaxagent.bench.rollouts import (naive_row, naive_rollout, rollout_fn, rollout_row,
                                     with_attention)
from jaxagent.envs.host import HostLookupEnv
from jaxagent.models import attention
from jaxagent.planning.flops import param_counts

PEER = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, tie_word_embeddings=False, qkv_bias=True, rope_theta=1e6)
PEER_EPISODES, PEER_TURNS, PEER_TOKENS, PEER_HOPS = 64, 8, 16, 4
# The SmolLM2 row (issue 41): 4 tasks x 4 episodes x 4 turns of `lookup` in the model's own text,
# each turn up to the environment's whole action length; torch on 2 threads (the benchmark
# machine's cores).
MODEL_PEER_TASKS, MODEL_PEER_GROUP, MODEL_PEER_TURNS, MODEL_PEER_THREADS = 4, 4, 4, 2


def hf_generate(model, eot: int, pad: int):
  """`generate` for `rollouts.naive_rollout` with a transformers (PyTorch) model: the batch of
  histories left-padded, one `model.generate` call (its own KV cache within the call, nothing
  kept across turns), plain sampling at temperature 1 (top-k and top-p off), stopping at
  `eot`. The batch goes to the model's device (a GPU where `load_hf` put it there)."""
  import torch   # noqa: PLC0415 (optional: the benchmark's transformers row)

  def generate(histories, max_new, seed):
    width = max(len(h) for h in histories)
    ids = torch.full((len(histories), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, h in enumerate(histories):
      ids[i, width - len(h):] = torch.tensor(h)
      mask[i, width - len(h):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
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


def load_hf(policy, hf_dir, dtype: str = "float32", device: str = "cpu"):
  """`policy` written as a Hugging Face directory `hf_dir` and loaded by transformers in `dtype`
  on the torch `device` ("cpu", "cuda"), in eval mode: the same weights in both frameworks."""
  from transformers import AutoModelForCausalLM   # noqa: PLC0415 (optional dependency)
  import torch   # noqa: PLC0415
  policy.save_pretrained(hf_dir)
  model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
  return model.to(device).eval()


def peer_section(base, repeats: int, workdir, episodes: int = PEER_EPISODES,
                 turns: int = PEER_TURNS) -> dict:
  """jaxagent's jitted rollout (and, where the model's attention path is the CPU kernel, the
  same with XLA's attention) against the `transformers` generate loop on the peers' workload:
  seconds, episodes/s and generated tokens of each, the speedup (the loop's seconds over the
  rollout's; target >= 5x), and the two frameworks' largest logit difference on the first
  prompt (the same weights). The exported model is written under `workdir`/peer_qwen2. Needs
  torch and transformers' model classes."""
  import torch   # noqa: PLC0415
  policy = random_policy(base, seed=0, **PEER)
  model = load_hf(policy, pathlib.Path(workdir) / "peer_qwen2")
  env = envs.make("lookup", policy.tokenizer, hops=PEER_HOPS)
  host = HostLookupEnv(env.codec, hops=PEER_HOPS)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), episodes))
  # Same weights: the two frameworks' logits on the first prompt.
  _, obs0 = host.reset(jax.tree.map(np.asarray, tasks), -1)
  probe = obs0.tokens[:1, :obs0.length[0]]
  with torch.no_grad():
    want = model(torch.tensor(probe, dtype=torch.long)).logits.numpy()
  diff = float(np.abs(np.asarray(policy.forward(probe.tolist())) - want).max())
  secs, traj = timed(rollout_fn(policy, env, tasks, 1, turns, PEER_TOKENS), repeats)
  jax_row = rollout_row(secs, traj, episodes)
  xla_row = None
  if attention.kernel_enabled(policy.config.attention):   # XLA's attention beside the kernel
    xla_secs, xla_traj = timed(rollout_fn(with_attention(policy, "xla"), env, tasks, 1, turns,
                                          PEER_TOKENS), repeats)
    xla_row = rollout_row(xla_secs, xla_traj, episodes)
  eot, pad = int(env.codec.end_of_turn_id), int(env.codec.pad_id)
  gen = hf_generate(model, eot, pad)
  hf = naive_row(None, host, jax.tree.map(np.asarray, tasks), 1, turns, PEER_TOKENS, repeats,
                 generate=gen)
  return {"params": param_counts(policy.config, policy.params)["total"],
          "episodes": episodes, "turns": turns, "tokens_per_turn": PEER_TOKENS,
          "hops": PEER_HOPS, "logits_max_abs_diff": diff,
          "torch_threads": torch.get_num_threads(), "jax": jax_row, "jax_xla_attention": xla_row,
          "hf": hf, "speedup": hf["seconds"] / secs}


def model_peer_row(policy, env, host, tasks, group: int, turns: int, repeats: int, workdir,
                   name: str, torch_threads: int = MODEL_PEER_THREADS) -> dict:
  """jaxagent's held rollout program (`rollouts.rollout_fn`: one `Rollouts` owner, compiled
  once) against the `transformers` loop (`hf_generate` in `rollouts.naive_rollout`: history
  re-encoded each turn, torch on `torch_threads` threads) on `policy`'s weights (exported to
  `workdir`/`name`), the same `tasks` x `group` episodes of `turns` turns, each turn up to the
  environment's whole action length, in one process. After the rollout's compiling run, each
  of `repeats` rounds times one rollout then one loop (interleaved: both see the same machine);
  seconds are the medians (PyTorch has nothing to compile, so the loop has no untimed run).
  `env` is the JAX-native environment and `host` its host twin (`HostLookupEnv`).

  Returns both rows (`rollouts.rollout_row`, `naive_row`'s fields), each round's seconds, the
  speedup (the loop's median over the rollout's) and the frameworks' largest logit difference
  on the first prompt."""
  import torch   # noqa: PLC0415 (optional: the benchmark's transformers rows)
  threads = torch.get_num_threads()
  torch.set_num_threads(torch_threads)
  try:
    model = load_hf(policy, pathlib.Path(workdir) / name)
    np_tasks = jax.tree.map(np.asarray, tasks)
    rep_tasks = jax.tree.map(lambda x: np.repeat(x, group, axis=0), np_tasks)
    episodes = len(jax.tree.leaves(rep_tasks)[0])
    _, obs0 = host.reset(jax.tree.map(lambda x: x[:1], rep_tasks), -1)
    probe = obs0.tokens[:1, :obs0.length[0]]
    with torch.no_grad():
      want = model(torch.tensor(probe, dtype=torch.long)).logits.numpy()
    diff = float(np.abs(np.asarray(policy.forward(probe.tolist())) - want).max())
    run = rollout_fn(policy, env, tasks, group, turns)
    traj = run()                                                    # compiles
    gen = hf_generate(model, int(env.codec.end_of_turn_id), int(env.codec.pad_id))
    rounds, hf_tokens = [], 0
    for _ in range(max(1, repeats)):
      jax_s, traj = _once(run)
      hf_s, hf_tokens = _once(lambda: naive_rollout(None, host, rep_tasks, turns,
                                                    env.max_action_len, 0, generate=gen))
      rounds.append({"jax_seconds": jax_s, "hf_seconds": hf_s})
    jax_secs = statistics.median(r["jax_seconds"] for r in rounds)
    hf_secs = statistics.median(r["hf_seconds"] for r in rounds)
  finally:
    torch.set_num_threads(threads)
  return {"params": param_counts(policy.config, policy.params)["total"], "episodes": episodes,
          "turns": turns, "tokens_per_turn": int(env.max_action_len),
          "logits_max_abs_diff": diff, "torch_threads": torch_threads, "rounds": rounds,
          "jax": rollout_row(jax_secs, traj, episodes),
          "hf": {"seconds": hf_secs, "episodes_per_s": episodes / hf_secs,
                 "generated_tokens": hf_tokens, "generated_tokens_per_s": hf_tokens / hf_secs},
          "speedup": hf_secs / jax_secs}


def _once(fn):
  """(seconds, output) of one call of `fn`."""
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out
