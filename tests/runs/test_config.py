"""Typed config sections (jaxagent.runs.config): configs/default.py's sections build and carry its
values; unknown, missing and wrongly typed keys, bad specs and out-of-range values raise a
ConfigError naming the full key."""

import dataclasses

import ml_collections
import pytest

from configs import default, hf, smollm2
from jaxagent.learners.update import LearnerConfig
from jaxagent.rollout.budget import Budget
from jaxagent.runs import config as rc
from jaxagent.runs.config import ConfigError


def test_default_sections_carry_the_config_values():
  c = default.get_config()
  sft = rc.sft_config(c)
  assert sft == rc.SFTConfig(steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=10,
                             weight_decay=0.0, max_grad_norm=1.0)
  rl = rc.rl_config(c)
  assert (rl.steps, rl.num_tasks, rl.group_size) == (20, 8, 8)
  assert rl.budget == Budget.parse("fixed:8", per="batch")
  assert rl.budget.max_turns == 8 and rl.budget.arm == "fixed"
  assert rl.budget_visible is False and rl.reference_on_host is False
  assert rl.max_action_tokens == 0
  assert isinstance(rl.temperature, float) and rl.learner.temperature == rl.temperature
  assert rl.learner == LearnerConfig.from_config({**c.rl.learner.to_dict(), "temperature": 1.0})
  assert (rl.learner.kl_coef, rl.learner.clip_eps_high, rl.learner.minibatches) == (0.05, 0.28, 2)
  ev = rc.eval_config(c)
  assert ev.budgets == tuple(range(1, 9)) and ev.budget_visible is False
  assert ev.rerun_budgets == (2, 4, 6, 8) and ev.curve_ks == (1, 2, 4, 8)
  assert ev.extra_envs == () and ev.env_specs() == []
  # one field per key of c.eval, each carrying the config's value (specs parsed)
  assert sorted(f.name for f in dataclasses.fields(rc.EvalConfig)) == sorted(c.eval.keys())
  assert ev.sharpen_temperatures == (1.0, 0.7, 0.5, 0.3, 0.0)
  parsed = {"rerun_budgets", "curve_ks", "extra_envs", "sharpen_temperatures"}
  assert {k: getattr(ev, k) for k in c.eval if k not in parsed} == {
      k: v for k, v in c.eval.items() if k not in parsed}
  # hashable: usable as a cache key of compiled programs
  assert len({sft, rl, ev, rc.eval_config(default.get_config())}) == 3
  rc.validate(c)


def test_rerun_mode_budgets_and_visibility():
  c = default.get_config()
  c.eval.mode, c.eval.rerun_budgets = "rerun", "2,4"
  ev = rc.eval_config(c)
  # The default follows the default training (budget hidden).
  assert ev.budgets == (2, 4) and ev.budget_visible is False
  c.eval.rerun_budget_visible = True
  assert rc.eval_config(c).budget_visible is True
  # Budgets are sorted and unique: every consumer may take the last as T_max.
  c.eval.rerun_budgets = "8,2,4,4"
  assert rc.eval_config(c).budgets == (2, 4, 8)


def test_study_section():
  c = default.get_config()
  st = rc.study_config(c)
  assert st.seeds == 3 and st.min_seeds == 2 and st.margin_non_inferiority == 0.05
  c.study.seeds = 0
  with pytest.raises(rc.ConfigError, match=r"config\.study\.seeds must be >= 1"):
    rc.study_config(c)
  c.study.seeds, c.study.mix_budget = 2, "mix:"
  with pytest.raises(rc.ConfigError, match=r"config\.study\.mix_budget"):
    rc.study_config(c)
  c.study.mix_budget = "mix:2,4"
  c.study.margins = 1
  with pytest.raises(rc.ConfigError, match="unknown key"):
    rc.study_config(c)


@pytest.mark.parametrize("variant", ["quick", "smoke"])
def test_variants_build(variant):
  c = default.get_config(variant)
  rc.validate(c)
  rc.study_config(c)
  assert rc.rl_config(c).budget.spec == c.rl.budget
  assert rc.eval_config(c).max_turns == c.eval.max_turns


