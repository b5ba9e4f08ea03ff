"""SFT batches are cut to the split's longest demonstration (`runs.setup.load_demos`, rounded up
to 64 tokens): the loss and the gradient of a cut batch equal those of the full-width batch."""

import jax
import numpy as np

from jaxagent.learners import sft as sft_lib
from jaxagent.models import decoder


def test_a_cut_batch_has_the_loss_and_gradient_of_the_full_one(small_model):
  params = decoder.init_params(small_model, 0)
  rng = np.random.default_rng(0)
  b, full, cut = 3, 160, 128
  length = np.array([37, 90, 61], np.int32)
  slot = np.arange(full)[None, :]
  tokens = np.where(slot < length[:, None],
                    rng.integers(1, small_model.vocab_size, (b, full)), 0).astype(np.int32)
  mask = ((slot < length[:, None]) & (slot >= 20)).astype(np.float32)

  def loss_and_grad(w):
    return jax.value_and_grad(lambda p: sft_lib.sft_loss(
        small_model, p, tokens[:, :w], length, mask[:, :w])[0])(params)

  (loss_full, grad_full), (loss_cut, grad_cut) = loss_and_grad(full), loss_and_grad(cut)
  np.testing.assert_allclose(loss_cut, loss_full, rtol=1e-6)
  for g_cut, g_full in zip(jax.tree.leaves(grad_cut), jax.tree.leaves(grad_full)):
    np.testing.assert_allclose(g_cut, g_full, rtol=1e-4, atol=1e-7)
