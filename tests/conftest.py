"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls, a shared tiny tokenizer,
and a persistent XLA compilation cache."""

import json
import os
import pathlib
import tempfile

# Must be set before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Many tests compile the same programs: in-process through new closures (a new update function
# per test), and again in the subprocesses of the launch, study and multi-process tests. JAX's
# persistent cache (keyed by the program, its compile options, the backend and the jax version)
# lets every one after the first load the executable instead of compiling it; the env vars reach
# the xdist workers and every subprocess. A size limit turns on jax's file lock, so concurrent
# workers never read an entry while it is being written.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jaxagent-tests-xla-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _metrics_lines(workdir) -> list[dict]:
  """The rows of `<workdir>/metrics.jsonl`, without their wall-clock `timing` (for comparing two
  runs' metrics exactly)."""
  rows = [json.loads(line) for line in
          (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  for row in rows:
    row.pop("timing")
  return rows


@pytest.fixture(scope="session")
def metrics_lines():
  return _metrics_lines


@pytest.fixture(scope="session")
def builtin_tokenizer():
  from transformers import AutoTokenizer
  from jaxagent.models.builtin import BUILTIN_DIRS
  return AutoTokenizer.from_pretrained(str(BUILTIN_DIRS["tiny"]))


# ---- scheduling on xdist workers ----------------------------------------------------------------
# `make test` runs `-n 2 --dist loadgroup`: a test marked `xdist_group(name)` runs on the worker
# that runs every other test of that group, the rest go one by one to whichever worker is free,
# in collection order.


def _shares_module_state(item) -> bool:
  """The test uses a module- or class-scoped fixture (a trained run, a loaded model, a benchmark
  result): split across two workers, each would build it."""
  info = getattr(item, "_fixtureinfo", None)
  if info is None:
    return False
  return any(d.scope in ("module", "class")
             for defs in info.name2fixturedefs.values() for d in defs)


def pytest_collection_modifyitems(config, items):
  """Keeps each module's shared fixtures on one worker, and hands out the slow end-to-end tests
  first, so the long ones start while the other worker still has short ones to balance with
  (longest first; in collection order, a 4-minute test drawn last leaves one core idle)."""
  for item in items:
    if _shares_module_state(item):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)   # stable: slow first
