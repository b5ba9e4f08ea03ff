"""Builds the built-in tokenizer and model config shipped in `jaxagent/models/builtin/tiny/`.

The files are committed; this script documents how they were made and rebuilds them
deterministically:  python -m jaxagent.models.builtin.build

The tokenizer is a byte-level BPE (any byte sequence round-trips), trained with `tokenizers` on a
small synthetic corpus of English and tool-call text, with digits split one per token and a
ChatML chat template, so it exercises the same code paths as Qwen/Llama tokenizers.
"""

import json
import pathlib
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = pathlib.Path(__file__).parent
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = """
the a an of to in on at by for with from and or not is are was be you your it this that
task tool tools call calls result results error errors answer lookup find search move up down
left right north south east west take drop open close unlock lock put get use key keys door box
chest room inventory item items wall trap goal start position turn turns left budget remaining
add sub mul div calc calculator number value unknown invalid bad argument arguments failed
precondition missing expected available system user assistant observation action done solved
who what where which entity link next hop city person company river country capital born
located owner founded red blue green gold silver small large cannot because already empty
""".split()

TEMPLATES = [
    "lookup({w})", "answer({w})", "move({d})", "take({w})", "open({w})", "unlock({w}, {w})",
    "put({w}, {w})", "add({n}, {n})", "mul({n}, {n})", "sub({n}, {n})", "answer({n})",
    "Error: {w} {w} {w}.", "Result: {w} {n}.", "Turns left: {n}.", "You are at ({n}, {n}).",
]


def _corpus(num_lines: int = 20000, seed: int = 0):
  rng = random.Random(seed)
  dirs = ["up", "down", "left", "right"]
  for _ in range(num_lines):
    parts = []
    for _ in range(rng.randint(1, 4)):
      t = rng.choice(TEMPLATES)
      while "{w}" in t or "{n}" in t or "{d}" in t:
        t = t.replace("{w}", rng.choice(WORDS), 1)
        t = t.replace("{n}", str(rng.randint(0, 999)), 1)
        t = t.replace("{d}", rng.choice(dirs), 1)
      parts.append(t)
    parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    yield " ".join(parts)


def build_tokenizer() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(_corpus(), trainer=trainer)
  return tok


def main():
  out = HERE / "tiny"
  out.mkdir(exist_ok=True)
  tok = build_tokenizer()
  tok.save(str(out / "tokenizer.json"))
  eos = tok.token_to_id("<|im_end|>")
  pad = tok.token_to_id("<|endoftext|>")
  (out / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>",
      "bos_token": None,
      "model_max_length": 4096,
      "chat_template": CHAT_TEMPLATE,
  }, indent=2) + "\n")
  (out / "config.json").write_text(json.dumps({
      "architectures": ["Qwen2ForCausalLM"],
      "model_type": "qwen2",
      "vocab_size": tok.get_vocab_size(),
      "hidden_size": 256,
      "intermediate_size": 768,
      "num_hidden_layers": 4,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
      "max_position_embeddings": 4096,
      "rope_theta": 10000.0,
      "rms_norm_eps": 1e-6,
      "tie_word_embeddings": True,
      "hidden_act": "silu",
      "torch_dtype": "float32",
      "bos_token_id": None,
      "eos_token_id": eos,
      "pad_token_id": pad,
      "initializer_range": 0.02,
      # No safetensors ship with the built-in model: from_pretrained initialises the weights
      # from this seed (the SFT phase trains them), through the same loading code path.
      "jaxagent_init_seed": 0,
  }, indent=2) + "\n")
  print(f"wrote {out}: vocab {tok.get_vocab_size()}, eos {eos}, pad {pad}")
  # builtin:micro: the same tokenizer, a 4x narrower 2-layer decoder (tests, smoke runs).
  micro = HERE / "micro"
  micro.mkdir(exist_ok=True)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    (micro / f).write_text((out / f).read_text())
  cfg = json.loads((out / "config.json").read_text())
  cfg.update(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
  (micro / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
  main()
