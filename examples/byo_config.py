"""Run configs of the bring-your-own-environment examples: the smoke variant of
configs/default.py with another `config.env` (docs/guides/environments.md).

    python -m launch.train --config=examples/byo_config.py:calc --workdir=/tmp/calc
    python -m launch.study --config=examples/byo_config.py:guess --workdir=/tmp/guess
"""

import ml_collections

from configs import default

ENVS = {
    # name: (config.env.name, config.env.difficulty)
    "calc": ("examples.byo_host_env:CalcEnv", {"max_number": 99}),      # a host tool
    "guess": ("examples.byo_jax_env:GuessEnv", {"size": 256}),          # a JAX environment
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if (arg or "calc") not in ENVS:
    raise ValueError(f"unknown example {arg!r}; use one of {', '.join(ENVS)}")
  c = default.get_config("smoke")
  c.env.name, knobs = ENVS[arg or "calc"]
  c.env.difficulty = ml_collections.ConfigDict(knobs)
  return c
