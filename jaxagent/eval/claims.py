"""The five claims of docs/STUDY.md, each decided by a rule fixed before the numbers
(`jaxagent.eval.evidence`: the seed-level model of `seedmodel`, conditions "X > c", Holm). Each
claim is decided on its primary conditions (the paper's definitions, pre-registered in
docs/STUDY.md and `jaxagent.eval.power.PLAN`); its secondary conditions (the stricter or other-
scale statistics) get their own decision beside it, never the verdict.

    out = decide_claims(StudyData(...), rules, num_bootstrap=1000, seed=0)

Every claim is decided on the arm it is about and reported for the others:

* the **standard RL arm** is the fixed-budget arm with the largest training budget (the generous
  one): claims 1, 2, 4 and 5 are about what standard multi-turn RL does;
* the **BudgetMix arm** (the first arm whose budget is a mix): claim 3.

Each RL arm is trained once per seed u = 0..S-1 from the base of seed u mod (number of bases);
a contrast "RL - base" compares, per seed, the arm's run with its own base. States for step
quality and recovery are common to every policy (the first base's evaluation rollouts and the
oracle's), so rates are paired across policies.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxagent.eval import evidence, recovery, seedmodel
from jaxagent.eval.evidence import INCONCLUSIVE, Condition, Estimate, Rules

CLAIMS = {
    1: "Trajectory-level RL gains depend on the interaction budget T: large when T is generous, "
       "shrinking or vanishing when T is tight.",
    2: "RL mostly improves error recovery rather than the quality of each single action "
       "(per-step quality can even drop under standard multi-turn RL).",
    3: "BudgetMix RL gives robust performance across budgets and keeps single-step quality.",
    4: "RL-generated trajectories are far more likely under the RL policy than under the base "
       "policy.",
    5: "In error states, the RL policy corrects a failed tool call more often than the base policy.",
}


def rules_text(r: Rules) -> dict[int, str]:
  """Each claim's rule, with the margins filled in (restated by every report)."""
  e, ni, ll = r.effect, r.non_inferiority, r.loglik_nats
  return {
      1: f"Decided on the standard RL arm. Pass@(1,T); T_tight per task = the smallest evaluated "
         f"T >= that task's optimal number of turns, T_gen = the largest evaluated T; gain(T) = "
         f"Pass_RL(1,T) - Pass_base(1,T). Primary (absolute scale, the paper's points): held iff "
         f"gain(T_gen) > {e:g} and gain(T_gen) - gain(T_tight) > {e:g} are both shown. Secondary "
         f"(headroom scale): the same with share(T) = gain(T) / (1 - Pass_base(1,T)). Gains are "
         f"also reported per T on both scales.",
      2: f"Decided on the standard RL arm. d_rec = controlled recovery (valid next call, sampled) "
         f"on the common error states whose error needs a different action (tool_failure, "
         f"precondition_failed, wrong_answer), RL - base; d_step = step quality (valid call, "
         f"sampled) on the common reference states that follow no error, RL - base. Held iff "
         f"d_rec > {e:g} and d_rec - d_step > {e:g} are both shown. Format errors (parse_error, "
         f"unknown_tool, bad_arguments) are reported apart: fixing one is the skill of step "
         f"validity. 'Step quality dropped' is reported iff the interval of d_step lies below 0.",
      3: f"Decided on the BudgetMix arm m against every fixed-T arm f. Held iff Pass_m(1,T) - "
         f"Pass_f(1,T) > -{ni:g} at every evaluated T at which some of these runs solves some "
         f"task, for every f (within the margin of the best fixed-T arm at every budget), d_step_m > -{ni:g} (keeps step quality, as claim 2's "
         f"d_step) and d_step_m - d_step_f > -{ni:g} for every f (no larger step-quality decline "
         f"than fixed-T RL) are all shown.",
      4: f"Decided on the standard RL arm. For seed u and RL run r_u's own evaluation "
         f"trajectories tau (agent tokens only, nats per trajectory): x = log p_r_u(tau) - log "
         f"p_base(tau). Primary (the paper's): held iff x > {ll:g} is shown. Secondary (against a "
         f"null of seed-to-seed variation): x - y > {ll:g}, y = log p_r_u(tau) - log p_r_v(tau), "
         f"v = the next seed of the same arm (needs two seeds). The other direction (the base's "
         f"trajectories under base and under RL) is reported.",
      5: f"Decided on the standard RL arm. Controlled recovery (valid next call, sampled) on the "
         f"common error states that need a different action, RL - base: held iff > {e:g} is "
         f"shown (primary). Secondary: the same over every error state (format errors too: the "
         f"paper's 'tool-call errors' read broadly). Every error kind is reported apart, with "
         f"RL's and the base's rates on the same states (the seed's framing: 41.4% vs 27.2%).",
  }


