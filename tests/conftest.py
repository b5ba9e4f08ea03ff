"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls, a shared tiny tokenizer."""

import os

# Must be set before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def builtin_tokenizer():
  from transformers import AutoTokenizer
  from jaxagent.models.builtin import BUILTIN_DIRS
  return AutoTokenizer.from_pretrained(str(BUILTIN_DIRS["tiny"]))
