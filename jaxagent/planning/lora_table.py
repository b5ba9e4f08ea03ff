"""The memory table of issue 40: Qwen2.5-1.5B and -7B RL on one 80 GB GPU, full fine-tuning vs
LoRA vs LoRA on an int8 base, peak bytes per phase, from `memory.plan` (no weights, no device).

    python -m launch.plan --lora_table            # prints the markdown table
    rows = lora_table.rows(); print(lora_table.markdown(rows))

The two models are their Hugging Face config.json sizes, written here as ModelConfig constants
(Qwen/Qwen2.5-1.5B-Instruct and Qwen/Qwen2.5-7B-Instruct; nothing is downloaded). The setting
(`SETTING`) is one RL step of 32 episodes (8 tasks x group 4) of 2,048 context tokens (512 of
prompt), 8 minibatches, bfloat16 compute, a KL term (so full fine-tuning holds a reference copy
on the device), no rematerialisation, on one device (mesh 1 x 1 x 1).
"""

from __future__ import annotations

import dataclasses

from jaxagent.models.config import ModelConfig
from jaxagent.models.lora import TARGETS, LoraConfig
from jaxagent.planning import memory

_QWEN25 = dict(model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
               qk_norm=False, max_position_embeddings=32768, dtype="bfloat16",
               eos_token_ids=(151645, 151643), pad_token_id=151643, attention="xla")
QWEN25_1_5B = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                          num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                          tie_word_embeddings=True, **_QWEN25)
QWEN25_7B = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                        tie_word_embeddings=False, **_QWEN25)
MODELS = {"Qwen2.5-1.5B": QWEN25_1_5B, "Qwen2.5-7B": QWEN25_7B}
DEVICE_BYTES = 80 * 10**9            # "80 GB": an H100/A100 80GB (74.5 GiB)
SETTING = dict(global_batch=32, seq_len=2048, prefill_len=512, minibatches=8,
               reference_policy="device", compute_dtype="bfloat16")
RANK = 16
# (label, param dtype, LoraConfig or None)
ARMS = (
    ("full, float32 params", "float32", None),
    ("full, bfloat16 params", "bfloat16", None),
    (f"LoRA r{RANK} attention, bfloat16 base", "bfloat16", LoraConfig(rank=RANK)),
    (f"LoRA r{RANK} all 7, bfloat16 base", "bfloat16", LoraConfig(rank=RANK, targets=TARGETS)),
    (f"LoRA r{RANK} all 7, int8 base", "bfloat16",
     LoraConfig(rank=RANK, targets=TARGETS, base_dtype="int8")),
)


@dataclasses.dataclass(frozen=True)
class Row:
  model: str
  arm: str
  plan: memory.MemoryPlan

  @property
  def rollout_phase(self) -> int:      # what is live while rolling out
    return self.plan.persistent + self.plan.rollout_peak

  @property
  def update_phase(self) -> int:       # what is live at the update's peak
    return self.plan.persistent + self.plan.update_peak


def rows(models=None, device_bytes: int = DEVICE_BYTES) -> list[Row]:
  """One plan per (model, arm) in the SETTING."""
  del device_bytes
  out = []
  for name, cfg in (models or MODELS).items():
    for label, param_dtype, lcfg in ARMS:
      p = memory.plan(cfg, {}, param_dtype=param_dtype, lora=lcfg, **SETTING)
      out.append(Row(name, label, p))
  return out


def _gib(n: int) -> str:
  return f"{n / memory.GIB:,.1f}"


def markdown(table_rows: list[Row], device_bytes: int = DEVICE_BYTES) -> str:
  """The rows as a markdown table (GiB per device; the verdict against `device_bytes`)."""
  head = ("| model | arm | params (base) | adapters + grads + Adam | reference | rollout phase "
          "peak | update phase peak | fits 80 GB |")
  lines = [head, "|" + "---|" * 8]
  for r in table_rows:
    p = r.plan
    trained = p.adapters + p.gradients + p.optimizer_state if p.lora else (
        p.gradients + p.optimizer_state)
    fits = "yes" if p.total <= device_bytes else f"no ({_gib(p.total)} GiB)"
    lines.append(f"| {r.model} | {r.arm} | {_gib(p.params)} | {_gib(trained)} | "
                 f"{_gib(p.reference)} | {_gib(r.rollout_phase)} | {_gib(r.update_phase)} | "
                 f"{fits} |")
  return "\n".join(lines)


def render() -> str:
  """The table with a line stating its setting (what `launch.plan --lora_table` prints)."""
  s = SETTING
  return (f"GiB per device, one device of {DEVICE_BYTES / 1e9:.0f} GB "
          f"({DEVICE_BYTES / memory.GIB:.1f} GiB); {s['global_batch']} episodes x "
          f"{s['seq_len']} tokens ({s['prefill_len']} prompt), {s['minibatches']} minibatches, "
          f"{s['compute_dtype']} compute, KL reference {s['reference_policy']}, no remat.\n\n"
          + markdown(rows()))