def tight_generous(t_values, optimal_turns: np.ndarray) -> tuple[np.ndarray, int]:
  """(T_tight [tasks], T_gen) of claim 1's rule: per task the smallest evaluated T >= its optimal
  turns (T_gen where none is), and the largest evaluated T."""
  t_values = np.asarray(sorted(int(t) for t in t_values))
  opt = np.asarray(optimal_turns, np.int64).reshape(-1)
  idx = np.minimum(np.searchsorted(t_values, opt, side="left"), len(t_values) - 1)
  return t_values[idx], int(t_values[-1])


def at_budget(p: np.ndarray, t_values, t) -> np.ndarray:
  """Per-task values of p [tasks, len(t_values)] at budget t: one T for all tasks, or [tasks]."""
  t_values = [int(v) for v in t_values]
  t = np.asarray(t)
  if t.ndim == 0:
    return p[:, t_values.index(int(t))]
  cols = np.asarray([t_values.index(int(x)) for x in t], np.int64)
  return p[np.arange(p.shape[0]), cols]


@dataclasses.dataclass
class StudyData:
  """What the claims are decided from. Labels name runs; arms group them by seed.

  arms: arm -> run labels by seed (every arm the same number S of seeds).
  bases: the base runs' labels by base seed (RL seed u starts from bases[u % len(bases)]).
  kinds: arm -> "fixed", "mix" or "schedule" (`Budget.arm`), or "credit" (trained with turn-level
    credit or process rewards: reported beside the standard arm, never taken for a fixed-T arm);
    turns: arm -> its training T_max.
  t_values, t_tight [tasks], t_gen: the evaluated budgets and claim 1's budgets.
  pass1: label -> per-task Pass@(1,T) [tasks, len(t_values)].
  step, step_task, step_after_error: label -> valid next call [N] (sampled) on the common
    reference states, their tasks [N], and whether each follows an error [N].
  rec, rec_task, rec_kind: label -> valid next call [M] on the common error states, their tasks
    and previous error kinds [M].
  loglik: (trajectories' label, scoring label) -> {"sum": [R], "mean": [R], "count": [R]} of the
    first label's evaluation trajectories (`likelihood.agent_loglik`); traj_task: label -> the
    tasks of those trajectories [R].
  """
  arms: dict[str, list[str]]
  bases: list[str]
  kinds: dict[str, str]
  turns: dict[str, int]
  num_tasks: int
  t_values: list[int]
  t_tight: np.ndarray
  t_gen: int
  pass1: dict[str, np.ndarray]
  step: dict[str, np.ndarray]
  step_task: np.ndarray
  step_after_error: np.ndarray
  rec: dict[str, np.ndarray]
  rec_task: np.ndarray
  rec_kind: np.ndarray
  loglik: Callable[[str, str], dict]
  traj_task: dict[str, np.ndarray]
  # The sharpening control (`jaxagent.eval.sharpening`): arm -> the label, per seed, of the base
  # that seed is also compared with (its own base at the temperature matching its action
  # entropy); those labels have entries in pass1, step, rec, traj_task and loglik.
  sharpened: dict[str, list[str]] = dataclasses.field(default_factory=dict)

  @property
  def num_seeds(self) -> int:
    return len(next(iter(self.arms.values()))) if self.arms else 0

  def base_of(self, u: int) -> str:
    return self.bases[u % len(self.bases)]

  def standard_arm(self) -> str | None:
    fixed = [a for a in self.arms if self.kinds[a] == "fixed"]
    return max(fixed, key=lambda a: self.turns[a]) if fixed else None

  def mix_arms(self) -> list[str]:
    return [a for a in self.arms if self.kinds[a] == "mix"]

  def credit_arms(self) -> list[str]:
    return [a for a in self.arms if self.kinds[a] == "credit"]


