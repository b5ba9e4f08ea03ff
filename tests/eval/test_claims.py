"""Each claim's rule on synthetic study results with a known truth: a real effect -> held, no
effect with little data -> inconclusive (never held), the opposite effect -> not held; claim 4
against identical policies and against two seeds of one arm."""

import numpy as np
import pytest

from jaxagent.envs.base import ErrorKind
from jaxagent.eval import claims, evidence
from jaxagent.eval.evidence import HELD, INCONCLUSIVE, NOT_HELD

RULES = evidence.Rules(effect=0.02, non_inferiority=0.05, loglik_nats=1.0, confidence=0.95,
                       min_seeds=2, min_tasks=10)
ARMS = {"fixed_tight": ("fixed", 2), "fixed_generous": ("fixed", 4), "budgetmix": ("mix", 4)}
T_VALUES = [1, 2, 3, 4]


def make(*, tasks=80, seeds=3, pass_gain=None, step=None, rec=None, ll_gap=None, noise=0.1,
         seed=0, arm_kinds=ARMS) -> claims.StudyData:
  """Synthetic results. pass_gain[arm]: Pass@1 gain over the base per T [4]; step[arm]: valid
  rate on states that follow no error; rec[arm]: (action, format) recovery rates; ll_gap[arm]:
  (log p_arm - log p_base, log p_arm - log p_other seed) of the arm's trajectories, in nats.
  Base: Pass@1 0.1, 0.3, 0.5, 0.6 by T; step 0.6; recovery 0.3 (action) and 0.5 (format)."""
  rng = np.random.default_rng(seed)
  pass_gain = pass_gain or {}
  step, rec, ll_gap = step or {}, rec or {}, ll_gap or {}
  base_pass = np.array([0.1, 0.3, 0.5, 0.6])
  arms = {a: [f"{a}_s{u}" for u in range(seeds)] for a in arm_kinds}
  labels = ["base"] + [lab for labs in arms.values() for lab in labs]

  def arm_of(lab):
    return "base" if lab == "base" else lab.rsplit("_s", 1)[0]

  pass1 = {}
  for lab in labels:
    mean = base_pass + np.asarray(pass_gain.get(arm_of(lab), 0.0))
    seed_shift = 0.0 if lab == "base" else noise * 0.3 * rng.standard_normal()
    pass1[lab] = np.clip(mean + seed_shift + noise * rng.standard_normal((tasks, 4)), 0, 1)
  # 5 states per task, the last one after an error; 4 error states per task, action/format.
  step_task = np.repeat(np.arange(tasks), 5)
  after = np.tile([False] * 4 + [True], tasks)
  rec_task = np.repeat(np.arange(tasks), 4)
  rec_kind = np.tile([ErrorKind.TOOL_FAILURE, ErrorKind.PARSE_ERROR] * 2, tasks)
  action = rec_kind == ErrorKind.TOOL_FAILURE
  step_out, rec_out = {}, {}
  for lab in labels:
    p = step.get(arm_of(lab), 0.6)
    step_out[lab] = rng.random(step_task.size) < p
    pa, pf = rec.get(arm_of(lab), (0.3, 0.5))
    rec_out[lab] = rng.random(rec_task.size) < np.where(action, pa, pf)
  n_traj = 2 * tasks
  traj_task = {lab: np.repeat(np.arange(tasks), 2) for lab in labels}
  own = {lab: -40 + rng.standard_normal(n_traj) for lab in labels}

  def loglik(traj, scorer):
    a = arm_of(traj)
    if scorer == traj:
      s = own[traj]
    elif scorer == "base" or arm_of(scorer) == "base":
      s = own[traj] - ll_gap.get(a, (0.0, 0.0))[0] + 0.5 * rng.standard_normal(n_traj)
    else:   # another seed of the same arm, or another arm
      s = own[traj] - ll_gap.get(a, (0.0, 0.0))[1] + 0.5 * rng.standard_normal(n_traj)
    return {"sum": s, "mean": s / 20, "count": np.full(n_traj, 20.0)}

  cache = {}

  def memo(a, b):
    if (a, b) not in cache:
      cache[(a, b)] = loglik(a, b)
    return cache[(a, b)]

  t_tight = np.full(tasks, 2)
  return claims.StudyData(
      arms=arms, bases=["base"], kinds={a: k for a, (k, _) in arm_kinds.items()},
      turns={a: t for a, (_, t) in arm_kinds.items()}, num_tasks=tasks, t_values=T_VALUES,
      t_tight=t_tight, t_gen=4, pass1=pass1, step=step_out, step_task=step_task,
      step_after_error=after, rec=rec_out, rec_task=rec_task, rec_kind=rec_kind, loglik=memo,
      traj_task=traj_task)


