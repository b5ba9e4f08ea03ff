"""LoRA in a run: the frozen base, the adapters' checkpoints, and restoring base + adapters.

    base, start = run_base(config, policy.params, lcfg, mesh)   # base weights, starting adapters
    meta = checkpoint_meta(lcfg, base_fingerprint(base))        # saved with every checkpoint
    check_workdir(ckpt, lcfg, fingerprint)                      # before resuming a phase
    params = restore_policy(workdir, phase, step, abstract, base_fn, mesh)   # eval: full or LoRA

With config.model.lora.rank > 0 a phase's train state holds the adapters only (and their
optimizer state); the base is loaded once per run and passed to every step as a frozen argument.
An adapter checkpoint is an ordinary checkpoint ({"params": adapters, "opt_state", "step",
"key"}) whose meta also holds the base fingerprint (`lora_io.BASE_FINGERPRINT_KEY`) and the
adapters' hyper-parameters (`LORA_KEY`), so evaluation rebuilds base + adapters from the
checkpoint alone, whatever the evaluating config's lora section says.

The base of a LoRA run is the model's own weights (config.model.path), or the newest checkpoint
of config.model.init_from when that is a full (non-LoRA) one. When init_from holds adapters
(e.g. a study's arms starting from the base run's SFT adapters) the base is the model's own
weights and those adapters are where training starts.

With config.model.lora.base_dtype="int8" the base is held as `quant.quantize_params` makes it
(`held`), in training and in evaluation alike; its fingerprint is that of the int8 weights the
adapters were trained on (so adapters of the int8 base are refused on the float base and back).
With base_dtype="gguf" the policy is loaded in the .gguf file's blocks (`setup.load_policy`,
`gguf_base`) and is the base as it is; a float base (a full checkpoint of init_from, or an
evaluating config with another base_dtype) is refused naming the fix.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxagent.checkpoint import Checkpointer, IncompatibleCheckpointError
from jaxagent.models import gguf_base, lora, quant
from jaxagent.models.config import ModelConfig
from jaxagent.models.lora_io import BASE_FINGERPRINT_KEY, base_fingerprint
from jaxagent.runs import layout
from jaxagent.sharding.mesh import tree_shardings

LORA_KEY = "lora"     # meta key: the adapters' LoraConfig as a dict


def checkpoint_meta(lcfg: lora.LoraConfig, fingerprint: str) -> dict:
  """The meta entries of an adapter checkpoint."""
  return {BASE_FINGERPRINT_KEY: fingerprint,
          LORA_KEY: {"rank": lcfg.rank, "alpha": lcfg.alpha, "dropout": lcfg.dropout,
                     "targets": list(lcfg.targets), "base_dtype": lcfg.base_dtype}}


def config_from_meta(meta: dict) -> lora.LoraConfig | None:
  """The LoraConfig an adapter checkpoint was saved with, or None for a full checkpoint."""
  d = meta.get(LORA_KEY)
  if d is None:
    return None
  return lora.LoraConfig(rank=int(d["rank"]), alpha=float(d["alpha"]),
                         dropout=float(d["dropout"]), targets=tuple(d["targets"]),
                         base_dtype=str(d.get("base_dtype", "float")))


def held(params: dict, lcfg: lora.LoraConfig) -> dict:
  """The base as a LoRA run holds it: int8 (`quant.quantize_params`) with base_dtype "int8",
  GGUF blocks with "gguf" (loaded so: `setup.load_policy`; float params are refused), else as it
  is."""
  if lcfg.gguf_base:
    if not gguf_base.is_block_base(params):
      raise ValueError(
          "config.model.lora.base_dtype='gguf': the base must be config.model.path's .gguf file "
          "loaded in its blocks (with config.model.lora.base_dtype='gguf' and rank > 0 in the "
          "config that loads it), not float weights such as a full checkpoint of "
          "config.model.init_from; use config.model.lora.base_dtype='int8' for those")
    return params
  return quant.quantize_params(params) if lcfg.int8_base else params


def abstract_adapters(cfg: ModelConfig, lcfg: lora.LoraConfig, mesh) -> dict:
  """float32 ShapeDtypeStructs of the adapters, sharded like their base matrices on `mesh` (or
  on the default device without one)."""
  shapes = jax.tree.map(lambda sa: jax.ShapeDtypeStruct(sa[0], jnp.float32),
                        lora.adapter_shapes(cfg, lcfg),
                        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                        and isinstance(x[0], tuple))
  if mesh is None:               # one device: restored onto the default device
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return layout.placed(shapes, jax.tree.map(lambda _: one, shapes))
  return layout.placed(shapes, tree_shardings(lora.logical_axes(cfg, lcfg), shapes, mesh))


def init_adapters(cfg: ModelConfig, lcfg: lora.LoraConfig, key: jax.Array, mesh) -> dict:
  """Fresh adapters (`lora.init_adapters`), placed with their shardings on `mesh`."""
  adapters = lora.init_adapters(cfg, lcfg, key)
  if mesh is None:
    return adapters
  return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), adapters,
                      abstract_adapters(cfg, lcfg, mesh))


def _latest(workdir) -> tuple[str, int, dict] | None:
  """(phase, step, meta) of the newest checkpoint of `workdir`'s last phase holding one."""
  have = layout.checkpoint_steps(workdir)
  if not have:
    return None
  phase, step = have[-1]
  return phase, step, read_meta(workdir, phase, step)


