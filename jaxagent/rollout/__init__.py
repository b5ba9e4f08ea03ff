"""Sampling, multi-turn rollouts and trajectory scoring."""

from jaxagent.rollout.api import rollout
from jaxagent.rollout.engine import HostRollout, RolloutConfig, make_rollout_fn
from jaxagent.rollout.scoring import score, token_logprobs
from jaxagent.rollout.trajectory import STATUS_NAMES, Status, Trajectory

__all__ = ["HostRollout", "RolloutConfig", "STATUS_NAMES", "Status", "Trajectory",
           "make_rollout_fn", "rollout", "score", "token_logprobs"]
