"""Training checkpoints: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

One checkpoint per step directory, holding three orbax items:

    <workdir>/<step>/state/      the train-state pytree (params, optimizer state, step, RNG, ...)
    <workdir>/<step>/meta/       JSON dict: data position, seeds, phase, model fingerprint, config
    <workdir>/<step>/prng_keys/  JSON {leaf path: PRNG impl name} for typed PRNG-key leaves

    ckpt = Checkpointer(workdir, max_to_keep=3, save_interval_steps=100)
    ckpt.check_compatible(model_fingerprint(model_cfg))      # before any compute
    if ckpt.latest_step() is not None:
      state = ckpt.restore(abstract_state=jax.eval_shape(make_state))  # with .sharding set
      meta = ckpt.restore_meta()
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

Typed PRNG keys (`jax.random.key`) are stored as their `jax.random.key_data` (uint32) with the
impl name beside them, and wrapped back on restore, so keys round-trip on any orbax version and
the stored arrays are plain integers any tool can read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, SingleDeviceSharding

PyTree = Any

STATE_ITEM = "state"
META_ITEM = "meta"
KEYS_ITEM = "prng_keys"
# Meta key under which the trainer stores `model_fingerprint(model_config)`.
FINGERPRINT_KEY = "model_fingerprint"

# Fields of a model config that do not change which checkpoints it can load: dtypes (a checkpoint
# restores into any dtype), token ids (tokenizer-side) and the init seed (a checkpoint replaces
# the initial weights).
NON_ARCHITECTURE_FIELDS = frozenset(
    {"dtype", "param_dtype", "eos_token_ids", "pad_token_id", "bos_token_id", "init_seed"})


class CheckpointMismatchError(ValueError):
  """A checkpoint that does not fit what the caller asked for; the message names the fix."""


class IncompatibleCheckpointError(CheckpointMismatchError):
  """The workdir holds a checkpoint of another model."""


# ---------------------------------------------------------------------------------------------
# Model fingerprint


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
  if isinstance(value, float):
    return repr(value)   # exact, and independent of json's float formatting
  return repr(value)


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


# ---------------------------------------------------------------------------------------------
# Typed PRNG keys <-> key data


def _is_prng_key(leaf: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def _path_str(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path))


def _keys_to_data(tree: PyTree) -> tuple[PyTree, dict[str, str]]:
  """Replaces each typed PRNG-key array by its key data; returns {leaf path: impl name}."""
  impls: dict[str, str] = {}

  def convert(path, leaf):
    if _is_prng_key(leaf):
      impls[_path_str(path)] = str(jax.random.key_impl(leaf))
      return jax.random.key_data(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(convert, tree), impls


def _key_data_sharding(sharding: Any) -> Any:
  """The sharding of a key array's data: the key's, with the trailing key dims replicated."""
  if sharding is None or isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
    return sharding   # a NamedSharding spec shorter than the rank replicates the rest
  raise TypeError(f"cannot place PRNG key data for a key with sharding {type(sharding).__name__}; "
                  "give PRNG-key leaves a NamedSharding or SingleDeviceSharding")


def _abstract_keys_to_data(abstract: PyTree) -> PyTree:
  """Abstract tree with each abstract PRNG-key leaf replaced by its key data's abstract array."""
  def convert(leaf):
    if not _is_prng_key(leaf):
      return leaf
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype,
                                sharding=_key_data_sharding(getattr(leaf, "sharding", None)))
  return jax.tree.map(convert, abstract)


def _data_to_keys(restored: PyTree, abstract: PyTree, impls: Mapping[str, str],
                  prefix: Sequence[Any] = ()) -> PyTree:
  """Wraps key data back into typed keys where `abstract` has a PRNG-key leaf."""
  def convert(path, leaf, abs_leaf):
    if not _is_prng_key(abs_leaf):
      return leaf
    name = _path_str(tuple(prefix) + tuple(path))
    if name not in impls:
      raise CheckpointMismatchError(
          f"state{name} is a PRNG key in the requested state but was saved as a plain array; "
          "restore it as the saved uint32 array (jax.random.wrap_key_data) or fix the state "
          "structure")
    key = jax.random.wrap_key_data(leaf, impl=impls[name])
    if key.dtype != abs_leaf.dtype:
      raise CheckpointMismatchError(
          f"state{name}: saved PRNG impl {impls[name]!r} gives {key.dtype}, requested "
          f"{abs_leaf.dtype}; use the saved PRNG impl (jax_default_prng_impl)")
    return key
  return jax.tree_util.tree_map_with_path(convert, restored, abstract)


