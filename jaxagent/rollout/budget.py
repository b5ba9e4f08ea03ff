"""The interaction budget T, typed: parsed once from a spec, then used everywhere (BudgetMix
draws it per batch or per task group; the rollout engine carries it per row and ends an episode
when it is spent; reports classify training arms by its `arm`).

Spec strings (whitespace ignored; budgets are integers >= 1):

    fixed:8                    always T = 8 (plain multi-turn RL); a bare "8" means the same
    mix:2,4,8,12               uniform over the set {2, 4, 8, 12} (distinct values)
    weighted:2=0.5,8=0.5       T = 2 or 8 with the given relative weights (> 0; normalised)
    schedule:0=2,100=8,200=2   piecewise constant over training steps: T = 2 for steps [0, 100),
                               8 for [100, 200), 2 from 200 on (the first step must be 0, then
                               strictly increasing)

Mode `per` (how often T is drawn): "batch" (default) draws one T per batch, shared by every
group; "group" draws one T per task group, independently. Within a GRPO group all episodes always
share one T, so their rewards compare.

    budget = Budget.parse("mix:2,4,8,12", per="batch")
    budget.max_turns                                     # 12: T_max, the static shape to compile with
    budget.support                                       # (2, 4, 8, 12): every value it can draw
    budget.arm                                           # "mix" (or "fixed", "schedule")
    budgets = budget.sample(step, key, num_groups)       # int32 [num_groups]

`sample` is a pure function of (step, key): T = f(fold_in(key, step)), so a resumed run draws
the same budgets, and it is jit-friendly (step may be traced; num_groups is static).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("fixed", "mix", "weighted", "schedule")
PER_MODES = ("batch", "group")
SPEC_FORMS = ("valid forms: 'fixed:T' (or just 'T'), 'mix:T1,T2,...' (uniform), "
              "'weighted:T1=w1,T2=w2,...' (relative weights > 0), "
              "'schedule:0=T0,S1=T1,S2=T2,...' (T_i from training step S_i on; S increasing "
              "from 0); budgets are integers >= 1, e.g. 'mix:2,4,8,12'")


class BudgetSpecError(ValueError):
  """A budget spec that does not parse; the message shows the valid forms."""


# How a training run's budget is classified for the study's claims: one value for the whole run,
# a draw from a distribution (BudgetMix), or a value that changes over training steps.
ARMS = ("fixed", "mix", "schedule")


@dataclasses.dataclass(frozen=True)
class Budget:
  """A parsed budget spec (hashable; see the module docstring). Build it with `Budget.parse`."""
  kind: str                   # one of KINDS (as written in the spec)
  budgets: tuple[int, ...]    # the budgets (schedule: the budget of each segment, in order)
  probs: tuple[float, ...]    # fixed/mix/weighted: probability of each budget (sums to 1)
  steps: tuple[int, ...]      # schedule: the first training step of each segment; else ()
  per: str = "batch"          # one of PER_MODES: one draw per batch or per task group
  spec: str = ""              # the spec it was parsed from

  @classmethod
  def parse(cls, spec: str, per: str = "batch") -> "Budget":
    """Parses a spec string (module docstring); `BudgetSpecError` (a ValueError) with the valid
    forms when it does not parse."""
    return _parse(spec, per)

  @property
  def max_turns(self) -> int:
    """T_max: the largest budget it can draw, the static turn count rollouts are compiled with."""
    return max(self.budgets)

  @property
  def support(self) -> tuple[int, ...]:
    """Every budget it can draw, sorted, each once."""
    return tuple(sorted(set(self.budgets)))

  @property
  def arm(self) -> str:
    """One of ARMS: "fixed" when it can draw one value only (`fixed:8`, `8`, `mix:8`,
    `schedule:0=8`), "schedule" for a schedule over several values, else "mix"."""
    if len(self.support) == 1:
      return "fixed"
    return "schedule" if self.kind == "schedule" else "mix"

  def sample(self, step, key: jax.Array, num_groups: int) -> jax.Array:
    """Budgets int32 [num_groups], one per task group; all equal in "batch" mode.

    Deterministic given (step, key): the draw uses `fold_in(key, step)`.
    """
    values = jnp.asarray(self.budgets, jnp.int32)
    if self.kind == "schedule":
      seg = jnp.searchsorted(jnp.asarray(self.steps, jnp.int32), jnp.asarray(step, jnp.int32),
                             side="right") - 1
      return jnp.full((num_groups,), values[jnp.maximum(seg, 0)], jnp.int32)
    k = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
    shape = () if self.per == "batch" else (num_groups,)
    idx = jax.random.choice(k, len(self.budgets), shape, p=jnp.asarray(self.probs, jnp.float32))
    return jnp.broadcast_to(values[idx], (num_groups,)).astype(jnp.int32)


def _fail(spec: str, why: str):
  raise BudgetSpecError(f"budget spec {spec!r}: {why}; {SPEC_FORMS}")


def _int(spec: str, text: str, what: str, minimum: int) -> int:
  try:
    v = int(text)
  except ValueError:
    _fail(spec, f"{what} {text!r} is not an integer")
  if v < minimum:
    _fail(spec, f"{what} {v} must be >= {minimum}")
  return v


def _pairs(spec: str, body: str) -> list[tuple[str, str]]:
  out = []
  for item in body.split(","):
    if item.count("=") != 1:
      _fail(spec, f"item {item!r} is not of the form key=value")
    a, b = item.split("=")
    out.append((a, b))
  return out


def _parse(spec: str, per: str) -> Budget:
  if per not in PER_MODES:
    raise BudgetSpecError(f"budget per={per!r}: draw the budget per 'batch' or per 'group'")
  if not isinstance(spec, str):
    _fail(str(spec), f"expected a string, got {type(spec).__name__}")
  text = "".join(spec.split())
  if ":" not in text:
    if text.isdigit():
      text = "fixed:" + text
    else:
      _fail(spec, "missing 'kind:'")
  kind, body = text.split(":", 1)
  kind = kind.lower()
  if kind not in KINDS:
    _fail(spec, f"unknown kind {kind!r}")
  if not body:
    _fail(spec, "nothing after the colon")
  steps: tuple[int, ...] = ()
  if kind == "fixed":
    budgets = (_int(spec, body, "budget", 1),)
    probs = (1.0,)
  elif kind == "mix":
    budgets = tuple(_int(spec, t, "budget", 1) for t in body.split(","))
    probs = (1.0 / len(budgets),) * len(budgets)
  elif kind == "weighted":
    pairs = _pairs(spec, body)
    budgets = tuple(_int(spec, t, "budget", 1) for t, _ in pairs)
    weights = []
    for _, w in pairs:
      try:
        wf = float(w)
      except ValueError:
        wf = float("nan")
      if not (math.isfinite(wf) and wf > 0):
        _fail(spec, f"weight {w!r} must be a finite number > 0")
      weights.append(wf)
    total = sum(weights)
    probs = tuple(w / total for w in weights)
  else:
    pairs = _pairs(spec, body)
    steps = tuple(_int(spec, s, "step", 0) for s, _ in pairs)
    budgets = tuple(_int(spec, t, "budget", 1) for _, t in pairs)
    probs = ()
    if steps[0] != 0:
      _fail(spec, f"the schedule must start at step 0, not {steps[0]}")
    if any(b <= a for a, b in zip(steps, steps[1:])):
      _fail(spec, f"schedule steps {list(steps)} must be strictly increasing")
  if kind in ("mix", "weighted") and len(set(budgets)) != len(budgets):
    _fail(spec, f"budgets {list(budgets)} repeat a value (give each once; use weighted: for "
          "unequal probabilities)")
  return Budget(kind=kind, budgets=budgets, probs=probs, steps=steps, per=per, spec=spec)


def budget_distribution(budget: Budget, step: int) -> dict[int, float]:
  """{budget: probability} of one draw at `step` (host-side; for reports and tests)."""
  if budget.kind == "schedule":
    seg = int(np.searchsorted(np.asarray(budget.steps), step, side="right")) - 1
    return {budget.budgets[max(seg, 0)]: 1.0}
  return dict(zip(budget.budgets, budget.probs))
