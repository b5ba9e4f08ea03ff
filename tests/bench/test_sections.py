"""The benchmark's sections one at a time (jaxagent.bench's modules): the random-weight policy it
measures, how it adds the machine's limits to its results (the accounting itself is
tests/planning/test_flops.py's), credit's interleaved timing, the rollout's pieces, and the
markdown rendered from given results. The peers' section runs in test_benchmark.py's end-to-end
run; the SmolLM2 row's comparison (`peers.model_peer_row`) runs here on a tiny random model."""

import dataclasses
import types

import jax
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.bench import decode, machine, models, peers, pieces, report, rollouts, update
from jaxagent.envs.host import HostLookupEnv
from jaxagent.learners.update import LearnerConfig
from jaxagent.models import from_pretrained
from jaxagent.models.config import ModelConfig

CFG = ModelConfig(
    model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=False, qk_norm=False, max_position_embeddings=64)


def test_random_policy_sizes():
  class Base:
    config = CFG
    tokenizer = None
  big = models.random_policy(Base, hidden_size=16, num_layers=3, dtype="bfloat16")
  assert big.config.num_layers == 3 and big.config.vocab_size == 10
  leaves = jax.tree.leaves(big.params)
  assert all(x.dtype == np.dtype("bfloat16") for x in leaves)
  assert big.params["embed"].shape == (10, 16)
  assert dataclasses.replace(CFG, hidden_size=16, num_layers=3, dtype="bfloat16",
                             param_dtype="bfloat16") == big.config


def test_with_limits_adds_mfu_and_bound():
  # A decode of 100 tokens in 2 s whose bound reads 300 bytes at 100 B/s (3 s: 1.5x the bound,
  # impossible on a real machine but fine arithmetic); an update at 50 FLOP/s of a 200 peak.
  sec = lambda: {"update": {"model_flops_per_s": 50.0},
                 "decode": {"tokens": 100, "seconds": 2.0, "bound_bytes": 300.0}}
  res = {**sec(), "big": sec()}
  report.with_limits(res, peak=200.0, bandwidth=100.0)
  for s in (res, res["big"]):
    assert s["update"]["mfu"] == 0.25
    assert s["decode"]["bound_seconds"] == pytest.approx(3.0)
    assert s["decode"]["bound_tokens_per_s"] == pytest.approx(100 / 3)
    assert s["decode"]["fraction_of_bound"] == pytest.approx(1.5)
  no_big = {**sec(), "big": None}
  report.with_limits(no_big, peak=200.0, bandwidth=100.0)
  assert no_big["update"]["mfu"] == 0.25 and no_big["big"] is None