BASE = "<base>"   # the arm name `_Stats` reads as "each seed's base run"


class _Stats:
  """Estimates over one `Resampler` (the same seeds and tasks drawn for every one)."""

  def __init__(self, data: StudyData, num_bootstrap: int, seed: int,
               base_labels: list[str] | None = None):
    """base_labels: the run each seed's BASE reads (default its base run, `base_of`), e.g. the
    sharpened bases of one arm."""
    self.d = data
    self.s = data.num_seeds
    self.r = evidence.Resampler(max(self.s, 1), data.num_tasks, num_bootstrap, seed,
                                seedmodel.unit_groups(max(self.s, 1), len(data.bases)))
    self.base_labels = base_labels or [data.base_of(u) for u in range(self.s)]

  def labels(self, arm: str) -> list[str]:
    return self.d.arms[arm] if arm != BASE else self.base_labels

  def base_of(self, u: int) -> str:
    return self.base_labels[u]

  def pass1(self, arm: str, t) -> Estimate:
    return self.r.ratio(np.stack([at_budget(self.d.pass1[lab], self.d.t_values, t)
                                  for lab in self.labels(arm)]))

  def rate(self, arm: str, outcomes: dict, task: np.ndarray, sel: np.ndarray) -> Estimate:
    parts = [evidence.per_task(np.asarray(outcomes[lab], float)[sel], task[sel], self.d.num_tasks)
             for lab in self.labels(arm)]
    return self.r.ratio(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))

  def step(self, arm: str) -> Estimate:
    return self.rate(arm, self.d.step, self.d.step_task, ~self.d.step_after_error)

  def recovery(self, arm: str, sel: np.ndarray) -> Estimate:
    return self.rate(arm, self.d.rec, self.d.rec_task, sel)

  def loglik_gap(self, pairs) -> Estimate:
    """Mean over trajectories of sum_ll(tau; a) - sum_ll(tau; b), tau = traj's trajectories, per
    seed: pairs[u] = (traj label, a, b)."""
    nums, dens = [], []
    for traj, a, b in pairs:
      x = self.d.loglik(traj, a)["sum"] - self.d.loglik(traj, b)["sum"]
      n, c = evidence.per_task(x, self.d.traj_task[traj], self.d.num_tasks)
      nums.append(n)
      dens.append(c)
    return self.r.ratio(np.stack(nums), np.stack(dens))

  def token_gap(self, pairs) -> float:
    """The per-token version of `loglik_gap`'s estimate (no interval)."""
    vals = []
    for traj, a, b in pairs:
      la, lb = self.d.loglik(traj, a), self.d.loglik(traj, b)
      keep = la["count"] > 0
      vals.append((la["mean"] - lb["mean"])[keep])
    v = np.concatenate(vals) if vals else np.zeros(0)
    return float(v.mean()) if v.size else float("nan")


def _with(rules: Rules, s: int, conditions, secondary=None, **details) -> dict:
  """The decision on the primary `conditions` (the verdict), the `secondary` conditions' own
  decision beside it ("secondary": reported, never the verdict), and the details' intervals."""
  out = evidence.decide(conditions, rules, s)
  if secondary is not None:
    out["secondary"] = evidence.decide(secondary, rules, s)
  conf = rules.confidence
  out["details"] = {k: (v.interval(conf) if isinstance(v, Estimate) else v)
                    for k, v in details.items()}
  return out


