"""The accelerator preset (`python -m launch.benchmark --preset=accelerator`) end to end at its
smallest on CPU: the preset's code path with the tiny shape in bf16, batches 2 and 4, one turn,
the `transformers` loop on torch's CPU build; the returned dict and the markdown hold the same
numbers. The device table and the preset's own sizes are checked apart (no device was lent:
the GPU run itself is docs/benchmark/accelerator.md's to record)."""

import dataclasses
import json
import re

import jax
import pytest

import jaxagent.envs as envs
from jaxagent.bench import accelerator, markdown, report, run_benchmark, write
from jaxagent.bench.report import nbytes
from jaxagent.bench.run import PRESETS, preset
from jaxagent.models import from_pretrained
from launch import benchmark as launcher

SMALLEST = dict(accelerator=("tiny",), accel_batches=(2, 4), accel_detail_batch=2, accel_turns=1,
                accel_hf=True, matmul_size=128, bandwidth_mib=4, limit_repeats=1)


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
  out = tmp_path_factory.mktemp("accelerator")
  res = run_benchmark(preset("accelerator", launcher.default_learner(), out=str(out), **SMALLEST))
  return res, out, write(res, out)


def test_the_preset_measures_the_three_shapes_alone():
  o = preset("accelerator", launcher.default_learner())
  assert o.accelerator == ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b")
  assert o.accel_batches == (8, 64, 256) and o.accel_detail_batch == 64
  assert o.accel_dtype == "bfloat16"
  assert not (o.core or o.big or o.smollm2 or o.peers or o.scaling)
  assert o.accel_budget_s == 390.0                 # the 8-minute device call, with its margin
  assert set(PRESETS) == {"default", "accelerator"}
  with pytest.raises(ValueError, match="pick one of default, accelerator"):
    preset("gpu", launcher.default_learner())
  with pytest.raises(ValueError, match="leave env at 'lookup'"):
    run_benchmark(preset("accelerator", launcher.default_learner(), env="grid"))


def test_device_table_and_its_fallback():
  h100 = accelerator.device_limits("NVIDIA H100 80GB HBM3")
  assert (h100["bandwidth"], h100["peak_bf16_flops"]) == (3.35e12, 989e12)
  assert h100["bandwidth_source"] == h100["peak_source"] == "table"
  assert accelerator.device_limits("NVIDIA H100 PCIe")["bandwidth"] == 2.0e12
  assert accelerator.device_limits("NVIDIA H200")["bandwidth"] == 4.8e12
  assert accelerator.device_limits("NVIDIA L40S")["bandwidth"] == 0.864e12
  assert accelerator.device_limits("NVIDIA A100-SXM4-80GB")["bandwidth"] == 2.039e12
  cpu = accelerator.device_limits("cpu", matmul_size=64, bandwidth_mib=1, repeats=1)
  assert cpu["bandwidth_source"] == cpu["peak_source"] == "measured"
  assert cpu["bandwidth"] > 0 and cpu["peak_bf16_flops"] > 0


def test_the_transformers_row_runs_only_on_the_jax_rows_kind_of_device(monkeypatch):
  assert accelerator.torch_device() == "cpu"
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert accelerator.torch_device() is None          # torch has no TPU: the row says not run


def test_the_launcher_offers_the_presets():
  from absl import flags            # noqa: PLC0415 (the launcher's import defined its flags)
  assert flags.FLAGS["preset"].default == "default"
  assert sorted(flags.FLAGS["preset"].parser.enum_values) == sorted(PRESETS)
  assert flags.FLAGS["accel_models"].default == []


def test_the_section_ran_every_batch_and_the_transformers_loop(smallest):
  res, out, _ = smallest
  assert "rollout" not in res and "big" not in res and "peers" not in res
  ac = res["accelerator"]
  assert ac["limits"]["device"] == jax.devices()[0].device_kind
  assert ac["versions"]["jax"] == jax.__version__ and ac["versions"]["torch"]
  (m,) = ac["models"]
  assert m["shape"] == "tiny" and m["dtype"] == "bfloat16"
  assert [r["episodes"] for r in m["batches"]] == [2, 4]
  assert all(r["turns"] == 1 and r["generated_tokens"] > 0 for r in m["batches"])
  assert m["decode"]["tokens"] == m["rollout"]["generated_tokens"]
  assert 0 < m["update"]["mfu"] and 0 < m["decode"]["fraction_of_bound"]
  assert m["update"]["mfu"] == pytest.approx(
      m["update"]["model_flops_per_s"] / ac["limits"]["peak_bf16_flops"])
  assert m["hf"]["device"] == "cpu" and m["hf"]["generated_tokens"] > 0
  assert m["hf_ratio"] == pytest.approx(m["hf"]["seconds"] / m["rollout"]["seconds"])
  assert m["peak_bytes"] is None and ac["limits"]["device_bytes"] is None   # CPU: no stats
  assert m["planned_bytes"] > 0
  assert (out / "hf_tiny" / "config.json").is_file()
  partial = json.loads((out / "accelerator_partial.json").read_text())
  assert partial["models"] == json.loads(json.dumps(ac["models"]))


