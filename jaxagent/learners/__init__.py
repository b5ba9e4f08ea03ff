"""Learners: rewards, advantage estimators and policy losses (registered by name), the RL update.

    from jaxagent import learners
    cfg = learners.LearnerConfig.from_config({"advantage": "grpo", "loss": "ppo_clip"})
    update = learners.make_update_fn(cfg, policy.config, cfg.make_optimizer())
"""

from jaxagent.learners.credit import (TURN_ADVANTAGE_ESTIMATORS, compute_turn_advantages,
                                      register_turn_advantage, turn_rewards)
from jaxagent.learners.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages,
                                          register_advantage)
from jaxagent.learners.losses import (KL_ESTIMATORS, POLICY_LOSSES, aggregate, policy_loss,
                                      register_policy_loss)
from jaxagent.learners.rewards import episode_rewards, equal_group_mask
from jaxagent.learners.update import (LearnerConfig, TrainState, current_learning_rate,
                                      init_train_state, make_optimizer, make_update_fn)

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LearnerConfig", "POLICY_LOSSES",
           "TURN_ADVANTAGE_ESTIMATORS", "TrainState", "aggregate", "compute_advantages",
           "compute_turn_advantages", "current_learning_rate", "register_turn_advantage",
           "turn_rewards",
           "episode_rewards", "equal_group_mask", "init_train_state", "make_optimizer",
           "make_update_fn", "policy_loss", "register_advantage", "register_policy_loss"]