def decide(data, num):
  return claims.decide_claims(data, RULES, num_bootstrap=500, seed=0)[num]


def test_standard_and_mix_arms():
  d = make(seeds=2)
  assert d.standard_arm() == "fixed_generous" and d.mix_arms() == ["budgetmix"]
  out = claims.decide_claims(d, RULES, num_bootstrap=100, seed=0)
  assert [out[n]["decided_on"] for n in range(1, 6)] == ["fixed_generous"] * 2 + [
      "budgetmix"] + ["fixed_generous"] * 2
  assert set(out[1]["per_arm"]) == set(ARMS) and set(out[3]["per_arm"]) == {"budgetmix"}


@pytest.mark.parametrize("seed", [0, 1])
def test_claim1(seed):
  real = make(pass_gain={"fixed_generous": [0.0, 0.02, 0.2, 0.3]}, seed=seed)
  c = decide(real, 1)
  assert c["verdict"] == HELD
  per = c["per_arm"]["fixed_generous"]["details"]["per_budget"]
  want = np.mean([real.pass1[f"fixed_generous_s{u}"][:, 3].mean() for u in range(3)])
  assert per["4"]["gain"]["est"] == pytest.approx(want - real.pass1["base"][:, 3].mean())
  assert per["4"]["gain"]["est"] == pytest.approx(0.3, abs=0.08)     # less: clipped at 1
  assert per["4"]["share_of_headroom"]["est"] == pytest.approx(
      per["4"]["gain"]["est"] / (1 - per["4"]["pass_base"]))
  small = make(tasks=12, seeds=2, noise=0.3, seed=seed)
  assert decide(small, 1)["verdict"] == INCONCLUSIVE
  opposite = make(pass_gain={"fixed_generous": [0.0, 0.3, 0.1, 0.0]}, seed=seed)
  assert decide(opposite, 1)["verdict"] == NOT_HELD
  # The claim is decided on the standard arm only: a tight arm that gains most at tight T
  # (as it should) does not decide it.
  mixed = make(pass_gain={"fixed_generous": [0.0, 0.02, 0.2, 0.3],
                          "fixed_tight": [0.0, 0.4, 0.2, 0.1]}, seed=seed)
  c = decide(mixed, 1)
  assert c["verdict"] == HELD and c["per_arm"]["fixed_tight"]["verdict"] == NOT_HELD


@pytest.mark.parametrize("seed", [0, 1])
def test_claim2_and_claim5(seed):
  real = make(rec={"fixed_generous": (0.6, 0.5)}, seed=seed)
  assert decide(real, 2)["verdict"] == HELD and decide(real, 5)["verdict"] == HELD
  by_kind = decide(real, 5)["per_arm"]["fixed_generous"]["details"]["by_error_kind"]
  assert by_kind["tool_failure"]["class"] == "action"
  assert by_kind["tool_failure"]["rate_rl"]["est"] == pytest.approx(0.6, abs=0.06)
  assert by_kind["parse_error"]["difference"]["est"] == pytest.approx(0.0, abs=0.06)
  # Recovery from format errors alone is step validity, not recovery: no evidence for either.
  fmt = make(rec={"fixed_generous": (0.3, 0.9)}, seed=seed)
  assert decide(fmt, 5)["verdict"] != HELD and decide(fmt, 2)["verdict"] != HELD
  small = make(tasks=12, seeds=2, seed=seed)
  assert decide(small, 2)["verdict"] == INCONCLUSIVE
  assert decide(small, 5)["verdict"] == INCONCLUSIVE
  # Step quality rose more than recovery: not "mostly recovery".
  both = make(rec={"fixed_generous": (0.4, 0.5)}, step={"fixed_generous": 0.95}, seed=seed)
  assert decide(both, 2)["verdict"] == NOT_HELD
  worse = make(rec={"fixed_generous": (0.05, 0.5)}, seed=seed)
  assert decide(worse, 5)["verdict"] == NOT_HELD
  dropped = make(rec={"fixed_generous": (0.6, 0.5)}, step={"fixed_generous": 0.3}, seed=seed)
  assert decide(dropped, 2)["per_arm"]["fixed_generous"]["details"]["step_quality_dropped"]


