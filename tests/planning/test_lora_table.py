"""The LoRA memory table (jaxagent.planning.lora_table): what it says holds (the 7B fits one
80 GB GPU with LoRA only; an int8 base is a quarter of float32's), `launch.plan --lora_table`
prints it, and the committed benchmark page is its output, not a hand-copied one."""

import pathlib
import subprocess
import sys

from jaxagent.planning import lora_table, memory

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/benchmark/2026-12-07-lora-memory/README.md"


def test_table_verdicts():
  rows = {(r.model, r.arm): r.plan for r in lora_table.rows()}
  assert len(rows) == len(lora_table.MODELS) * len(lora_table.ARMS)
  fits = lambda p: p.total <= lora_table.DEVICE_BYTES
  for (model, arm), p in rows.items():
    if arm.startswith("full"):
      assert p.lora is None and p.reference == p.params       # a second copy for the KL term
      assert fits(p) == (model == "Qwen2.5-1.5B")
    else:
      assert p.lora is not None and fits(p)
      assert p.reference == p.adapters < p.params / 20        # the reference: no second base
      assert p.optimizer_state < p.params / 10
  f32 = rows[("Qwen2.5-7B", "full, float32 params")]
  int8 = rows[("Qwen2.5-7B", lora_table.ARMS[-1][0])]
  assert 0.25 < int8.params / f32.params < 0.26
  # The 7B's sizes are its config's: 7.62B parameters, untied.
  assert abs(lora_table.QWEN25_7B.num_params() - 7.616e9) < 1e7
  assert abs(lora_table.QWEN25_1_5B.num_params() - 1.544e9) < 1e7


def test_page_is_the_generated_table():
  text = PAGE.read_text()
  assert lora_table.render() in text
  assert "python -m launch.plan --lora_table" in text


def test_launch_flag_prints_it():
  out = subprocess.run([sys.executable, "-m", "launch.plan", "--lora_table"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == lora_table.render()
  bare = subprocess.run([sys.executable, "-m", "launch.plan"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert bare.returncode != 0 and "--lora_table" in bare.stderr
