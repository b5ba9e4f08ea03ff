"""Tests of the demonstration-set TFDS builder (data/demos.py): array_record, no TensorFlow."""

import copy
import os
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

import jaxagent.envs as envs
from jaxagent.data import demos, tasks
from jaxagent.envs.base import ErrorKind
from jaxagent.models.builtin import BUILTIN_DIRS

CONFIG = dict(num_train=12, num_validation=4, num_test=4, error_rate=0.4, recovery_rate=0.6,
              max_turns=12, max_len=768, seed=7, size=4, num_traps=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory, builtin_tokenizer):
  root = tmp_path_factory.mktemp("demos")
  path = demos.build(root, "grid", builtin_tokenizer, **CONFIG)
  return root, path


def test_demo_sets_round_trip_and_decode(built, builtin_tokenizer):
  root, path = built
  assert path == demos.builder_dir(root, "grid", builtin_tokenizer, **CONFIG)
  assert {"demo_sets", "task_sets"} <= set(os.listdir(root))   # the task set was built first
  env = envs.make("grid", builtin_tokenizer, size=4, num_traps=1)
  codec = env.codec
  eot = codec.decode([codec.end_of_turn_id])
  for split, n in (("train", 12), ("validation", 4)):
    d = demos.load(root, "grid", builtin_tokenizer, split, **CONFIG)
    assert d["tokens"].shape == (n, 768) and d["tokens"].dtype == np.int32
    assert d["loss_mask"].dtype == np.float32 and d["error_kind"].shape == (n, 12)
    np.testing.assert_array_equal(d["task_index"], np.arange(n))
    task_arrays = tasks.load(root, "grid", split, seed=0, num_train=12, num_validation=4,
                             num_test=4, size=4, num_traps=1)
    task_batch = tasks.tasks_from_arrays(env, task_arrays)
    for b in range(n):
      text = codec.decode(d["tokens"][b, :d["length"][b]])
      task = type(task_batch)(**{k: np.asarray(getattr(task_batch, k))[b]
                                 for k in ("walls", "traps", "start", "goal")})
      assert env.prompt_user_text(task) in text           # the demo is of its task
      actions = codec.decode(d["tokens"][b][d["loss_mask"][b] > 0]).split(eot)[:-1]
      assert len(actions) == d["num_turns"][b] == d["acted"][b].sum()
      for a, kind, injected in zip(actions, d["error_kind"][b], d["injected"][b]):
        assert (kind != ErrorKind.NONE) == injected, a
        assert (a in env.error_texts) if injected else a.startswith("move(")
    assert np.all(d["success_turn"] <= 12) and not d["truncated"].any()
  assert "tensorflow" not in sys.modules


def test_same_config_gives_identical_demos(built, builtin_tokenizer, tmp_path):
  root, _ = built
  demos.build(tmp_path, "grid", builtin_tokenizer, **CONFIG)
  for split in demos.SPLITS:
    a = demos.load(root, "grid", builtin_tokenizer, split, **CONFIG)
    b = demos.load(tmp_path, "grid", builtin_tokenizer, split, **CONFIG)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_tokenizer_is_part_of_the_config(builtin_tokenizer, tmp_path):
  again = AutoTokenizer.from_pretrained(str(BUILTIN_DIRS["tiny"]))
  fp = demos.tokenizer_fingerprint(builtin_tokenizer)
  assert demos.tokenizer_fingerprint(again) == fp and len(fp) == 12
  other = copy.deepcopy(again)
  other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
  assert demos.tokenizer_fingerprint(other) != fp
  a = demos.demo_set_config("grid", builtin_tokenizer, **CONFIG)
  b = demos.demo_set_config("grid", other, **CONFIG)
  assert a.name != b.name and f"tok{fp}" in a.name
  assert demos.demo_set_config("grid", builtin_tokenizer, **{**CONFIG, "seed": 8}).name != a.name
  # Building a config with another tokenizer than the one it was made for is refused.
  builder = demos.DemoSets(data_dir=str(tmp_path), tokenizer=other, config=a)
  with pytest.raises(ValueError, match="fingerprint"):
    builder.download_and_prepare()
  with pytest.raises(FileNotFoundError, match="build it first"):
    demos.load(tmp_path, "grid", builtin_tokenizer, "train", **CONFIG)
