"""Checkpointer: exact round trips, restore onto other meshes, retention, params-only restore,
model fingerprints, and the errors a user can cause."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxagent.checkpoint import (Checkpointer, CheckpointMismatchError,
                                 IncompatibleCheckpointError, model_fingerprint)
from jaxagent.models import decoder
from jaxagent.models.config import ModelConfig
from jaxagent.models.policy import param_shardings
from jaxagent.sharding import make_mesh

CFG = ModelConfig(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=True, qk_norm=False, max_position_embeddings=128)


def make_state(mesh, seed: int = 0):
  """Decoder-shaped params sharded by the model's rules, an adam state (mu/nu nonzero), a step
  and PRNG keys. Values come from numpy so that no test pays for compiling the model."""
  rng = np.random.default_rng(seed)
  _, shapes = decoder.abstract_params(CFG)
  shardings = param_shardings(CFG, mesh)

  def fill(s, sharding, scale=1.0):
    return jax.device_put((rng.standard_normal(s.shape) * scale).astype(s.dtype), sharding)

  params = jax.tree.map(fill, shapes, shardings)
  adam, empty = jax.eval_shape(optax.adam(1e-2).init, params)
  adam = adam._replace(count=jnp.int32(3), mu=jax.tree.map(fill, shapes, shardings),
                       nu=jax.tree.map(lambda s, d: jnp.abs(fill(s, d, 1e-3)), shapes, shardings))
  keys = jax.random.wrap_key_data(np.asarray([[1, 2], [3, 4], [5, 6], [7, 8]], np.uint32))
  return {"params": params, "opt_state": (adam, empty), "step": jnp.int32(17),
          "rng": jax.random.key(5), "rngs": keys}


def abstract_on(state, shardings_of_params, other_sharding):
  """The state's abstract tree: params (and adam mu/nu) on `shardings_of_params`, rest on
  `other_sharding`."""
  def sds(x, s):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  params = jax.tree.map(sds, state["params"], shardings_of_params)
  adam, empty = state["opt_state"]
  adam = adam._replace(count=sds(adam.count, other_sharding),
                       mu=jax.tree.map(sds, adam.mu, shardings_of_params),
                       nu=jax.tree.map(sds, adam.nu, shardings_of_params))
  return {"params": params, "opt_state": (adam, empty), "step": sds(state["step"], other_sharding),
          "rng": sds(state["rng"], other_sharding), "rngs": sds(state["rngs"], other_sharding)}


def assert_placed(restored, abstract):
  """Every leaf on the requested sharding (PRNG keys may spell P() as P(None,): equivalent)."""
  for r, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
    assert r.sharding.is_equivalent_to(a.sharding, r.ndim), (r.sharding, a.sharding)
    if not jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key):
      assert r.sharding == a.sharding


def assert_exact(restored, expected):
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      assert r.dtype == e.dtype
      r, e = jax.random.key_data(r), jax.random.key_data(e)
    assert r.dtype == e.dtype and r.shape == e.shape
    np.testing.assert_array_equal(np.asarray(r), np.asarray(e))


def test_round_trip_exact(tmp_path):
  mesh = make_mesh()                                  # 8 devices on fsdp
  state = make_state(mesh)
  assert state["params"]["embed"].sharding.spec == P(None, "fsdp")   # really sharded
  meta = {"data_position": 123, "seeds": [1, 2], "phase": "rl", "model_fingerprint": "abc",
          "config": {"lr": 0.01, "budget": "mix:2,4"}}
  expected = jax.tree.map(lambda x: x, state)
  expected["params"] = jax.tree.map(np.array, state["params"])     # host copies
  with Checkpointer(tmp_path / "ckpt", max_to_keep=3, save_interval_steps=1) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(17, state, meta)
    # The arrays were copied to host before save returned: donating them now is safe.
    jax.tree.map(lambda x: x.delete(), state["params"])
  ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=3, save_interval_steps=1)   # as on restart
  assert ckpt.all_steps() == [17]
  shardings = param_shardings(CFG, mesh)
  abstract = abstract_on(expected, shardings, NamedSharding(mesh, P()))
  restored = ckpt.restore(abstract_state=abstract)
  assert_exact(restored, expected)
  assert_placed(restored, abstract)
  assert ckpt.restore_meta() == meta
  # The restored key draws the same numbers.
  np.testing.assert_array_equal(jax.random.normal(restored["rng"], (4,)),
                                jax.random.normal(state["rng"], (4,)))
  ckpt.close()


def test_python_scalars_and_reader_reload(tmp_path):
  dev = SingleDeviceSharding(jax.devices()[0])
  writer = Checkpointer(tmp_path, max_to_keep=5, save_interval_steps=1, async_save=False)
  writer.save(1, {"epoch": 2, "lr": 0.5, "w": jnp.arange(3)}, {})
  reader = Checkpointer.reader(tmp_path)
  out = reader.restore(abstract_state={
      "epoch": 0, "lr": 0.0, "w": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=dev)})
  assert out["epoch"] == 2 and type(out["epoch"]) is int and out["lr"] == 0.5
  np.testing.assert_array_equal(out["w"], [0, 1, 2])
  writer.save(2, {"epoch": 3, "lr": 0.25, "w": jnp.arange(3)}, {})
  assert reader.latest_step() == 1                  # a reader's list is a snapshot ...
  reader.reload()
  assert reader.latest_step() == 2                  # ... refreshed on demand (eval polling)


@pytest.mark.parametrize("target", ["fsdp2_tensor4", "single_device"])
def test_restore_onto_another_mesh(tmp_path, target):
  state = make_state(make_mesh())                      # saved with params on an 8-way fsdp mesh
  with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=1) as ckpt:
    ckpt.save(3, state, {"model_fingerprint": model_fingerprint(CFG)})
  if target == "fsdp2_tensor4":
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    shardings = param_shardings(CFG, mesh)
    other = NamedSharding(mesh, P())
    # The target layout differs from the saved one: heads split over tensor, embed over 2 not 8.
    assert shardings["layers"]["q_proj"].spec == P(None, "fsdp", "tensor", None)
  else:
    dev = SingleDeviceSharding(jax.devices()[3])
    shardings = jax.tree.map(lambda _: dev, state["params"])
    other = dev
  abstract = abstract_on(state, shardings, other)
  restored = Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=1).restore(
      3, abstract_state=abstract)
  assert_exact(restored, state)
  assert_placed(restored, abstract)


def test_max_to_keep_and_interval(tmp_path):
  x = {"w": jnp.zeros((3,), jnp.float32)}
  with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
    saved = [ckpt.save(s, {"w": x["w"] + s}, {"s": s}) for s in range(1, 8)]
    assert saved == [False, True, False, True, False, True, False]
    assert ckpt.save(7, {"w": x["w"] + 7}, {"s": 7}, force=True)      # preemption save
    assert not ckpt.save(7, {"w": x["w"]}, {"s": 7}, force=True)      # never twice
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [6, 7]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
  reopened = Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2)
  assert reopened.latest_step() == 7
  abstract = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=SingleDeviceSharding(
      jax.devices()[0]))}
  np.testing.assert_array_equal(reopened.restore(6, abstract_state=abstract)["w"], [6, 6, 6])
  assert reopened.restore_meta(7) == {"s": 7}
  with pytest.raises(ValueError, match="already holds step 7.*new --workdir"):
    reopened.save(4, x, {}, force=True)


def test_restore_params_reads_only_params(tmp_path, monkeypatch):
  mesh = make_mesh()
  state = make_state(mesh)
  with Checkpointer(tmp_path, max_to_keep=1, save_interval_steps=1) as ckpt:
    ckpt.save(9, state, {})
  read: list[str] = []
  original = ocp.type_handlers.ArrayHandler.deserialize

  async def spy(self, infos, args=None):
    read.extend(info.name for info in infos)
    return await original(self, infos, args)

  monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", spy)
  target_mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  shardings = param_shardings(CFG, target_mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state["params"], shardings)
  reader = Checkpointer.reader(tmp_path)
  params = reader.restore_params(None, abstract)
  assert_exact(params, state["params"])
  assert_placed(params, abstract)
  n_params = len(jax.tree.leaves(state["params"]))
  assert len(read) == n_params and all(name.startswith("params.") for name in read), read
  # A full restore reads the optimizer state too (the spy sees it), so the check above is real.
  read.clear()
  reader.restore(abstract_state=abstract_on(state, shardings, NamedSharding(target_mesh, P())))
  assert any(name.startswith("opt_state.") for name in read)
  with pytest.raises(CheckpointMismatchError, match="no state\\['weights'\\].*fix key_path"):
    reader.restore_params(9, abstract, key_path=("weights",))
  # Params of another model (an untied head missing) are refused, not silently half-restored.
  fewer = {k: v for k, v in abstract.items() if k != "lm_head"}
  with pytest.raises(CheckpointMismatchError, match="not requested: \\[\\('lm_head',\\)\\]"):
    reader.restore_params(9, fewer)
  more = {**abstract, "extra": abstract["final_norm"]}
  with pytest.raises(CheckpointMismatchError, match="not in the checkpoint: \\[\\('extra',\\)\\]"):
    reader.restore_params(9, more)


def test_restore_params_nested_key_path(tmp_path):
  dev = SingleDeviceSharding(jax.devices()[0])
  state = {"model": {"policy": {"w": jnp.arange(6.0).reshape(2, 3)}, "ema": {"w": jnp.ones(2)}},
           "rng": jax.random.key(1)}
  with Checkpointer(tmp_path, max_to_keep=1, save_interval_steps=1) as ckpt:
    ckpt.save(1, state, {})
  out = Checkpointer.reader(tmp_path).restore_params(
      1, {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=dev)},
      key_path=("model", "policy"))
  np.testing.assert_array_equal(out["w"], np.arange(6.0).reshape(2, 3))


@dataclasses.dataclass(frozen=True)
class OtherConfig:
  width: int
  depth: int
  tags: tuple = ()


def test_model_fingerprint():
  fp = model_fingerprint(CFG)
  assert isinstance(fp, str) and len(fp) == 16 and int(fp, 16) >= 0
  assert model_fingerprint(dataclasses.replace(CFG)) == fp                       # deterministic
  # Dtypes, token ids and the init seed do not change which checkpoints load.
  assert model_fingerprint(dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16",
                                               eos_token_ids=(2,), init_seed=7)) == fp
  for change in ({"num_layers": 3}, {"hidden_size": 64}, {"qk_norm": True},
                 {"rope_theta": 1e6}, {"model_type": "llama"}):
    assert model_fingerprint(dataclasses.replace(CFG, **change)) != fp, change
  # Any dataclass works, nested values included.
  assert model_fingerprint(OtherConfig(1, 2, ("a",))) != model_fingerprint(OtherConfig(1, 2))
  assert model_fingerprint(OtherConfig(1, 2)) == model_fingerprint(OtherConfig(1, 2))
  with pytest.raises(TypeError, match="dataclass instance"):
    model_fingerprint({"width": 1})


def test_check_compatible(tmp_path):
  ckpt = Checkpointer(tmp_path / "run", max_to_keep=2, save_interval_steps=1)
  fp = model_fingerprint(CFG)
  assert ckpt.check_compatible(fp) is None                  # empty workdir: anything goes
  ckpt.save(5, {"w": jnp.ones(2)}, {"model_fingerprint": fp})
  assert ckpt.check_compatible(fp) == 5
  other = model_fingerprint(dataclasses.replace(CFG, num_layers=4))
  with pytest.raises(IncompatibleCheckpointError) as err:
    Checkpointer(tmp_path / "run", max_to_keep=2, save_interval_steps=1).check_compatible(other)
  msg = str(err.value)
  assert str(tmp_path / "run") in msg and fp in msg and other in msg
  assert "use a new --workdir or the matching model" in msg
  ckpt.close()


def test_user_errors(tmp_path):
  dev = SingleDeviceSharding(jax.devices()[0])
  ckpt = Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=1)
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=dev)})
  with pytest.raises(TypeError, match="meta must be JSON"):
    ckpt.save(1, {"w": jnp.ones(2)}, {"bad": object()})
  assert ckpt.all_steps() == []                              # nothing was written
  ckpt.save(1, {"w": jnp.ones(2)}, {})
  with pytest.raises(FileNotFoundError, match=r"step 2 .*available steps: \[1\]"):
    ckpt.restore(2, abstract_state={"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=dev)})
  with pytest.raises(CheckpointMismatchError, match="new --workdir"):
    ckpt.restore(1, abstract_state={"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=dev),
                                    "extra": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev)})
  with pytest.raises(ValueError, match=r"\['w'\].*without a sharding.*NamedSharding"):
    ckpt.restore(1, abstract_state={"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
  with pytest.raises(PermissionError, match="read-only"):
    Checkpointer.reader(tmp_path).save(2, {"w": jnp.ones(2)}, {})
  with pytest.raises(FileNotFoundError, match="--workdir"):
    Checkpointer.reader(tmp_path / "missing")
  ckpt.close()