def test_credit_overhead_interleaves_and_reports_ratios(monkeypatch):
  # Fake updates on a fake clock: GRPO takes 10 ms, gigpo 11 ms (10% overhead), per_turn 10 ms
  # except one slow outlier (the median ignores it); gigpo's metrics carry the anchor-group size.
  clock = {"now": 0.0}
  calls = []
  cost = {"grpo": [0.010] * 5, "gigpo": [0.011] * 5, "per_turn": [0.010, 0.010, 0.5, 0.010, 0.010]}

  def fake_runner(policy, traj, learner, advantage=None):
    def run():
      calls.append(advantage)
      clock["now"] += cost[advantage][sum(c == advantage for c in calls) - 1]
      return {"anchor_group_size": np.float32(2.5)} if advantage == "gigpo" else {}
    return run, None, traj, None

  monkeypatch.setattr(update, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
  out = update.credit_overhead(None, None, LearnerConfig(), repeats=3, runner=fake_runner)
  # One untimed round, then three interleaved timed rounds (gigpo's metrics from its last one).
  assert calls == ["grpo", "gigpo", "per_turn"] * 4
  assert out["repeats"] == 3 and out["grpo"]["overhead"] == 0.0
  assert out["grpo"]["seconds"] == pytest.approx(0.010)
  assert out["gigpo"]["overhead"] == pytest.approx(0.1)
  assert out["per_turn"]["overhead"] == pytest.approx(0.0)
  assert out["gigpo"]["anchor_group_size"] == 2.5


def _section(update_flops_per_s=50.0, decode_seconds=2.0):
  return {"update": {"model_flops_per_s": update_flops_per_s, "tokens_per_s": 400.0,
                     "tokens": 800, "padded_length": 256},
          "decode": {"tokens": 100, "seconds": decode_seconds, "tokens_per_s": 100 / decode_seconds,
                     "bound_bytes": 300.0}}


def test_markdown_has_the_smollm2_rows():
  # The SmolLM2 section gets its own decode-vs-bound and update/MFU rows and a line with its
  # rollout, beside the built-in model's (a 100 FLOP/s update of a 200 peak: 50%).
  row = lambda s: {"seconds": s, "episodes_per_s": 8 / s, "generated_tokens_per_s": 80 / s,
                   "mean_length": 300.0}
  res = {"model": "builtin:micro", "env": "lookup", "params": 500_000, "episodes": 8, "turns": 2,
         "machine": {"cpu": "test cpu", "devices": "1 x cpu", "backend": "cpu", "jax": "0",
                     "peak_gflops": 0.0, "bandwidth_gbs": 0.0},
         "rollout": {"jax": row(1.0), "host": row(2.0), "naive": row(10.0)},
         **_section(),
         "smollm2": {"dtype": "float32", "params": 134_515_008, "episodes": 8, "turns": 2,
                     "rollout": row(4.0), **_section(update_flops_per_s=100.0,
                                                     decode_seconds=6.0)}}
  report.with_limits(res, peak=200.0, bandwidth=100.0)
  assert res["smollm2"]["update"]["mfu"] == 0.5
  assert res["smollm2"]["decode"]["fraction_of_bound"] == pytest.approx(0.5)
  md = report.markdown(res)
  assert "| SmolLM2-135M update tokens/s, MFU | 400, 50.0% of peak" in md
  assert "| SmolLM2-135M decode tokens/s (bound) | 17 (33: 50% of it) |" in md
  assert "SmolLM2-135M model: 134,515,008 parameters (float32)" in md
  assert "jax rollout 4.00 s, 2.00 episodes/s, 20 generated tokens/s" in md
  assert "| jax rollout vs naive loop (episodes/s) | 10.0x |" in md
  assert "SmolLM2-135M: jax rollout vs the transformers" not in md
  res["smollm2"]["peers"] = {
      "params": 134_515_008, "episodes": 16, "turns": 4, "tokens_per_turn": 32,
      "logits_max_abs_diff": 2e-5, "torch_threads": 2,
      "rounds": [{"jax_seconds": 4.0, "hf_seconds": 12.0}, {"jax_seconds": 5.0,
                                                             "hf_seconds": 20.0}],
      "jax": row(4.5) | {"episodes_per_s": 16 / 4.5}, "hf": {"seconds": 16.0,
                                                             "episodes_per_s": 1.0},
      "speedup": 16.0 / 4.5}
  md = report.markdown(res)
  assert ("| SmolLM2-135M: jax rollout vs the transformers generate loop (episodes/s) | 3.56x "
          "(3.56 vs 1.00) | >= 3x |") in md
  assert ("16 episodes x 4 turns x <= 32 tokens, median of 2 interleaved rounds: jax rollout "
          "4.50 s, transformers loop 16.00 s (3.56x)") in md


def test_model_peer_row_runs_both_frameworks_on_the_same_weights(tmp_path):
  """The SmolLM2 row's comparison on a tiny random model: the same logits in both frameworks,
  every round timing both, the speedup the medians' ratio, and torch's threads restored."""
  torch = pytest.importorskip("torch")
  base = from_pretrained("builtin:micro")
  policy = models.random_policy(base, **models.BIG["tiny"])
  env = envs.make("lookup", policy.tokenizer)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 2))
  threads = torch.get_num_threads()
  row = peers.model_peer_row(policy, env, HostLookupEnv(env.codec), tasks, 2, 2, 2, tmp_path,
                             "peer_tiny", torch_threads=1)
  assert torch.get_num_threads() == threads
  assert row["logits_max_abs_diff"] < 1e-4 and row["torch_threads"] == 1
  assert (row["episodes"], row["turns"], row["tokens_per_turn"]) == (4, 2, env.max_action_len)
  assert len(row["rounds"]) == 2
  assert row["jax"]["seconds"] == np.median([r["jax_seconds"] for r in row["rounds"]])
  assert row["hf"]["seconds"] == np.median([r["hf_seconds"] for r in row["rounds"]])
  assert row["speedup"] == pytest.approx(row["hf"]["seconds"] / row["jax"]["seconds"])
  assert row["jax"]["generated_tokens"] > 0 and row["hf"]["generated_tokens"] > 0
  assert (tmp_path / "peer_tiny" / "config.json").is_file()


