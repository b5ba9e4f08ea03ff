"""Training checkpoints (orbax): async save, resume, restore onto another mesh, restore params only
for evaluation, model fingerprints, fallback past damaged checkpoints, failed saves that stop the
run, and a preemption guard.

See `jaxagent.checkpoint.manager` for the on-disk layout (and the modules beside it: `damage`,
`saving`, `fingerprint`, `trees`, `errors`) and `jaxagent.checkpoint.preemption` for the SIGTERM
protocol.
"""

from jaxagent.checkpoint.errors import (CheckpointDamagedError, CheckpointMismatchError,
                                        CheckpointSaveError, IncompatibleCheckpointError)
from jaxagent.checkpoint.fingerprint import FINGERPRINT_KEY, model_fingerprint
from jaxagent.checkpoint.manager import Checkpointer
from jaxagent.checkpoint.preemption import PreemptionGuard

__all__ = ["FINGERPRINT_KEY", "CheckpointDamagedError", "CheckpointMismatchError",
           "CheckpointSaveError", "Checkpointer", "IncompatibleCheckpointError", "PreemptionGuard",
           "model_fingerprint"]
