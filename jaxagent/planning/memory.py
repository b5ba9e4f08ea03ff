"""Memory planner: bytes per device of one RL step (rollout, then update) for a model and a mesh.

    from jaxagent.planning import memory
    p = memory.plan(model_cfg, {"data": 1, "fsdp": 8, "tensor": 1}, batch_per_device=16,
                    seq_len=2048, param_dtype="bfloat16", compute_dtype="bfloat16")
    print(p.table()); memory.check_fits(p, memory.device_memory_bytes())
    p = memory.plan_for_config(config, num_devices=8)    # the same from a training config

Every per-device size is derived from the project's own sharding rules: each array gets its
logical axes, `logical_to_spec` picks the mesh axes (dropping an axis that does not divide the
dimension, as the real placement does), and the per-device element count is the global count
divided by the product of the chosen axis sizes. Parameters and optimizer state use the decoder's
own parameter tree (`decoder.abstract_params` / `logical_axes`) and `make_optimizer(...).init`
(abstractly), so they match the arrays the trainer creates byte for byte (tests check this on 8
fake devices, together with the rollout's KV cache).

A planning module sits above what it measures: it imports the models, learners, rollout and
sharding code it accounts for, and nothing in the library imports it (launch scripts and tests
do).

Notation (all per device unless "global"): c = compute-dtype bytes, p = param-dtype bytes;
G = global episodes per RL step, M = G / minibatches episodes per optimizer step, S = context
tokens per episode (the rollout's transcript / KV capacity), P = prompt tokens (first
observation); D hidden, F intermediate, H heads, K kv heads, hd head_dim, V vocab, N layers.
loc(axes, shape) = elements of that global shape on one device under the rules (batch over
(data, fsdp), heads / kv_heads / mlp / vocab over tensor; hidden activations replicated).

  params      = sum over parameters of loc(param) * p
  optimizer   = AdamW (`make_optimizer`): mu and nu in the param dtype (optax's default), each
                sharded like its parameter, plus replicated scalar counters -> ~2 * params
  gradients   = params (same dtype and sharding; they exist during the update's backward pass)
  reference   = params if reference_policy == "device" (the trainer's copy when kl_coef > 0),
                0 for "none"; for "host" it is 0 persistently and counted only in its own
                reference-pass phase (rl.reference_on_host: the trainer offloads it to pinned host
                memory and the update moves it back for the pass)
  activations = saved residuals of the update's forward + backward through the layer scan, for
                one minibatch of M episodes x S tokens. With T = loc((M, S)) tokens per device:
      layer(Sq, Sk) = T*(3c + 16)*D                      x, normed x, MLP input (c) and 4
                                                         float32 norm terms
                    + 2c*loc(M, S, H, hd) + 2c*loc(M, K, S, hd)   q and attention output; k, v
                    + 2c*loc(M, S, F)                             gate and up (`decoder.swiglu`)
                    + (4 + c)*loc(M, H, Sq, Sk)                   float32 scores + probs in c, or
                      8*loc(M, H, Sq) when Sq = Sk > QUERY_BLOCK (`decoder.causal_attention` in
                      query blocks keeps only each query's softmax max and sum)
      (these are what `jax.ad_checkpoint.print_saved_residuals` lists for the decoder's layer)
      no remat: (N + 1) * layer(S, S)   (N layers saved by the scan, + one layer's cotangents)
      remat:    N * c*T*D + 2 * layer(S, S)   (layer inputs only; one layer recomputed + its
                cotangents; the decoder has no remat switch yet: an estimate of what a
                per-layer `jax.checkpoint` would keep)
      + 1*loc(M, H, S, S) attention mask (bool, materialised once; 7*loc(M, H, S, S) with query
        blocks, fitted to XLA's compiled memory at S = 256-1024)
      + 4*c*T*D (embedding output, final hidden states, their norm and cotangent)
      + 16*loc(M, chunk, V) (one chunk of the float32 log-softmax, entropy and their
        cotangents; `logprob_chunk` tokens at a time)
  update_batch = trajectory (below) + the update's copies: 4*loc(G, S) loss mask (+4*loc(G, S)
                reference log-probs) + (12 (+4))*loc(M, S) for the gathered minibatch
  kv_cache    = 2 * c * loc(N, G, K, S, hd) (k and v, [layers, B, kv_heads, S, head_dim],
                batch over (data, fsdp), kv_heads over tensor) + 4*loc(G) lengths
  rollout_buffers = 36*loc(G, S): the engine's four [B, S] transcript buffers (16 bytes per
                token) and the returned trajectory's five (20 bytes per token)
  rollout_transient = one prefill chunk of the prompt (`sampler.prefill` appends equal chunks
                of C = chunk_width(P, PREFILL_CHUNK) <= 128 tokens; nothing is saved across
                layers): (8 + c)*loc(G, H, C, C + CB) + loc(G, C, C) -- float32 scores of the
                chunk against itself and one cache block of CB = CACHE_BLOCK slots, their masked
                copy and the probabilities of one layer, plus the bool mask -- + 4*loc(G, V), the
                float32 logits of each row's last token (the only position unembedded), + one
                layer's activations of the chunk, c*(3*loc(G, C, F) + loc(G, C, H + 2K, hd) +
                4*loc(G, C, D)): gate, up and their product; q, k, v; the layer's input, its
                norm, the attention output and the residual sum. With smaller chunks the scores
                shrink as C^2 and these as C, so they had to be counted (at C = 100 they are a
                third of XLA's compiled rollout temp on the 1x8x1 mesh of the test)
  trajectory  = 20*loc(G, S) (tokens, positions, loss mask, behaviour log-probs, turn ids)

Phases: persistent = params + optimizer + reference + adapters; rollout = kv_cache +
rollout_buffers + rollout_transient + dequant; update = gradients + activations + update_batch +
dequant; reference pass ("host" only) = params + layer(S, S) + 16*loc(G, chunk, V).
total = persistent + max(rollout, update, reference pass).

With LoRA (`lora`, rank > 0; `lora_memory`): params = the frozen base in its storage dtype
(base_dtype "int8": 1 byte per quantised element + a float32 scale per output channel; "gguf":
each matrix in the file's block format, e.g. 20/32 bytes per weight for Q4_1, unsharded); adapters
= the float32 adapters; gradients = adapters; optimizer = AdamW's moments of the adapters only;
reference = a frozen copy of the starting adapters when there is a KL term (the base with
adapters off is the reference: no second base, on the device or the host); activations as for
full fine-tuning, less what no weight gradient needs (`lora_memory.unsaved_bytes`: one layer
when no MLP projection has an adapter, the attention output when o_proj has none; fitted to
XLA's compiled memory on builtin micro/tiny, S = 64-256); dequant (int8 or gguf base) = the
unembedding matrix and one layer's [D, F] matrix dequantised in the compute dtype.

This is an estimate of live buffers, not of XLA's allocator: fusion, layout padding and
fragmentation move the real peak; leave headroom. Checked against XLA's compiled memory analysis
on CPU (tests/planning/test_memory.py, float32, 1 device and meshes 1x8x1, 2x2x2): the update
within ~10% and the rollout within ~30%. Not measured on GPU/TPU, nor in bfloat16 (XLA on CPU
computes bfloat16 in float32). Not covered: the SFT phase (`sft.batch_size` x
`data.demo_max_len`) and evaluation rollouts (`eval.*` batch sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

import jaxagent.envs as envs
from jaxagent.learners.update import LearnerConfig, make_optimizer
from jaxagent.models import decoder, gguf_base, gguf_io, hf_io
from jaxagent.models.config import ModelConfig
from jaxagent.models.lora import LoraConfig
from jaxagent.planning import lora_memory
from jaxagent.models.policy import gguf_base_needs_gguf, load_config_and_tokenizer, resolve_path
from jaxagent.models.sampler import PREFILL_CHUNK, chunk_width
from jaxagent.rollout.api import default_context_len
from jaxagent.rollout.budget import Budget
from jaxagent.runs import config as sections
from jaxagent.sharding.mesh import MESH_AXES, local_elements, mesh_sizes

GIB = 1 << 30
OPTIMIZERS = ("adamw", "none")
REFERENCE_POLICIES = ("none", "device", "host")
# Bytes per token of the rollout's transcript buffers (4 arrays) + the returned trajectory (5).
_ROLLOUT_BUFFER_BYTES = 16 + 20
_TRAJECTORY_BYTES = 20


def abstract_mesh(mesh_shape: Mapping[str, int]) -> AbstractMesh:
  """A device-free mesh of the given axis sizes (every axis of MESH_AXES; missing ones are 1)."""
  sizes = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
  if any(s < 1 for s in sizes):
    raise ValueError(f"mesh shape {dict(mesh_shape)}: sizes must be >= 1 here (resolve -1 with "
                     "jaxagent.sharding.mesh_sizes(shape, num_devices) first)")
  return AbstractMesh(sizes, MESH_AXES)


def _tree_local_bytes(shapes, axes_of, mesh) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs; axes_of(path, leaf) gives logical axes."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    axes = axes_of(path, leaf)
    total += local_elements(axes, leaf.shape, mesh) * jnp.dtype(leaf.dtype).itemsize
  return total


def _dict_keys(path) -> tuple[str, ...]:
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _param_axes_lookup(cfg: ModelConfig):
  axes = decoder.logical_axes(cfg)
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: isinstance(x, tuple))[0]:
    flat[_dict_keys(path)] = leaf
  return flat


def param_bytes(cfg: ModelConfig, mesh) -> int:
  """Per-device bytes of the decoder's parameters (its own tree, axes and dtypes)."""
  _, shapes = decoder.abstract_params(cfg)
  lookup = _param_axes_lookup(cfg)
  return _tree_local_bytes(shapes, lambda path, _: lookup[_dict_keys(path)], mesh)