def _headroom(gain: Estimate, base: Estimate) -> Estimate:
  """gain / (1 - base): the gain as a share of the base's headroom, with its bootstrap samples
  and its linearised influence values (d(g / r) = dg / r + g db / r^2, r = 1 - base)."""
  room, room_s = 1.0 - base.est, 1.0 - base.samples
  with np.errstate(invalid="ignore", divide="ignore"):
    samples = np.where(room_s > 0, gain.samples / np.where(room_s > 0, room_s, 1), np.nan)
    ok = room > 0 and gain.infl is not None and base.infl is not None
    infl = gain.infl / room + gain.est * base.infl / room ** 2 if ok else None
    return Estimate(gain.est / room if room > 0 else float("nan"), samples, gain.tasks, infl,
                    gain.groups)


def claim1(st: _Stats, arm: str, rules: Rules) -> dict:
  """Primary: absolute gains (the paper's Pass@(K,T) points); secondary: the same conditions on
  the headroom scale, gain / (1 - Pass_base)."""
  d = st.d
  base = {t: st.pass1(BASE, t) for t in d.t_values}
  gains = {t: st.pass1(arm, t) - base[t] for t in d.t_values}
  base_tight = st.pass1(BASE, d.t_tight)
  tight = st.pass1(arm, d.t_tight) - base_tight
  gen = gains[d.t_gen]
  share_gen, share_tight = _headroom(gen, base[d.t_gen]), _headroom(tight, base_tight)
  per_budget = {str(t): {"gain": g.interval(rules.confidence),
                         "share_of_headroom": _headroom(g, base[t]).interval(rules.confidence),
                         "pass_base": base[t].est, "pass_rl": base[t].est + g.est}
                for t, g in gains.items()}
  e = rules.effect
  details = dict(gain_tight=tight, gain_generous=gen, share_tight=share_tight,
                 share_generous=share_gen)
  if np.all(np.asarray(d.t_tight) == d.t_gen):
    out = _with(rules, st.s, [], [], **details)
    out["note"] = "T_tight = T_gen for every task: the evaluated budgets cannot test the claim"
  else:
    out = _with(rules, st.s,
                [Condition(f"gain(T_gen) > {e:g}", gen, e),
                 Condition(f"gain(T_gen) - gain(T_tight) > {e:g}", gen - tight, e)],
                [Condition(f"share(T_gen) > {e:g}", share_gen, e),
                 Condition(f"share(T_gen) - share(T_tight) > {e:g}", share_gen - share_tight, e)],
                **details)
  out["details"]["per_budget"] = per_budget
  return out


def claim2(st: _Stats, arm: str, rules: Rules) -> dict:
  cls = recovery.error_class(st.d.rec_kind)
  d_rec = st.recovery(arm, cls == recovery.ACTION) - st.recovery(BASE, cls == recovery.ACTION)
  d_fmt = st.recovery(arm, cls == recovery.FORMAT) - st.recovery(BASE, cls == recovery.FORMAT)
  d_step = st.step(arm) - st.step(BASE)
  e = rules.effect
  out = _with(rules, st.s, [Condition(f"d_rec(action errors) > {e:g}", d_rec, e),
                            Condition(f"d_rec - d_step > {e:g}", d_rec - d_step, e)],
              d_rec_action=d_rec, d_rec_format=d_fmt, d_step=d_step)
  hi = out["details"]["d_step"]["hi"]
  out["details"]["step_quality_dropped"] = bool(hi is not None and hi < 0)
  return out


