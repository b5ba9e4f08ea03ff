"""The policy model (Flax NNX decoder for Qwen2/2.5, Qwen3, Llama 3.x) and HF checkpoint I/O."""

from jaxagent.models.config import CheckpointError, ModelConfig
from jaxagent.models.policy import Policy, from_pretrained, init_sharded, param_shardings

__all__ = ["CheckpointError", "ModelConfig", "Policy", "from_pretrained", "init_sharded",
           "param_shardings"]