def optimizer_bytes(cfg: ModelConfig, mesh, optimizer: str = "adamw") -> int:
  """Per-device bytes of the optimizer state `make_optimizer(...).init(params)` builds: every
  leaf whose key path ends in a parameter's path is sharded like that parameter; the rest (step
  counters, the injected learning rate) are replicated scalars. The state's shapes do not depend
  on the optimizer's hyperparameters (schedule, clipping, decay only change values)."""
  if optimizer == "none":
    return 0
  _, shapes = decoder.abstract_params(cfg)
  adamw = make_optimizer(learning_rate=1e-5, schedule="constant", warmup_steps=0, total_steps=0,
                         end_lr_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0, b1=0.9,
                         b2=0.999, eps=1e-8)
  state = jax.eval_shape(adamw.init, shapes)
  lookup = _param_axes_lookup(cfg)

  def axes_of(path, leaf):
    keys = _dict_keys(path)
    for n in range(len(keys), 0, -1):
      hit = lookup.get(keys[-n:])
      if hit is not None and len(hit) == leaf.ndim:
        return hit
    return (None,) * leaf.ndim
  return _tree_local_bytes(state, axes_of, mesh)


def kv_cache_bytes(cfg: ModelConfig, mesh, batch: int, capacity: int) -> int:
  """Per-device bytes of `decoder.init_cache(cfg, batch, capacity)` placed by the rules: k and v
  [layers, B, kv_heads, S, head_dim] (k stored with its last two axes swapped: the same bytes) in
  the compute dtype, plus the int32 lengths [B]."""
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
  kv = local_elements(("layers", "batch", "kv_heads", "length", "head_dim"), shape, mesh)
  return 2 * kv * cfg.jnp_dtype.itemsize + 4 * local_elements(("batch",), (batch,), mesh)


