"""Device mesh and logical-axis sharding rules.

The mesh has three named axes: `data` (batch of episodes), `fsdp` (batch, and parameters /
optimizer state sharded ZeRO-3 style) and `tensor` (Megatron-style heads / MLP split). Parameters
carry logical axis names (see `jaxagent.models.decoder.logical_axes`); `RULES` maps each logical
name to mesh axes. A mesh axis that does not divide a dimension is dropped for that dimension
(the array is replicated along it) rather than failing, so tiny test models run on 8 devices.

Batches (episodes) follow the `batch` rule, over (data, fsdp). The rollout and the update run
their programs under `mesh_context(mesh)`, in which the decoder calls `constrain_batch` on its
activations so that they stay split over the batch axes (ZeRO-3: weights are gathered per layer).
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, Sequence

import jax
from jax.experimental import mesh_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (tried in order; each mesh axis used at most once per array).
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("layers", ()),
    ("length", ()),
)


def mesh_sizes(shape: Mapping[str, int] | Sequence[int] | None, num_devices: int) -> dict[str, int]:
  """{axis: size} for a mesh of `num_devices` devices (the checks of `make_mesh`, no devices
  needed): `shape` as a dict or a 3-tuple, one size may be -1 (the rest of the devices);
  default all devices on `fsdp`. Raises ValueError naming the fix."""
  if shape is None:
    shape = {"data": 1, "fsdp": -1, "tensor": 1}
  if not isinstance(shape, Mapping):
    if len(shape) != len(MESH_AXES):
      raise ValueError(f"mesh shape {tuple(shape)}: give {len(MESH_AXES)} sizes, one for each "
                       f"of {MESH_AXES}, or a dict such as {{'fsdp': -1, 'tensor': 2}}")
    shape = dict(zip(MESH_AXES, shape))
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh axes {sorted(unknown)} unknown; use {MESH_AXES}")
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {dict(shape)}: at most one axis may be -1")
  if -1 in sizes:
    rest = math.prod(s for s in sizes if s != -1)
    sizes[sizes.index(-1)] = num_devices // rest
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices} are available; change the mesh config so the product "
                     "of axis sizes equals the device count (or use -1 for one axis)")
  return dict(zip(MESH_AXES, sizes))


def make_mesh(shape: Mapping[str, int] | Sequence[int] | None = None, devices=None) -> Mesh:
  """A mesh over `devices` (default: all) with axes (data, fsdp, tensor).

  `shape` gives the size of each axis, as a dict or a 3-tuple; one size may be -1 (the rest of
  the devices). Default: all devices on `fsdp`.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = list(mesh_sizes(shape, len(devices)).values())
  try:
    dev = mesh_utils.create_device_mesh(sizes, devices)
  except Exception:  # CPU or uneven topologies: plain reshape
    dev = np.asarray(devices).reshape(sizes)
  return Mesh(dev, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=RULES) -> P:
  """PartitionSpec for an array with the given logical axes and shape."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape):
    chosen = []
    size = 1
    for mesh_axis in table.get(name, ()) if name is not None else ():
      n = mesh.shape[mesh_axis]
      if mesh_axis in used or n == 1 or dim % (size * n):
        continue
      chosen.append(mesh_axis)
      size *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)



def local_elements(axes, shape, mesh) -> int:
  """Elements of a global `shape` with logical `axes` held by one device under the rules
  (the memory planner's unit: `logical_to_spec` picks the mesh axes that divide it)."""
  spec = logical_to_spec(axes, shape, mesh)
  div = 1
  for entry in spec:
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if name is not None:
        div *= mesh.shape[name]
  return math.prod(shape) // div

def tree_shardings(axes_tree, shapes_tree, mesh: Mesh, rules=RULES):
  """NamedSharding for every leaf, from parallel trees of logical axes and shapes."""
  return jax.tree.map(
      lambda axes, s: NamedSharding(mesh, logical_to_spec(axes, s.shape, mesh, rules)),
      axes_tree, shapes_tree, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int | None = None) -> NamedSharding:
  """Leading axis over (data, fsdp) where it divides; the rest replicated."""
  spec = logical_to_spec(("batch",) + (None,) * (ndim - 1),
                         (batch_size if batch_size is not None else mesh.size,) + (1,) * (ndim - 1),
                         mesh)
  return NamedSharding(mesh, spec)


def mesh_context(mesh: Mesh | None):
  """A context in which `mesh` is the ambient mesh of traced code (`jax.set_mesh`), so the
  decoder can keep activations split over the batch axes; a no-op context for None."""
  if mesh is None:
    return contextlib.nullcontext()
  setter = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
  return setter(mesh) if setter is not None else contextlib.nullcontext()


def constrain_batch(x):
  """Under an ambient mesh with this project's axes (see `mesh_context`), constrains x [B, ...]
  to the `batch` rule: rows over (data, fsdp) where B divides. Otherwise x unchanged. Without
  it, XLA may resolve the clash of a batch split over fsdp with weights split over fsdp by
  un-splitting the batch (every device then computing every row)."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get() if get is not None else None
  if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return x
  spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, spec)
