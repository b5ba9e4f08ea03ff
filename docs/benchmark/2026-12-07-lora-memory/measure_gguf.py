"""SmolLM2-135M's frozen LoRA base three ways, in one process: float32 (the GGUF file dequantised
at load), int8 (`quant.quantize_params` of that float32 base) and the file's own blocks
(`gguf_base.load_params`: Q4_1 layers, Q8_0 embedding).

    python docs/benchmark/2026-12-07-lora-memory/measure_gguf.py [ROUNDS]

Prints JSON lines: the bases' bytes; log-prob accuracy of each base against the float32 one on a
few texts; then per round, arms alternating, the seconds of one LoRA SFT step (rank 16 on all
seven projections, 4 x 256 tokens; `learners.sft.make_sft_step`) and of one generation (4
prompts, 32 new tokens; `sampler.generate`), each the median of 3 calls after a compiling one."""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.learners.sft import make_sft_step
from jaxagent.learners.update import LearnerConfig, init_train_state
from jaxagent.models import decoder, from_pretrained, gguf_base, lora, quant
from jaxagent.models.policy import resolve_path
from jaxagent.models.sampler import SamplingConfig, generate

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
TEXTS = [
    "The capital of France is Paris, a city on the Seine known for its museums, its cafes and "
    "the Eiffel Tower, which was built for the world's fair of 1889.",
    "To sort a list in Python, call sorted(xs) for a new list or xs.sort() to sort it in place; "
    "both accept a key function and reverse=True.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the "
    "chloroplasts of plant cells.",
    "Once upon a time a small fox lived at the edge of a forest, and every morning it walked to "
    "the river to drink.",
]

policy = from_pretrained("builtin:smollm2-135m")          # float32, dequantised at load
cfg, tok = policy.config, policy.tokenizer
path = resolve_path("builtin:smollm2-135m")
bases = {"float32": policy.params, "int8": quant.quantize_params(policy.params),
         "gguf": gguf_base.load_params(path, cfg)}
matrices = lambda p: [p["embed"]] + [p["layers"][n] for n in quant.LAYER_INPUT_AXES]
print(json.dumps({"bytes": {k: quant.nbytes(v) for k, v in bases.items()},
                  "matrix_bytes": {k: quant.nbytes(matrices(v)) for k, v in bases.items()},
                  "formats": {".".join(k): v for k, v in gguf_base.formats(path, cfg).items()}}))

# Accuracy: log-probs of each text's next tokens, and of the whole vocabulary, vs float32.
apply = jax.jit(decoder.apply, static_argnums=0)
ids = [tok(t)["input_ids"] for t in TEXTS]
n = max(len(i) for i in ids)
tokens = jnp.asarray([i + [0] * (n - len(i)) for i in ids], jnp.int32)
valid = np.asarray([[1] * (len(i) - 1) + [0] * (n - len(i)) for i in ids], bool)   # [B, n-1]
lp = {k: np.asarray(jax.nn.log_softmax(apply(cfg, v, tokens)[0][:, :-1])) for k, v in bases.items()}
nxt = np.asarray(tokens[:, 1:])
for k in bases:
  tok_lp = np.take_along_axis(lp[k], nxt[..., None], -1)[..., 0]
  ref = np.take_along_axis(lp["float32"], nxt[..., None], -1)[..., 0]
  top = (lp[k].argmax(-1) == lp["float32"].argmax(-1))[valid]
  print(json.dumps({"accuracy": k, "tokens": int(valid.sum()),
                    "mean_nll": round(float(-tok_lp[valid].mean()), 4),
                    "max_text_dlogprob": float(np.abs(tok_lp - ref)[valid].max()),
                    "max_vocab_dlogprob": float(np.abs(lp[k] - lp["float32"])[valid].max()),
                    "top1_same": f"{int(top.sum())}/{top.size}"}))

# Step times: one LoRA SFT step and one generation per arm, arms alternating.
lcfg = lora.LoraConfig(rank=16, alpha=32.0, targets=lora.TARGETS, base_dtype="float")
opt = LearnerConfig(learning_rate=1e-4).make_optimizer()
rng = np.random.default_rng(0)
batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 256)), jnp.int32),
         "loss_mask": jnp.ones((4, 256), jnp.float32), "length": jnp.full((4,), 256, jnp.int32)}
prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 16)), jnp.int32)
gen_args = (prompts, jnp.full((4,), 16, jnp.int32), jax.random.key(0), SamplingConfig.make(1.0),
            jnp.full((4,), 32, jnp.int32), jnp.full((4, 1), -1, jnp.int32))
steps = {k: make_sft_step(cfg, opt, lcfg) for k in bases}   # one jit (and compile) per arm
states = {k: init_train_state(lora.init_adapters(cfg, lcfg, jax.random.key(1)), opt,
                              jax.random.key(2)) for k in bases}
ad = lora.init_adapters(cfg, lcfg, jax.random.key(1))


def timed(fn, calls):
  out = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t)
  return out


def sft(k):
  states[k], m = steps[k](states[k], batch, bases[k])
  return m["loss"]


def gen(k):
  return generate(cfg, lora.attach(bases[k], ad, lcfg), *gen_args, max_new_tokens=32).tokens


for k in bases:                                           # compile (not timed)
  print(json.dumps({"compile": k, "sft_s": round(timed(lambda: sft(k), 1)[0], 1),
                    "gen_s": round(timed(lambda: gen(k), 1)[0], 1)}))
for r in range(ROUNDS):
  order = list(bases) if r % 2 == 0 else list(reversed(list(bases)))
  for k in order:
    s, g = timed(lambda: sft(k), 3), timed(lambda: gen(k), 3)
    print(json.dumps({"round": r + 1, "arm": k, "sft_s": round(statistics.median(s), 3),
                      "gen_s": round(statistics.median(g), 3),
                      "sft_all": [round(x, 2) for x in s], "gen_all": [round(x, 2) for x in g]}),
          flush=True)
