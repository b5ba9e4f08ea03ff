"""The memory planner against the real thing on 8 fake CPU devices: parameter, optimizer-state
and KV-cache bytes per device equal the bytes of the arrays the project's own code builds; the
update's and the rollout's activation estimates are close to XLA's compiled memory; check_fits
names changes that really fit; the launch script."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.learners.update import LearnerConfig, init_train_state, make_update_fn
from jaxagent.models import Policy, from_pretrained, init_sharded
from jaxagent.models.config import ModelConfig
from jaxagent.models import lora, sampler
from jaxagent.models.policy import param_shardings
from jaxagent.planning import memory
from jaxagent.rollout import api, engine
from jaxagent.rollout.trajectory import Trajectory
from jaxagent.runs import adapters
from jaxagent.sharding import batch_sharding, make_mesh
from jaxagent.sharding.mesh import mesh_context

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bytes_on_device0(tree) -> int:
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == dev)


# Qwen3-style, untied; nothing divides evenly on the (1, 4, 2) mesh except mlp: hidden 30 is not
# divisible by fsdp = 4 (replicated), vocab 721 and kv_heads 1 not by tensor = 2 (replicated),
# and 6 episodes not by fsdp = 4 (the batch is replicated too).
ODD = ModelConfig(
    model_type="qwen3", vocab_size=721, hidden_size=30, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=False, qk_norm=True, max_position_embeddings=4096,
    pad_token_id=0, eos_token_ids=(2,))


def _policy(name, mesh, tokenizer):
  if name == "micro":
    return from_pretrained("builtin:micro", mesh=mesh)
  params = init_sharded(ODD, 0, param_shardings(ODD, mesh))
  return Policy(config=ODD, params=params, tokenizer=tokenizer, mesh=mesh)


def _start_cache(policy, env, mesh, tasks_n, group, cfg):
  """The rollout's KV cache as the engine builds it (`engine._start`, jitted as HostRollout does),
  from inputs placed the way `rollout` places them, under the mesh `rollout` sets."""
  tasks, _, _, _ = api.build_batch(env, jax.random.key(0), tasks_n, group)
  b = tasks_n * group
  tasks = api.place_batch(mesh, tasks, b)
  budget = api.place_batch(mesh, np.full((b,), cfg.max_turns, np.int32), b)
  with mesh_context(mesh):
    _, obs0 = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(1), b), tasks,
                                           api.place_batch(mesh, np.full((b,), -1, np.int32), b))
    start = jax.jit(functools.partial(engine._start, policy.config, cfg, 0, env.max_action_len))
    return start(policy.params, obs0, budget, jax.random.key(2)).cache


@pytest.mark.parametrize("name, shape, tasks_n, group", [
    ("micro", (2, 2, 2), 4, 2),     # everything divides: params over fsdp/tensor, batch over 4
    ("odd", (1, 4, 2), 3, 2),       # dimensions and the batch of 6 that do not divide
])
def test_plan_equals_sharded_arrays(name, shape, tasks_n, group, builtin_tokenizer):
  mesh = make_mesh(shape)
  policy = _policy(name, mesh, builtin_tokenizer)
  cfg = policy.config
  env = envs.make("lookup", policy.tokenizer, hops=1)
  rcfg = engine.RolloutConfig(max_turns=1, max_action_tokens=8,
                              context_len=api.default_context_len(env, 1, 8))
  g = tasks_n * group
  p = memory.plan(cfg, dict(mesh.shape), global_batch=g, seq_len=rcfg.context_len,
                  prefill_len=env.max_obs_len, minibatches=2)

  # Parameters as loaded / initialised onto the mesh, the trainer's train state.
  optimizer = LearnerConfig().make_optimizer()
  state = init_train_state(policy.params, optimizer, jax.random.key(0), mesh=policy.mesh)
  assert p.params == _bytes_on_device0(policy.params)
  assert p.optimizer_state == _bytes_on_device0(state.opt_state)
  assert p.gradients == p.params

  cache = _start_cache(policy, env, mesh, tasks_n, group, rcfg)
  assert cache.v.shape == (cfg.num_layers, g, cfg.num_kv_heads, rcfg.context_len, cfg.head_dim)
  assert cache.k.shape == (cfg.num_layers, g, cfg.num_kv_heads, cfg.head_dim, rcfg.context_len)
  assert p.kv_cache == _bytes_on_device0((cache.k, cache.v, cache.length))

  # The rules' divisibility decides: not simply the global size over 8 devices.
  full_params = sum(x.nbytes for x in jax.tree.leaves(policy.params))
  full_kv = cache.k.nbytes + cache.v.nbytes + cache.length.nbytes
  if name == "micro":
    # k, v: batch 8 over data x fsdp = 4 and kv_heads 2 over tensor = 2; lengths over 4.
    assert p.batch_per_device == 2 and p.notes == ()
    assert p.kv_cache == (cache.k.nbytes + cache.v.nbytes) // 8 + cache.length.nbytes // 4
  else:
    assert p.batch_per_device == 6
    assert any("6 episodes do not divide data x fsdp = 4" in n for n in p.notes)
    assert any("kv_heads=1 does not divide tensor=2" in n for n in p.notes)
    assert p.kv_cache == full_kv                       # nothing of the cache divides
    assert p.params > full_params // 8
  assert p.total == p.persistent + max(p.rollout_peak, p.update_peak)


@pytest.mark.slow   # compiles the update (the decoder's gradient) on three meshes
@pytest.mark.parametrize("shape,seq", [((1, 1, 1), 64), ((1, 8, 1), 64), ((2, 2, 2), 64),
                                       ((1, 1, 1), 512)])   # 512: attention in query blocks
def test_update_activations_close_to_compiled_memory(shape, seq):
  """gradients + activations + the update's batch copies vs XLA's compiled temp bytes per
  device on one device, an FSDP mesh and a 2x2x2 mesh (float32: XLA on CPU computes bfloat16
  in float32, so only float32 is comparable here). Before the update split its minibatches over
  the batch axes, the two meshes needed 3-6x the plan (every device ran the whole minibatch)."""
  cfg = dataclasses.replace(ODD, vocab_size=256, hidden_size=64, intermediate_size=192,
                            num_kv_heads=2, head_dim=16)
  b = 16                                              # minibatches of 8: 1 per device on fsdp=8
  lcfg = LearnerConfig(minibatches=2)
  optimizer = lcfg.make_optimizer()
  update = make_update_fn(lcfg, cfg, optimizer)
  mesh = make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])
  params = init_sharded(cfg, 0, param_shardings(cfg, mesh))
  policy = Policy(config=cfg, params=params, tokenizer=None, mesh=mesh)
  state = init_train_state(params, optimizer, jax.random.key(0), mesh=policy.mesh)
  traj = _random_trajectory(np.random.default_rng(0), b, seq, cfg.vocab_size)
  traj = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.ndim, b)), traj)
  analysis = update.lower(state, traj, None).compile().memory_analysis()
  if analysis is None:
    pytest.skip("this backend reports no compiled memory analysis")
  p = memory.plan(cfg, dict(mesh.shape), global_batch=b, seq_len=seq, minibatches=2)
  trajectory_arg = 20 * p.batch_per_device * seq      # an argument of the update, not a temp
  est = p.gradients + p.activations + p.update_batch - trajectory_arg
  assert 0.85 < est / analysis.temp_size_in_bytes < 1.3, (est, analysis.temp_size_in_bytes)


@pytest.mark.slow   # compiles the rollout program on two meshes
@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2)])
def test_rollout_close_to_compiled_memory(shape):
  """The rollout phase (KV cache + transcript buffers + prompt prefill) vs XLA's compiled temp +
  output bytes per device of the rollout program, with inputs placed and the mesh set as
  `rollout` does. Before the rollout split its episodes over (data, fsdp), every device held
  the whole batch (3-4x the plan here)."""
  mesh = make_mesh(shape)
  policy = from_pretrained("builtin:micro", mesh=mesh)
  env = envs.make("lookup", policy.tokenizer, hops=1)
  rcfg = engine.RolloutConfig(max_turns=2, max_action_tokens=16,
                              context_len=api.default_context_len(env, 2, 16))
  tasks_n, group = 8, 2
  b = tasks_n * group
  tasks, task_id, group_id, _ = api.build_batch(env, jax.random.key(0), tasks_n, group)
  budget, task_id, group_id = api.place_batch(mesh, (np.full((b,), 2, np.int32), task_id,
                                                     group_id), b)
  fn = engine.make_rollout_fn(policy.config, env, rcfg)
  with mesh_context(mesh):
    compiled = fn.lower(policy.params, jax.random.key(1), api.place_batch(mesh, tasks, b), budget,
                        task_id, group_id, sampler.SamplingConfig.make(1.0)).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    pytest.skip("this backend reports no compiled memory analysis")
  p = memory.plan(policy.config, dict(mesh.shape), global_batch=b, seq_len=rcfg.context_len,
                  prefill_len=env.max_obs_len)
  measured = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
  assert 0.7 < p.rollout_peak / measured < 1.5, (p.rollout_peak, measured)


def _random_trajectory(rng, b, seq, vocab) -> Trajectory:
  t = 2
  z = lambda shape, dt: jnp.zeros(shape, dt)
  mask = np.zeros((b, seq), np.float32)
  mask[:, 10:] = 1
  return Trajectory(
      tokens=jnp.asarray(rng.integers(1, vocab, (b, seq)), jnp.int32),
      positions=jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq)),
      loss_mask=jnp.asarray(mask), behaviour_logprobs=z((b, seq), jnp.float32),
      turn_of_token=z((b, seq), jnp.int32), length=jnp.full((b,), seq, jnp.int32),
      acted=jnp.ones((b, t), bool), valid_call=jnp.ones((b, t), bool),
      error_kind=z((b, t), jnp.int32), oracle_match=z((b, t), bool),
      reward=z((b, t), jnp.float32), solved=jnp.asarray(rng.random((b, t)) < 0.5),
      action_length=jnp.full((b, t), 3, jnp.int32), turn_start=z((b, t), jnp.int32),
      action_tokens=z((b, t, 4), jnp.int32), action_tokens_len=jnp.full((b, t), 3, jnp.int32),
      state_id=z((b, t, 2), jnp.uint32), obs_truncated=z((b, t), bool),
      success_turn=jnp.full((b,), t + 1, jnp.int32), num_turns=jnp.full((b,), t, jnp.int32),
      budget=jnp.full((b,), t, jnp.int32), task_id=jnp.repeat(jnp.arange(b // 2), 2),
      group_id=jnp.repeat(jnp.arange(b // 2), 2), status=jnp.full((b,), 3, jnp.int32),
      optimal_turns=jnp.full((b,), 2, jnp.int32))


# ---------------------------------------------------------------------------------------------
# check_fits, device memory, input checks.

def _micro_cfg() -> ModelConfig:
  from jaxagent.models import hf_io
  from jaxagent.models.builtin import BUILTIN_DIRS
  return hf_io.read_config(BUILTIN_DIRS["micro"], dtype="float32")


def test_check_fits_raises_naming_changes_that_fit():
  cfg = _micro_cfg()
  # A 64-token first prompt in a 256-token context. (With the whole context as the prompt, its
  # 128-token prefill chunk alone, in the rollout phase, is over the budget below, so no number
  # of minibatches, which only shrink the update, fits.)
  p = memory.plan(cfg, {"data": 2, "fsdp": 1, "tensor": 1}, global_batch=16, seq_len=256,
                  minibatches=2, reference_policy="device", prefill_len=64)
  memory.check_fits(p, p.total)          # exactly enough: no error
  memory.check_fits(p, None)             # unknown memory (CPU): nothing to check
  # Between the plans with a quarter and a half of the episodes: halving is not enough, so the
  # batch suggestion must go down to a quarter.
  quarter = memory.plan(cfg, p.mesh_shape, global_batch=4, seq_len=256, minibatches=2,
                        reference_policy="device", prefill_len=64)
  half = memory.plan(cfg, p.mesh_shape, global_batch=8, seq_len=256, minibatches=2,
                     reference_policy="device", prefill_len=64)
  budget = (quarter.total + half.total) // 2
  with pytest.raises(ValueError) as info:
    memory.check_fits(p, budget)
  msg = str(info.value)
  assert msg.startswith(f"the plan needs {memory.format_bytes(p.total)} per device but the device "
                        f"has {memory.format_bytes(budget)}")
  assert "largest part: activations" in msg
  assert ("lower rl.num_tasks*group_size per device from 8 to 2 (episodes per step from 16 to 4)"
          in msg)
  assert "TOTAL" in msg                  # the table follows
  # Every suggestion really fits, checked here by planning it independently.
  fixes = memory.suggestions(p, budget)
  assert fixes and all(f in msg for f in fixes)
  fits = lambda mesh, m=2: memory.plan(cfg, mesh, global_batch=16, seq_len=256, minibatches=m,
                                      reference_policy="device", prefill_len=64).fits(budget)
  # Moving the data axis onto fsdp (same 2 devices) splits the batch no further: not enough;
  # 4x the devices on fsdp is the smallest that fits.
  assert "raise mesh.fsdp from 1 to 4 (4x the devices)" in fixes
  assert not fits({"fsdp": 2}) and not fits({"data": 2, "fsdp": 2}) and fits({"data": 2, "fsdp": 4})
  [mb_fix] = [f for f in fixes if f.startswith("raise rl.learner.minibatches from 2 to ")]
  m = int(mb_fix.split()[-1])
  assert fits({"data": 2}, m) and not fits({"data": 2}, m // 2)
  assert not any("kl_coef" in f for f in fixes)      # dropping the reference alone is too little
  with pytest.raises(ValueError, match="no single change"):
    memory.check_fits(p, 1 << 10)


def test_plan_components_follow_the_inputs():
  cfg = _micro_cfg()
  base = dict(global_batch=8, seq_len=128, minibatches=2)
  p = memory.plan(cfg, {"fsdp": 2}, **base)
  bf16 = memory.plan(cfg, {"fsdp": 2}, param_dtype="bfloat16", compute_dtype="bfloat16", **base)
  assert bf16.params * 2 == p.params and bf16.kv_cache < p.kv_cache
  ref = memory.plan(cfg, {"fsdp": 2}, reference_policy="device", **base)
  assert ref.reference == p.params and ref.total == p.total + p.params + (
      ref.update_peak - p.update_peak if ref.update_peak > ref.rollout_peak else 0)
  host = memory.plan(cfg, {"fsdp": 2}, reference_policy="host", **base)
  assert host.reference == 0 and host.host_bytes == p.params and host.reference_pass > p.params
  remat = memory.plan(cfg, {"fsdp": 2}, remat=True, **base)
  assert remat.activations < p.activations and "remat" in " ".join(remat.notes)
  per_dev = memory.plan(cfg, {"fsdp": 2}, batch_per_device=4, seq_len=128, minibatches=2)
  assert per_dev.global_batch == 8 and per_dev.as_dict() == p.as_dict()
  inference = memory.plan(cfg, {"fsdp": 2}, optimizer="none", **base)
  assert inference.optimizer_state == inference.gradients == 0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(global_batch=6, minibatches=4), "not divisible into 4 minibatches"),
    (dict(global_batch=8, optimizer="sgd"), "optimizer 'sgd' unknown"),
    (dict(global_batch=8, reference_policy="cpu"), "reference_policy 'cpu' unknown"),
    (dict(global_batch=8, batch_per_device=2), "exactly one of batch_per_device and global_batch"),
])
def test_plan_rejects_bad_inputs(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    memory.plan(_micro_cfg(), {"fsdp": 2}, seq_len=64, **kwargs)
  with pytest.raises(ValueError, match="resolve -1"):
    memory.plan(_micro_cfg(), {"fsdp": -1}, seq_len=64, global_batch=8)


def test_device_memory_bytes():
  class Dev:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      if isinstance(self.stats, Exception):
        raise self.stats
      return self.stats

  assert memory.device_memory_bytes(Dev({"bytes_limit": 80 << 30, "bytes_in_use": 5})) == 80 << 30
  assert memory.device_memory_bytes(Dev(None)) is None
  assert memory.device_memory_bytes(Dev(NotImplementedError())) is None
  assert memory.device_memory_bytes() is None            # the CPU backend reports nothing


# ---------------------------------------------------------------------------------------------
# From configs: the smoke config, the Qwen configs, the launch script.

def test_plan_for_smoke_config():
  from configs.default import get_config
  from jaxagent.rollout.budget import Budget
  config = get_config("smoke")
  p = memory.plan_for_config(config, 8)
  env = envs.make(config.env.name, from_pretrained("builtin:micro").tokenizer,
                  **dict(config.env.difficulty))
  turns = Budget.parse(config.rl.budget).max_turns
  assert p.seq_len == api.default_context_len(env, turns, env.max_action_len)
  assert p.prefill_len == env.max_obs_len
  assert p.mesh_shape == {"data": 1, "fsdp": 8, "tensor": 1}
  assert p.global_batch == config.rl.num_tasks * config.rl.group_size == 8
  assert p.batch_per_device == 1 and p.minibatches == config.rl.learner.minibatches
  assert p.model.param_dtype == "float32"
  # A device copy of the reference exactly when the trainer keeps one (kl_coef > 0).
  for kl, ref in ((0.1, p.params), (0.0, 0)):
    config.rl.learner.kl_coef = kl
    assert memory.plan_for_config(config, 8, context_len=p.seq_len).reference == ref
  config.model.path = ""
  with pytest.raises(ValueError, match="--config.model.path="):
    memory.plan_for_config(config, 8)


# Real dimensions (config.json of each checkpoint); the built-in tokenizer files stand in for the
# real ones (the environment's token counts, hence the context, come out longer than the real
# tokenizers'). variant -> (config.json fields, parameter count, devices, episodes per device
# per optimizer step). Parameter counts: the published totals (e.g. Qwen2.5-0.5B 0.49B, Llama
# 3.2-1B 1.24B), computed from the dimensions.
_LLAMA32 = dict(model_type="llama", vocab_size=128256, tie_word_embeddings=True,
                num_key_value_heads=8, intermediate_size=8192, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
HF = {
    "qwen2.5-0.5b": (dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          vocab_size=151936, tie_word_embeddings=True), 494_032_768, 1, 4),
    "qwen2.5-1.5b": (dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                          num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                          vocab_size=151936, tie_word_embeddings=True), 1_543_714_304, 1, 4),
    "qwen2.5-7b": (dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                        vocab_size=152064, tie_word_embeddings=False), 7_615_616_512, 8, 1),
    "qwen3-1.7b": (dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, vocab_size=151936, tie_word_embeddings=True),
                   1_720_574_976, 1, 4),
    "qwen3-8b": (dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, tie_word_embeddings=False),
                 8_190_735_360, 8, 1),
    "llama3.2-1b": (dict(_LLAMA32, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32), 1_235_814_400, 1, 4),
    "llama3.2-3b": (dict(_LLAMA32, hidden_size=3072, num_hidden_layers=28,
                         num_attention_heads=24), 3_212_749_824, 1, 2),
}


@pytest.mark.parametrize("variant", sorted(HF))
def test_hf_configs_plan(variant, tmp_path):
  import json
  import shutil
  from configs import hf
  from jaxagent.models.builtin import BUILTIN_DIRS
  dims, num_params, devices, episodes_per_device = HF[variant]
  (tmp_path / "config.json").write_text(json.dumps(dict(
      dict(max_position_embeddings=32768, rope_theta=1e6), architectures=["X"],
      rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16", eos_token_id=151645,
      **dims)))
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(BUILTIN_DIRS["micro"] / f, tmp_path / f)
  assert set(hf.VARIANTS) == set(HF)
  config = hf.get_config(variant)
  with pytest.raises(ValueError, match="--config.model.path="):
    memory.plan_for_config(config, devices)      # the path must be given
  config.model.path = str(tmp_path)
  p = memory.plan_for_config(config, devices)
  assert p.model.num_params() == num_params
  assert p.model.param_dtype == p.model.dtype == "bfloat16"
  assert p.mesh_shape == {"data": 1, "fsdp": devices, "tensor": 1}
  # ZeRO-3 shards of every matrix and hidden-size norm (3584, 4096 divide 8); the q/k/v biases
  # (Qwen2) and q/k norms (Qwen3) have no hidden axis and stay replicated.
  m = p.model
  replicated = 2 * m.num_layers * ((m.num_heads + 2 * m.num_kv_heads) * m.head_dim * m.qkv_bias
                                   + 2 * m.head_dim * m.qk_norm)
  assert replicated > 0 or devices == 1
  assert p.params * devices == 2 * num_params + (devices - 1) * replicated
  assert p.optimizer_state == 2 * p.params + 16       # + 4 replicated int32/float32 scalars
  # The sizing the config's docstring claims: fits 80 GiB per device with this many episodes per
  # device per optimizer step.
  assert p.fits(80 * memory.GIB), p.table()
  assert p.global_batch // p.minibatches // devices == episodes_per_device
  with pytest.raises(ValueError, match="unknown variant"):
    hf.get_config("qwen-70b")


def _run(args, **env):
  import os
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env={**os.environ, **env})


def test_launch_plan_smoke_config():
  ok = _run([sys.executable, "-m", "launch.plan", "--config=configs/default.py:smoke",
             "--num_devices=8", "--device_memory_gb=16"])
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "mesh data=1 x fsdp=8 x tensor=1" in ok.stdout and "TOTAL" in ok.stdout
  assert "fits (--device_memory_gb memory)" in ok.stdout
  bad = _run([sys.executable, "-m", "launch.plan", "--config=configs/default.py:smoke",
              "--num_devices=1", "--device_memory_gb=0.15", "--config.rl.learner.minibatches=1"])
  assert bad.returncode == 1
  assert "DOES NOT FIT (--device_memory_gb memory)" in bad.stderr
  assert "raise rl.learner.minibatches from 1 to 2" in bad.stderr
  assert "DOES NOT FIT" in bad.stdout                   # the table's verdict line


# ---------------------------------------------------------------------------------------------
# LoRA: adapters trained on a frozen base (float or int8).

LORA_CASES = [  # (targets, base_dtype): the default attention targets, all seven, an int8 base
    (("q_proj", "k_proj", "v_proj", "o_proj"), "float"),
    (tuple(lora.TARGETS), "float"),
    (tuple(lora.TARGETS), "int8"),
    (("q_proj", "v_proj"), "int8")]


@pytest.mark.parametrize("targets, base_dtype", LORA_CASES)
def test_lora_plan_equals_the_arrays(targets, base_dtype):
  """Base (in its storage dtype), adapters and their optimizer state: the bytes of the arrays
  the trainer builds, on a 2x2x2 mesh."""
  mesh = make_mesh((2, 2, 2))
  policy = from_pretrained("builtin:micro", mesh=mesh)
  lcfg = lora.LoraConfig(rank=8, targets=targets, base_dtype=base_dtype)
  base = adapters.FrozenBase(lcfg, adapters.held(policy.params, lcfg)).params
  ad = adapters.init_adapters(policy.config, lcfg, jax.random.key(0), mesh)
  state = init_train_state(ad, LearnerConfig().make_optimizer(), jax.random.key(0), mesh=mesh)
  p = memory.plan(policy.config, dict(mesh.shape), global_batch=8, seq_len=64, lora=lcfg,
                  reference_policy="device")
  assert p.params == _bytes_on_device0(base)
  assert p.adapters == p.gradients == p.reference == _bytes_on_device0(ad)
  assert p.optimizer_state == _bytes_on_device0(state.opt_state)
  full = memory.plan(policy.config, dict(mesh.shape), global_batch=8, seq_len=64,
                     reference_policy="device")
  # One base, no base-sized gradient, moments or reference: under half of full fine-tuning's
  # persistent bytes (params + 2 moments + reference = 4 bases; rank 8 on all seven of micro's
  # 128-wide projections is a large fraction of them); an int8 base ~1/4 of float32.
  assert p.persistent < full.persistent / 2
  assert p.params == full.params if base_dtype == "float" else 0.25 < p.params / full.params < 0.27


@pytest.mark.slow   # compiles the LoRA update of builtin:tiny four times
@pytest.mark.parametrize("targets, base_dtype", LORA_CASES)
def test_lora_update_within_10_percent_of_compiled_memory(targets, base_dtype):
  """The LoRA update's gradients (the adapters'), activations, batch copies and an int8 base's
  dequantised matrices vs XLA's compiled temp bytes (builtin:tiny, float32, one device, 16
  episodes of 256 tokens in 2 minibatches)."""
  policy = from_pretrained("builtin:tiny")
  cfg, seq, b = policy.config, 256, 16
  lcfg = lora.LoraConfig(rank=8, targets=targets, base_dtype=base_dtype)
  learner = LearnerConfig(minibatches=2)
  optimizer = learner.make_optimizer()
  update = make_update_fn(learner, cfg, optimizer, lcfg)
  state = init_train_state(lora.init_adapters(cfg, lcfg, jax.random.key(1)), optimizer,
                           jax.random.key(0))
  traj = _random_trajectory(np.random.default_rng(0), b, seq, cfg.vocab_size)
  base = adapters.held(policy.params, lcfg)
  analysis = update.lower(state, traj, None, base=base).compile().memory_analysis()
  if analysis is None:
    pytest.fail("this backend reports no compiled memory analysis")
  p = memory.plan(cfg, {}, global_batch=b, seq_len=seq, minibatches=2, lora=lcfg)
  trajectory_arg = 20 * b * seq                      # an argument of the update, not a temp
  est = p.gradients + p.activations + p.update_batch + p.dequant - trajectory_arg
  assert 0.9 < est / analysis.temp_size_in_bytes < 1.1, (est, analysis.temp_size_in_bytes)
