"""The model fingerprint: a short hash of a model config's architecture, saved in every
checkpoint's meta so that a run refuses a workdir holding a checkpoint of another model.

    meta[FINGERPRINT_KEY] = model_fingerprint(model_cfg)    # saved with each checkpoint
    ckpt.check_compatible(model_fingerprint(model_cfg))      # before any compute
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

from jaxagent.checkpoint.errors import IncompatibleCheckpointError

# Meta key under which the trainer stores `model_fingerprint(model_config)`.
FINGERPRINT_KEY = "model_fingerprint"

# Fields of a model config that do not change which checkpoints it can load: dtypes (a checkpoint
# restores into any dtype), token ids (tokenizer-side) and the init seed (a checkpoint replaces
# the initial weights).
NON_ARCHITECTURE_FIELDS = frozenset(
    {"dtype", "param_dtype", "eos_token_ids", "pad_token_id", "bos_token_id", "init_seed"})


def _canonical(value: Any) -> Any:
  """JSON-able canonical form: tuples as lists, dataclasses as dicts, other objects by repr."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): _canonical(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_canonical(v) for v in value]
  if value is None or isinstance(value, (bool, int, str)):
    return value
  return repr(value)   # floats too: exact, and independent of json's float formatting


def model_fingerprint(model_config: Any,
                      exclude: frozenset[str] = NON_ARCHITECTURE_FIELDS) -> str:
  """A short hex hash of the architecture-defining fields of a model config dataclass.

  Hashes the class name and every top-level field not in `exclude` (nested dataclasses, tuples
  and dicts included), so two configs share a fingerprint exactly when a checkpoint of one loads
  into the other: `ModelConfig`'s dtypes, token ids and init seed are excluded by default.

  Raises:
    TypeError: `model_config` is not a dataclass instance.
  """
  if not dataclasses.is_dataclass(model_config) or isinstance(model_config, type):
    raise TypeError(f"model_fingerprint needs a dataclass instance (e.g. ModelConfig), got "
                    f"{type(model_config).__name__}; pass the model's config object")
  fields = {f.name: _canonical(getattr(model_config, f.name))
            for f in dataclasses.fields(model_config) if f.name not in exclude}
  blob = json.dumps({"class": type(model_config).__name__, "fields": fields}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_fingerprint(directory: Any, step: int, meta: Mapping[str, Any],
                      fingerprint: str) -> None:
  """Raises `IncompatibleCheckpointError` unless the meta of checkpoint `step` in `directory`
  holds `fingerprint` under `FINGERPRINT_KEY`."""
  saved = meta.get(FINGERPRINT_KEY)
  if saved != fingerprint:
    raise IncompatibleCheckpointError(
        f"{directory} holds a checkpoint (step {step}) of another model: saved "
        f"{FINGERPRINT_KEY} {saved!r}, this run's model {fingerprint!r}. This workdir holds a "
        "checkpoint of another model: use a new --workdir or the matching model")