@pytest.mark.parametrize("seed", [0, 1])
def test_claim3(seed):
  gain = [0.0, 0.1, 0.1, 0.1]
  # Non-inferiority within 0.05 needs intervals narrower than the margin: states enough, and
  # seeds enough for the Student quantile (3 seeds: 4.30; 8: 2.36) and for the exact sign-flip
  # guard (6 units: every one above the margin). Refuting one of 11 conditions after Holm
  # needs more than 3 seeds too (alpha / 11 = 0.0023 with a 2-df quantile).
  same = make(tasks=400, seeds=8, pass_gain={"fixed_tight": gain, "fixed_generous": gain,
                                             "budgetmix": gain}, noise=0.05, seed=seed)
  assert decide(same, 3)["verdict"] == HELD
  worse = make(seeds=6, pass_gain={"fixed_tight": [0, 0.3, 0.3, 0.2], "budgetmix": gain},
               seed=seed)
  assert decide(worse, 3)["verdict"] == NOT_HELD
  step_drop = make(seeds=6,
                   pass_gain={"fixed_tight": gain, "fixed_generous": gain, "budgetmix": gain},
                   step={"budgetmix": 0.3}, noise=0.05, seed=seed)
  assert decide(step_drop, 3)["verdict"] == NOT_HELD
  small = make(tasks=12, seeds=2, noise=0.3, seed=seed)
  assert decide(small, 3)["verdict"] == INCONCLUSIVE


def test_claim3_ignores_budgets_nobody_solves():
  d = make(pass_gain={"fixed_tight": [0, 0.1, 0.1, 0.1]}, noise=0.05)
  for lab in d.pass1:
    d.pass1[lab][:, 0] = 0.0
  conds = decide(d, 3)["per_arm"]["budgetmix"]["conditions"]
  assert not any("(1,1)" in c["condition"] for c in conds)
  assert any("(1,2)" in c["condition"] for c in conds)


def test_claim4_null_of_seeds():
  far = make(ll_gap={"fixed_generous": (12.0, 0.5)})
  c = decide(far, 4)
  assert c["verdict"] == HELD
  det = c["per_arm"]["fixed_generous"]["details"]
  assert det["rl_vs_base"]["est"] == pytest.approx(12.0, abs=0.3)
  assert det["seed_null"]["est"] == pytest.approx(0.5, abs=0.3)
  # RL moved away from the base, but two seeds of RL differ as much from each other: the
  # paper's statistic (primary) is held, the stricter one against the seed-to-seed null
  # (secondary) is not.
  noise = make(ll_gap={"fixed_generous": (5.0, 5.0)})
  c = decide(noise, 4)["per_arm"]["fixed_generous"]
  assert c["verdict"] == HELD and c["secondary"]["verdict"] != HELD
  assert decide(far, 4)["per_arm"]["fixed_generous"]["secondary"]["verdict"] == HELD
  # Below the margin: x = 0.3 nats is not "far more likely" (refuted).
  near = make(seeds=3, ll_gap={"fixed_generous": (0.3, 0.1)})
  assert decide(near, 4)["verdict"] == NOT_HELD
  one_seed = make(seeds=1, ll_gap={"fixed_generous": (12.0, 0.5)})
  c = decide(one_seed, 4)
  assert c["verdict"] == INCONCLUSIVE
  assert "two seeds" in c["per_arm"]["fixed_generous"]["secondary"]["note"]


def test_claim4_identical_policies_are_never_held():
  d = make()
  zero = {"sum": np.zeros(160), "mean": np.zeros(160), "count": np.full(160, 20.0)}
  d.loglik = lambda a, b: zero
  assert decide(d, 4)["verdict"] in (NOT_HELD, INCONCLUSIVE)


def test_one_seed_is_always_inconclusive():
  d = make(seeds=1, pass_gain={"fixed_generous": [0.0, 0.02, 0.2, 0.3]},
           rec={"fixed_generous": (0.9, 0.5)})
  out = claims.decide_claims(d, RULES, num_bootstrap=200, seed=0)
  assert all(c["verdict"] == INCONCLUSIVE for c in out.values())
  assert "1 seed" in out[1]["per_arm"]["fixed_generous"]["note"]