@pytest.fixture(scope="module")
def micro_rollout():
  policy = from_pretrained("builtin:micro")
  env = envs.make("lookup", policy.tokenizer)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 2))
  _, traj = machine.timed(rollouts.rollout_fn(policy, env, tasks, 3, 3), 0)
  return policy, env, tasks, traj


def test_rollout_pieces_cover_the_transcript(micro_rollout, monkeypatch):
  """The breakdown's programs take the rollout's own tokens: the first observation, the sampled
  actions (<eot> included) and the later observations the prefill-only program appends make up
  every transcript token."""
  policy, env, tasks, traj = micro_rollout
  t = jax.device_get(traj)
  pre = pieces.observation_prefill_only(policy, traj, 1)
  first = np.array([t.turn_start[b, 0] for b in range(t.length.shape[0])])
  assert pre["tokens"] > 0 and pre["seconds"] > 0
  assert first.sum() + t.action_length.sum() + pre["tokens"] == t.length.sum()
  assert pieces.env_steps_only(env, tasks, 3, traj, 1)["seconds"] > 0
  prof = decode.decode_step_profile(policy, 4, 100, steps=2, repeats=1)
  assert prof["cache_attention_ms"] == pytest.approx(
      prof["step_ms"] - prof["step_without_cache_attention_ms"])
  cfg = policy.config
  assert prof["kv_bytes"] == 2 * cfg.num_layers * 4 * cfg.num_kv_heads * 100 * cfg.head_dim * 4
  assert min(prof[k] for k in prof if k.endswith("_ms") and k != "cache_attention_ms") > 0
  assert prof["step_path"] == "xla blocks" and "step_xla_blocks_ms" not in prof   # 8 devices
  prof = decode.decode_step_profile(rollouts.with_attention(policy, "kernel"), 4, 100,
                                   steps=2, repeats=1)      # the kernel, and XLA beside it
  assert prof["step_path"] == "kernel" and prof["step_xla_blocks_ms"] > 0


def test_markdown_has_the_breakdown_and_peer_rows():
  row = lambda s: {"seconds": s, "episodes_per_s": 8 / s, "generated_tokens_per_s": 80 / s,
                   "mean_length": 300.0}
  prof = {"step_ms": 2.0, "step_xla_blocks_ms": 4.0, "step_dense_ms": 3.0,
          "step_without_cache_attention_ms": 0.5, "cache_attention_ms": 1.5, "sampling_ms": 0.1,
          "batch": 64, "context": 700, "kv_bytes": 40e6, "step_path": "kernel"}
  res = {"model": "builtin:micro", "env": "lookup", "params": 500_000, "episodes": 8, "turns": 2,
         "machine": {"cpu": "test cpu", "devices": "1 x cpu", "backend": "cpu", "jax": "0",
                     "peak_gflops": 0.0, "bandwidth_gbs": 40.0},
         "rollout": {"jax": row(3.0), "jax_xla_attention": row(4.5), "host": row(4.0),
                     "naive": row(10.0)}, **_section(),
         "breakdown": {"observation_prefill": {"seconds": 0.5}, "environment": {"seconds": 0.1},
                       "decode_step": prof},
         "peers": {"params": 972_928, "episodes": 64, "turns": 8, "tokens_per_turn": 16,
                   "hops": 4, "logits_max_abs_diff": 1e-6, "torch_threads": 2, "speedup": 4.0,
                   "jax": row(2.0), "jax_xla_attention": row(4.0), "hf": row(8.0)}}
  res["decode"]["first_prefill_seconds"] = 0.5
  report.with_limits(res, peak=200.0, bandwidth=40e9)
  md = report.markdown(res)
  assert "| first observation's prefill only | 0.50 | | | 0.17x |" in md
  # 3.0 s of rollout over 2.0 s of decode + 0.5 s of each prefill.
  assert "| jax rollout time / (decode + both prefills) time | 1.00 | <= 1.5 |" in md
  assert ("| peers' workload: jax rollout vs the transformers generate loop (episodes/s) | "
          "4.0x") in md
  assert ("| builtin:micro | 64 x 700 | 2.00 (kernel) | 4.00 | 3.00 | 0.50 | 1.50 | 0.10 | "
          "1.00 |") in md
  assert "| jax_xla_attention | 4.50 | 1.8 | 18 | 1.50x |" in md
  assert "XLA's cache attention instead of the kernel: 4.00 s (2.0 episodes/s, 2.0x the" in md
