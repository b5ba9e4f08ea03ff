"""The benchmark end to end at its smallest: `run_benchmark` runs every section but SmolLM2 (the
big model at its tiny size, the peers' workload at 4 episodes x 2 turns, a scaling sweep of
one point), `write` writes its files, and the markdown holds each section's table with the
numbers of the returned dict. The launcher's flags default to the package's options."""

import json

import pytest
from absl import flags

from jaxagent.bench import Options, markdown, run_benchmark, write
from jaxagent.learners.update import LearnerConfig
from launch import benchmark as launcher

SMALLEST = dict(model="builtin:micro", env="lookup", tasks=2, group=2, turns=2, repeats=1,
                big=True, big_size="tiny", big_episodes=4, big_turns=2, smollm2=False,
                scaling=True, peers=True, matmul_size=128, bandwidth_mib=4, limit_repeats=1,
                credit_repeats=1, peer_episodes=4, peer_turns=2, scaling_batches=(2,),
                scaling_turns=(), scaling_tokens=())


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
  out = tmp_path_factory.mktemp("benchmark")
  res = run_benchmark(Options(learner=launcher.default_learner(), out=str(out), **SMALLEST))
  return res, out, write(res, out)


def test_every_section_ran(smallest):
  res, _, _ = smallest
  for key in ("machine", "rollout", "decode", "breakdown", "update", "credit", "big", "peers",
              "scaling", "host_path"):
    assert res[key], key
  assert "smollm2" not in res
  assert set(res["rollout"]) == {"jax", "host", "naive"}        # 8 devices: no kernel row
  assert res["episodes"] == 4 and res["rollout"]["jax"]["generated_tokens"] > 0
  assert res["decode"]["tokens"] == res["rollout"]["jax"]["generated_tokens"]
  assert len(res["machine"]["peak_gflops_runs"]) == 2
  assert res["machine"]["peak_gflops"] == max(res["machine"]["peak_gflops_runs"])
  assert 0 < res["update"]["mfu"] and 0 < res["decode"]["fraction_of_bound"]
  assert res["big"]["size"] == "tiny" and res["big"]["update"]["mfu"] > 0
  assert res["big"]["decode_step"]["batch"] == 4
  assert [(s["axis"], s["episodes"], s["turns"], s["tokens_per_turn"]) for s in res["scaling"]
          ] == [("batch", 2, 4, 32)]
  hp = res["host_path"]
  # The same oracle episodes on both paths: the same turns taken, every method.
  turns = {hp["env_steps"][k]["turns"] for k in ("jax", "host", "host_serial")}
  turns |= {hp["slow_tool"][k]["turns"] for k in ("host", "host_serial")}
  assert len(turns) == 1 and turns.pop() > 0 and hp["episodes"] == 4


def test_peers_run_both_systems_on_the_same_weights(smallest):
  """The transformers generate loop and the jitted rollout on one exported model: the same
  logits, every episode run by both (a small version of the peers' workload)."""
  res, out, _ = smallest
  pe = res["peers"]
  assert pe["logits_max_abs_diff"] < 1e-4
  assert pe["jax"]["generated_tokens"] > 0 and pe["hf"]["generated_tokens"] > 0
  assert pe["speedup"] == pytest.approx(pe["hf"]["seconds"] / pe["jax"]["seconds"])
  assert (out / "peer_qwen2" / "config.json").is_file()