def read_meta(workdir, phase: str, step: int) -> dict:
  ckpt = Checkpointer.reader(layout.checkpoint_dir(workdir, phase))
  try:
    return ckpt.restore_meta(step)
  finally:
    ckpt.close()


def run_base(init_from: str, policy_params: dict, cfg: ModelConfig, lcfg: lora.LoraConfig,
             mesh) -> tuple[dict, dict | None]:
  """(base, starting adapters or None) of a LoRA run: see the module docstring. Adapters from
  init_from must have been trained with this run's rank and targets and on this base."""
  if not init_from:
    return held(policy_params, lcfg), None
  found = _latest(init_from)
  if found is None:
    raise FileNotFoundError(f"config.model.init_from={init_from}: no checkpoint there; train it "
                            "first, or fix the path")
  phase, step, meta = found
  saved = config_from_meta(meta)
  if saved is None:          # a full checkpoint: the base itself
    params = layout.restore_params(init_from, phase, step, layout.abstract_params(policy_params))
    return held(params, lcfg), None
  if (saved.rank, saved.targets, saved.base_dtype) != (lcfg.rank, lcfg.targets, lcfg.base_dtype):
    raise ValueError(f"config.model.init_from={init_from} holds adapters of rank {saved.rank} on "
                     f"{','.join(saved.targets)} (base {saved.base_dtype}); set "
                     f"config.model.lora.rank={saved.rank}, config.model.lora.targets="
                     f"{','.join(saved.targets)!r} and config.model.lora.base_dtype="
                     f"{saved.base_dtype!r} to continue them")
  policy_params = held(policy_params, lcfg)
  want = base_fingerprint(policy_params)
  if meta.get(BASE_FINGERPRINT_KEY) != want:
    raise IncompatibleCheckpointError(
        f"config.model.init_from={init_from} ({phase} step {step}) holds LoRA adapters of another "
        f"base model: saved {BASE_FINGERPRINT_KEY} {meta.get(BASE_FINGERPRINT_KEY)!r}, this run's "
        f"base {want!r}; point config.model.path at the base they were trained on")
  adapters = layout.restore_params(init_from, phase, step, abstract_adapters(cfg, lcfg, mesh))
  return policy_params, adapters


def refuse_adapter_init(init_from: str) -> None:
  """Full fine-tuning (rank 0) from init_from: refused, naming the fix, when its newest
  checkpoint holds adapters (they are not a full set of weights)."""
  found = _latest(init_from) if layout.checkpoint_dir(init_from, "sft").parent.is_dir() else None
  if found is not None and config_from_meta(found[2]) is not None:
    lcfg = config_from_meta(found[2])
    raise ValueError(
        f"config.model.init_from={init_from} holds LoRA adapters ({found[0]} step {found[1]}, "
        f"rank {lcfg.rank}) but config.model.lora.rank=0: set config.model.lora.rank={lcfg.rank} "
        f"and config.model.lora.targets={','.join(lcfg.targets)!r} to continue them, or merge "
        "them first (jaxagent.models.lora_io.export_merged) and load that as config.model.path")


def check_base(ckpt, fingerprint: str) -> None:
  """Raises `IncompatibleCheckpointError` naming both fingerprints unless the newest checkpoint
  of Checkpointer `ckpt` (if any) holds adapters of the base `fingerprint`."""
  step = ckpt.latest_step()
  if step is None:
    return
  saved = ckpt.restore_meta(step).get(BASE_FINGERPRINT_KEY)
  if saved != fingerprint:
    raise IncompatibleCheckpointError(
        f"{ckpt.directory} holds LoRA adapters (step {step}) of another base model: saved "
        f"{BASE_FINGERPRINT_KEY} {saved!r}, this run's base {fingerprint!r}. Adapters only fit "
        "the weights they were trained on: load that base (config.model.path / init_from) or "
        "use a new --workdir")


