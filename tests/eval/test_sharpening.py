"""The sharpening control: action entropy and the expected oracle-match probability (hand values
on constructed distributions, and the compiled next-action program against an independent
teacher-forced scoring), and the choice of the temperature-matched base by entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxagent.envs as envs
from jaxagent.eval import sharpening, step_quality
from jaxagent.envs.base import TokenBuffer
from jaxagent.models import decoder, from_pretrained, sampler
from jaxagent.models.scoring import token_logprobs_and_entropy
from jaxagent.rollout import replay, rollout

ACTION_TOKENS, MAX_TURNS = 8, 3
SWEEP = (1.0, 0.7, 0.5, 0.3, 0.0)


def _entropy(logits, t):
  """Hand entropy (nats) of softmax(logits / t), numpy float64."""
  z = np.asarray(logits, np.float64) / t
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return -(p * np.log(np.where(p > 0, p, 1))).sum(-1)


def test_entropy_of_hand_values():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]))
  h = np.asarray(sampler.entropy_of(logits, jnp.float32(1.0)))
  assert h[0] == pytest.approx(1.5 * np.log(2), rel=1e-5) and h[1] == pytest.approx(0, abs=1e-5)
  # Temperature 0.5 squares and renormalises: (0.25, 0.0625, 0.0625) / 0.375.
  p = np.array([4, 1, 1]) / 6
  assert float(sampler.entropy_of(logits, jnp.float32(0.5))[0]) == pytest.approx(
      -(p * np.log(p)).sum(), rel=1e-5)
  assert np.all(np.asarray(sampler.entropy_of(logits, jnp.float32(0.0))) == 0)   # greedy


def test_expected_oracle_match_probability_equals_the_hand_value():
  # Four states of two tasks whose policy gives the oracle's action probability 0.5, 0.25, 1, 0
  # (oracle_logp = log p); the expected oracle-match probability is their mean, 0.4375, while
  # the sampled matches (one draw each) say 0.5.
  o = {"oracle_logp": np.array([np.log(0.5), np.log(0.25), 0.0, -np.inf], np.float32),
       "entropy": np.array([1.0, 2.0, 0.0, 3.0]), "scored": np.array([2, 2, 1, 3])}
  prob = step_quality.oracle_prob(o)
  np.testing.assert_allclose(prob, [0.5, 0.25, 1.0, 0.0], rtol=1e-6)
  q = step_quality.quality_rates(np.ones(4, bool), np.array([1, 0, 1, 0], bool),
                                 np.array([0, 0, 1, 1]), {}, num_bootstrap=200, confidence=0.9,
                                 seed=0, prob=prob, entropy=o["entropy"], scored=o["scored"])
  assert q["overall"]["oracle_prob"]["rate"] == pytest.approx(0.4375)
  assert q["overall"]["oracle"]["rate"] == 0.5
  # Entropy per token pools the states: (1 + 2 + 0 + 3) / (2 + 2 + 1 + 3).
  assert q["overall"]["entropy"]["rate"] == pytest.approx(6 / 8)
  assert step_quality.entropy_rate(o) == pytest.approx(6 / 8)


class _FakeEvaluator:
  """Acts from constructed next-token logits, one token per state: outcome entropies are the
  exact entropies of softmax(logits / T)."""

  def __init__(self, logits):
    self.logits = logits          # label -> [N, V]

  def act_at(self, params, states, key, temperature):
    return {"entropy": _entropy(self.logits[params], temperature) if temperature else
            np.zeros(len(self.logits[params])), "scored": np.ones(len(self.logits[params]))}


def test_the_matched_base_is_chosen_by_entropy_on_the_reference_states():
  rng = np.random.default_rng(0)
  z = rng.normal(0, 2.0, (40, 12))           # the base's logits on 40 reference states
  # RL seeds: the base sharpened exactly as sampling it at 0.5 and at 0.3 would (logits / T at
  # T = 1), and one whose entropy lies between the base's at 0.7 and at 0.5, nearer 0.7.
  h = {t: float(_entropy(z, t).mean()) if t else 0.0 for t in SWEEP}
  target = h[0.7] - 0.2 * (h[0.7] - h[0.5])
  mid = next(z / s for s in np.linspace(0.5, 1.0, 2001)[::-1]
             if float(_entropy(z / s, 1.0).mean()) <= target)
  logits = {"base": z, "rl_s0": z / 0.5, "rl_s1": z / 0.3, "rl_s2": mid}
  ev = _FakeEvaluator(logits)
  outcomes = {lab: {"sampled": ev.act_at(lab, None, None, 1.0),
                    "greedy": ev.act_at(lab, None, None, 0.0)} for lab in logits}
  params = {lab: lab for lab in logits}
  sh = sharpening.sweep(ev, params, None, ["base"], {"rl": ["rl_s0", "rl_s1", "rl_s2"]},
                        outcomes, None, SWEEP, 1.0)
  assert sh.entropy["base"] == pytest.approx(h)
  assert sh.entropy["rl_s0"] == pytest.approx(h[0.5])
  assert {lab: t for lab, (_, t) in sh.matched.items()} == {"rl_s0": 0.5, "rl_s1": 0.3,
                                                            "rl_s2": 0.7}
  assert sh.arms == {"rl": ["base@T0.5", "base@T0.3", "base@T0.7"]}
  # A run as flat as the base is matched to the base itself (T = the evaluation's), and ties go
  # to the higher temperature.
  assert sharpening.match_temperature(h[1.0] + 1.0, h) == 1.0
  assert sharpening.match_temperature(0.5, {1.0: 1.0, 0.5: 0.0}) == 1.0
  with pytest.raises(ValueError, match="max_reference_states"):
    sharpening.match_temperature(0.5, {1.0: float("nan")})


@pytest.fixture(scope="module")
def states():
  policy = from_pretrained("builtin:tiny")
  env = envs.make("lookup", policy.tokenizer, hops=1, distractor_entities=2)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(5), 3))
  traj = jax.device_get(rollout(policy, env, jax.random.key(6), tasks, 2, budgets=MAX_TURNS,
                                max_turns=MAX_TURNS, max_action_tokens=ACTION_TOKENS,
                                temperature=1.0))
  rows = jax.tree.map(lambda x: jnp.repeat(x, 2, axis=0), tasks)
  refs = step_quality.reference_states(replay.make_replay_fn(env, False), rows, traj,
                                       traj.acted, source="policy")
  return policy, env, refs


def _teacher_forced(policy, refs, actions, lengths, temperature):
  """(sum of log p, sum of entropies) over each state's given action tokens [N, A] (lengths [N],
  <eot> included), scored on prefix + action by `token_logprobs_and_entropy`."""
  n = len(refs)
  seq = np.zeros((n, refs.prefix.shape[1] + actions.shape[1]), np.int32)
  for i in range(n):
    p = refs.prefix_len[i]
    seq[i, :p] = refs.prefix[i, :p]
    seq[i, p:p + lengths[i]] = actions[i, :lengths[i]]
  total = refs.prefix_len + lengths
  lp, ent = jax.jit(token_logprobs_and_entropy, static_argnums=0)(
      policy.config, policy.params, jnp.asarray(seq), jnp.asarray(total), temperature)
  cols = np.arange(seq.shape[1])[None, :]
  mask = (cols >= refs.prefix_len[:, None]) & (cols < total[:, None])
  return (np.where(mask, np.asarray(lp), 0).sum(1), np.where(mask, np.asarray(ent), 0).sum(1))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_next_action_entropy_and_oracle_logp_match_teacher_forced_scoring(states, temperature):
  policy, env, refs = states
  fn = replay.make_next_action_fn(policy.config, env, ACTION_TOKENS)
  o = step_quality.next_actions(fn, policy.params, refs, jax.random.key(1), temperature, 4)
  assert len(refs) >= 4 and np.all(o["scored"] >= 1)
  # The entropy of each sampled token's distribution, as scoring the sampled action says.
  eot = env.codec.end_of_turn_id
  sampled = np.where(np.arange(ACTION_TOKENS)[None] == o["length"][:, None], eot,
                     o["tokens"][:, :ACTION_TOKENS])
  _, ent = _teacher_forced(policy, refs, sampled, o["scored"], temperature)
  np.testing.assert_allclose(o["entropy"], ent, rtol=2e-4, atol=2e-4)
  # The oracle's action and <eot>, teacher-forced.
  oracle = jax.device_get(jax.vmap(env.oracle_action)(refs.env_state))
  n = np.minimum(np.asarray(oracle.length), ACTION_TOKENS - 1)
  toks = np.asarray(oracle.tokens)[:, :ACTION_TOKENS].copy()
  toks[np.arange(len(n)), n] = eot
  lp, _ = _teacher_forced(policy, refs, toks, n + 1, temperature)
  np.testing.assert_allclose(o["oracle_logp"], lp, rtol=1e-4, atol=1e-4)
  # Greedy: probability 1 exactly where the greedy action is the oracle's, else 0; no entropy.
  g = step_quality.next_actions(fn, policy.params, refs, jax.random.key(1), 0.0, 4)
  same = np.asarray([g["length"][i] == n[i] and np.array_equal(g["tokens"][i, :n[i]],
                                                                toks[i, :n[i]])
                     for i in range(len(n))])
  np.testing.assert_array_equal(step_quality.oracle_prob(g), same.astype(float))
  assert np.all(g["entropy"] == 0)
  # The greedy branch's 1: force the greedy path itself. Its first A - 1 tokens are the action and
  # row 0's last token stands in for <eot>; every row whose last token is that one gets log p 0.
  cache = decoder.init_cache(policy.config, len(refs), refs.prefix.shape[1] + ACTION_TOKENS)
  logits, cache = sampler.prefill(policy.config, policy.params, cache, jnp.asarray(refs.prefix),
                                  jnp.asarray(refs.prefix_len))
  gen = sampler.decode(policy.config, policy.params, cache, logits, jax.random.key(0),
                       sampler.SamplingConfig.make(0.0), jnp.full((len(refs),), ACTION_TOKENS),
                       jnp.full((len(refs), 1), -1), ACTION_TOKENS)
  last = int(gen.tokens[0, -1])
  path = TokenBuffer(tokens=gen.tokens, length=jnp.full((len(refs),), ACTION_TOKENS - 1))
  lp = np.asarray(replay._forced_logp(policy.config, policy.params, cache, logits, path,
                                      sampler.SamplingConfig.make(0.0), ACTION_TOKENS, last, 0))
  on_path = np.asarray(gen.tokens[:, -1]) == last
  assert on_path[0] and np.all(lp[on_path] == 0) and np.all(lp[~on_path] == -np.inf)


def test_batching_by_prefix_length_changes_no_greedy_outcome(states):
  policy, env, refs = states
  assert np.any(np.diff(refs.prefix_len) < 0)          # the stored order is not by length
  fn = replay.make_next_action_fn(policy.config, env, ACTION_TOKENS)
  by_len = step_quality.next_actions(fn, policy.params, refs, jax.random.key(2), 0.0, 4)
  stored = step_quality.next_actions(fn, policy.params, refs, jax.random.key(2), 0.0, 4,
                                     order=False)
  for k in step_quality.FIELDS:
    np.testing.assert_array_equal(by_len[k], stored[k], err_msg=k)
  # Sampled: the same key gives the same outcomes, in the states' order.
  a = step_quality.next_actions(fn, policy.params, refs, jax.random.key(3), 1.0, 4)
  b = step_quality.next_actions(fn, policy.params, refs, jax.random.key(3), 1.0, 4)
  for k in step_quality.FIELDS:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