def test_a_model_past_the_time_budget_is_skipped_and_said(tmp_path):
  base = from_pretrained("builtin:micro")
  env = envs.make("lookup", base.tokenizer)
  ac = accelerator.accelerator_section(base, env, None, launcher.default_learner(), ("tiny",),
                                       "bfloat16", (2,), 2, 1, False, tmp_path, (64, 1, 1),
                                       budget_s=0.0)
  (m,) = ac["models"]
  # The seconds spent before the check depend on the machine (set-up: 0-2 s): read the message's
  # shape, and the budget that decided it.
  assert re.fullmatch(r"out of time: \d+ s spent, the last model took 0 s, budget 0 s.*",
                      m["skipped"]), m["skipped"]
  assert json.loads((tmp_path / "accelerator_partial.json").read_text())["models"] == [m]
  md = "\n".join(report.accelerator_lines({"accelerator": ac}))
  assert f"| tiny |  | skipped: {m['skipped']} | | | |" in md


def test_markdown_holds_the_section_with_its_numbers(smallest):
  res, out, paths = smallest
  assert sorted(paths) == sorted(str(out / f) for f in ("benchmark.md", "benchmark.json"))
  assert json.loads((out / "benchmark.json").read_text()) == json.loads(json.dumps(res))
  md = markdown(res)
  assert (out / "benchmark.md").read_text().startswith(md)
  ac = res["accelerator"]
  lim = ac["limits"]
  assert (f"HBM bandwidth {lim['bandwidth'] / 1e12:.3f} TB/s (measured), dense bf16 peak "
          f"{lim['peak_bf16_flops'] / 1e12:.1f} TFLOP/s (measured)") in md
  assert "the device holds n/a" in md
  (m,) = ac["models"]
  for r in m["batches"]:
    assert (f"| tiny | {m['params']:,} | {r['episodes']} | {r['seconds']:.2f} | "
            f"{r['episodes_per_s']:,.1f} | {r['generated_tokens_per_s']:,.0f} |") in md
  d, u, hf = m["decode"], m["update"], m["hf"]
  assert (f"| tiny | {d['tokens_per_s']:,.0f} ({d['bound_tokens_per_s']:,.0f}: "
          f"{100 * d['fraction_of_bound']:.1f}%) | {u['tokens_per_s']:,.0f}, "
          f"{100 * u['mfu']:.2f}% | {hf['episodes_per_s']:,.2f} (cpu) | {m['hf_ratio']:.2f}x | "
          f"n/a / {nbytes(m['planned_bytes'])} |") in md


@pytest.mark.parametrize("shape,vocab,published", [("smollm2-135m", 49152, 134_515_008),
                                                   ("qwen2-0.5b", 151936, 494_032_768),
                                                   ("qwen2-1.5b", 151936, 1_543_714_304)])
def test_the_shapes_are_the_real_models_layers(shape, vocab, published):
  """With the real vocabulary the shapes count the published models' parameters exactly."""
  cfg = dataclasses.replace(from_pretrained("builtin:micro").config, vocab_size=vocab,
                            **accelerator.SHAPES[shape])
  assert cfg.num_params() == published


def test_a_model_the_device_cannot_hold_is_skipped_and_said(tmp_path):
  base = from_pretrained("builtin:micro")
  env = envs.make("lookup", base.tokenizer)
  limits = {"device_bytes": 1000, "peak_bf16_flops": 1.0, "bandwidth": 1.0}
  m = accelerator.model_rows(base, env, None, launcher.default_learner(), "tiny", "bfloat16",
                             (2,), 2, 1, True, tmp_path, limits)
  assert m["planned_bytes"] > 1000 and "batches" not in m
  assert m["skipped"] == (f"the planner's {nbytes(m['planned_bytes'])} exceed the device's "
                          "1000 B")
  ac = {"date": "d", "backend": "gpu", "versions": {"jax": "v"}, "dtype": "bfloat16", "turns": 1,
        "detail_batch": 2, "limits": {**limits, "device": "X", "bandwidth_source": "table",
                                      "peak_source": "table"}, "models": [m]}
  md = "\n".join(report.accelerator_lines({"accelerator": ac}))
  assert f"| tiny | {m['params']:,} | skipped: {m['skipped']} | | | |" in md
  assert "the device holds 1000 B" in md