def _layer_bytes(cfg: ModelConfig, mesh, rows: int, q_len: int, k_len: int) -> int:
  """One decoder layer's saved intermediates for `rows` episodes of q_len tokens attending to
  k_len keys (formula `layer(Sq, Sk)` in the module docstring)."""
  c = cfg.jnp_dtype.itemsize
  d, f, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  hidden = local_elements(("batch", None, None), (rows, q_len, d), mesh)
  heads = local_elements(("batch", None, "heads", "head_dim"), (rows, q_len, h, hd), mesh)
  kv = local_elements(("batch", "kv_heads", None, "head_dim"), (rows, k, q_len, hd), mesh)
  mlp = local_elements(("batch", None, "mlp"), (rows, q_len, f), mesh)
  if _blocked(q_len, k_len):        # per query: the softmax's float32 max and sum
    attention = 8 * local_elements(("batch", "heads", None), (rows, h, q_len), mesh)
  else:                             # float32 scores + probabilities
    attention = (4 + c) * local_elements(("batch", "heads", None, None), (rows, h, q_len, k_len),
                                         mesh)
  return (3 * c + 16) * hidden + 2 * c * heads + 2 * c * kv + 2 * c * mlp + attention


def _blocked(q_len: int, k_len: int) -> bool:
  """Whether the decoder's causal attention without a cache runs in query blocks
  (`decoder.causal_attention`)."""
  return q_len == k_len and 0 < decoder.QUERY_BLOCK < q_len


