"""Log-likelihoods: agent-token masking by hand, and the cross matrix against a direct forward."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.eval import likelihood
from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig

# A decoder small enough to compile in a second or two on CPU.
SMALL = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=True, qk_norm=False, max_position_embeddings=256)


def test_agent_loglik_sums_only_masked_tokens():
  lp = np.array([[0.0, -1.0, -2.0, -3.0, -4.0],
                 [0.0, -0.5, -0.25, -9.0, -9.0],
                 [0.0, -1.0, -1.0, -1.0, -1.0]])
  mask = np.array([[0, 1, 0, 1, 1],
                   [0, 1, 1, 0, 0],
                   [0, 0, 0, 0, 0]])
  out = likelihood.agent_loglik(lp, mask)
  np.testing.assert_array_equal(out["sum"], [-8.0, -0.75, 0.0])
  np.testing.assert_array_equal(out["count"], [3, 2, 0])
  np.testing.assert_allclose(out["mean"][:2], [-8.0 / 3, -0.375])
  assert np.isnan(out["mean"][2])        # no agent tokens: undefined, never 0


def _direct(params, tokens, length, mask, temperature):
  """sum_l mask * log softmax(logits_{l-1} / T)[tokens_l], per row, by a plain forward pass."""
  attn = (np.arange(tokens.shape[1])[None] < length[:, None]).astype(np.int32)
  logits = decoder.apply(SMALL, params, jnp.asarray(tokens), attention_mask=jnp.asarray(attn))[0]
  logp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1), np.float64)
  b, l = tokens.shape
  lp = np.zeros((b, l))
  for i in range(b):
    for j in range(1, int(length[i])):
      lp[i, j] = logp[i, j - 1, tokens[i, j]]
  return (lp * mask).sum(1), mask.sum(1)


@pytest.fixture(scope="module")
def two_policies():
  return {"A": decoder.init_params(SMALL, 0), "B": decoder.init_params(SMALL, 1)}


def _trajs(seed, b, l=24):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, SMALL.vocab_size, (b, l)).astype(np.int32)
  length = rng.integers(l // 2, l + 1, (b,)).astype(np.int32)
  inside = np.arange(l)[None] < length[:, None]
  mask = (rng.random((b, l)) < 0.4) & inside
  mask[:, 0] = False
  tokens = np.where(inside, tokens, 0).astype(np.int32)
  return {"tokens": tokens, "length": length, "loss_mask": mask.astype(np.float32)}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cross_matrix_equals_direct_scoring(two_policies, temperature):
  trajs = {"A": _trajs(0, 5), "B": _trajs(1, 3)}
  # batch_size 2: both sets end with a padded batch, which must not leak into the averages.
  out = likelihood.cross_likelihood(SMALL, trajs, two_policies, temperature=temperature,
                                    batch_size=2)
  assert out["rows"] == ["A", "B"] and out["cols"] == ["A", "B"]
  for i, a in enumerate(out["rows"]):
    t = trajs[a]
    for j, b in enumerate(out["cols"]):
      s, c = _direct(two_policies[b], t["tokens"], t["length"], t["loss_mask"], temperature)
      per = out["per_trajectory"][a][b]
      np.testing.assert_allclose(per["sum"], s, rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(per["count"], c)
      assert out["sum"][i][j] == pytest.approx(np.mean(s), rel=1e-4)
      assert out["mean"][i][j] == pytest.approx(np.mean(s / c), rel=1e-4)
  # Different parameters score differently (the matrix is not a constant).
  assert out["sum"][0][0] != pytest.approx(out["sum"][0][1], rel=1e-3)


def test_environment_tokens_do_not_count(two_policies):
  """Changing only unmasked (environment) tokens after the last agent token leaves the
  agent-token likelihood unchanged; changing an agent token changes it."""
  t = _trajs(2, 2)
  t["loss_mask"][:] = 0
  t["loss_mask"][:, 3:6] = 1
  base = likelihood.cross_likelihood(SMALL, {"x": t}, {"A": two_policies["A"]}, temperature=1.0,
                                     batch_size=2)["per_trajectory"]["x"]["A"]["sum"]
  env_changed = {**t, "tokens": t["tokens"].copy()}
  env_changed["tokens"][:, 8:] = (env_changed["tokens"][:, 8:] + 7) % SMALL.vocab_size
  same = likelihood.cross_likelihood(SMALL, {"x": env_changed}, {"A": two_policies["A"]},
                                     temperature=1.0, batch_size=2)["per_trajectory"]["x"]["A"]
  np.testing.assert_allclose(same["sum"], base, rtol=1e-5)
  agent_changed = {**t, "tokens": t["tokens"].copy()}
  agent_changed["tokens"][:, 4] = (agent_changed["tokens"][:, 4] + 1) % SMALL.vocab_size
  diff = likelihood.cross_likelihood(SMALL, {"x": agent_changed}, {"A": two_policies["A"]},
                                     temperature=1.0, batch_size=2)["per_trajectory"]["x"]["A"]
  assert np.all(np.abs(diff["sum"] - base) > 1e-4)


def test_fewer_rows_than_a_batch_score_in_a_fitted_batch(two_policies):
  assert [likelihood.fit_batch(n, 32) for n in (1, 8, 9, 16, 31, 32, 100)] == [
      8, 8, 16, 16, 32, 32, 32]
  assert likelihood.fit_batch(3, 4) == 4
  t = _trajs(2, 5)
  got = likelihood.score_rows(SMALL, two_policies["A"], t["tokens"], t["length"], 1.0, 32)
  s, _ = _direct(two_policies["A"], t["tokens"], t["length"], t["loss_mask"], 1.0)
  np.testing.assert_allclose((got * t["loss_mask"]).sum(1), s, rtol=1e-4, atol=1e-4)
  # The same rows scored in batches of 2 (padded last batch): the same log-probs.
  by2 = likelihood.score_rows(SMALL, two_policies["A"], t["tokens"], t["length"], 1.0, 2)
  np.testing.assert_allclose(got, by2, rtol=1e-5, atol=1e-5)


def test_a_policy_and_its_sharpened_self_score_from_one_forward_pass(two_policies, monkeypatch):
  """`compare.LogLikelihoods`: labels sharing one params object (a base, the base sharpened)
  score a trajectory set in one call, each at its own temperature, equal to scoring alone."""
  from jaxagent.eval import compare
  ev = types.SimpleNamespace(model_config=SMALL, likelihood_rows=lambda n: np.arange(n))
  e = types.SimpleNamespace(temperature=1.0, score_batch=4)
  sets = {k: types.SimpleNamespace(**_trajs(seed, 5)) for seed, k in enumerate("AB")}
  ll = compare.LogLikelihoods(ev, two_policies, sets, e)
  ll.add("A@T0.5", two_policies["A"], sets["A"], 0.5)
  ll.add("A@T0", two_policies["A"], sets["A"], 0.0)
  calls = []
  real = likelihood.score_rows_at
  monkeypatch.setattr(likelihood, "score_rows_at",
                      lambda *a, **k: calls.append(a[4]) or real(*a, **k))
  got = {b: ll("B", b) for b in ("A", "A@T0.5", "A@T0", "B")}
  assert calls == [[0.5, 1.0], [1.0]]       # A and A@T0.5 together; B alone; greedy: none
  t = sets["B"]
  for b, p, temp in (("A", "A", 1.0), ("A@T0.5", "A", 0.5), ("B", "B", 1.0)):
    s, c = _direct(two_policies[p], t.tokens, t.length, t.loss_mask, temp)
    np.testing.assert_allclose(got[b]["sum"], s, rtol=1e-4, atol=1e-4, err_msg=b)
    np.testing.assert_allclose(got[b]["count"], c)
  assert np.all(np.isnan(got["A@T0"]["sum"]))
  assert not np.allclose(got["A"]["sum"], got["A@T0.5"]["sum"])