@pytest.mark.parametrize("variant", ["cpu", "gpu", "lora"])
def test_smollm2_variants_build(variant):
  c = smollm2.get_config(variant)
  rc.validate(c)
  st = rc.study_config(c)
  # The built-in default's environment and budgets (the two studies side by side), >= 2 seeds.
  assert c.model.path == "builtin:smollm2-135m" and c.env.name == "grid"
  assert (st.tight_budget, st.generous_budget, st.mix_budget) == (
      "fixed:4", "fixed:8", "mix:3,4,6,8")
  assert st.seeds >= 2
  assert rc.run_config(c).model.lora.enabled == (variant == "lora")
  with pytest.raises(ValueError, match="use cpu, gpu or lora"):
    smollm2.get_config("tpu")


def test_smoke_values():
  c = default.get_config("smoke")
  rl, ev = rc.rl_config(c), rc.eval_config(c)
  assert rl.budget.arm == "mix" and rl.budget.support == (1, 2) and rl.budget.max_turns == 2
  assert ev.budgets == (1, 2, 3, 4) and ev.rerun_budgets == (2, 3, 4) and ev.curve_ks == (1, 2, 4)


@pytest.mark.parametrize("variant", sorted(hf.VARIANTS))
def test_hf_variants_build(variant):
  c = hf.get_config(variant)
  with pytest.raises(rc.ConfigError, match=r"config\.model\.path is empty; pass --config"):
    rc.validate(c)                       # the variant's checkpoint directory is the user's to give
  c.model.path = "/models/" + hf.VARIANTS[variant][0]
  rc.validate(c)
  assert rc.rl_config(c).learner.minibatches == hf.VARIANTS[variant][3]


def _bad(mutate, match):
  c = default.get_config()
  with c.unlocked():
    mutate(c)
  with pytest.raises(ConfigError, match=match):
    rc.validate(c)


def test_unknown_key():
  _bad(lambda c: setattr(c.rl, "nonexistent", 1),
       r"config\.rl: unknown key\(s\) config\.rl\.nonexistent; valid")
  _bad(lambda c: setattr(c.sft, "stpes", 1),
       r"config\.sft: unknown key.*config\.sft\.stpes \(did you mean config\.sft\.steps\?\); "
       r"valid keys: steps")
  _bad(lambda c: setattr(c.eval, "turns", 1), r"config\.eval: unknown key")


def test_missing_key():
  def drop(section, key):
    return lambda c: delattr(c[section], key)
  _bad(drop("sft", "steps"), r"config\.sft\.steps is missing; add it.*configs/default\.py")
  _bad(drop("rl", "budget_per"), r"config\.rl\.budget_per is missing")
  _bad(drop("rl", "learner"), r"config\.rl\.learner is missing")
  _bad(drop("eval", "curve_ks"), r"config\.eval\.curve_ks is missing")
  c = default.get_config()
  del c["eval"]
  with pytest.raises(ConfigError, match=r"config\.eval is missing"):
    rc.eval_config(c)


