"""Typed sections of a run config: `sft`, `rl` and `eval`, read once and checked.

    sft = sft_config(config)      # SFTConfig: the supervised phase
    rl = rl_config(config)        # RLConfig: the RL phase (budget parsed, LearnerConfig built)
    ev = eval_config(config)      # EvalConfig: evaluation (string specs parsed into tuples)
    validate(config)              # every section; raises the first ConfigError
    run = run_config(config)      # RunConfig: every section typed (run, model, env, data, ...)

configs/default.py is the one set of defaults: these dataclasses have none, so every key of a
section must be in the config. Reading a section rejects unknown keys, missing keys and wrongly
typed values with a `ConfigError` (a ValueError) that names the full key, e.g.
`config.sft.steps must be an int, got '10'`. Types are strict: an int is not a bool, a float may
be given as an int, a bool must be a bool and a str a str.

String specs are parsed here, once: `rl.budget` and `rl.budget_per` into one
`jaxagent.rollout.budget.Budget` (the section keeps no separate spec string), `rl.learner` into a
`jaxagent.learners.update.LearnerConfig` whose temperature is `rl.temperature` (log-probs are
recomputed at the rollout temperature), and the comma/semicolon lists of `eval` into tuples.

Every section is a frozen, hashable dataclass (usable as a cache key of compiled programs); so
`EvalConfig.extra_envs` keeps each environment's knobs as a sorted tuple of (knob, value) pairs
(JSON lists and objects frozen into tuples): `EvalConfig.knobs(i)` / `env_specs()` give dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import typing
from typing import Any, Callable, Mapping

import ml_collections

import jaxagent.envs as envs
from jaxagent.data import demos as demo_data
from jaxagent.data import tasks as task_data
from jaxagent.learners.update import LearnerConfig
from jaxagent.models.config import ATTENTION_ENV, ATTENTIONS
from jaxagent.models.lora import LoraConfig
from jaxagent.rollout.budget import PER_MODES, Budget, BudgetSpecError

EVAL_MODES = ("truncation", "rerun")
EVAL_PHASES = ("", "sft", "rl")
_DEFAULTS = "configs/default.py lists every key"


class ConfigError(ValueError):
  """A config key that is unknown, missing, wrongly typed or out of range; the message names
  the full key (config.section.key)."""


# -- sections ---------------------------------------------------------------------------------


def _require(ok: bool, message: str):
  if not ok:
    raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """config.sft: supervised training on demonstrations (0 steps skips the phase)."""
  steps: int
  batch_size: int
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  max_grad_norm: float

  def __post_init__(self):
    _require(self.steps >= 0, f"config.sft.steps must be >= 0, got {self.steps}")
    _require(self.batch_size >= 1, f"config.sft.batch_size must be >= 1, got {self.batch_size}")
    _require(self.warmup_steps >= 0,
             f"config.sft.warmup_steps must be >= 0, got {self.warmup_steps}")
    _require(self.max_grad_norm >= 0,
             f"config.sft.max_grad_norm must be >= 0 (0 disables clipping), got "
             f"{self.max_grad_norm}")
    _learning_rate("sft.learning_rate", self.learning_rate)
    _require(self.steps == 0 or self.warmup_steps < self.steps,
             f"config.sft.warmup_steps ({self.warmup_steps}) must be < config.sft.steps "
             f"({self.steps}): the cosine schedule decays over the steps after the warmup")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """config.rl: the RL phase (0 steps skips it). `budget` is parsed from the config keys
  `budget` (spec) and `budget_per`; `learner` from `learner`, with `temperature` as its
  temperature."""
  steps: int
  num_tasks: int
  group_size: int
  budget: Budget
  budget_visible: bool
  temperature: float
  max_action_tokens: int
  reference_on_host: bool
  learner: LearnerConfig

  def __post_init__(self):
    for key in ("num_tasks", "group_size"):
      value = getattr(self, key)
      _require(value >= 1, f"config.rl.{key} must be >= 1, got {value}")
    for key in ("steps", "max_action_tokens", "temperature"):
      value = getattr(self, key)
      _require(value >= 0, f"config.rl.{key} must be >= 0, got {value}")
    batch = self.num_tasks * self.group_size
    _require(batch % self.learner.minibatches == 0,
             f"config.rl.learner.minibatches ({self.learner.minibatches}) must divide the "
             f"episodes per step, config.rl.num_tasks x config.rl.group_size = {batch}")
    _require(self.max_action_tokens != 1,
             "config.rl.max_action_tokens must be 0 (the environment's limit) or >= 2 (it "
             "counts the end-of-turn token), got 1")
    _require(self.steps == 0 or self.temperature > 0,
             f"config.rl.temperature={self.temperature}: RL needs sampled episodes (at "
             "temperature 0 every episode of a group is the same, advantages are zero and the "
             "updates are noise); use a positive temperature, e.g. 1.0, or config.rl.steps=0")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """config.eval: evaluation of checkpoints (see the comments of configs/default.py's `c.eval`).

  Parsed fields: rerun_budgets (sorted, without repeats: every consumer may take the last as
  T_max) and curve_ks from "2,4,6,8"; sharpen_temperatures from "1,0.7,0.5,0.3,0" (distinct,
  highest first); extra_envs from
  "name:knob=value,...;name2:..." as ((name, ((knob, value), ...)), ...) with sorted knobs
  (hashable; `knobs(i)` and `env_specs()` give them as dicts).
  """
  num_samples: int
  max_turns: int
  mode: str
  rerun_budgets: tuple[int, ...]
  rerun_budget_visible: bool
  temperature: float
  max_action_tokens: int
  num_tasks: int
  tasks_per_batch: int
  max_reference_states: int
  max_error_states: int
  state_batch: int
  score_batch: int
  likelihood_trajectories: int
  num_bootstrap: int
  confidence: float
  seed: int
  phase: str
  base_workdir: str
  extra_envs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
  curve_ks: tuple[int, ...]
  sharpen_temperatures: tuple[float, ...]

  def __post_init__(self):
    _require(self.mode in EVAL_MODES,
             f"config.eval.mode={self.mode!r}: use 'truncation' or 'rerun'")
    _require(self.max_turns >= 1, f"config.eval.max_turns must be >= 1, got {self.max_turns}")
    bad = [t for t in self.rerun_budgets if not 1 <= t <= self.max_turns]
    _require(not bad and (self.rerun_budgets or self.mode != "rerun"),
             f"config.eval.rerun_budgets={','.join(map(str, self.rerun_budgets))!r}: give "
             f"budgets in [1, config.eval.max_turns={self.max_turns}]"
             + (f" ({bad} are not)" if bad else " (rerun mode needs at least one)"))
    for key in ("num_samples", "tasks_per_batch", "state_batch", "score_batch",
                "num_bootstrap"):
      value = getattr(self, key)
      _require(value >= 1, f"config.eval.{key} must be >= 1, got {value}")
    for key in ("num_tasks", "max_reference_states", "max_error_states", "likelihood_trajectories",
                "max_action_tokens", "temperature"):
      value = getattr(self, key)
      _require(value >= 0, f"config.eval.{key} must be >= 0 (0 = all / default), got {value}")
    _require(self.phase in EVAL_PHASES,
             f"config.eval.phase={self.phase!r}: use 'rl', 'sft' or '' (every phase)")
    _require(0 < self.confidence < 1,
             f"config.eval.confidence must be in (0, 1), got {self.confidence}")
    _require(all(k >= 1 for k in self.curve_ks),
             f"config.eval.curve_ks={','.join(map(str, self.curve_ks))!r}: K values must be "
             ">= 1")

  @property
  def budgets(self) -> tuple[int, ...]:
    """The budgets evaluated: rerun_budgets in rerun mode, else 1..max_turns (truncation)."""
    if self.mode == "rerun":
      return self.rerun_budgets
    return tuple(range(1, self.max_turns + 1))

  @property
  def budget_visible(self) -> bool:
    """Whether evaluation rollouts tell the agent its budget: rerun mode with
    rerun_budget_visible (a truncated T_max run never knows where it is cut)."""
    return self.mode == "rerun" and self.rerun_budget_visible

  def knobs(self, i: int) -> dict:
    """The knobs of extra environment i as a dict."""
    return dict(self.extra_envs[i][1])

  def env_specs(self) -> list[tuple[str, dict]]:
    """extra_envs as [(name, knobs dict)] (the form of `parse_env_specs`)."""
    return [(name, self.knobs(i)) for i, (name, _) in enumerate(self.extra_envs)]


# -- the generic reader -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Convert:
  """How one special field is built: the config key of the same name must have type `raw`;
  `build(raw_value, plain)` makes the field (plain: the section's checked plain values and
  extra keys). A ValueError it raises becomes a ConfigError prefixed with the key."""
  raw: type | tuple[type, ...]
  build: Callable[[Any, dict], Any]


_PLAIN = {int: "an int", float: "a float", bool: "a bool", str: "a str"}


def _type_ok(value, kind) -> bool:
  if kind is bool:
    return isinstance(value, bool)
  if isinstance(value, bool):
    return False
  if kind is float:
    return isinstance(value, (int, float))
  return isinstance(value, kind)


def _type_name(kind) -> str:
  if kind in _PLAIN:
    return _PLAIN[kind]
  kinds = kind if isinstance(kind, tuple) else (kind,)
  return " or ".join("a " + k.__name__ for k in kinds)


def _check(name: str, key: str, value, kind):
  ok = (any(_type_ok(value, k) for k in kind) if isinstance(kind, tuple)
        else _type_ok(value, kind))
  if not ok:
    raise ConfigError(f"{_key(name, key)} must be {_type_name(kind)}, got {value!r}")
  return float(value) if kind is float else value


def _read(cls, section: ml_collections.ConfigDict | Mapping, name: str,
          convert: Mapping[str, _Convert] = {}, extra: Mapping[str, type] = {}):
  """`cls` (a dataclass) from config section `name` (e.g. "rl"). Plain fields (int, float,
  bool, str per the field's annotation) are type-checked and copied; the fields in `convert`
  are built from their raw value; `extra` lists config keys that are no field but that the
  converters read (e.g. rl.budget_per), type-checked like plain fields. Unknown, missing or
  wrongly typed keys raise ConfigError naming `config.<name>.<key>`."""
  if not isinstance(section, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict,
                              Mapping)):
    raise ConfigError(f"config.{name} must be a section (ConfigDict), got {section!r}")
  items = dict(section.items())
  hints = typing.get_type_hints(cls)
  fields = [f.name for f in dataclasses.fields(cls)]
  valid = fields + [k for k in extra if k not in fields]
  reject_unknown(items, valid, name)
  for key in valid:
    if key not in items:
      raise ConfigError(f"{_key(name, key)} is missing; add it to the config ({_DEFAULTS})")
  plain = {}
  for key in valid:
    if key in convert:
      continue
    kind = extra[key] if key not in hints else hints[key]
    if kind not in _PLAIN:
      raise TypeError(f"{cls.__name__}.{key}: type {kind} needs a converter")
    plain[key] = _check(name, key, items[key], kind)
  values = {k: v for k, v in plain.items() if k in fields}
  for key, conv in convert.items():
    raw = _check(name, key, items[key], conv.raw)
    try:
      values[key] = conv.build(raw, plain)
    except ConfigError:
      raise
    except ValueError as e:
      raise ConfigError(f"{_key(name, key)}: {e}") from e
  return cls(**values)


def _key(name: str, key: str) -> str:
  """The full name of a key: config.<section>.<key> (config.<key> at the top level)."""
  return f"config.{name}.{key}" if name else f"config.{key}"


def nearest_key(key: str, valid) -> str | None:
  """The valid key `key` was most likely meant to be: a close spelling, else one whose word
  initials it is (lr -> learning_rate), else one containing it; None when nothing is near."""
  valid = list(valid)
  near = (difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
          or [k for k in valid if "".join(w[:1] for w in k.split("_")) == key]
          or [k for k in valid if key in k])
  return near[0] if near else None


def reject_unknown(present, valid, name: str) -> None:
  """ConfigError naming every key of `present` not in `valid` (section `name`, "" at the top
  level), the nearest valid key to the first one that has one, and the valid keys."""
  valid = list(valid)
  unknown = sorted(set(present) - set(valid))
  if not unknown:
    return
  near = next(((k, n) for k in unknown if (n := nearest_key(k, valid))), None)
  hint = f" (did you mean {_key(name, near[1])}?)" if near else ""
  raise ConfigError(f"{'config.' + name if name else 'config'}: unknown key(s) "
                    f"{', '.join(_key(name, k) for k in unknown)}{hint}; valid keys: "
                    f"{', '.join(valid)}")


# -- parsers ----------------------------------------------------------------------------------


def _ints(key: str, spec: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in spec.split(",") if x.strip())
  except ValueError:
    raise ConfigError(f"config.{key}={spec!r}: give comma-separated integers, e.g. "
                      "'1,2,4'") from None


def _temperatures(key: str, spec: str) -> tuple[float, ...]:
  """"1,0.7,0.5,0.3,0" -> (1.0, 0.7, 0.5, 0.3, 0.0): distinct, highest first, each >= 0."""
  try:
    out = tuple(sorted({float(x) for x in spec.split(",") if x.strip()}, reverse=True))
  except ValueError:
    raise ConfigError(f"config.{key}={spec!r}: give comma-separated temperatures, e.g. "
                      "'1,0.7,0.5,0.3,0' (0 = greedy), or '' (no sweep)") from None
  _require(all(t >= 0 and t == t for t in out),
           f"config.{key}={spec!r}: temperatures must be >= 0 (0 = greedy)")
  return out


def parse_env_specs(spec: str) -> list[tuple[str, dict]]:
  """"name:knob=value,knob=value;name2:..." -> [(name, knobs)]; values are JSON literals where
  they parse (1, 0.2, true), else strings. Empty -> []."""
  out = []
  for part in str(spec or "").split(";"):
    part = part.strip()
    if not part:
      continue
    name, _, knobs = part.partition(":")
    kw = {}
    for item in filter(None, (x.strip() for x in knobs.split(","))):
      k, eq, v = item.partition("=")
      if not eq or not k.strip():
        raise ValueError(f"config.eval.extra_envs={spec!r}: {item!r} is not knob=value; write "
                         "e.g. 'lookup:hops=1,distractor_entities=2;arithmetic:num_ops=2'")
      try:
        kw[k.strip()] = json.loads(v.strip())
      except json.JSONDecodeError:
        kw[k.strip()] = v.strip()
    out.append((name.strip(), kw))
  return out


def _freeze(value):
  """A JSON value made hashable: lists -> tuples, objects -> sorted (key, value) tuples."""
  if isinstance(value, list):
    return tuple(_freeze(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  return value


def _extra_envs(spec: str, _) -> tuple:
  try:
    specs = parse_env_specs(spec)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return tuple((name, _freeze(knobs)) for name, knobs in specs)


def _budget(spec: str, plain: dict) -> Budget:
  per = plain["budget_per"]
  key = "budget_per" if per not in PER_MODES else "budget"
  try:
    return Budget.parse(spec, per=per)
  except BudgetSpecError as e:
    raise ConfigError(f"config.rl.{key}: {e}") from e


def _learner(section, plain: dict) -> LearnerConfig:
  items = section.to_dict() if hasattr(section, "to_dict") else dict(section)
  if "temperature" in items:
    raise ConfigError("config.rl.learner.temperature: set config.rl.temperature instead (the "
                      "learner recomputes log-probs at the rollout temperature)")
  reject_unknown(items, [f.name for f in dataclasses.fields(LearnerConfig)
                         if f.name != "temperature"], "rl.learner")
  try:
    learner = LearnerConfig.from_config({**items, "temperature": plain["temperature"]})
  except ValueError as e:
    raise ConfigError(f"config.rl.learner: {e}") from e
  _learning_rate("rl.learner.learning_rate", learner.learning_rate)
  return learner


def _learning_rate(key: str, lr: float) -> None:
  _require(math.isfinite(lr) and 0 < lr <= 1,
           f"config.{key} must be in (0, 1], got {lr} (a negative rate climbs the loss, a huge one "
           "saturates the policy so every gradient is zero; typical: 1e-5 to 1e-3)")


_SECTION = (ml_collections.ConfigDict, ml_collections.FrozenConfigDict, dict)


# -- per section ------------------------------------------------------------------------------


def _section(config, name: str):
  try:
    return config[name]
  except KeyError:
    raise ConfigError(f"config.{name} is missing; add the section ({_DEFAULTS})") from None


def sft_config(config) -> SFTConfig:
  """config.sft (of the whole run config) as an SFTConfig."""
  return _read(SFTConfig, _section(config, "sft"), "sft")


def rl_config(config) -> RLConfig:
  """config.rl (of the whole run config) as an RLConfig."""
  return _read(RLConfig, _section(config, "rl"), "rl",
               convert={"budget": _Convert(str, _budget),
                        "learner": _Convert(_SECTION, _learner)},
               extra={"budget_per": str})


def eval_config(config) -> EvalConfig:
  """config.eval (of the whole run config) as an EvalConfig."""
  return _read(EvalConfig, _section(config, "eval"), "eval",
               convert={"rerun_budgets": _Convert(str, lambda s, _: tuple(sorted(set(
                   _ints("eval.rerun_budgets", s))))),
                        "curve_ks": _Convert(str, lambda s, _: _ints("eval.curve_ks", s)),
                        "sharpen_temperatures": _Convert(str, lambda s, _: _temperatures(
                            "eval.sharpen_temperatures", s)),
                        "extra_envs": _Convert(str, _extra_envs)})


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """config.model: which weights, in which dtypes, started from where."""
  path: str
  dtype: str
  param_dtype: str
  init_from: str
  allow_nonfinite_weights: bool
  attention: str
  lora: LoraConfig               # from config.model.lora; rank 0 = off

  def __post_init__(self):
    _require(self.attention in ("",) + ATTENTIONS,
             f"config.model.attention must be one of {('',) + ATTENTIONS} (\"\": "
             f"{ATTENTION_ENV}, else auto), got {self.attention!r}")
    _require(bool(self.path), "config.model.path is empty; pass --config.model.path=DIR (a local "
             "Hugging Face directory) or builtin:NAME")
    for key in ("dtype", "param_dtype"):
      value = getattr(self, key)
      _require(value in DTYPES, f"config.model.{key} must be one of {DTYPES}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """config.data: the fixed task splits and the SFT demonstrations."""
  dir: str
  seed: int
  num_train: int
  num_validation: int
  num_test: int
  demo_episodes_per_task: int
  demo_error_rate: float
  demo_recovery_rate: float
  demo_max_turns: int
  demo_max_len: int

  def __post_init__(self):
    for key in ("num_train", "num_validation", "num_test", "demo_episodes_per_task",
                "demo_max_turns", "demo_max_len"):
      value = getattr(self, key)
      _require(value >= 1, f"config.data.{key} must be >= 1, got {value}")
    for key in ("demo_error_rate", "demo_recovery_rate"):
      value = getattr(self, key)
      _require(0 <= value <= 1, f"config.data.{key} must be in [0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  """config.study: the arms of the study, their seeds, and the margins its claims are decided
  with (fixed before the numbers; `jaxagent.eval.claims`)."""
  tight_budget: str
  generous_budget: str
  mix_budget: str
  seeds: int                     # RL seeds per arm (paired across arms)
  base_seeds: int                # SFT bases; RL seed u starts from base u mod base_seeds
  margin_effect: float           # smallest effect of interest (rates, Pass@1)
  margin_non_inferiority: float  # "not worse than" margin (claim 3)
  margin_loglik_nats: float      # claim 4's margin over the seed-to-seed null
  min_seeds: int                 # fewer seeds per arm: every claim inconclusive
  min_tasks: int                 # a statistic resting on fewer tasks: inconclusive
  # More arms at the generous budget with other learner settings (turn-level credit):
  # "name:key=value,key=value;name2:..." over config.rl.learner ("" = none).
  credit_arms: str

  def __post_init__(self):
    self.credit_overrides()          # raises naming the fix
    for key in ("tight_budget", "generous_budget", "mix_budget"):
      try:
        Budget.parse(getattr(self, key))
      except ValueError as e:
        raise ConfigError(f"config.study.{key}: {e}") from e
    for key in ("seeds", "base_seeds", "min_seeds", "min_tasks"):
      _require(getattr(self, key) >= 1, f"config.study.{key} must be >= 1, got "
               f"{getattr(self, key)}")
    for key in ("margin_effect", "margin_non_inferiority", "margin_loglik_nats"):
      _require(getattr(self, key) >= 0, f"config.study.{key} must be >= 0, got "
               f"{getattr(self, key)}")

  def credit_overrides(self) -> dict[str, dict]:
    """{arm name: {learner key: value}} of `credit_arms`; values typed as LearnerConfig's fields
    (checked with the rest of the learner config when the arm's run is validated)."""
    fields = {f.name: type(f.default) for f in dataclasses.fields(LearnerConfig)}
    out: dict[str, dict] = {}
    for part in filter(None, (p.strip() for p in self.credit_arms.split(";"))):
      name, sep, body = part.partition(":")
      name = name.strip()
      _require(sep and name.isidentifier() and not name.startswith("base")
               and name not in ("fixed_tight", "fixed_generous", "budgetmix") and name not in out,
               f"config.study.credit_arms: {part!r} must be 'name:key=value,...' with a new arm "
               "name (an identifier, not base*, fixed_tight, fixed_generous or budgetmix)")
      overrides = {}
      for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        _require(eq and key in fields, f"config.study.credit_arms: {item!r} in arm {name!r} must "
                 f"be key=value with a learner key ({', '.join(sorted(fields))})")
        kind = fields[key]
        try:
          overrides[key] = (value.lower() in ("1", "true") if kind is bool else kind(value))
        except ValueError:
          raise ConfigError(f"config.study.credit_arms: {key}={value!r} in arm {name!r} is not "
                            f"a {kind.__name__}") from None
      _require(overrides, f"config.study.credit_arms: arm {name!r} changes nothing")
      out[name] = overrides
    return out


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """config.guard: when a run that cannot be learning stops (beside the NaN guard)."""
  stall_steps: int            # consecutive steps of the conditions below that stop the run
  loss_explode_factor: float  # SFT: loss above this x the first step's loss

  def __post_init__(self):
    _require(self.stall_steps >= 1, f"config.guard.stall_steps must be >= 1, got "
             f"{self.stall_steps}")
    _require(self.loss_explode_factor > 1, f"config.guard.loss_explode_factor must be > 1, got "
             f"{self.loss_explode_factor}")


@dataclasses.dataclass(frozen=True)
class RunSection:
  """The run config's top-level keys."""
  seed: int
  num_devices: int
  log_every: int
  checkpoint_every: int
  max_to_keep: int
  progress_bar: bool

  def __post_init__(self):
    _require(self.num_devices >= 0, f"config.num_devices must be >= 0 (0: all), got "
             f"{self.num_devices}")
    for key in ("log_every", "checkpoint_every", "max_to_keep"):
      value = getattr(self, key)
      _require(value >= 1, f"config.{key} must be >= 1, got {value}")


DTYPES = ("float32", "bfloat16", "float16")
# The sections of a run config; the typed ones are read by the functions below.
SECTIONS = ("model", "mesh", "env", "data", "sft", "rl", "study", "eval", "guard")


def model_config(config) -> ModelSection:
  return _read(ModelSection, _section(config, "model"), "model",
               convert={"lora": _Convert(_SECTION, lambda s, _: _lora(s))})


def _lora(section) -> LoraConfig:
  """config.model.lora as a LoraConfig: targets a comma-separated string of projection names
  (the rank's bound, the matrices' sizes, is checked when the model is known: `check`)."""
  fields = {"rank": int, "alpha": float, "dropout": float, "targets": str, "base_dtype": str}
  items = dict(section.items())
  reject_unknown(items, list(fields), "model.lora")
  values = {}
  for key, kind in fields.items():
    if key == "base_dtype" and key not in items:   # configs pinned before it existed
      continue
    if key not in items:
      raise ConfigError(f"config.model.lora.{key} is missing; add it to the config ({_DEFAULTS})")
    values[key] = _check("model.lora", key, items[key], kind)
  values["targets"] = tuple(t.strip() for t in values["targets"].split(",") if t.strip())
  try:
    return LoraConfig(**values)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def data_config(config) -> DataConfig:
  return _read(DataConfig, _section(config, "data"), "data")


def study_config(config) -> StudyConfig:
  return _read(StudyConfig, _section(config, "study"), "study")


def guard_config(config) -> GuardConfig:
  return _read(GuardConfig, _section(config, "guard"), "guard")


def run_section(config) -> RunSection:
  """The top-level keys; unknown top-level keys or sections raise (with the nearest key)."""
  fields = [f.name for f in dataclasses.fields(RunSection)]
  reject_unknown(config.keys(), fields + list(SECTIONS), "")
  top = {k: config[k] for k in fields if k in config}
  return _read(RunSection, top, "")


def check_env(config) -> None:
  """config.env.name must name a registered environment or an importable "package.module:Class"
  (`envs.resolve`; its knobs are checked when it is built: an unknown knob raises TypeError from
  the environment's constructor)."""
  name = _section(config, "env").name
  _require(isinstance(name, str), f"config.env.name={name!r} must be a string")
  try:
    envs.resolve(name)
  except ValueError as e:
    raise ConfigError(f"config.env.name={name!r} is not an environment: {e}") from e
  knobs, reserved = getattr(config.env, "difficulty", None) or {}, pipeline_arguments()
  clash = sorted(set(dict(knobs)) & set(reserved))
  _require(not clash,
           f"config.env.difficulty has the knob(s) {', '.join(map(repr, clash))}, which the "
           "task splits and demonstrations take as their own arguments (passed beside the "
           f"environment's knobs: {', '.join(reserved)}); rename the knob in "
           f"{name}'s constructor (e.g. 'db_seed', as envs/sql does, or 'max_moves')")


def pipeline_arguments() -> tuple[str, ...]:
  """The keyword arguments the task-split and demonstration configs take beside an
  environment's difficulty knobs (`data.tasks.task_set_config`, `data.demos.demo_set_config`):
  no knob may share their names."""
  names = set()
  for fn in (task_data.task_set_config, demo_data.demo_set_config):
    names |= {p.name for p in inspect.signature(fn).parameters.values()
              if p.kind == p.KEYWORD_ONLY}
  return tuple(sorted(names))


def validate(config) -> None:
  """Reads every typed section (top-level keys, model, env, data, guard, sft, rl, eval); raises
  the first ConfigError, naming the key, the bad value and the accepted range."""
  run_config(config)


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """config.env: the environment's name (a registered one) and its difficulty knobs, as sorted
  (knob, value) pairs so the section is hashable; `knobs` gives them as a dict."""
  name: str
  difficulty: tuple[tuple[str, Any], ...]

  @property
  def knobs(self) -> dict[str, Any]:
    """The difficulty knobs as keyword arguments of the environment (`envs.make`)."""
    return dict(self.difficulty)


def env_config(config) -> EnvConfig:
  """config.env as an EnvConfig (the name checked by `check_env`)."""
  check_env(config)
  env = config.env
  return EnvConfig(name=env.name, difficulty=tuple(sorted(dict(env.difficulty).items())))


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run config, typed: what training reads, every section read and checked once
  (`run_config`). The raw config stays the run's record (pinned to <workdir>/config.json)."""
  run: RunSection        # the top-level keys: seed, devices, logging, checkpoints
  model: ModelSection
  env: EnvConfig
  data: DataConfig
  guard: GuardConfig
  sft: SFTConfig
  rl: RLConfig
  eval: EvalConfig


def run_config(config) -> RunConfig:
  """Every typed section of `config` (in the order `validate` checks them); raises the first
  ConfigError."""
  run = run_section(config)
  env = env_config(config)
  return RunConfig(run=run, env=env, model=model_config(config), data=data_config(config),
                   guard=guard_config(config), sft=sft_config(config), rl=rl_config(config),
                   eval=eval_config(config))
