"""Training checkpoints: `Checkpointer`, a thin wrapper over `orbax.checkpoint.CheckpointManager`.

One checkpoint per step directory, holding three orbax items:

    <workdir>/<step>/state/      the train-state pytree (params, optimizer state, step, RNG, ...)
    <workdir>/<step>/meta/       JSON dict: data position, seeds, phase, model fingerprint, config
    <workdir>/<step>/prng_keys/  JSON {leaf path: PRNG impl name} for typed PRNG-key leaves

    ckpt = Checkpointer(workdir, max_to_keep=3, save_interval_steps=100)
    ckpt.check_compatible(model_fingerprint(model_cfg))      # before any compute
    restored, step = ckpt.restore_latest(abstract_state)     # ShapeDtypeStructs with .sharding
    if step is not None:
      meta = ckpt.restore_meta(step)
    ...
    ckpt.save(step, state, meta)          # async; returns as soon as arrays are on the host
    ckpt.close()                          # waits for the last save

Atomicity is orbax's: a step is written under `<step>.orbax-checkpoint-tmp` and renamed (on
object stores: a commit file is written) only when every item is complete, so a step whose writer
died is never listed by `latest_step()`; writers remove such leftovers when they open the
directory, readers (`Checkpointer.reader`) leave them alone because a live writer may own them.

Restoring takes an abstract pytree of `jax.ShapeDtypeStruct`s whose `.sharding` says where each
array goes, so a checkpoint saved on one mesh (or host count) restores onto another: each process
reads only the shards its devices need.

`latest_step()` comes from the directory listing alone (a step directory is only listed once its
save committed), so "is this phase finished?" (`latest_step() >= total_steps`) is answered without
reading, or being stopped by, a damaged last checkpoint.

The rest lives beside this module: `fingerprint` (the model fingerprint), `trees` (typed PRNG keys
stored as key data; saved vs requested structure), `damage` (damaged checkpoints: skipped by
`restore_latest`, renamed `<step>.damaged`), `saving` (failed saves: `CheckpointSaveError`, no
temporary directory left) and `errors` (the exceptions).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Sequence

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxagent.checkpoint.damage import damage_raised, move_aside, quiet_orbax_leftovers
from jaxagent.checkpoint.errors import (CheckpointDamagedError, CheckpointMismatchError,
                                        CheckpointSaveError, IncompatibleCheckpointError, os_errno)
from jaxagent.checkpoint.fingerprint import FINGERPRINT_KEY, check_fingerprint, model_fingerprint
from jaxagent.checkpoint.saving import SaveTracker
from jaxagent.checkpoint.trees import (PyTree, abstract_keys_to_data, check_placed, check_subtree,
                                       data_to_keys, keys_to_data, pytree_restore, structure_diff)

__all__ = ["FINGERPRINT_KEY", "CheckpointDamagedError", "CheckpointMismatchError",
           "CheckpointSaveError", "Checkpointer", "IncompatibleCheckpointError",
           "model_fingerprint"]

log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
KEYS_ITEM = "prng_keys"


def _as_path(directory: str | os.PathLike) -> epath.Path:
  """Absolute local paths (orbax needs them); URLs such as gs://bucket/dir unchanged."""
  text = os.fspath(directory)
  if "://" in text:
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