def test_markdown_holds_each_section_with_its_numbers(smallest):
  res, out, paths = smallest
  assert sorted(paths) == sorted(str(out / f) for f in
                                 ("benchmark.md", "benchmark.json", "scaling.png"))
  assert json.loads((out / "benchmark.json").read_text()) == json.loads(json.dumps(res))
  md = markdown(res)
  assert (out / "benchmark.md").read_text().startswith(md)
  m, r, d = res["machine"], res["rollout"], res["decode"]
  assert f"Measured peak float32 matmul {m['peak_gflops']:.1f} GFLOP/s" in md
  assert f"read bandwidth {m['bandwidth_gbs']:.1f} GB/s" in md
  jax_s = r["jax"]["seconds"]
  for k in ("jax", "host", "naive"):
    assert (f"| {k} | {r[k]['seconds']:.2f} | {r[k]['episodes_per_s']:,.1f} | "
            f"{r[k]['generated_tokens_per_s']:,.0f} | {r[k]['seconds'] / jax_s:.2f}x |") in md
  assert (f"| decode only (no environment) | {d['seconds']:.2f} | | {d['tokens_per_s']:,.0f} | "
          f"{d['seconds'] / jax_s:.2f}x |") in md
  env_s = res["breakdown"]["environment"]["seconds"]
  assert f"| environment steps only | {env_s:.3f} | | | {env_s / jax_s:.2f}x |" in md
  assert (f"| jax rollout vs naive loop (episodes/s) | {r['naive']['seconds'] / jax_s:.1f}x | "
          f">= 10x |") in md
  gigpo = res["credit"]["gigpo"]
  assert (f"| update with state grouping (gigpo) vs GRPO | {100 * gigpo['overhead']:+.1f}% "
          f"({gigpo['seconds']:.3f} s") in md
  for name, sec in (("", res), ("~TINY ", res["big"])):
    u, dd = sec["update"], sec["decode"]
    assert (f"| {name}update tokens/s, MFU | {u['tokens_per_s']:,.0f}, {100 * u['mfu']:.1f}% "
            f"of peak ({u['model_flops_per_s'] / 1e9:.1f} GFLOP/s) |") in md
    assert (f"| {name}decode tokens/s (bound) | {dd['tokens_per_s']:,.0f} "
            f"({dd['bound_tokens_per_s']:,.0f}: {100 * dd['fraction_of_bound']:.0f}% of it) |"
            ) in md
  for name, pr in (("builtin:micro", res["breakdown"]["decode_step"]),
                   ("~TINY ", res["big"]["decode_step"])):
    assert (f"| {name} | {pr['batch']} x {pr['context']} | {pr['step_ms']:.2f} (xla blocks) | "
            f"{pr['step_ms']:.2f} | {pr['step_dense_ms']:.2f} | "
            f"{pr['step_without_cache_attention_ms']:.2f} | {pr['cache_attention_ms']:.2f} | "
            f"{pr['sampling_ms']:.2f} |") in md
  pe = res["peers"]
  assert (f"| peers' workload: jax rollout vs the transformers generate loop (episodes/s) | "
          f"{pe['speedup']:.1f}x ({pe['jax']['episodes_per_s']:,.1f} vs "
          f"{pe['hf']['episodes_per_s']:,.1f}) | >= 5x |") in md
  assert (f"{pe['episodes']} episodes x {pe['turns']} turns x <= {pe['tokens_per_turn']} tokens: "
          f"jax rollout {pe['jax']['seconds']:.2f} s") in md
  hp, jax_eps, host_eps = res["host_path"], r["jax"]["episodes_per_s"], r["host"]["episodes_per_s"]
  es, slow = hp["env_steps"], hp["slow_tool"]
  assert (f"| rollout (model included), episodes/s | {jax_eps:,.1f} | {host_eps:,.1f} | | "
          f"{jax_eps / host_eps:.2f}x |") in md
  assert (f"| environment steps only (oracle actions), turns/s | {es['jax']['turns_per_s']:,.0f} "
          f"| {es['host']['turns_per_s']:,.0f} | {es['host_serial']['turns_per_s']:,.0f} | "
          f"{es['jax']['turns_per_s'] / es['host']['turns_per_s']:.1f}x |") in md
  assert (f"| a tool that waits 2 ms per call, turns/s | | {slow['host']['turns_per_s']:,.0f} | "
          f"{slow['host_serial']['turns_per_s']:,.0f} | threads: "
          f"{slow['host']['turns_per_s'] / slow['host_serial']['turns_per_s']:.1f}x") in md
  b = res["big"]
  assert f"~TINY model: {b['params']:,} parameters (float32), random weights, 4 episodes" in md
  for s in res["scaling"]:
    assert (f"| {s['axis']} | {s['episodes']} | {s['turns']} | {s['tokens_per_turn']} | "
            f"{s['mean_length']:.0f} | {s['seconds']:.2f} | {s['episodes_per_s']:,.1f} | "
            f"{s['generated_tokens_per_s']:,.0f} |") in md


def test_the_launcher_defaults_are_the_options_defaults():
  """`python -m launch.benchmark` with no flags measures what `Options`' defaults say (the
  commands in README.md and docs/guides quote these flags)."""
  defaults = Options(learner=LearnerConfig())
  assert callable(launcher.main)     # importing the launcher defined its flags
  for name in ("model", "env", "tasks", "group", "turns", "repeats", "big", "big_size",
               "big_dtype", "big_episodes", "big_turns", "smollm2", "scaling", "peers", "out"):
    assert flags.FLAGS[name].default == getattr(defaults, name), name
