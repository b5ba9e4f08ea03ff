"""Supervised fine-tuning on demonstration transcripts, masked to the agent's tokens.

loss = - sum_{b,i} mask[b,i] * log p(tokens[b,i] | tokens[b,:i]) / sum_{b,i} mask[b,i]

where mask is 1 exactly on the agent's action tokens and their end-of-turn token (the
environment's observations are context, never targets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxagent.models import lora as lora_lib
from jaxagent.models.config import ModelConfig
from jaxagent.models.scoring import token_logprobs


def sft_loss(cfg: ModelConfig, params, tokens, length, loss_mask):
  """(loss, metrics) for a batch: tokens/loss_mask [B, L], length [B]."""
  lp = token_logprobs(cfg, params, tokens, length)
  mask = loss_mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  nll = -jnp.sum(lp * mask) / n
  return nll, {"loss": nll, "agent_tokens": jnp.sum(mask), "perplexity": jnp.exp(nll)}


def make_sft_step(cfg: ModelConfig, optimizer: optax.GradientTransformation,
                  lora: lora_lib.LoraConfig | None = None):
  """Jitted `step(train_state, batch) -> (train_state, metrics)`; the state is donated.

  `batch` is a dict with tokens [B, L] int32, loss_mask [B, L], length [B] int32. With `lora`
  enabled the state's params are the adapters only and each call takes the frozen base,
  `step(state, batch, base)` (read in place, not donated); adapter dropout draws from
  fold_in(state.key, state.step).
  """
  adapters_only = lora is not None and lora.enabled

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, batch, base=None):
    if adapters_only != (base is not None):
      raise ValueError("LoRA SFT takes the frozen base (step(state, batch, base), with adapters "
                       "as the state's params); full fine-tuning takes no base")
    key = jax.random.fold_in(state.key, state.step)
    full = ((lambda p: lora_lib.attach(base, p, lora, key)) if adapters_only else (lambda p: p))
    grad_fn = jax.value_and_grad(
        lambda p: sft_loss(cfg, full(p), batch["tokens"], batch["length"], batch["loss_mask"]),
        has_aux=True)
    (_, metrics), grads = grad_fn(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return step
