"""jaxagent: multi-turn RL for LLM agents in JAX/Flax, and Pass@(K,T) evaluation."""

__version__ = "0.1.0"
