"""The sharpening control of docs/STUDY.md: is an RL gain more than a sharper (lower-entropy) base?

Lowering a policy's sampling temperature is the cheap way to sharpen it. So every base is also
evaluated at a sweep of temperatures (config.eval.sharpen_temperatures, 0 = greedy), every policy's
action entropy is measured on the comparison's common reference states, and each RL run is set
against its own base at the sweep temperature whose entropy is nearest the RL run's own (at the
evaluation temperature): the "sharpened base". Each claim is then also decided against it
(`jaxagent.eval.claims`, secondary: never the verdict).

**Action entropy** of a policy at temperature T on states S (`step_quality.entropy_rate`): at each
state the policy samples one action at T (`jaxagent.rollout.replay.make_next_action_fn`); each
sampled token i (the action's tokens and its <eot>) was drawn from p_i = softmax(logits_i / T),
whose entropy is H_i = -sum_v p_i(v) log p_i(v) (0 when greedy);

    H(policy, T; S) = sum_{s in S} sum_i H_i(s) / sum_{s in S} (tokens sampled at s)

nats per action token, pooled over states (by the chain rule, sum_i H_i(s) is a one-sample
estimate of the entropy of the whole action's distribution at s). S = the reference states of the
config's environment (oracle and base prefixes, as step quality).

**Matching**: RL run r (seed u, base b = bases[u mod B]) is matched to the temperature T* of the
sweep minimising |H(b, T*) - H(r, T_eval)| (ties: the higher T, the lesser sharpening). Nearest,
not interpolated: every sweep temperature's step quality is already measured, so the matched base
costs only its Pass@(K,T) rollouts, its error-state actions and its likelihoods, once per distinct
(base, T*); a finer sweep gives a closer match. The sweep's program is the step-quality program
(temperature is a traced argument of `sampler.SamplingConfig`): no temperature compiles anything.
"""

from __future__ import annotations

import dataclasses
import math

from jaxagent.eval import pass_at_kt, step_quality

DEFINITION = (
    "Action entropy H(policy, T) on the common reference states: each state's sampled action at "
    "temperature T, the entropy (nats) of softmax(logits / T) at each sampled token (<eot> "
    "included; 0 when greedy), summed over states and tokens, over the tokens sampled. Each RL "
    "run is matched to its base at the sweep temperature whose entropy is nearest its own (ties: "
    "the higher temperature); the claims are also decided against that sharpened base "
    "(secondary, never the verdict). Expected oracle-match probability: at each reference state, "
    "p(the oracle's action tokens and <eot>) under the policy at T (greedy: 1 iff each token is "
    "the arg-max), averaged over states; in environments with several oracle-equivalent actions "
    "(grid: every shortest-path move matches) it is the probability of the environment's one "
    "oracle action, a lower bound on the probability of a match.")


def label(base: str, temperature: float) -> str:
  """The label of base run `base` acting at `temperature` ("base@T0.5"; greedy: "base@T0")."""
  return f"{base}@T{temperature:g}"


def match_temperature(target: float, entropies: dict[float, float]) -> float:
  """The temperature of `entropies` ({T: H(base, T)}) whose entropy is nearest `target` (ties:
  the higher T). Raises ValueError naming the fix when no entropy is finite."""
  finite = {t: h for t, h in entropies.items() if math.isfinite(h)}
  if not finite or not math.isfinite(target):
    raise ValueError(f"no finite action entropy to match (target {target}, sweep {entropies}): "
                     "the reference states are empty; raise config.eval.max_reference_states")
  return min(finite, key=lambda t: (abs(finite[t] - target), -t))


@dataclasses.dataclass
class Sharpening:
  """The sweep, the matches and the sharpened bases' data (`sweep`, then `evaluate`)."""
  temperatures: tuple[float, ...]
  sweep: dict            # base label -> {T: next-action outcomes on the reference states}
  entropy: dict          # label -> H at the evaluation temperature (every run); bases: {T: H}
  matched: dict          # RL label -> (base label, T*)
  arms: dict             # arm -> [sharpened label per seed] (the arms the claims need)
  runs: dict = dataclasses.field(default_factory=dict)   # sharpened label -> its data

  def record(self, rates: dict) -> dict:
    """comparison.json's "sharpening" (rates: base -> {T: step-quality rates overall, the entropy
    among them with its interval over tasks})."""
    return {"definition": DEFINITION, "temperatures": list(self.temperatures),
            "base_sweep": {b: {f"{t:g}": rates[b][t] for t in self.temperatures}
                           for b in self.sweep},
            "entropy": {lab: h for lab, h in self.entropy.items() if lab not in self.sweep},
            "matched": {lab: {"base": b, "temperature": t, "label": label(b, t),
                              "entropy_rl": self.entropy[lab],
                              "entropy_base": self.entropy[b][t]}
                        for lab, (b, t) in self.matched.items()},
            "arms": self.arms,
            "runs": {lab: {"base": r["base"], "temperature": r["temperature"],
                           "pass_at_kt": r["grid"]} for lab, r in self.runs.items()}}