def claim3(st: _Stats, arm: str, fixed: list[str], rules: Rules) -> dict:
  ni = rules.non_inferiority
  conds = []
  # Budgets at which some compared run solves some task: below them every arm scores 0 by
  # construction (no task is solvable in fewer turns), which is no evidence of robustness.
  runs = [lab for a in [arm, *fixed] for lab in st.d.arms[a]]
  informative = [t for j, t in enumerate(st.d.t_values)
                 if any(np.any(st.d.pass1[lab][:, j] > 0) for lab in runs)]
  for f in fixed:
    for t in informative:
      conds.append(Condition(f"Pass_mix(1,{t}) - Pass_{f}(1,{t}) > -{ni:g}",
                             st.pass1(arm, t) - st.pass1(f, t), -ni))
  d_step = st.step(arm) - st.step(BASE)
  conds.append(Condition(f"d_step_mix > -{ni:g}", d_step, -ni))
  for f in fixed:
    conds.append(Condition(f"d_step_mix - d_step_{f} > -{ni:g}", st.step(arm) - st.step(f), -ni))
  gains = {str(t): (st.pass1(arm, t) - st.pass1(BASE, t)).interval(rules.confidence)
           for t in st.d.t_values}
  out = _with(rules, st.s, conds, d_step=d_step)
  out["details"]["gain_vs_base"] = gains
  if not fixed:
    out["verdict"], out["note"] = INCONCLUSIVE, "no fixed-T arm to compare with"
  return out


def claim4(st: _Stats, arm: str, rules: Rules) -> dict:
  """Primary (the paper's): x = log p_RL(tau_RL) - log p_base(tau_RL) > margin; secondary
  (today's stricter one): x - y > margin, y the same gap to another seed of the arm."""
  labs = st.d.arms[arm]
  s = len(labs)
  x_pairs = [(labs[u], labs[u], st.base_of(u)) for u in range(s)]
  back = [(st.base_of(u), st.base_of(u), labs[u]) for u in range(s)]
  x, rev = st.loglik_gap(x_pairs), st.loglik_gap(back)
  details = dict(rl_vs_base=x, base_trajectories_base_vs_rl=rev,
                 per_token_rl_vs_base=st.token_gap(x_pairs))
  ll = rules.loglik_nats
  primary = [Condition(f"x > {ll:g} nats", x, ll)]
  if s < 2:
    out = _with(rules, s, primary, [], **details)
    out["secondary"]["note"] = "the seed-to-seed null needs two seeds of the arm"
    return out
  y_pairs = [(labs[u], labs[u], labs[(u + 1) % s]) for u in range(s)]
  y = st.loglik_gap(y_pairs)
  return _with(rules, s, primary, [Condition(f"x - y > {ll:g} nats", x - y, ll)], seed_null=y,
               per_token_seed_null=st.token_gap(y_pairs), **details)


def claim5(st: _Stats, arm: str, rules: Rules) -> dict:
  kinds = np.asarray(st.d.rec_kind)
  cls = recovery.error_class(kinds)
  act = cls == recovery.ACTION
  d = st.recovery(arm, act) - st.recovery(BASE, act)
  by_kind = {}
  for k in sorted(set(kinds.tolist())):
    sel = kinds == k
    rl, base = st.recovery(arm, sel), st.recovery(BASE, sel)
    by_kind[recovery.ERROR_KIND_NAMES[k]] = {
        "class": str(cls[sel][0]), "states": int(sel.sum()),
        "rate_rl": rl.interval(rules.confidence), "rate_base": base.interval(rules.confidence),
        "difference": (rl - base).interval(rules.confidence)}
  e = rules.effect
  every = np.ones_like(act)
  d_all = st.recovery(arm, every) - st.recovery(BASE, every)
  out = _with(rules, st.s, [Condition(f"d_rec(action errors) > {e:g}", d, e)],
              [Condition(f"d_rec(every error) > {e:g}", d_all, e)], d_rec_action=d,
              rate_rl_action=st.recovery(arm, act), rate_base_action=st.recovery(BASE, act),
              d_rec_every_error=d_all)
  out["details"]["by_error_kind"] = by_kind
  return out


CREDIT_RULE = ("Each turn-level credit arm c against the standard RL arm s (same seeds, paired): "
               "held iff rec_c - rec_s > {e:g} is shown, rec = controlled recovery (valid next "
               "call, sampled) on the error states that need a different action; Pass@(1,T) at "
               "T_tight and T_gen and step quality (no-error states) are reported as c - s.")


