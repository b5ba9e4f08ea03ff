"""Mesh from config (axes data, fsdp, tensor) and logical-axis sharding rules."""

from jaxagent.sharding.mesh import (MESH_AXES, RULES, batch_sharding, logical_to_spec, make_mesh,
                                    mesh_sizes, tree_shardings)

__all__ = ["MESH_AXES", "RULES", "batch_sharding", "logical_to_spec", "make_mesh", "mesh_sizes",
           "tree_shardings"]