# ---------------------------------------------------------------------------------------------
# Checkpointer


def _as_path(directory: str | os.PathLike) -> epath.Path:
  """Absolute local paths (orbax needs them); URLs such as gs://bucket/dir unchanged."""
  text = os.fspath(directory)
  if "://" in text:
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def _leaf_paths(tree: PyTree) -> list[tuple[str, ...]]:
  """Leaf paths with dict keys, attribute names and indices alike (orbax stores NamedTuples as
  dicts and tuples as lists, so only the names are comparable)."""
  def name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return [tuple(name(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _check_placed(abstract: PyTree, what: str) -> None:
  """Every `ShapeDtypeStruct` leaf must say where it goes (orbax would return numpy otherwise)."""
  unplaced = [jax.tree_util.keystr(path)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
              if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None]
  if unplaced:
    raise ValueError(
        f"{what}: leaves {unplaced[:5]}{' ...' if len(unplaced) > 5 else ''} are "
        "ShapeDtypeStructs without a sharding; attach one, e.g. jax.ShapeDtypeStruct(shape, "
        "dtype, sharding=NamedSharding(mesh, P())) for a replicated leaf")


def _pytree_restore(target: PyTree, partial: bool = False) -> ocp.args.PyTreeRestore:
  """Restore args placing every leaf as its abstract leaf (`ShapeDtypeStruct.sharding`) says."""
  return ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=partial)


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

  @classmethod
  def reader(cls, directory: str | os.PathLike) -> "Checkpointer":
    """A read-only Checkpointer (for evaluation jobs); call `reload()` to see new steps."""
    return cls(directory, max_to_keep=None, save_interval_steps=1, async_save=False,
               read_only=True)

  # -- listing ------------------------------------------------------------------------------

  def latest_step(self) -> int | None:
    """The newest step, or None. Includes a save this process started and has not finished
    (every restore waits for it); never a step whose writing process died."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All kept steps, ascending (same caveat as `latest_step`)."""
    return sorted(self._manager.all_steps())

  def reload(self) -> None:
    """Re-reads the step list from storage (another process may have saved since)."""
    self._manager.reload()

  # -- saving -------------------------------------------------------------------------------

  def save(self, step: int, state_pytree: PyTree, meta: Mapping[str, Any],
           force: bool = False) -> bool:
    """Saves `state_pytree` and the JSON dict `meta` as checkpoint `step` (async).

    Writes only when `step % save_interval_steps == 0` or `force` (the preemption save), and
    never twice for one step. The arrays are copied to host memory before this returns, so the
    caller may donate or overwrite them afterwards. Put `model_fingerprint(model_config)` in
    `meta[FINGERPRINT_KEY]` so that `check_compatible` can guard a reused workdir.

    Returns:
      whether a checkpoint was started.
    Raises:
      TypeError: `meta` is not JSON-serialisable (raised before anything is written).
      ValueError: `step` is older than the newest checkpoint (a run that did not resume).
    """
    if self.read_only:
      raise PermissionError(f"{self.directory} was opened read-only (Checkpointer.reader); "
                            "open it with Checkpointer(...) to save")
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
    state, impls = _keys_to_data(state_pytree)
    return self._manager.save(
        step, force=True,   # the interval decision is made above
        args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(state),
                                   META_ITEM: ocp.args.JsonSave(meta),
                                   KEYS_ITEM: ocp.args.JsonSave(impls)}))

  def wait_until_finished(self) -> None:
    """Blocks until the pending async save is committed; re-raises its error if it failed."""
    self._manager.wait_until_finished()
    self._manager.check_for_errors()

  def close(self) -> None:
    """Waits for the pending save and releases orbax's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restoring ----------------------------------------------------------------------------

  def _resolve_step(self, step: int | None) -> int:
    self._manager.wait_until_finished()   # a step this process is still writing
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

  def restore_meta(self, step: int | None = None) -> dict:
    """The JSON meta dict saved with `step` (default: the latest)."""
    step = self._resolve_step(step)
    return dict(self._restore_items(step, **{META_ITEM: ocp.args.JsonRestore()})[META_ITEM])

  def _prng_impls(self, step: int) -> dict[str, str]:
    return dict(self._restore_items(step, **{KEYS_ITEM: ocp.args.JsonRestore()})[KEYS_ITEM])

  def restore(self, step: int | None = None, *, abstract_state: PyTree) -> PyTree:
    """Restores the full state of `step` (default: the latest) onto the given shardings.

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
    """
    _check_placed(abstract_state, "abstract_state")
    step = self._resolve_step(step)
    impls = self._prng_impls(step)
    target = _abstract_keys_to_data(abstract_state)
    try:
      restored = self._restore_items(step, **{STATE_ITEM: _pytree_restore(target)})
    except ValueError as e:
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} does not match the requested state: {e}\n"
          "The state's structure or shapes changed since it was saved (model, optimizer or "
          "config); restore with the config it was saved with, or use a new --workdir") from e
    return _data_to_keys(restored[STATE_ITEM], abstract_state, impls)

  def restore_params(self, step: int | None, abstract_params: PyTree,
                     key_path: Sequence[str] = ("params",)) -> PyTree:
    """Restores only the subtree at `key_path` of the saved state (evaluation jobs).

    Orbax's partial restore reads only the requested leaves: the optimizer state and everything
    else is never read, so this costs the parameters' bytes only.

    Args:
      step: the checkpoint step, None for the latest.
      abstract_params: the subtree's structure with `jax.ShapeDtypeStruct`s (with shardings).
      key_path: the dict keys from the state's root to the subtree.
    """
    if not key_path or not all(isinstance(k, str) for k in key_path):
      raise TypeError(f"key_path={key_path!r}: give the dict keys from the state's root to the "
                      "params, e.g. ('params',)")
    _check_placed(abstract_params, "abstract_params")
    step = self._resolve_step(step)
    self._check_subtree(step, key_path, abstract_params)
    # A target holding only the subtree; partial_restore reads nothing else.
    target: Any = _abstract_keys_to_data(abstract_params)
    for k in reversed(key_path):
      target = {k: target}
    try:
      restored = self._restore_items(step, **{STATE_ITEM: _pytree_restore(target, partial=True)})
    except (ValueError, KeyError) as e:
      where = "".join(f"[{k!r}]" for k in key_path)
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step}: cannot restore state{where} as requested: {e}\n"
          "Fix key_path, or load with the model config the run was trained with") from e
    sub = restored[STATE_ITEM]
    for k in key_path:
      sub = sub[k]
    impls = self._prng_impls(step)
    prefix = [jax.tree_util.DictKey(k) for k in key_path]
    return _data_to_keys(sub, abstract_params, impls, prefix=prefix)

  def _check_subtree(self, step: int, key_path: Sequence[str], abstract: PyTree) -> None:
    """Raises unless the saved subtree at `key_path` has exactly the leaves of `abstract`
    (partial restore would silently hand back missing leaves as their abstract values)."""
    saved = self._manager.item_metadata(step)[STATE_ITEM]
    node = getattr(saved, "tree", saved)
    where = "state"
    for k in key_path:
      if not isinstance(node, Mapping) or k not in node:
        have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
        raise CheckpointMismatchError(
            f"checkpoint {self.directory}/{step} has no {where}[{k!r}] (it has {have}); "
            "fix key_path")
      node, where = node[k], f"{where}[{k!r}]"
    saved_paths = set(_leaf_paths(node))
    wanted = set(_leaf_paths(abstract))
    if saved_paths != wanted:
      missing, extra = sorted(wanted - saved_paths), sorted(saved_paths - wanted)
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step}: {where} does not match the requested params "
          f"(not in the checkpoint: {missing[:5]}, not requested: {extra[:5]}); load with the "
          "model config the run was trained with")

  # -- compatibility ------------------------------------------------------------------------

  def check_compatible(self, fingerprint: str) -> int | None:
    """Raises unless the latest checkpoint (if any) was saved for the model `fingerprint`.

    Call it before any compute. Returns the latest step (None for an empty directory).

    Raises:
      IncompatibleCheckpointError: the latest checkpoint's meta holds another (or no)
        `model_fingerprint`.
    """
    step = self.latest_step()
    if step is None:
      return None
    saved = self.restore_meta(step).get(FINGERPRINT_KEY)
    if saved != fingerprint:
      raise IncompatibleCheckpointError(
          f"{self.directory} holds a checkpoint (step {step}) of another model: saved "
          f"{FINGERPRINT_KEY} {saved!r}, this run's model {fingerprint!r}. This workdir holds a "
          "checkpoint of another model: use a new --workdir or the matching model")
    return step