def test_wrong_types():
  def put(section, key, value):
    return lambda c: setattr(c[section], key, value)
  # ConfigDict itself refuses some changes of type (int -> str); a mapping reaches the reader.
  d = {**default.get_config().sft.to_dict(), "steps": "10"}
  with pytest.raises(ConfigError, match=r"config\.sft\.steps must be an int, got '10'"):
    rc._read(rc.SFTConfig, d, "sft")
  c = default.get_config()
  with c.sft.ignore_type():
    c.sft.steps = "10"
  with pytest.raises(ConfigError, match=r"config\.sft\.steps must be an int, got '10'"):
    rc.sft_config(c)
  with c.rl.ignore_type():
    c.rl.budget_visible = 1
  with pytest.raises(ConfigError, match=r"config\.rl\.budget_visible must be a bool, got 1"):
    rc.rl_config(c)
  with c.eval.ignore_type():
    c.eval.num_samples = True
  with pytest.raises(ConfigError, match=r"config\.eval\.num_samples must be an int, got True"):
    rc.eval_config(c)
  # float accepts an int (as a float); str and tuple specs must be strings
  c = default.get_config()
  with c.sft.ignore_type():
    c.sft.learning_rate = 1
  assert rc.sft_config(c).learning_rate == 1.0 and isinstance(rc.sft_config(c).learning_rate,
                                                              float)
  with c.eval.ignore_type():
    c.eval.rerun_budgets = 4
  with pytest.raises(ConfigError, match=r"config\.eval\.rerun_budgets must be a str, got 4"):
    rc.eval_config(c)
  with c.rl.ignore_type():
    c.rl.learner = "grpo"
  with pytest.raises(ConfigError, match=r"config\.rl\.learner must be a ConfigDict"):
    rc.rl_config(c)


def test_bad_budget():
  _bad(lambda c: setattr(c.rl, "budget", "mix:"),
       r"config\.rl\.budget: budget spec 'mix:'.*valid forms: 'fixed:T'")
  _bad(lambda c: setattr(c.rl, "budget_per", "task"), r"config\.rl\.budget_per: .*'group'")


def test_bad_learner():
  _bad(lambda c: setattr(c.rl.learner, "kl_coeff", 0.1),
       r"config\.rl\.learner: unknown key\(s\) config\.rl\.learner\.kl_coeff \(did you mean "
       r"config\.rl\.learner\.kl_coef\?\)")
  _bad(lambda c: setattr(c.rl.learner, "loss", "ppo"), r"config\.rl\.learner: .*unknown loss")
  _bad(lambda c: setattr(c.rl.learner, "temperature", 0.5),
       r"config\.rl\.learner\.temperature: set config\.rl\.temperature")


def test_out_of_range():
  _bad(lambda c: setattr(c.eval, "rerun_budgets", "2,4,9"),
       r"config\.eval\.rerun_budgets='2,4,9'.*config\.eval\.max_turns=8")
  _bad(lambda c: setattr(c.eval, "rerun_budgets", "2,x"), r"config\.eval\.rerun_budgets=.*integers")
  _bad(lambda c: setattr(c.eval, "mode", "x"),
       r"config\.eval\.mode='x': use 'truncation' or 'rerun'")
  _bad(lambda c: setattr(c.eval, "phase", "base"), r"config\.eval\.phase='base'")
  _bad(lambda c: setattr(c.eval, "confidence", 1.0), r"config\.eval\.confidence")
  _bad(lambda c: setattr(c.eval, "score_batch", 0), r"config\.eval\.score_batch must be >= 1")
  _bad(lambda c: setattr(c.eval, "num_bootstrap", 0), r"config\.eval\.num_bootstrap")
  _bad(lambda c: setattr(c.eval, "max_turns", 0), r"config\.eval\.max_turns must be >= 1")
  _bad(lambda c: setattr(c.sft, "batch_size", 0), r"config\.sft\.batch_size must be >= 1")
  _bad(lambda c: setattr(c.sft, "steps", -1), r"config\.sft\.steps must be >= 0")
  _bad(lambda c: setattr(c.rl, "group_size", 0), r"config\.rl\.group_size must be >= 1")
  _bad(lambda c: setattr(c.rl, "temperature", -1.0), r"config\.rl\.temperature must be >= 0")


def test_extra_envs():
  c = default.get_config()
  c.eval.extra_envs = "lookup:hops=1,distractor_entities=2; grid:hint=true,size=4,name=x"
  ev = rc.eval_config(c)
  assert ev.extra_envs == (("lookup", (("distractor_entities", 2), ("hops", 1))),
                           ("grid", (("hint", True), ("name", "x"), ("size", 4))))
  assert ev.knobs(1) == {"size": 4, "hint": True, "name": "x"}
  assert ev.env_specs()[0] == ("lookup", {"hops": 1, "distractor_entities": 2})
  hash(ev)
  c.eval.extra_envs = "grid:size"
  with pytest.raises(ConfigError, match=r"config\.eval\.extra_envs='grid:size'.*knob=value"):
    rc.eval_config(c)


