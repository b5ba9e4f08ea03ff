"""Sharding on 8 fake CPU devices: the mesh, the logical-axis rules, parameters loaded already
sharded, and sharded computation equal to the unsharded one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxagent.models import decoder, from_pretrained
from jaxagent.models.config import ModelConfig
from jaxagent.models.policy import Policy
from jaxagent.sharding import make_mesh
from jaxagent.sharding.mesh import batch_sharding, logical_to_spec

# Untied, with qkv biases; kv_heads = 2 does not divide tensor = 4 (that axis must fall back to
# replication), everything else divides both meshes below.
CFG = ModelConfig(
    model_type="qwen2", vocab_size=720, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=True, qk_norm=False, max_position_embeddings=128,
    pad_token_id=0)


def test_eight_fake_devices():
  assert jax.device_count() == 8


# ---------------------------------------------------------------------------------------------
# make_mesh and the rules.

def test_make_mesh_shapes():
  assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  assert dict(make_mesh((1, 2, 4)).shape) == {"data": 1, "fsdp": 2, "tensor": 4}
  assert dict(make_mesh({"fsdp": 4, "tensor": -1}).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert dict(make_mesh({"data": 2, "fsdp": -1}).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  one = make_mesh(devices=jax.devices()[:1])
  assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert make_mesh((1, 2, 4)).axis_names == ("data", "fsdp", "tensor")


@pytest.mark.parametrize("shape, needle", [
    ({"fsdp": 3, "tensor": 2}, "needs 6 devices, but 8 are available"),
    ({"fsdp": -1, "tensor": 3}, "needs 6 devices, but 8 are available"),
    ((2, 2, 4), "needs 16 devices"),
    ({"fsdp": -1, "tensor": -1}, "at most one axis may be -1"),
    ({"model": 8}, "mesh axes ['model'] unknown"),
    ((1, 1, 2, 4), "3 sizes"),
    ((8,), "3 sizes"),
])
def test_make_mesh_rejects_bad_shapes(shape, needle):
  with pytest.raises(ValueError) as info:
    make_mesh(shape)
  assert needle in str(info.value)


def test_logical_to_spec_rules():
  mesh = make_mesh({"fsdp": 2, "tensor": 4})
  assert logical_to_spec(("vocab", "embed"), (720, 64), mesh) == P("tensor", "fsdp")
  # kv_heads = 2 is not divisible by tensor = 4: replicated along that axis.
  assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == \
      P("fsdp", None, None)
  # A mesh axis is used at most once per array.
  assert logical_to_spec(("embed", "embed"), (64, 64), mesh) == P("fsdp", None)
  assert logical_to_spec((None, "mlp"), (3, 96), mesh) == P(None, "tensor")
  # Batch goes over (data, fsdp) where it divides.
  mesh2 = make_mesh({"data": 2, "fsdp": 4})
  assert logical_to_spec(("batch",), (16,), mesh2) == P(("data", "fsdp"))
  assert logical_to_spec(("batch",), (6,), mesh2) == P("data")
  assert batch_sharding(mesh, 2, batch_size=8).spec == P("fsdp", None)


# ---------------------------------------------------------------------------------------------
# A checkpoint loaded onto a mesh.

@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, builtin_tokenizer):
  """A random model of CFG exported to a Hugging Face directory (read back tensor by tensor)."""
  rng = np.random.RandomState(0)
  _, shapes = decoder.abstract_params(CFG)
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  leaves = [jnp.asarray(("norm" in jax.tree_util.keystr(p)) + rng.normal(size=s.shape) * 0.2,
                        jnp.float32) for p, s in flat]
  params = jax.tree.unflatten(jax.tree.structure(shapes), leaves)
  path = tmp_path_factory.mktemp("sharding_ckpt")
  Policy(config=CFG, params=params, tokenizer=builtin_tokenizer).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def unsharded(ckpt_dir):
  return from_pretrained(ckpt_dir)


# mesh shape -> {param path: (expected spec, expected shape of one device's shard)}
EXPECTED = {
    (2, 4): {
        ("embed",): (P("tensor", "fsdp"), (180, 32)),
        ("lm_head",): (P("fsdp", "tensor"), (32, 180)),
        ("final_norm",): (P("fsdp"), (32,)),
        ("layers", "q_proj"): (P(None, "fsdp", "tensor", None), (2, 32, 1, 16)),
        ("layers", "k_proj"): (P(None, "fsdp", None, None), (2, 32, 2, 16)),
        ("layers", "k_bias"): (P(None, None, None), (2, 2, 16)),
        ("layers", "o_proj"): (P(None, "tensor", None, "fsdp"), (2, 1, 16, 32)),
        ("layers", "gate_proj"): (P(None, "fsdp", "tensor"), (2, 32, 24)),
        ("layers", "down_proj"): (P(None, "tensor", "fsdp"), (2, 24, 32)),
    },
    (4, 2): {
        ("embed",): (P("tensor", "fsdp"), (360, 16)),
        ("layers", "k_proj"): (P(None, "fsdp", "tensor", None), (2, 16, 1, 16)),
        ("layers", "k_bias"): (P(None, "tensor", None), (2, 1, 16)),
        ("layers", "attn_norm"): (P(None, "fsdp"), (2, 16)),
        ("layers", "up_proj"): (P(None, "fsdp", "tensor"), (2, 16, 48)),
    },
}


def _leaf(tree, path):
  for p in path:
    tree = tree[p]
  return tree


@pytest.mark.parametrize("fsdp, tensor", [(2, 4), (4, 2)])
def test_sharded_load_and_forward_equal_unsharded(fsdp, tensor, ckpt_dir, unsharded):
  mesh = make_mesh({"fsdp": fsdp, "tensor": tensor})
  policy = from_pretrained(ckpt_dir, mesh=mesh)
  for path, (spec, shard_shape) in EXPECTED[(fsdp, tensor)].items():
    x = _leaf(policy.params, path)
    assert x.sharding.mesh == mesh and x.sharding.spec == spec, path
    assert len(x.sharding.device_set) == 8
    assert {s.data.shape for s in x.addressable_shards} == {shard_shape}, path
  # Every leaf is laid out as the rules say, and holds exactly the unsharded values.
  want = policy.param_shardings()
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(s)),
               policy.params, want)
  jax.tree.map(np.testing.assert_array_equal, policy.params, unsharded.params)

  rng = np.random.RandomState(fsdp)
  tokens = rng.randint(3, 720, size=(4, 12)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, :5] = 0
  mask[2, 9:] = 0
  if (fsdp, tensor) == (2, 4):   # a sharded policy exports (and reloads) like any other
    out = ckpt_dir.parent / "sharded_export"
    policy.save_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, from_pretrained(out).params, unsharded.params)
  got = np.asarray(policy.forward(tokens, mask))
  ref = np.asarray(unsharded.forward(tokens, mask))
  # Sharded matmuls sum in another order: equal up to float32 rounding of logits of size ~10.
  scale = np.abs(ref).max()
  assert scale > 1.0
  assert np.abs(got - ref)[mask == 1].max() < 1e-5 * scale


def test_sharded_greedy_generation(ckpt_dir, unsharded):
  """Greedy decoding through the KV cache on the mesh picks, at every step, the argmax of the
  unsharded model's full forward pass (checked without compiling a second sampler)."""
  policy = from_pretrained(ckpt_dir, mesh=make_mesh({"fsdp": 2, "tensor": 4}))
  prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
  outs = policy.generate(prompts, 6, temperature=0.0)
  assert [len(o) for o in outs] == [6, 6, 6]
  seqs = np.zeros((4, 12), np.int32)   # the shape of the forward test above: no new compile
  for b, (p, o) in enumerate(zip(prompts, outs)):
    seqs[b, :len(p) + 6] = p + o
  logits = np.asarray(unsharded.forward(seqs))
  for b, (p, o) in enumerate(zip(prompts, outs)):
    np.testing.assert_array_equal(logits[b, len(p) - 1:len(p) + 5].argmax(-1), o)