def credit_vs_standard(st: _Stats, arm: str, standard: str, rules: Rules) -> dict:
  """Does turn-level credit (arm) recover from action errors more often than the standard arm?"""
  cls = recovery.error_class(st.d.rec_kind)
  act = cls == recovery.ACTION
  d_rec = st.recovery(arm, act) - st.recovery(standard, act)
  e = rules.effect
  return _with(rules, st.s, [Condition(f"rec_{arm} - rec_{standard} > {e:g}", d_rec, e)],
               d_rec_action=d_rec,
               d_rec_format=(st.recovery(arm, cls == recovery.FORMAT)
                             - st.recovery(standard, cls == recovery.FORMAT)),
               d_step=st.step(arm) - st.step(standard),
               d_pass_tight=st.pass1(arm, st.d.t_tight) - st.pass1(standard, st.d.t_tight),
               d_pass_generous=st.pass1(arm, st.d.t_gen) - st.pass1(standard, st.d.t_gen))


def decide_credit(data: StudyData, rules: Rules, *, num_bootstrap: int, seed: int) -> dict:
  """{credit arm: decision} of `credit_vs_standard` ({} without credit arms or standard arm)."""
  standard = data.standard_arm()
  if standard is None or not data.credit_arms():
    return {}
  st = _Stats(data, num_bootstrap, seed)
  return {a: {"rule": CREDIT_RULE.format(e=rules.effect), "against": standard,
              **credit_vs_standard(st, a, standard, rules)} for a in data.credit_arms()}


def decide_claims(data: StudyData, rules: Rules, *, num_bootstrap: int, seed: int) -> dict:
  """{claim number: {"claim", "rule", "decided_on", "verdict", "per_arm": {arm: decision}}}:
  each claim's verdict is its deciding arm's; the other arms' decisions are reported."""
  if not data.arms:
    raise ValueError("no RL arm to decide the claims on")
  seeds = {a: len(labs) for a, labs in data.arms.items()}
  if len(set(seeds.values())) != 1:
    raise ValueError(f"every arm needs the same number of seeds (paired), got {seeds}")
  st = _Stats(data, num_bootstrap, seed)
  text = rules_text(rules)
  standard, mixes = data.standard_arm(), data.mix_arms()
  fixed = [a for a in data.arms if data.kinds[a] == "fixed"]
  rl = list(data.arms)
  plan = {
      1: (standard, rl, lambda a: claim1(st, a, rules)),
      2: (standard, rl, lambda a: claim2(st, a, rules)),
      3: (mixes[0] if mixes else None, mixes, lambda a: claim3(st, a, fixed, rules)),
      4: (standard, rl, lambda a: claim4(st, a, rules)),
      5: (standard, rl, lambda a: claim5(st, a, rules)),
  }
  sharp = {a: _Stats(data, num_bootstrap, seed, labs) for a, labs in data.sharpened.items()}
  against = {
      1: lambda a: claim1(sharp[a], a, rules), 2: lambda a: claim2(sharp[a], a, rules),
      3: lambda a: claim3(sharp[a], a, fixed, rules), 4: lambda a: claim4(sharp[a], a, rules),
      5: lambda a: claim5(sharp[a], a, rules)}
  out = {}
  for num, (decider, arms, fn) in plan.items():
    per = {a: fn(a) for a in arms}
    c = {"claim": CLAIMS[num], "rule": text[num], "decided_on": decider, "per_arm": per}
    if decider is None:
      c["verdict"] = INCONCLUSIVE
      c["note"] = ("no BudgetMix arm" if num == 3 else
                   "no fixed-budget (standard RL) arm to decide on")
    else:
      c["verdict"] = per[decider]["verdict"]
      if decider in sharp:
        c["sharpened"] = {"against": sharp[decider].base_labels, "about": SHARPENED_NOTE,
                          **against[num](decider)}
    out[num] = c
  return out


SHARPENED_NOTE = ("RL vs a sharpened base (secondary, never the verdict): the same rule with "
                  "each seed's base replaced by that base sampled at the temperature whose action "
                  "entropy on the reference states is nearest the RL run's "
                  "(jaxagent.eval.sharpening)")