class Checkpointer:
  """Saves and restores train states under one directory, async, keeping the newest few.

  Every call must be made by all processes of a multi-host job (orbax synchronises them and
  writes each shard from the process that holds it, metadata from the primary process).

  Args:
    directory: the checkpoint root (e.g. `<workdir>/checkpoints`); created if missing.
    max_to_keep: how many of the newest checkpoints to keep (older ones are deleted).
    save_interval_steps: `save(step, ...)` writes only when `step % save_interval_steps == 0`,
      unless `force=True`.
    async_save: write in a background thread; `save` returns once arrays are copied to host.
    read_only: never write or delete (evaluation jobs reading a live training directory); use
      `Checkpointer.reader(directory)`.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None,
               save_interval_steps: int, async_save: bool = True, read_only: bool = False):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep}: keep at least 1 checkpoint (or None: all)")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps={save_interval_steps}: must be >= 1")
    self.directory = _as_path(directory)
    self.save_interval_steps = save_interval_steps
    self.read_only = read_only
    if read_only and not self.directory.exists():
      raise FileNotFoundError(f"no checkpoint directory {self.directory}; point the job at the "
                              "training run's checkpoint directory (its --workdir)")
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(save_interval_steps),
        preservation_policy=policies.LatestN(n=max_to_keep),   # None: keep all
        enable_async_checkpointing=async_save,
        # A writer owns the directory, so tmp dirs left by a dead writer are garbage; a reader
        # must not touch them (the writer may be alive).
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        # PyTreeCheckpointHandler (what StandardCheckpointHandler wraps, same files) because it
        # supports partial restore, which `restore_params` needs.
        item_handlers={STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                       META_ITEM: ocp.JsonCheckpointHandler(),
                       KEYS_ITEM: ocp.JsonCheckpointHandler()})
    self._saves = SaveTracker(self._manager, self.directory)

  @classmethod
  def reader(cls, directory: str | os.PathLike) -> "Checkpointer":
    """A read-only Checkpointer (for evaluation jobs); call `reload()` to see new steps."""
    return cls(directory, max_to_keep=None, save_interval_steps=1, async_save=False,
               read_only=True)

  # -- listing ------------------------------------------------------------------------------

  def latest_step(self) -> int | None:
    """The newest step, or None. Includes a save this process started and has not finished
    (every restore waits for it); never a step whose writing process died.

    Comes from the directory listing alone and reads no checkpoint contents, so it is the step
    count to decide whether a phase is finished (`latest_step() >= total_steps`) even when that
    checkpoint is damaged; the state itself then comes from `restore_latest` /
    `restore_params_latest`, which may fall back to an older step.
    """
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All kept steps, ascending (same caveat as `latest_step`)."""
    return sorted(self._manager.all_steps())

  def reload(self) -> None:
    """Re-reads the step list from storage (another process may have saved since)."""
    self._manager.reload()

  def damage(self, step: int) -> str | None:
    """Why checkpoint `step` is damaged, or None if all its metadata reads.

    Reads the meta and PRNG-key JSON and the state's tree metadata (which opens every array's
    metadata in the OCDBT index), not the array data: a truncated or missing data file shows
    only when restoring. Cheap enough to call for each step of a listing.
    """
    step = self._resolve_step(step)
    try:
      self.restore_meta(step)
      self._prng_impls(step)
      self._saved_state_tree(step)
    except CheckpointDamagedError as e:
      return e.reasons[step]
    return None

  def latest_intact_step(self) -> int | None:
    """The newest step whose metadata reads (`damage(step)` is None), or None.

    Logs a warning for each newer step it passes over. Evaluation can resolve a step with it;
    `restore_params_latest` goes further and also falls back when array data is damaged.
    """
    for step in reversed(self.all_steps()):
      why = self.damage(step)
      if why is None:
        return step
      log.warning("%s: checkpoint step %d is damaged, skipping it: %s", self.directory, step, why)
    return None

  # -- saving -------------------------------------------------------------------------------

  def save(self, step: int, state_pytree: PyTree, meta: Mapping[str, Any],
           force: bool = False) -> bool:
    """Saves `state_pytree` and the JSON dict `meta` as checkpoint `step` (async).

    Writes only when `step % save_interval_steps == 0` or `force` (the preemption save), and
    never twice for one step. The arrays are copied to host memory before this returns, so the
    caller may donate or overwrite them afterwards. Put `model_fingerprint(model_config)` in
    `meta[FINGERPRINT_KEY]` so that `check_compatible` can guard a reused workdir.

    Call it every step (it returns False between intervals): each call also checks, without
    blocking, whether the previous background save failed, so a failure stops the run within a
    step of happening.

    Returns:
      whether a checkpoint was started.
    Raises:
      CheckpointSaveError: this save cannot be written (the directory is not writable or its disk
        is full: checked before anything is started), or the previous async save failed. Every
        later `save` raises it again.
      TypeError: `meta` is not JSON-serialisable (raised before anything is written).
      ValueError: `step` is older than the newest checkpoint (a run that did not resume).
    """
    if self.read_only:
      raise PermissionError(f"{self.directory} was opened read-only (Checkpointer.reader); "
                            "open it with Checkpointer(...) to save")
    self._saves.check(block=False)
    try:
      meta = json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint meta must be JSON (str/int/float/bool/None, lists, dicts "
                      f"with str keys): {e}; convert the offending value (e.g. config.to_dict(), "
                      "int(np_scalar))") from e
    step = int(step)
    if not force and step % self.save_interval_steps:
      return False
    latest = self.latest_step()
    if step in self._manager.all_steps():
      return False
    if latest is not None and step < latest:
      raise ValueError(
          f"cannot save step {step}: {self.directory} already holds step {latest}. A run on this "
          "workdir must resume from its latest checkpoint (Checkpointer.restore); to start over "
          "use a new --workdir")
    self._saves.check(block=True)   # orbax waits for the previous save anyway
    self._saves.probe(step)
    state, impls = keys_to_data(state_pytree)
    try:
      started = self._manager.save(
          step, force=True,   # the interval decision is made above
          args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(state),
                                     META_ITEM: ocp.args.JsonSave(meta),
                                     KEYS_ITEM: ocp.args.JsonSave(impls)}))
    except Exception as e:  # pylint: disable=broad-except
      if os_errno(e) is None:
        raise                 # not a storage failure (e.g. an unsupported leaf type)
      self._saves.fail(step, e)
    if started:
      self._saves.pending_step = step
    return started

  def wait_until_finished(self) -> None:
    """Blocks until the pending async save is committed.

    Raises:
      CheckpointSaveError: that save (or an earlier one) failed.
    """
    self._saves.check(block=True)

  def close(self) -> None:
    """Waits for the pending save and releases orbax's threads.

    Raises:
      CheckpointSaveError: the pending save failed (not raised again if a call already did).
    """
    try:
      if self._saves.failure is None:
        self._saves.check(block=True)
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        if self._saves.failure is None:
          raise
        # orbax re-raises the failure it already reported; nothing is left to wait for.
        log.debug("closing %s after a failed save", self.directory, exc_info=True)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restoring ----------------------------------------------------------------------------

  def _resolve_step(self, step: int | None) -> int:
    self._saves.check(block=True)   # a step this process is still writing
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint in {self.directory}; train first or point at "
                                "the run's checkpoint directory")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                              f"available steps: {steps}")
    return int(step)

  def _restore_items(self, step: int, **args: Any) -> Any:
    return self._manager.restore(step, args=ocp.args.Composite(**args))

  def _read_json(self, step: int, item: str) -> dict:
    with damage_raised(self.directory, step, item):
      value = self._restore_items(step, **{item: ocp.args.JsonRestore()})[item]
    if not isinstance(value, Mapping):
      raise CheckpointDamagedError(self.directory, {
          step: f"{item}: holds {type(value).__name__}, not a JSON object"})
    return dict(value)

  def restore_meta(self, step: int | None = None) -> dict:
    """The JSON meta dict saved with `step` (default: the latest).

    Raises:
      CheckpointDamagedError: the meta file is missing or garbled.
    """
    return self._read_json(self._resolve_step(step), META_ITEM)

  def _prng_impls(self, step: int) -> dict[str, str]:
    return self._read_json(step, KEYS_ITEM)

  def _saved_state_tree(self, step: int) -> PyTree:
    """The saved state's tree of orbax leaf metadata (shapes, dtypes)."""
    with damage_raised(self.directory, step, STATE_ITEM):
      saved = self._manager.item_metadata(step)[STATE_ITEM]
    tree = getattr(saved, "tree", saved)
    if not isinstance(tree, Mapping):
      raise CheckpointDamagedError(self.directory, {
          step: f"{STATE_ITEM}: its tree metadata (_METADATA) is missing or unreadable"})
    return tree

  def restore(self, step: int | None = None, *, abstract_state: PyTree) -> PyTree:
    """Restores the full state of `step` (default: the latest) onto the given shardings.

    No fallback: `restore_latest` skips damaged checkpoints.

    Args:
      abstract_state: the state's structure with a `jax.ShapeDtypeStruct` carrying a
        `.sharding` at every array leaf, e.g. `jax.eval_shape(init_state)` with shardings
        attached (a Python scalar leaf restores as a Python scalar). The mesh may differ from
        the one the checkpoint was saved with.
    Returns:
      the state, each leaf placed as its abstract leaf says; PRNG keys typed again.
    Raises:
      FileNotFoundError: no such checkpoint (the message lists what exists).
      ValueError: an abstract leaf has no sharding.
      CheckpointMismatchError: the saved state has another structure or shapes.
      CheckpointDamagedError: the checkpoint's files are missing, truncated or garbled.
    """
    check_placed(abstract_state, "abstract_state")
    step = self._resolve_step(step)
    impls = self._prng_impls(step)
    target = abstract_keys_to_data(abstract_state)
    if diff := structure_diff(self._saved_state_tree(step), target):
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} does not match the requested state: {diff}\n"
          "The state's structure or shapes changed since it was saved (model, optimizer or "
          "config); restore with the config it was saved with, or use a new --workdir")
    try:
      with damage_raised(self.directory, step, STATE_ITEM):
        restored = self._restore_items(step, **{STATE_ITEM: pytree_restore(target)})
    except ValueError as e:
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} cannot be restored as requested: {e}\n"
          "Restore with the config it was saved with, or use a new --workdir") from e
    return data_to_keys(restored[STATE_ITEM], abstract_state, impls)

  def restore_params(self, step: int | None, abstract_params: PyTree,
                     key_path: Sequence[str] = ("params",)) -> PyTree:
    """Restores only the subtree at `key_path` of the saved state (evaluation jobs).

    Orbax's partial restore reads only the requested leaves: the optimizer state and everything
    else is never read, so this costs the parameters' bytes only. No fallback:
    `restore_params_latest` skips damaged checkpoints.

    Args:
      step: the checkpoint step, None for the latest.
      abstract_params: the subtree's structure with `jax.ShapeDtypeStruct`s (with shardings).
      key_path: the dict keys from the state's root to the subtree.
    Raises:
      CheckpointMismatchError: the saved subtree has other leaves or shapes.
      CheckpointDamagedError: the checkpoint's files are missing, truncated or garbled.
    """
    if not key_path or not all(isinstance(k, str) for k in key_path):
      raise TypeError(f"key_path={key_path!r}: give the dict keys from the state's root to the "
                      "params, e.g. ('params',)")
    check_placed(abstract_params, "abstract_params")
    step = self._resolve_step(step)
    impls = self._prng_impls(step)
    check_subtree(self._saved_state_tree(step), key_path, abstract_params,
                  f"{self.directory}/{step}")
    # A target holding only the subtree; partial_restore reads nothing else.
    target: Any = abstract_keys_to_data(abstract_params)
    for k in reversed(key_path):
      target = {k: target}
    try:
      with damage_raised(self.directory, step, STATE_ITEM):
        restored = self._restore_items(
            step, **{STATE_ITEM: pytree_restore(target, partial=True)})
    except ValueError as e:
      where = "".join(f"[{k!r}]" for k in key_path)
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step}: cannot restore state{where} as requested: {e}\n"
          "Fix key_path, or load with the model config the run was trained with") from e
    sub = restored[STATE_ITEM]
    for k in key_path:
      sub = sub[k]
    prefix = [jax.tree_util.DictKey(k) for k in key_path]
    return data_to_keys(sub, abstract_params, impls, prefix=prefix)

  # -- restoring the newest intact checkpoint -----------------------------------------------

  def _newest_intact(self, load, fingerprint: str | None) -> tuple[Any, int | None, dict]:
    """Calls `load(step)` from the newest step down until one is not damaged.

    Returns (value, step, {damaged step: reason}); (None, None, {}) for an empty directory.
    Mismatches (`CheckpointMismatchError`, including another model's fingerprint) propagate.
    """
    self._saves.check(block=True)
    steps = self.all_steps()
    damaged: dict[int, str] = {}
    for i, step in enumerate(reversed(steps)):
      with quiet_orbax_leftovers():
        try:
          if fingerprint is not None:
            check_fingerprint(self.directory, step, self.restore_meta(step), fingerprint)
          else:
            self.restore_meta(step)      # part of an intact checkpoint (data position, seeds)
          value = load(step)
        except CheckpointDamagedError as e:
          damaged[step] = e.reasons[step]
          older = steps[len(steps) - 2 - i] if i + 1 < len(steps) else None
          log.warning("%s: checkpoint step %d is damaged, skipping it%s: %s", self.directory,
                      step, f" and trying step {older}" if older is not None else "",
                      damaged[step])
          continue
      return value, step, damaged
    if damaged:
      raise CheckpointDamagedError(self.directory, damaged, every=True)
    return None, None, {}

  def restore_latest(self, abstract_state: PyTree, *,
                     fingerprint: str | None = None) -> tuple[PyTree, int] | tuple[None, None]:
    """Restores the newest intact checkpoint: `(state, step)`, or `(None, None)` if there is none.

    Tries the newest step first; one whose files are missing, truncated or garbled (see
    `CheckpointDamagedError`) is skipped with a warning naming the step and the reason, and the
    next older one is tried. A writer (not `reader`) then renames each skipped step directory to
    `<step>.damaged` (kept for inspection; no longer listed), so training can write those steps
    again: delete them once no longer needed.

    Args:
      abstract_state: as for `restore`.
      fingerprint: if given, each candidate's meta must hold this `model_fingerprint`.
    Raises:
      CheckpointDamagedError: every kept checkpoint is damaged (the message lists each step and
        why).
      CheckpointMismatchError: a readable checkpoint has another structure or shapes; not
        treated as damage (an older one would not fit either).
      IncompatibleCheckpointError: `fingerprint` given and a readable checkpoint has another.
    """
    check_placed(abstract_state, "abstract_state")
    state, step, damaged = self._newest_intact(
        lambda s: self.restore(s, abstract_state=abstract_state), fingerprint)
    if damaged and not self.read_only:
      self._quarantine(sorted(damaged))
    return state, step

  def restore_params_latest(
      self, abstract_params: PyTree, key_path: Sequence[str] = ("params",), *,
      fingerprint: str | None = None) -> tuple[PyTree, int] | tuple[None, None]:
    """`restore_params` of the newest intact checkpoint: `(params, step)`, or `(None, None)`.

    Skips damaged steps like `restore_latest` (warning for each), but never renames anything:
    safe for readers of a live training directory.

    Raises:
      CheckpointDamagedError: every kept checkpoint is damaged.
      CheckpointMismatchError / IncompatibleCheckpointError: as for `restore_latest`.
    """
    params, step, _ = self._newest_intact(
        lambda s: self.restore_params(s, abstract_params, key_path), fingerprint)
    return params, step

  def _quarantine(self, steps: Sequence[int]) -> None:
    """Renames damaged step directories to `<step>.damaged` (the primary process does it)."""
    if jax.process_index() == 0:
      for step in steps:
        target = move_aside(self.directory, step)
        log.warning("%s: moved damaged checkpoint step %d to %s; delete it once you no longer "
                    "need it", self.directory, step, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxagent_checkpoint_quarantine_{steps[-1]}")
    self._manager.reload()

  # -- compatibility ------------------------------------------------------------------------

  def check_compatible(self, fingerprint: str) -> int | None:
    """Raises unless the newest readable checkpoint (if any) was saved for the model
    `fingerprint`.

    Call it before any compute. A step whose meta is damaged is skipped with a warning (the
    fingerprint is read from the next older one; if none is readable, nothing can be checked and
    the restore will report the damage). Returns the latest step (None for an empty directory),
    as `latest_step()`.

    Raises:
      IncompatibleCheckpointError: that checkpoint's meta holds another (or no)
        `model_fingerprint`.
    """
    latest = self.latest_step()
    for step in reversed(self.all_steps()):
      try:
        meta = self.restore_meta(step)
      except CheckpointDamagedError as e:
        log.warning("%s: checkpoint step %d is damaged, reading the model fingerprint from an "
                    "older step: %s", self.directory, step, e.reasons[step])
        continue
      check_fingerprint(self.directory, step, meta, fingerprint)
      break
    return latest
