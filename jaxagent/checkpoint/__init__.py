"""Training checkpoints (orbax): async save, resume, restore onto another mesh, restore params only
for evaluation, model fingerprints, and a preemption guard.

See `jaxagent.checkpoint.manager` for the on-disk layout and `jaxagent.checkpoint.preemption` for
the SIGTERM protocol.
"""

from jaxagent.checkpoint.manager import (FINGERPRINT_KEY, CheckpointMismatchError, Checkpointer,
                                         IncompatibleCheckpointError, model_fingerprint)
from jaxagent.checkpoint.preemption import PreemptionGuard

__all__ = ["FINGERPRINT_KEY", "CheckpointMismatchError", "Checkpointer",
           "IncompatibleCheckpointError", "PreemptionGuard", "model_fingerprint"]
