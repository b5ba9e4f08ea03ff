"""Multi-turn rollouts (one compiled program per batch of episodes), the typed interaction
budget, trajectories and their statistics. Sampling and scoring live with the model
(`jaxagent.models.sampler`, `jaxagent.models.scoring`)."""

from jaxagent.rollout.api import Rollouts, rollout
from jaxagent.rollout.budget import Budget, BudgetSpecError
from jaxagent.rollout.engine import HostRollout, RolloutConfig, make_rollout_fn
from jaxagent.rollout.trajectory import STATUS_NAMES, Status, Trajectory

__all__ = ["Budget", "BudgetSpecError", "HostRollout", "RolloutConfig", "Rollouts",
           "STATUS_NAMES", "Status", "Trajectory", "make_rollout_fn", "rollout"]