def check_workdir(ckpt: Checkpointer, lcfg: lora.LoraConfig, fingerprint: str | None) -> None:
  """Refuses to resume a phase whose newest checkpoint is of the other kind (adapters vs full
  weights) or holds adapters of another base (naming both fingerprints)."""
  step = ckpt.latest_step()
  if step is None:
    return
  saved = ckpt.restore_meta(step).get(BASE_FINGERPRINT_KEY)
  if lcfg.enabled and saved is None:
    raise IncompatibleCheckpointError(
        f"{ckpt.directory} holds full fine-tuning checkpoints (step {step}) but "
        f"config.model.lora.rank={lcfg.rank}; use a new --workdir, or config.model.lora.rank=0")
  if not lcfg.enabled and saved is not None:
    raise IncompatibleCheckpointError(
        f"{ckpt.directory} holds LoRA adapter checkpoints (step {step}) but config.model.lora.rank"
        "=0; set config.model.lora (rank, targets) as that run had it, or use a new --workdir")
  if lcfg.enabled:
    check_base(ckpt, fingerprint)


class BaseLoader:
  """The base weights of adapter checkpoints, computed on first use (with its fingerprint), and
  its int8 form (`held`) for adapters trained on an int8 base."""

  def __init__(self, load: Callable[[], dict]):
    self._load, self._base, self._fp = load, None, None
    self._int8, self._int8_fp = None, None

  @property
  def params(self) -> dict:
    if self._base is None:
      self._base = self._load()
    return self._base

  @property
  def fingerprint(self) -> str:
    if self._fp is None:
      self._fp = base_fingerprint(self.params)
    return self._fp

  def for_adapters(self, lcfg: lora.LoraConfig) -> tuple[dict, str]:
    """(base params, fingerprint) as adapters of `lcfg` were trained on them."""
    if lcfg.gguf_base:                # the file's blocks, as loaded (else refused, naming the fix)
      return held(self.params, lcfg), self.fingerprint
    if not lcfg.int8_base:
      return self.params, self.fingerprint
    if self._int8 is None:
      self._int8 = held(self.params, lcfg)
      self._int8_fp = base_fingerprint(self._int8)
    return self._int8, self._int8_fp


def restore_policy(workdir, phase: str, step: int, abstract: Any, cfg: ModelConfig,
                   base: BaseLoader, mesh) -> dict:
  """The policy of checkpoint (phase, step) of `workdir`: its params (a full checkpoint, placed
  as `abstract` says) or, for an adapter checkpoint, `base` with the adapters attached (the base
  is read only then; another base than the adapters' is refused, naming both fingerprints)."""
  meta = read_meta(workdir, phase, step)
  lcfg = config_from_meta(meta)
  if lcfg is None:
    return layout.restore_params(workdir, phase, step, abstract)
  saved = meta.get(BASE_FINGERPRINT_KEY)
  params, fingerprint = base.for_adapters(lcfg)
  if saved != fingerprint:
    raise IncompatibleCheckpointError(
        f"{pathlib.Path(workdir)} ({phase} step {step}) holds LoRA adapters of another base: saved "
        f"{BASE_FINGERPRINT_KEY} {saved!r}, the evaluated model's {fingerprint!r}; evaluate "
        "with the config.model.path (and config.model.init_from) the run was trained with")
  adapters = layout.restore_params(workdir, phase, step, abstract_adapters(cfg, lcfg, mesh))
  return lora.attach(params, adapters, lcfg)


def base_loader(init_from: str, policy_params: Callable[[], dict], abstract: Any) -> BaseLoader:
  """The BaseLoader of a run's adapter checkpoints: init_from's full checkpoint (placed as
  `abstract` says), else the model's own weights (`policy_params()`, called only when needed)."""
  def load():
    if init_from:
      found = _latest(init_from)
      if found is not None and config_from_meta(found[2]) is None:
        return layout.restore_params(init_from, found[0], found[1], abstract)
    return policy_params()
  return BaseLoader(load)


class FrozenBase:
  """The frozen base of a LoRA run, loaded once: its params, fingerprint and LoraConfig."""

  def __init__(self, lcfg: lora.LoraConfig, params: dict):
    self.lcfg, self.params = lcfg, params
    self.fingerprint = base_fingerprint(params)

  def policy(self, adapters: dict) -> dict:
    """The adapted policy's params: the base with `adapters` attached (no array copied)."""
    return lora.attach(self.params, adapters, self.lcfg)

  def meta(self) -> dict:
    return checkpoint_meta(self.lcfg, self.fingerprint)


def all_zero_b(adapters: dict) -> bool:
  """Whether every adapter's B is zero: the adapted policy is then exactly the base."""
  return all(not bool(jnp.any(ab["b"] != 0)) for ab in adapters.values())
