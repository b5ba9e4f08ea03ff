"""A GGUF file's block formats as the frozen LoRA base (config.model.lora.base_dtype="gguf";
`jaxagent.models.blocks`, `gguf_base`), on tiny GGUF files written here: the blocks dequantise
bit for bit as `gguf.quants.dequantize` does, the block base is the float base of the same file
(logits of the adapted model within 5e-5, float32), matrices of other types fall back to int8
(logged), gradients reach the adapters only with no float matrix saved for the backward pass,
the planner counts the kept bytes, and bad inputs are refused naming the fix."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals   # what autodiff keeps for the backward

from configs.default import get_config
from jaxagent.models import (CheckpointError, blocks, decoder, from_pretrained, gguf_base,
                             gguf_io, lora, lora_io, quant)
from jaxagent.models.sampler import SamplingConfig, generate
from jaxagent.models.scoring import token_logprobs
from jaxagent.planning import memory
from jaxagent.runs import adapters, setup
from jaxagent.runs.config import ConfigError
from jaxagent.sharding import make_mesh
from tests.models.test_gguf import (ARCHS, _LAYERS, _add_metadata, _finish, _hf_shapes, _permute,
                                    _tensor)

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType
LCFG = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS, base_dtype="gguf")
# Adapted logits with the block base against the float32 base loaded from the same file: the
# same weights (bit for bit), so only the order of float32 operations differs (XLA fuses the
# dequantisation into the products). Measured on these files (logits up to ~10, XLA:CPU): max
# 1.3e-5 (llama); SmolLM2 (30 layers, logits up to ~33): 0.0.
LOGITS_ATOL = 5e-5
apply = jax.jit(decoder.apply, static_argnums=0)

# GGUF short name -> type; every stacked matrix one kept type, each of Q8_0/Q4_0/Q4_1 used.
KEPT = {"token_embd": "Q8_0", "output": "Q4_1", "attn_q": "Q4_1", "attn_k": "Q4_0",
        "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q8_0",
        "ffn_down": "Q4_1"}


def _short(g: str) -> str:
  return g.split(".")[2] if g.startswith("blk.") else g.split(".")[0]


def _write(path, arch: str, types: dict, seed: int = 0, per_layer: dict | None = None,
           context: int = 256):
  """A tiny `arch` file with each matrix of GGUF short name s in types[s] (per_layer[(s, i)]
  overrides layer i), norms and biases F32, Q/K rows permuted as llama.cpp writes llama files;
  `context`: its context_length."""
  d, f, h, k, hd, _ = ARCHS[arch]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length = lambda _: type(w).add_context_length(w, context)   # _add_metadata's
  _add_metadata(w, d, f, h, k, hd)
  for name, shape in _hf_shapes(arch).items():
    g = gguf_io.gguf_tensor_name(name)
    qtype = QT.F32
    if len(shape) == 2:
      layer = int(g.split(".")[1]) if g.startswith("blk.") else None
      qtype = QT[(per_layer or {}).get((_short(g), layer), types[_short(g)])]
    if arch == "llama" and len(shape) == 2 and name.endswith(("q_proj.weight", "k_proj.weight")):
      x = (rng.standard_normal(shape) * 0.2).astype(np.float32)   # quantised after permuting
      x = _permute(x, h if "q_proj" in name else k)
      data, raw = ((gguf.quants.quantize(x, qtype), qtype) if qtype.name in blocks.FORMATS
                   else (x, None))
    else:
      data, raw = _tensor(rng, shape, qtype, norm=name.endswith("norm.weight"))
    w.add_tensor(g, data, raw_dtype=raw)
  return _finish(w, path)


def _load(path):
  cfg = gguf_io.read_config(path, "float32")
  return cfg, gguf_io.load_params(path, cfg), gguf_base.load_params(path, cfg)


def _trained(cfg, seed=1):
  ad = lora.init_adapters(cfg, LCFG, jax.random.key(seed))
  rng = np.random.RandomState(seed)
  return {n: {"a": t["a"], "b": jnp.asarray(rng.normal(size=t["b"].shape) * 0.05, jnp.float32)}
          for n, t in ad.items()}


@pytest.fixture(scope="module", params=["llama", "qwen2"])   # permuted Q/K; tied embedding
def kept(request, tmp_path_factory):
  arch = request.param
  path = _write(tmp_path_factory.mktemp("gb") / f"{arch}.gguf", arch, KEPT)
  return (path, *_load(path))


@pytest.mark.parametrize("kind", blocks.FORMATS)
def test_blocks_dequantise_bit_for_bit_as_gguf(kind):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
  x[3, :32] = 0.0                                     # an all-zero block (scale 0)
  raw = gguf.quants.quantize(x, QT[kind])
  want = gguf.quants.dequantize(raw, QT[kind]).astype(np.float32)
  qs, d, m = blocks.split_blocks(kind, raw)
  assert qs.dtype == (np.int8 if kind == "Q8_0" else np.uint8) and d.dtype == np.float16
  assert qs.nbytes + d.nbytes + (0 if m is None else m.nbytes) == raw.nbytes   # as in the file
  got = jax.jit(blocks.dequant_rows, static_argnums=0)(kind, qs, d, m)
  np.testing.assert_array_equal(np.asarray(got), want)
  # Our layout: o_proj-like [in = (4, 64), out = 48] is the transposed, reshaped HF matrix.
  w = blocks.BlockTensor(qs, d, m, kind, (4, 64), (48,))
  assert w.shape == (4, 64, 48)
  np.testing.assert_array_equal(np.asarray(w.dequantize()), want.T.reshape(4, 64, 48))


def test_block_base_is_the_files_float_base(kept):
  path, cfg, floats, base = kept
  short = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
           "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
  want = {("embed",): "Q8_0", **{("layers", n): KEPT[g] for n, g in short.items()}}
  if not cfg.tie_word_embeddings:
    want[("lm_head",)] = "Q4_1"
  assert gguf_base.formats(path, cfg) == want
  is_q = lambda x: quant.is_quantized(x)
  for (kp, want), got in zip(jax.tree_util.tree_flatten_with_path(floats)[0],
                             jax.tree.leaves(base, is_leaf=is_q)):
    if blocks.is_blocks(got):   # the file's values exactly, in our layout, q/k rows unpermuted
      np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(want),
                                    err_msg=jax.tree_util.keystr(kp))
      assert got.shape == want.shape
    else:                        # norms and biases: as the float loader reads them
      assert got is not None and not is_q(got)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_adapted_logits_equal_the_float_base(kept):
  _, cfg, floats, base = kept
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
  ad = _trained(cfg)
  want = apply(cfg, lora.attach(floats, ad, LCFG), tokens)[0]
  got = apply(cfg, lora.attach(base, ad, LCFG), tokens)[0]
  assert float(jnp.abs(want).max()) > 0.5              # the weights do reach the logits
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=LOGITS_ATOL)
  # Step 0 (B = 0) is the block base itself.
  fresh = lora.init_adapters(cfg, LCFG, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(apply(cfg, lora.attach(base, fresh, LCFG), tokens)[0]),
                                np.asarray(apply(cfg, base, tokens)[0]))


def test_gradients_only_for_adapters_and_no_dequantised_residuals(kept):
  _, cfg, floats, base = kept
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  ad = _trained(cfg)
  loss = lambda a, b: jnp.mean(
      token_logprobs(cfg, lora.attach(b, a, LCFG), tokens, jnp.full((2,), 16, jnp.int32)))
  g = jax.jit(jax.grad(loss))(ad, base)
  assert jax.tree.structure(g) == jax.tree.structure(ad)
  g_float = jax.jit(jax.grad(loss))(ad, floats)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6,
                                                       rtol=2e-4), g, g_float)
  # The backward keeps the blocks as they are, never a float copy of a matrix.
  shapes = {floats["layers"][n].shape[1:] for n in quant.LAYER_INPUT_AXES}
  shapes |= {floats["layers"][n].shape for n in quant.LAYER_INPUT_AXES} | {floats["embed"].shape}
  kept_res = saved_residuals(loss, ad, base)
  float_weights = [(a.shape, why) for a, why in kept_res
                   if a.shape in shapes and jnp.issubdtype(a.dtype, jnp.floating)]
  assert not float_weights, float_weights
  assert any(a.dtype == jnp.uint8 for a, _ in kept_res)      # Q4 blocks, saved as they are


def test_decoding_on_the_block_base_equals_the_float_base(kept):
  _, cfg, floats, base = kept
  ad = _trained(cfg)
  args = (jax.random.randint(jax.random.key(2), (3, 6), 0, cfg.vocab_size),
          jnp.asarray([6, 3, 5], jnp.int32), jax.random.key(7), SamplingConfig.make(1.0),
          jnp.full((3,), 8, jnp.int32), jnp.full((3, 1), -1, jnp.int32))
  want = generate(cfg, lora.merge(lora.attach(floats, ad, LCFG)), *args, max_new_tokens=8)
  got = generate(cfg, lora.attach(base, ad, LCFG), *args, max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-4)


def test_other_types_fall_back_to_int8_and_are_logged(tmp_path, caplog):
  """A K-quant in one layer of ffn_down and an F16 lm_head: those two matrices are int8 (the
  int8 base's per-channel format, from the file's values); the log names them and their types."""
  path = _write(tmp_path / "mixed.gguf", "llama", {**KEPT, "output": "F16"},
                per_layer={("ffn_down", 1): "Q4_K"})
  cfg = gguf_io.read_config(path, "float32")
  with caplog.at_level(logging.INFO):
    base = gguf_base.load_params(path, cfg)
  floats = gguf_io.load_params(path, cfg)
  fmt = gguf_base.formats(path, cfg)
  assert fmt[("layers", "down_proj")] == fmt[("lm_head",)] == "int8"
  assert fmt[("layers", "up_proj")] == "Q8_0"
  for w, want in ((base["layers"]["down_proj"], floats["layers"]["down_proj"]),
                  (base["lm_head"], floats["lm_head"])):
    assert isinstance(w, quant.QTensor) and w.shape == want.shape
    err = np.abs(np.asarray(w.dequantize() - want))
    assert np.all(err <= np.asarray(w.scale) / 2 + 1e-7)
  line = next(r.getMessage() for r in caplog.records if "base_dtype='gguf'" in r.getMessage())
  assert "layers.down_proj (Q4_1/Q4_K)" in line and "lm_head (F16)" in line
  assert "layers.q_proj (Q4_1)" in line and "final_norm (F32)" in line


def test_plan_counts_the_kept_bytes(kept):
  """The planner's base bytes are the loaded arrays' on each device of a 2x2x2 mesh (the kept
  matrices whole on every device), Q4_1 at 20/32 bytes per weight."""
  path, cfg, floats, _ = kept
  mesh = make_mesh((2, 2, 2))
  from jaxagent.models.policy import param_shardings
  base = gguf_base.load_params(path, cfg, param_shardings(cfg, mesh))
  on0 = sum(s.data.nbytes for x in jax.tree.leaves(base) for s in x.addressable_shards
            if s.device == jax.devices()[0])
  fmt = gguf_base.formats(path, cfg)
  p = memory.plan(cfg, dict(mesh.shape), global_batch=8, seq_len=32, lora=LCFG,
                  base_formats=fmt)
  assert p.params == on0
  q4 = base["layers"]["q_proj"]
  assert quant.nbytes(q4) == np.prod(q4.shape) * 20 // 32
  assert p.dequant > 0
  with pytest.raises(ValueError, match=r"base_formats=jaxagent\.models\.gguf_base\.formats"):
    memory.plan(cfg, dict(mesh.shape), global_batch=8, seq_len=32, lora=LCFG)


def test_bad_inputs_are_refused_naming_the_fix(kept, tmp_path):
  path, cfg, floats, base = kept
  fix = r"base_dtype='int8'.*or point config\.model\.path at a \.gguf file"
  with pytest.raises(ValueError, match=r"'builtin:micro' is not a \.gguf file; use .*" + fix):
    from_pretrained("builtin:micro", gguf_blocks=True)
  config = get_config("smoke")
  config.model.lora.rank, config.model.lora.base_dtype = 4, "gguf"
  assert not str(config.model.path).endswith(".gguf")
  with pytest.raises(ConfigError, match=fix):
    setup.gguf_blocks(config)
  with pytest.raises(ConfigError, match=fix):
    memory.plan_for_config(config, 1, context_len=64, prompt_len=32)
  with pytest.raises(ValueError, match=r"needs adapters.*rank > 0"):
    lora.LoraConfig(rank=0, base_dtype="gguf")
  with pytest.raises(ValueError, match=r"base_dtype='gguf'.*not float weights.*'int8'"):
    adapters.held(floats, LCFG)
  assert adapters.held(base, LCFG) is base
  ad = _trained(cfg)
  with pytest.raises(ValueError, match=r"GGUF block base.*base_dtype='gguf'.*config\.model\.path"
                                       r".*dequantize_params"):
    lora_io.export_merged(tmp_path / "merged", cfg, base, ad, LCFG)
  lora_io.export_merged(tmp_path / "merged", cfg, quant.dequantize_params(base), ad, LCFG)
  # Non-finite block scales: named, as the float loader names them.
  bad = tmp_path / "nan.gguf"
  d, f, h, k, hd, _ = ARCHS["qwen2"]
  w = gguf.GGUFWriter(str(bad), "qwen2")
  _add_metadata(w, d, f, h, k, hd)
  rng = np.random.default_rng(0)
  for name, shape in _hf_shapes("qwen2").items():
    g = gguf_io.gguf_tensor_name(name)
    data, raw = _tensor(rng, shape, QT.Q8_0 if len(shape) == 2 else QT.F32, norm=False)
    if g == "blk.1.ffn_up.weight":
      data = data.copy()
      data[5, 0:2] = np.array([np.inf], np.float16).view(np.uint8)   # block 0's scale of row 5
    w.add_tensor(g, data, raw_dtype=raw)
  _finish(w, bad)
  c = gguf_io.read_config(bad, "float32")
  with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_up\.weight' holds .*Inf"):
    gguf_base.load_params(bad, c)
  assert _LAYERS == 2


def test_from_pretrained_keeps_the_blocks(kept):
  path, cfg, _, base = kept
  policy = from_pretrained(path, gguf_blocks=True)
  assert policy.config == cfg and gguf_base.is_block_base(policy.params)
  assert lora_io.base_fingerprint(policy.params) == lora_io.base_fingerprint(base)
  assert quant.quantize_params(policy.params) is policy.params