def sweep_temperatures(temperatures, eval_temperature: float) -> tuple[float, ...]:
  """The sweep's temperatures that `sweep` computes itself (not greedy, not the evaluation's,
  which the step-quality analysis has): what `Evaluator.policy_analyses(sweep=...)` can compute
  for each base from its step-quality prefills."""
  return tuple(float(t) for t in temperatures if t != 0 and t != eval_temperature)


def sweep(ev, params: dict, refs, bases: list[str], rl: dict[str, list[str]], outcomes: dict,
          key, temperatures, eval_temperature: float, done: dict | None = None) -> Sharpening:
  """The sweep over `temperatures` of every base on the reference states `refs`, and the match
  of every RL run (rl: arm -> labels by seed; outcomes: label -> {"greedy", "sampled"}
  next-action outcomes on refs, from the step-quality analysis, reused at T = 0 and T_eval;
  done: base -> {T: outcomes} already computed with `ev.act_at`'s key, e.g.
  `PolicyAnalyses.sweep` from the same prefills as the step-quality actions (`sweep_temperatures`
  says which); any other T is computed here)."""
  ts = tuple(temperatures)
  sw, ent = {}, {}
  for b in bases:
    sw[b] = {}
    for t in ts:
      if t == eval_temperature:
        sw[b][t] = outcomes[b]["sampled"]
      elif t == 0:
        sw[b][t] = outcomes[b]["greedy"]
      elif t in (done or {}).get(b, {}):
        sw[b][t] = done[b][t]
      else:
        sw[b][t] = ev.act_at(params[b], refs, key, t)
    ent[b] = {t: step_quality.entropy_rate(o) for t, o in sw[b].items()}
  matched, arms = {}, {}
  for arm, labs in rl.items():
    arms[arm] = []
    for u, lab in enumerate(labs):
      ent[lab] = step_quality.entropy_rate(outcomes[lab]["sampled"])
      b = bases[u % len(bases)]
      t = match_temperature(ent[lab], ent[b])
      matched[lab] = (b, t)
      arms[arm].append(b if t == eval_temperature else label(b, t))
  return Sharpening(ts, sw, ent, matched, arms)


def evaluate(sh: Sharpening, ev, params: dict, errs, k_roll, k_act, need: list[str]) -> None:
  """Evaluates each distinct sharpened base that the arms `need` use (not the bases themselves,
  at the evaluation temperature): its Pass@(K,T) rollouts with the evaluation's key, its actions
  on the error states (at T*, with the sampled mode's key) and its reference-state actions from
  the sweep. Fills sh.runs[label] = {"base", "temperature", "params", "traj", "success_by_t",
  "grid", "pass1"?, "step", "rec"}."""
  for arm in need:
    for lab in sh.arms[arm]:
      if lab in sh.runs or lab in sh.sweep:
        continue
      b, t = next((b, t) for b, t in sh.matched.values() if label(b, t) == lab)
      traj, success = ev.pass_rollouts(params[b], k_roll, t)
      sh.runs[lab] = {"base": b, "temperature": t, "params": params[b], "traj": traj,
                      "success_by_t": success, "grid": ev.pass_grid(success),
                      "step": sh.sweep[b][t], "rec": ev.act_at(params[b], errs, k_act, t)}


def per_task_pass1(sh: Sharpening, mode: str, t_values, t_top: int) -> dict:
  """label -> per-task Pass@(1,T) [tasks, len(t_values)] of each sharpened base."""
  return {lab: pass_at_kt.per_task_pass1(mode, r["success_by_t"], t_values, t_top)
          for lab, r in sh.runs.items()}


def rates_overall(ev, sh: Sharpening, refs) -> dict:
  """base -> {T: step-quality rates on the reference states, overall} of the sweep."""
  return {b: {t: ev.quality({"sampled": o}, refs)["sampled"]["overall"] for t, o in per.items()}
          for b, per in sh.sweep.items()}

