"""The pytrees a checkpoint stores and restores: typed PRNG keys as key data, the placement every
abstract leaf must carry, and what differs between a saved tree and a requested one.

Typed PRNG keys (`jax.random.key`) are stored as their `jax.random.key_data` (uint32) with the
impl name beside them, and wrapped back on restore, so keys round-trip on any orbax version and
the stored arrays are plain integers any tool can read.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding

from jaxagent.checkpoint.errors import CheckpointMismatchError

PyTree = Any

# ---------------------------------------------------------------------------------------------
# Typed PRNG keys <-> key data


def _is_prng_key(leaf: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def _path_str(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path))


def keys_to_data(tree: PyTree) -> tuple[PyTree, dict[str, str]]:
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


def abstract_keys_to_data(abstract: PyTree) -> PyTree:
  """Abstract tree with each abstract PRNG-key leaf replaced by its key data's abstract array."""
  def convert(leaf):
    if not _is_prng_key(leaf):
      return leaf
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype,
                                sharding=_key_data_sharding(getattr(leaf, "sharding", None)))
  return jax.tree.map(convert, abstract)


def data_to_keys(restored: PyTree, abstract: PyTree, impls: Mapping[str, str],
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
# Placement and restore args


def check_placed(abstract: PyTree, what: str) -> None:
  """Every `ShapeDtypeStruct` leaf must say where it goes (orbax would return numpy otherwise)."""
  unplaced = [jax.tree_util.keystr(path)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
              if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None]
  if unplaced:
    raise ValueError(
        f"{what}: leaves {unplaced[:5]}{' ...' if len(unplaced) > 5 else ''} are "
        "ShapeDtypeStructs without a sharding; attach one, e.g. jax.ShapeDtypeStruct(shape, "
        "dtype, sharding=NamedSharding(mesh, P())) for a replicated leaf")


def pytree_restore(target: PyTree, partial: bool = False) -> ocp.args.PyTreeRestore:
  """Restore args placing every leaf as its abstract leaf (`ShapeDtypeStruct.sharding`) says."""
  return ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=partial)


# ---------------------------------------------------------------------------------------------
# Saved vs requested structure


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


def _leaf_shapes(tree: PyTree) -> dict[tuple[str, ...], tuple[int, ...] | None]:
  """{leaf path (as `_leaf_paths`): shape or None} of an abstract or metadata tree."""
  shapes = []
  for _, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", None)
    if shape is None and isinstance(leaf, (bool, int, float, complex)):
      shape = ()
    shapes.append(None if shape is None else tuple(shape))
  return dict(zip(_leaf_paths(tree), shapes))


def structure_diff(saved: PyTree, wanted: PyTree) -> str:
  """"" when `saved` (orbax metadata) has exactly the leaves and shapes of `wanted`, else what
  differs."""
  have, want = _leaf_shapes(saved), _leaf_shapes(wanted)
  missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
  if missing or extra:
    return f"not in the checkpoint: {missing[:5]}, not requested: {extra[:5]}"
  shapes = [(k, have[k], want[k]) for k in sorted(want)
            if have[k] is not None and want[k] is not None and have[k] != want[k]]
  if shapes:
    return "shapes differ (leaf, saved, requested): " + ", ".join(map(str, shapes[:5]))
  return ""


def check_subtree(saved: PyTree, key_path: Sequence[str], abstract: PyTree,
                  checkpoint: str) -> None:
  """Raises `CheckpointMismatchError` unless the subtree at `key_path` of `saved` (the state tree
  metadata of `checkpoint`, "<directory>/<step>") has exactly the leaves (and shapes) of
  `abstract` (partial restore would silently hand back missing leaves as their abstract values)."""
  node = saved
  where = "state"
  for k in key_path:
    if not isinstance(node, Mapping) or k not in node:
      have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise CheckpointMismatchError(
          f"checkpoint {checkpoint} has no {where}[{k!r}] (it has {have}); fix key_path")
    node, where = node[k], f"{where}[{k!r}]"
  if diff := structure_diff(node, abstract_keys_to_data(abstract)):
    raise CheckpointMismatchError(
        f"checkpoint {checkpoint}: {where} does not match the requested params ({diff}); load "
        "with the model config the run was trained with")
