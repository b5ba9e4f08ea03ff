"""RL raises a weak policy's success: the training loop (`train.run`) makes a weak base by a
short SFT on noisy-oracle demonstrations of a small grid, then runs a few dozen steps of
multi-turn RL from it; both checkpoints are evaluated on the same 512 episodes (128 random tasks x
4 samples, one seed). A 3x3 map without walls has only ~50 distinct tasks, so the splits hold most
of them and the evaluation draws tasks from the whole space, as training does.

The base imitates its demonstrations' errors (error rate 0.6: malformed calls, unknown tools, bad
arguments, moves off the map) and follows the goal hint only loosely; RL on the success reward,
with a penalty per invalid call, has to find the valid, hinted moves in its own samples.
"""

import pathlib

import jax
import pytest

from configs.default import get_config
from jaxagent.checkpoint import Checkpointer
from jaxagent import train
from jaxagent.runs import layout, setup
from jaxagent.rollout import rollout
from jaxagent.rollout.stats import trajectory_stats

BUDGET = 6
EVAL_SAMPLES = 4


def _config(data_dir):
  c = get_config("default")
  c.num_devices = 1
  c.progress_bar = False
  c.data.dir = str(data_dir)
  # 3x3 maps without walls or traps; starts 2 or more moves from the goal; the hint on.
  c.env.difficulty.update({"size": 3, "wall_density": 0.0, "num_traps": 0, "min_distance": 2})
  c.data.num_train, c.data.num_validation, c.data.num_test = 40, 4, 4
  c.data.demo_episodes_per_task, c.data.demo_error_rate, c.data.demo_recovery_rate = 24, 0.6, 0.5
  c.data.demo_max_turns = BUDGET
  c.sft.steps, c.sft.batch_size, c.sft.learning_rate, c.sft.warmup_steps = 60, 16, 3e-3, 5
  c.rl.steps, c.rl.num_tasks, c.rl.group_size, c.rl.budget = 20, 8, 8, f"fixed:{BUDGET}"
  c.rl.max_action_tokens = 12
  c.rl.learner.update({"learning_rate": 1e-3, "warmup_steps": 0, "kl_coef": 0.05,
                       "aggregation": "sequence", "invalid_call_penalty": 0.1,
                       "minibatches": 1})
  c.checkpoint_every = 100
  return c


def _phase_params(workdir, phase, abstract):
  reader = Checkpointer.reader(pathlib.Path(workdir) / "checkpoints" / phase)
  try:
    return reader.restore_params(reader.latest_step(), abstract)
  finally:
    reader.close()


@pytest.mark.slow
def test_rl_raises_a_weak_policys_success(tmp_path):
  config = _config(tmp_path / "data")
  train.run(config, tmp_path / "run")

  policy = setup.load_policy(config)
  env = setup.make_env(config, policy.tokenizer)
  abstract = layout.abstract_params(policy.params)

  def evaluate(params):
    traj = rollout(policy, env, jax.random.key(123), 128, EVAL_SAMPLES, BUDGET,
                   max_action_tokens=12, params=params)
    stats = jax.device_get(trajectory_stats(traj))
    return float(stats["success_rate"]), float(stats["valid_call_rate"])

  base_success, base_valid = evaluate(_phase_params(tmp_path / "run", "sft", abstract))
  rl_success, rl_valid = evaluate(_phase_params(tmp_path / "run", "rl", abstract))
  print(f"base success {base_success:.3f} valid {base_valid:.3f}; "
        f"rl success {rl_success:.3f} valid {rl_valid:.3f}")
  # 512 episodes each: a rate's standard error is <= 0.02.
  assert base_success < 0.2, "the SFT base should be weak"
  assert rl_success >= base_success + 0.05
  assert rl_success >= 1.4 * base_success
  assert rl_valid >= base_valid + 0.1