def test_unpaired_seeds_are_refused():
  d = make(seeds=2)
  d.arms["budgetmix"] = d.arms["budgetmix"][:1]
  with pytest.raises(ValueError, match="same number of seeds"):
    claims.decide_claims(d, RULES, num_bootstrap=10, seed=0)


WITH_CREDIT = {**ARMS, "gigpo": ("credit", 8)}


@pytest.mark.parametrize("seed", [0, 1])
def test_credit_arm_against_the_standard_arm(seed):
  """A credit arm is reported beside the standard arm, never taken for it (even with a larger
  training T) nor compared as a fixed-T arm in claim 3; its own rule: held when it recovers
  from action errors more often than the standard arm, inconclusive on too little data, not
  held when it recovers less."""
  real = make(seeds=5, rec={"fixed_generous": (0.4, 0.5), "gigpo": (0.6, 0.5)}, seed=seed,
              arm_kinds=WITH_CREDIT)
  assert real.standard_arm() == "fixed_generous" and real.credit_arms() == ["gigpo"]
  out = claims.decide_claims(real, RULES, num_bootstrap=300, seed=0)
  assert out[1]["decided_on"] == "fixed_generous" and "gigpo" in out[5]["per_arm"]
  c3 = out[3]["per_arm"]["budgetmix"]["conditions"]
  assert not any("gigpo" in c["condition"] for c in c3)
  credit = claims.decide_credit(real, RULES, num_bootstrap=500, seed=0)
  assert set(credit) == {"gigpo"} and credit["gigpo"]["against"] == "fixed_generous"
  assert credit["gigpo"]["verdict"] == HELD
  assert credit["gigpo"]["details"]["d_rec_action"]["est"] == pytest.approx(0.2, abs=0.06)
  small = make(tasks=12, seeds=2, rec={"gigpo": (0.32, 0.5)}, seed=seed, arm_kinds=WITH_CREDIT)
  assert claims.decide_credit(small, RULES, num_bootstrap=500, seed=0)["gigpo"]["verdict"] == (
      INCONCLUSIVE)
  worse = make(rec={"fixed_generous": (0.6, 0.5), "gigpo": (0.4, 0.5)}, seed=seed,
               arm_kinds=WITH_CREDIT)
  assert claims.decide_credit(worse, RULES, num_bootstrap=500, seed=0)["gigpo"]["verdict"] == (
      NOT_HELD)
  assert claims.decide_credit(make(seed=seed), RULES, num_bootstrap=100, seed=0) == {}


def test_each_claim_is_also_decided_against_the_sharpened_base():
  # RL recovers from action errors at 0.5 against the base's 0.3 (claim 5 held); a sharpened base
  # (the base at a lower temperature) already recovers at 0.5: against it the gain is gone.
  data = make(rec={"fixed_generous": (0.5, 0.5)}, pass_gain={"fixed_generous": [0, 0, 0.1, 0.2]})
  rng = np.random.default_rng(7)
  sharp = "base@T0.5"
  action = data.rec_kind == ErrorKind.TOOL_FAILURE
  data.rec[sharp] = rng.random(data.rec_task.size) < np.where(action, 0.5, 0.5)
  data.step[sharp], data.pass1[sharp] = data.step["base"], data.pass1["base"]
  data.traj_task[sharp] = data.traj_task["base"]
  scored = data.loglik      # the sharpened base's likelihoods: the base's (claim 4 unchanged)
  data.loglik = lambda a, b: scored(*[x.replace(sharp, "base") for x in (a, b)])
  data.sharpened = {"fixed_generous": [sharp] * 3, "budgetmix": ["base"] * 3}
  out = claims.decide_claims(data, RULES, num_bootstrap=300, seed=0)
  assert out[5]["verdict"] == HELD
  sh = out[5]["sharpened"]
  assert sh["against"] == [sharp] * 3 and "secondary" in sh["about"]
  assert sh["verdict"] != HELD
  assert abs(sh["details"]["d_rec_action"]["est"]) < 0.05
  assert out[5]["per_arm"]["fixed_generous"]["details"]["d_rec_action"]["est"] > 0.15
  # Every claim carries it; a sharpened base that is the base itself decides as the verdict did.
  assert all("sharpened" in out[n] for n in range(1, 6))
  assert out[3]["sharpened"]["verdict"] == out[3]["verdict"]
  assert out[1]["sharpened"]["conditions"] == out[1]["per_arm"]["fixed_generous"]["conditions"]
  assert out[4]["sharpened"]["verdict"] == out[4]["verdict"]
