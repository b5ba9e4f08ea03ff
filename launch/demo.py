"""Demo: load the built-in model and tokenizer and sample a few chat continuations.

    python -m launch.demo --workdir=workdirs/demo [--model=builtin:tiny] [--temperature=0.8]

Writes `workdir/demo.json` (prompts, completions, decode tokens/s). The built-in model is
untrained until the training phases run, so the text is noise; this checks the whole path
(checkpoint loading, chat template, jitted prefill + decode) on a fresh machine.
"""

import json
import pathlib
import time

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", "workdirs/demo", "Where to write demo.json.")
_MODEL = flags.DEFINE_string("model", "builtin:tiny", "builtin:NAME or a local HF directory.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (0 = greedy).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Tokens to generate per prompt.")


def main(argv):
  del argv
  from jaxagent.models import from_pretrained
  policy = from_pretrained(_MODEL.value)
  tok = policy.tokenizer
  logging.info("loaded %s: %.2fM parameters, vocab %d", _MODEL.value,
               policy.config.num_params() / 1e6, policy.config.vocab_size)
  questions = ["Find the capital of the country where Ada was born.",
               "Move to the goal without hitting a wall.",
               "Open the chest and take the key."]
  prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"] for q in questions]
  stop = list(policy.config.eos_token_ids)
  policy.generate(prompts, _MAX_NEW.value, temperature=_TEMPERATURE.value, stop_tokens=stop)
  start = time.perf_counter()
  outs = policy.generate(prompts, _MAX_NEW.value, temperature=_TEMPERATURE.value, seed=1,
                         stop_tokens=stop)
  secs = time.perf_counter() - start
  n_tokens = sum(len(o) for o in outs)
  records = []
  for q, o in zip(questions, outs):
    text = tok.decode(o)
    print(f"\nuser: {q}\nassistant ({len(o)} tokens): {text!r}")
    records.append({"prompt": q, "completion": text, "tokens": o})
  out = pathlib.Path(_WORKDIR.value)
  out.mkdir(parents=True, exist_ok=True)
  (out / "demo.json").write_text(json.dumps(
      {"model": _MODEL.value, "samples": records, "decode_tokens_per_s": n_tokens / secs}, indent=2))
  print(f"\n{n_tokens} tokens in {secs:.2f}s ({n_tokens / secs:.0f} tokens/s); wrote {out / 'demo.json'}")


if __name__ == "__main__":
  app.run(main)