def test_parse_env_specs():
  assert rc.parse_env_specs("") == []
  assert rc.parse_env_specs("grid:size=4,hint=true; lookup") == [
      ("grid", {"size": 4, "hint": True}), ("lookup", {})]
  with pytest.raises(ValueError, match="is not knob=value"):
    rc.parse_env_specs("grid:size")


def test_read_a_plain_mapping():
  section = {"steps": 1, "batch_size": 2, "learning_rate": 0.1, "warmup_steps": 0,
             "weight_decay": 0.0, "max_grad_norm": 0.0}
  assert rc._read(rc.SFTConfig, section, "sft") == rc.SFTConfig(**section)
  assert rc._read(rc.SFTConfig, ml_collections.FrozenConfigDict(section), "sft").steps == 1


def test_run_config_holds_every_typed_section():
  c = default.get_config("smoke")
  with c.unlocked():
    c.env.name = "lookup"
    c.env.difficulty = ml_collections.ConfigDict({"hops": 1, "distractor_entities": 2})
  run = rc.run_config(c)
  assert run.env == rc.EnvConfig("lookup", (("distractor_entities", 2), ("hops", 1)))
  assert run.env.knobs == {"hops": 1, "distractor_entities": 2}
  assert (run.run, run.model, run.data, run.guard) == (
      rc.run_section(c), rc.model_config(c), rc.data_config(c), rc.guard_config(c))
  assert (run.sft, run.rl, run.eval) == (rc.sft_config(c), rc.rl_config(c), rc.eval_config(c))
  hash(run)                                   # frozen sections: usable as a cache key
  with c.unlocked():
    c.env.name = "chess"
  with pytest.raises(ConfigError, match="config.env.name='chess' is not an environment"):
    rc.run_config(c)


def test_a_knob_named_like_a_pipeline_argument_is_refused_before_any_compute():
  """The task splits and demonstrations take seed=, max_turns=, ... beside the environment's
  knobs: a knob of the same name would be a bare TypeError deep in the data pipeline."""
  assert {"seed", "task_seed", "num_train", "max_turns", "max_len", "error_rate"} <= set(
      rc.pipeline_arguments())
  c = default.get_config("smoke")
  c.env.difficulty.update({"seed": 3, "max_turns": 9})
  with pytest.raises(ConfigError, match=r"knob\(s\) 'max_turns', 'seed'.*rename the knob"):
    rc.run_config(c)


def test_lora_section():
  from jaxagent.models.lora import LoraConfig
  assert rc.model_config(default.get_config()).lora == LoraConfig(
      rank=0, alpha=16.0, dropout=0.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
  c = default.get_config()
  c.model.lora.rank, c.model.lora.targets = 8, "q_proj, v_proj,down_proj"
  assert rc.model_config(c).lora.targets == ("q_proj", "v_proj", "down_proj")
  assert rc.model_config(c).lora.scale == 2.0
  _bad(lambda c: setattr(c.model.lora, "rank", -2), r"config\.model\.lora\.rank must be 0")
  _bad(lambda c: setattr(c.model.lora, "alpha", -1.0), r"config\.model\.lora\.alpha must be > 0")
  _bad(lambda c: setattr(c.model.lora, "dropout", 1.0),
       r"config\.model\.lora\.dropout must be in \[0, 1\)")
  _bad(lambda c: setattr(c.model.lora, "targets", "q_proj,query"),
       r"config\.model\.lora\.targets='q_proj,query': unknown \['query'\]; valid names: q_proj, "
       r"k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
  _bad(lambda c: setattr(c.model.lora, "ranks", 4),
       r"config\.model\.lora: unknown key.*did you mean config\.model\.lora\.rank")
  _bad(lambda c: delattr(c.model.lora, "alpha"), r"config\.model\.lora\.alpha is missing")
