"""Config-override checks that run before absl parses the flags.

`--config.rl.nonexistent=1` would otherwise fail inside ml_collections' flag parser with a long
chained traceback that ends in `AttributeError: 'nonexistent'`. `check_config_overrides` loads the
config file itself, walks every `--config.a.b.c` override, and exits with one line that names the
unknown key and the nearest real one.
"""

from __future__ import annotations

import runpy
import sys

import ml_collections

from jaxagent.runs.config import nearest_key


def _load(spec: str):
  path, _, arg = spec.partition(":")
  return runpy.run_path(path)["get_config"](arg or None)


def unknown_override(config, dotted: str) -> str | None:
  """The error message for override key `dotted` (e.g. "rl.nonexistent") if it names no key of
  `config`, else None."""
  node, walked = config, "config"
  for part in dotted.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)):
      return f"{walked} is a value, not a section: --{walked}.{part}... names no key"
    keys = list(node.keys())
    if part not in keys:
      near = nearest_key(part, keys)
      hint = f" (did you mean --{walked}.{near}?)" if near else ""
      return (f"--{walked}.{part}: no such key in the config{hint}; the keys of {walked} are: "
              f"{', '.join(keys)}")
    node, walked = node[part], f"{walked}.{part}"
  return None


def check_config_overrides(argv: list[str], default_spec: str | None = None) -> None:
  """Exits (status 2, one line on stderr) when an override names no key of the config file
  given by --config (or `default_spec`). Leaves every other problem to absl's own parsing."""
  spec = default_spec
  for a in argv[1:]:
    if a.startswith("--config="):
      spec = a.split("=", 1)[1]
  if not spec:
    return
  try:
    config = _load(spec)
  except Exception:   # absl reports a config file that does not load, with its own message
    return
  for a in argv[1:]:
    if a.startswith("--config."):
      message = unknown_override(config, a[len("--config."):].split("=", 1)[0])
      if message:
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)