def activation_bytes(cfg: ModelConfig, mesh, minibatch: int, seq_len: int, *, remat: bool,
                     logprob_chunk: int = 128) -> int:
  """The update's activations for one minibatch (formula `activations` in the module docstring)."""
  c = cfg.jnp_dtype.itemsize
  layer = _layer_bytes(cfg, mesh, minibatch, seq_len, seq_len)
  hidden = local_elements(("batch", None, None), (minibatch, seq_len, cfg.hidden_size), mesh)
  if remat:
    saved = cfg.num_layers * c * hidden + 2 * layer
  else:
    saved = (cfg.num_layers + 1) * layer
  mask = local_elements(("batch", "heads", None, None),
                        (minibatch, cfg.num_heads, seq_len, seq_len), mesh)
  if _blocked(seq_len, seq_len):
    # In query blocks XLA (CPU) still keeps ~6 bytes per [M, H, S, S] element beside the mask,
    # once per update (one product kept 8 per layer, (N + 1) times): fitted to the compiled
    # memory analysis at S = 256-1024 (2026-12-06). Not yet traced to its buffers: ordering the
    # blocks with optimization barriers did not change it.
    mask *= 7
  chunk = min(logprob_chunk, max(seq_len - 1, 1))
  logits = 16 * local_elements(("batch", None, "vocab"), (minibatch, chunk, cfg.vocab_size), mesh)
  return saved + mask + 4 * c * hidden + logits


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of each component (see the module docstring for every formula)."""
  model: ModelConfig
  mesh_shape: dict
  global_batch: int          # G: episodes per RL step over the whole mesh
  batch_per_device: int      # loc(G): episodes each device rolls out and holds
  minibatches: int
  seq_len: int               # S
  prefill_len: int           # P
  optimizer: str
  remat: bool
  reference_policy: str
  logprob_chunk: int
  params: int
  optimizer_state: int
  gradients: int
  activations: int
  update_batch: int
  kv_cache: int
  rollout_buffers: int
  rollout_transient: int
  reference: int             # on the device for the whole run ("device")
  reference_pass: int        # peak of the reference log-prob pass ("host"), else 0
  host_bytes: int            # host memory the plan assumes (the "host" reference)
  notes: tuple[str, ...] = ()
  lora: LoraConfig | None = None   # adapters (rank > 0) on a frozen base, or None
  adapters: int = 0          # the float32 adapters (LoRA)
  dequant: int = 0           # an int8 base's dequantised matrices alive at once

  @property
  def persistent(self) -> int:
    return self.params + self.optimizer_state + self.reference + self.adapters

  @property
  def rollout_peak(self) -> int:
    return self.kv_cache + self.rollout_buffers + self.rollout_transient + self.dequant

  @property
  def update_peak(self) -> int:
    return self.gradients + self.activations + self.update_batch + self.dequant

  @property
  def total(self) -> int:
    return self.persistent + max(self.rollout_peak, self.update_peak, self.reference_pass)

  def fits(self, device_bytes: int) -> bool:
    return self.total <= device_bytes

  def components(self) -> dict[str, int]:
    return {"params": self.params, "optimizer_state": self.optimizer_state,
            "reference": self.reference, "gradients": self.gradients,
            "activations": self.activations, "update_batch": self.update_batch,
            "kv_cache": self.kv_cache, "rollout_buffers": self.rollout_buffers,
            "rollout_transient": self.rollout_transient, "reference_pass": self.reference_pass,
            "adapters": self.adapters, "dequant": self.dequant}

  def as_dict(self) -> dict[str, Any]:
    return {**self.components(), "persistent": self.persistent, "rollout_peak": self.rollout_peak,
            "update_peak": self.update_peak, "total": self.total, "mesh": dict(self.mesh_shape),
            "global_batch": self.global_batch, "batch_per_device": self.batch_per_device,
            "minibatches": self.minibatches, "seq_len": self.seq_len,
            "prefill_len": self.prefill_len, "param_dtype": self.model.param_dtype,
            "compute_dtype": self.model.dtype, "remat": self.remat,
            "reference_policy": self.reference_policy, "host_bytes": self.host_bytes,
            "lora": None if self.lora is None else {
                "rank": self.lora.rank, "targets": list(self.lora.targets),
                "base_dtype": self.lora.base_dtype},
            "notes": list(self.notes)}

  def table(self, device_bytes: int | None = None) -> str:
    """A plain-text table of the plan per device."""
    m = self.model
    mesh = " x ".join(f"{a}={self.mesh_shape[a]}" for a in MESH_AXES)
    lines = [
        f"memory plan per device: mesh {mesh}; {m.num_params() / 1e6:,.1f}M params "
        f"({m.param_dtype} params, {m.dtype} compute)",
        f"  episodes: {self.global_batch} per step, {self.batch_per_device} per device, "
        f"{self.minibatches} minibatch(es); context S={self.seq_len}, prompt P="
        f"{self.prefill_len}; remat={self.remat}; reference={self.reference_policy}",
    ]
    if self.lora is not None:
      lines.append(f"  LoRA rank {self.lora.rank} on {','.join(self.lora.targets)}; frozen base "
                   f"{self.lora.base_dtype} (params = the base; gradients and optimizer state "
                   "= the adapters')")
    lines.append(f"  {'component':<22}{'per device':>14}")
    lora_rows = lambda *rows: list(rows) if self.lora is not None else []
    rows = [("params", self.params), *lora_rows(("adapters", self.adapters)),
            ("optimizer_state", self.optimizer_state),
            ("reference", self.reference), ("= persistent", self.persistent),
            ("kv_cache", self.kv_cache), ("rollout_buffers", self.rollout_buffers),
            ("rollout_transient", self.rollout_transient),
            *lora_rows(("dequant", self.dequant)), ("= rollout peak", self.rollout_peak),
            ("gradients", self.gradients), ("activations", self.activations),
            ("update_batch", self.update_batch), *lora_rows(("dequant", self.dequant)),
            ("= update peak", self.update_peak)]
    if self.reference_policy == "host":
      rows.append(("= reference pass", self.reference_pass))
    rows.append(("TOTAL", self.total))
    lines += [f"  {name:<22}{format_bytes(v):>14}" for name, v in rows]
    if self.host_bytes:
      lines.append(f"  host memory (reference): {format_bytes(self.host_bytes)}")
    if device_bytes is not None:
      verdict = "fits" if self.fits(device_bytes) else "DOES NOT FIT"
      lines.append(f"  device memory {format_bytes(device_bytes)}: {verdict} "
                   f"({100 * self.total / device_bytes:.0f}% used)")
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


def format_bytes(n: int) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:,.2f} {unit}"
  return f"{n} B"


def plan(model_cfg: ModelConfig, mesh_shape: Mapping[str, int], *, param_dtype: str | None = None,
         compute_dtype: str | None = None, optimizer: str = "adamw",
         batch_per_device: int | None = None, global_batch: int | None = None,
         seq_len: int, prefill_len: int | None = None, remat: bool = False,
         reference_policy: str = "none", minibatches: int = 1,
         logprob_chunk: int = 128, lora: LoraConfig | None = None,
         base_formats: dict | None = None) -> MemoryPlan:
  """Bytes per device of an RL step (rollout + update) of `model_cfg` on a mesh.

  Args:
    mesh_shape: {data, fsdp, tensor} sizes (all >= 1).
    param_dtype, compute_dtype: override the model config's dtypes.
    optimizer: "adamw" (the trainer's `make_optimizer`) or "none" (inference only).
    batch_per_device: episodes per device (the global batch is this x data x fsdp); or give
      global_batch (episodes over the mesh; the rules decide what each device holds, e.g. a batch
      not divisible by fsdp is replicated over fsdp).
    seq_len: context tokens per episode (KV capacity, transcript length).
    prefill_len: tokens of the first observation (default seq_len, an upper bound).
    remat: per-layer rematerialisation (an estimate: the decoder has no remat switch yet).
    reference_policy: "none", "device" (a second params copy on device) or "host".
    minibatches: the learner's minibatches per pass (activations are per minibatch).
    logprob_chunk: the learner's sequence chunk of the log-softmax.
    lora: adapters on a frozen base (rank > 0; its base_dtype "int8" for an int8 base, "gguf"
      for a GGUF file's blocks): only they are trained, and the KL reference costs no second
      base (module docstring).
    base_formats: with base_dtype "gguf", each matrix's format in the file
      (`gguf_base.formats(path, cfg)`; `plan_for_config` reads it from config.model.path).
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer {optimizer!r} unknown; use one of {OPTIMIZERS}")
  if reference_policy not in REFERENCE_POLICIES:
    raise ValueError(f"reference_policy {reference_policy!r} unknown; use one of "
                     f"{REFERENCE_POLICIES}")
  if (batch_per_device is None) == (global_batch is None):
    raise ValueError("plan: give exactly one of batch_per_device and global_batch")
  cfg = dataclasses.replace(model_cfg, param_dtype=param_dtype or model_cfg.param_dtype,
                            dtype=compute_dtype or model_cfg.dtype)
  mesh = abstract_mesh(mesh_shape)
  sizes = dict(mesh.shape)
  batch_shards = sizes["data"] * sizes["fsdp"]
  g = batch_per_device * batch_shards if global_batch is None else global_batch
  if g < 1 or seq_len < 1:
    raise ValueError(f"plan: need episodes >= 1 and seq_len >= 1, got {g} and {seq_len}")
  if minibatches < 1 or g % minibatches:
    raise ValueError(f"{g} episodes per step are not divisible into {minibatches} minibatches; "
                     "change rl.learner.minibatches or rl.num_tasks * rl.group_size")
  p_len = min(prefill_len or seq_len, seq_len)
  mb = g // minibatches
  notes = []
  local_g = local_elements(("batch",), (g,), mesh)
  if local_g * batch_shards != g:
    notes.append(f"{g} episodes do not divide data x fsdp = {batch_shards}: the batch is "
                 f"replicated over part of the mesh ({local_g} episodes per device)")
  if local_elements(("batch",), (mb,), mesh) * batch_shards != mb:
    notes.append(f"a minibatch of {mb} episodes does not divide data x fsdp = {batch_shards}")
  if sizes["tensor"] > 1 and cfg.num_kv_heads % sizes["tensor"]:
    notes.append(f"kv_heads={cfg.num_kv_heads} does not divide tensor={sizes['tensor']}: k/v "
                 "projections and the KV cache are replicated over tensor")
  if remat:
    notes.append("remat=True is an estimate: the decoder has no per-layer remat switch yet")

  lcfg = lora if lora is not None and lora.enabled else None
  acts = activation_bytes(cfg, mesh, mb, seq_len, remat=remat, logprob_chunk=logprob_chunk)
  ref = reference_policy in ("device", "host")
  adapters = dequant = 0
  if lcfg is None:
    params = param_bytes(cfg, mesh)
    opt = optimizer_bytes(cfg, mesh, optimizer)
    grads = params if optimizer != "none" else 0
  else:
    lcfg.check(cfg)
    params = lora_memory.base_bytes(cfg, mesh, lcfg, base_formats)
    adapters = lora_memory.adapter_bytes(cfg, lcfg, mesh)
    opt = lora_memory.adapter_optimizer_bytes(cfg, lcfg, mesh) if optimizer != "none" else 0
    grads = adapters if optimizer != "none" else 0
    acts -= lora_memory.unsaved_bytes(cfg, mesh, lcfg, mb, seq_len, remat,
                                      _layer_bytes(cfg, mesh, mb, seq_len, seq_len))
    dequant = lora_memory.dequant_bytes(cfg, mesh) if lcfg.quantized_base else 0
  tok_g = local_elements(("batch", None), (g, seq_len), mesh)
  tok_mb = local_elements(("batch", None), (mb, seq_len), mesh)
  trajectory = _TRAJECTORY_BYTES * tok_g
  update_batch = trajectory + (4 + 4 * ref) * tok_g + (12 + 4 * ref) * tok_mb
  kv = kv_cache_bytes(cfg, mesh, g, seq_len)
  rollout_buffers = _ROLLOUT_BUFFER_BYTES * tok_g
  c = cfg.jnp_dtype.itemsize
  chunk = chunk_width(p_len, PREFILL_CHUNK)
  block = min(decoder.CACHE_BLOCK, seq_len)
  prompt_scores = local_elements(("batch", "heads", None, None),
                                 (g, cfg.num_heads, chunk, chunk + block), mesh)
  prompt_mask = local_elements(("batch", None, None), (g, chunk, chunk), mesh)
  last_logits = local_elements(("batch", "vocab"), (g, cfg.vocab_size), mesh)
  chunk_layer = c * (
      3 * local_elements(("batch", None, "mlp"), (g, chunk, cfg.intermediate_size), mesh)
      + local_elements(("batch", None, "heads", "head_dim"),
                       (g, chunk, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim), mesh)
      + 4 * local_elements(("batch", None, None), (g, chunk, cfg.hidden_size), mesh))
  rollout_transient = (8 + c) * prompt_scores + prompt_mask + 4 * last_logits + chunk_layer
  reference_pass = 0
  if reference_policy == "host" and lcfg is None:
    chunk = min(logprob_chunk, max(seq_len - 1, 1))
    reference_pass = (params + _layer_bytes(cfg, mesh, g, seq_len, seq_len)
                      + 16 * local_elements(("batch", None, "vocab"), (g, chunk, cfg.vocab_size),
                                            mesh))
  return MemoryPlan(
      model=cfg, mesh_shape=sizes, global_batch=g, batch_per_device=local_g,
      minibatches=minibatches, seq_len=seq_len, prefill_len=p_len, optimizer=optimizer,
      remat=remat, reference_policy=reference_policy, logprob_chunk=logprob_chunk,
      params=params, optimizer_state=opt, gradients=grads, activations=acts,
      update_batch=update_batch, kv_cache=kv, rollout_buffers=rollout_buffers,
      rollout_transient=rollout_transient,
      reference=(adapters if ref else 0) if lcfg else (
          params if reference_policy == "device" else 0),
      reference_pass=reference_pass,
      host_bytes=params if reference_policy == "host" and lcfg is None else 0,
      notes=tuple(notes), lora=lcfg, adapters=adapters, dequant=dequant)


def _replan(p: MemoryPlan, **changes) -> MemoryPlan:
  kw = dict(mesh_shape=p.mesh_shape, param_dtype=p.model.param_dtype,
            compute_dtype=p.model.dtype, optimizer=p.optimizer, global_batch=p.global_batch,
            seq_len=p.seq_len, prefill_len=p.prefill_len, remat=p.remat,
            reference_policy=p.reference_policy, minibatches=p.minibatches,
            logprob_chunk=p.logprob_chunk, lora=p.lora)
  kw.update(changes)
  return plan(p.model, **kw)


def suggestions(p: MemoryPlan, device_bytes: int) -> list[str]:
  """Single config changes that each make the plan fit `device_bytes` (checked by replanning)."""
  out = []
  sizes = p.mesh_shape
  for axis in ("fsdp", "tensor"):
    for k in (2, 4, 8, 16, 32, 64):
      if sizes["data"] % k == 0:          # move devices from data: same device count
        shape, how = dict(sizes, data=sizes["data"] // k, **{axis: sizes[axis] * k}), \
            f" and lower mesh.data from {sizes['data']} to {sizes['data'] // k}"
      else:
        shape, how = dict(sizes, **{axis: sizes[axis] * k}), f" ({k}x the devices)"
      try:
        q = _replan(p, mesh_shape=shape)
      except ValueError:
        continue
      if q.fits(device_bytes):
        out.append(f"raise mesh.{axis} from {sizes[axis]} to {sizes[axis] * k}{how}")
        break
  shards = p.global_batch // max(p.batch_per_device, 1)
  for k in (2, 4, 8, 16, 32, 64, 128):
    g = p.global_batch // k
    if g < p.minibatches or g % p.minibatches or g * k != p.global_batch:
      break
    if _replan(p, global_batch=g).fits(device_bytes):
      out.append(f"lower rl.num_tasks*group_size per device from {p.batch_per_device} to "
                 f"{max(g // max(shards, 1), 1)} (episodes per step from {p.global_batch} to {g})")
      break
  for k in (2, 4, 8, 16, 32, 64):
    m = p.minibatches * k
    if p.global_batch % m:
      break
    if _replan(p, minibatches=m).fits(device_bytes):
      out.append(f"raise rl.learner.minibatches from {p.minibatches} to {m}")
      break
  if jnp.dtype(p.model.param_dtype).itemsize > 2 and _replan(
      p, param_dtype="bfloat16").fits(device_bytes):
    out.append("set model.param_dtype=bfloat16")
  if jnp.dtype(p.model.dtype).itemsize > 2 and _replan(
      p, compute_dtype="bfloat16").fits(device_bytes):
    out.append("set model.dtype=bfloat16 (compute: activations and the KV cache)")
  if p.reference_policy == "device" and _replan(p, reference_policy="none").fits(device_bytes):
    out.append("set rl.learner.kl_coef=0 (no reference copy on the device)")
  for k in (2, 4, 8):
    s = p.seq_len // k
    if s < 1:
      break
    if _replan(p, seq_len=s, prefill_len=min(p.prefill_len, s)).fits(device_bytes):
      out.append(f"shorten the rollout context from {p.seq_len} to {s} tokens (fewer max turns "
                 "via rl.budget, or lower rl.max_action_tokens)")
      break
  return out


def check_fits(p: MemoryPlan, device_bytes: int | None) -> None:
  """Raises ValueError when the plan's total exceeds `device_bytes`, naming changes that fit.
  `device_bytes` None (unknown, e.g. on CPU) checks nothing."""
  if device_bytes is None or p.fits(device_bytes):
    return
  biggest = max(p.components().items(), key=lambda kv: kv[1])
  fixes = suggestions(p, device_bytes)
  how = ("; or ".join(fixes) if fixes else
         "no single change of mesh.fsdp/tensor, batch, minibatches, dtypes or context fits: "
         "combine them, or use more devices")
  raise ValueError(
      f"the plan needs {format_bytes(p.total)} per device but the device has "
      f"{format_bytes(device_bytes)} (over by {format_bytes(p.total - device_bytes)}; largest "
      f"part: {biggest[0]} {format_bytes(biggest[1])}). To fit: {how}.\n{p.table(device_bytes)}")


def device_memory_bytes(device=None) -> int | None:
  """Memory of a local device from `device.memory_stats()` (GPU, TPU: bytes_limit), or None
  where the backend does not report it (CPU)."""
  device = device if device is not None else jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:   # backends without the call
    return None
  if not stats:
    return None
  limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
  return int(limit) if limit else None


# ---- from a training config --------------------------------------------------------------------


def model_config_for(config) -> ModelConfig:
  """The config's ModelConfig from its config.json (or a .gguf file's metadata) only (no weights,
  no tokenizer), with the dtypes `jaxagent.runs.setup.load_policy` gives it."""
  if not config.model.path:
    raise ValueError("config.model.path is empty; pass --config.model.path=/path/to/hf_checkpoint "
                     "(a local Hugging Face directory) or builtin:NAME")
  dtype = config.model.dtype
  root = resolve_path(config.model.path)
  read = gguf_io.read_config if gguf_io.is_gguf(root) else hf_io.read_config
  return read(root, dtype, config.model.param_dtype or dtype)


def rollout_lengths(config, tokenizer=None) -> tuple[int, int]:
  """(context_len, prompt_len) of the config's RL rollouts, as `rollout` computes them
  (`default_context_len(env, max_turns, max_action_tokens)`, env.max_obs_len). Builds the
  environment with the model's tokenizer (loaded from the model directory if not given)."""
  if tokenizer is None:
    _, tokenizer = load_config_and_tokenizer(config.model.path)
  env = envs.make(config.env.name, tokenizer, **dict(config.env.difficulty))
  max_turns = Budget.parse(config.rl.budget, per=config.rl.budget_per).max_turns
  a = config.rl.max_action_tokens or env.max_action_len
  return default_context_len(env, max_turns, a), int(env.max_obs_len)


def plan_for_config(config, num_devices: int | None = None, *, context_len: int | None = None,
                    prompt_len: int | None = None, tokenizer=None) -> MemoryPlan:
  """The plan of one RL step of a training config on `num_devices` devices (default the
  config's num_devices, else all): config.model (config.json and dtypes), config.mesh,
  rl.num_tasks * rl.group_size episodes, the rollout context from the environment (or
  `context_len` / `prompt_len` given), the learner's minibatches and log-prob chunk, the reference
  copy when rl.learner.kl_coef > 0, on the device or (rl.reference_on_host) on the host. The
  learner knobs are read through `LearnerConfig.from_config(config.rl.learner)`, as the trainer
  reads them (keys a config leaves out, e.g. logprob_chunk, take LearnerConfig's defaults); with
  config.model.lora.rank > 0, LoRA (adapters, and the base in config.model.lora.base_dtype)."""
  if num_devices is None:
    num_devices = config.num_devices or jax.device_count()
  sizes = mesh_sizes(dict(config.mesh), num_devices)
  cfg = model_config_for(config)
  if context_len is None:
    context_len, env_prompt = rollout_lengths(config, tokenizer)
    prompt_len = prompt_len or env_prompt
  learner = LearnerConfig.from_config(config.rl.learner)
  if learner.kl_coef <= 0:
    reference_policy = "none"
  else:
    reference_policy = "host" if config.rl.reference_on_host else "device"
  lcfg = sections.model_config(config).lora if "lora" in config.model else None
  formats = None
  if lcfg is not None and lcfg.gguf_base:
    root = resolve_path(config.model.path)
    if not gguf_io.is_gguf(root):
      raise sections.ConfigError(gguf_base_needs_gguf(config.model.path))
    formats = gguf_base.formats(root, cfg)
  return plan(cfg, sizes, global_batch=config.rl.num_tasks * config.rl.group_size,
              seq_len=context_len, prefill_len=prompt_len, minibatches=learner.minibatches,
              logprob_chunk=learner.logprob_chunk, reference_policy=reference_policy, lora=lcfg,
              base_formats=formats)
