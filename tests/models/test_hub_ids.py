"""Hugging Face Hub ids as model paths ("org/name", "org/name@revision"), resolved through a fake
huggingface_hub cache in tmp_path (HF_HUB_CACHE) with downloads off (HF_HUB_OFFLINE=1): no test
touches the network (the one that allows downloads replaces snapshot_download)."""

from __future__ import annotations

import pathlib
import shutil

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub import constants as hub_constants

from jaxagent.models import CheckpointError, from_pretrained
from jaxagent.models.policy import resolve_path

COMMIT_MAIN, COMMIT_V1 = "a" * 40, "b" * 40
IDS = np.random.default_rng(0).integers(3, 720, (2, 12))


def _add_snapshot(cache, repo_id: str, commit: str, src, ref: str | None = None):
  """A snapshot as huggingface_hub stores it: models--org--name/snapshots/<commit>/<files>, and
  refs/<ref> holding the commit hash."""
  repo = cache / ("models--" + repo_id.replace("/", "--"))
  snap = repo / "snapshots" / commit
  shutil.copytree(src, snap)
  if ref is not None:
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
  return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, hf_checkpoint):
  """A cache holding org/name: main = the qwen2 checkpoint, tag v1 = the llama one."""
  cache = tmp_path / "hub"
  _add_snapshot(cache, "org/name", COMMIT_MAIN, hf_checkpoint("qwen2_tied").path, "main")
  _add_snapshot(cache, "org/name", COMMIT_V1, hf_checkpoint("llama3_untied").path, "v1")
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return cache


def _logits(policy):
  return np.asarray(policy.forward(IDS))


def test_hub_id_loads_the_cached_snapshot(hub_cache, hf_checkpoint):
  snap = hub_cache / "models--org--name" / "snapshots" / COMMIT_MAIN
  assert resolve_path("org/name") == snap
  policy, direct = from_pretrained("org/name"), from_pretrained(hf_checkpoint("qwen2_tied").path)
  assert policy.config == direct.config and policy.config.model_type == "qwen2"
  np.testing.assert_array_equal(_logits(policy), _logits(direct))


@pytest.mark.parametrize("revision", ["v1", COMMIT_V1])
def test_hub_id_at_a_revision(hub_cache, hf_checkpoint, revision):
  policy = from_pretrained(f"org/name@{revision}")
  direct = from_pretrained(hf_checkpoint("llama3_untied").path)
  assert policy.config.model_type == "llama"
  np.testing.assert_array_equal(_logits(policy), _logits(direct))


def test_an_existing_local_path_wins(hub_cache, hf_checkpoint, tmp_path, monkeypatch):
  shutil.copytree(hf_checkpoint("qwen3_untied").path, tmp_path / "work" / "org" / "name")
  monkeypatch.chdir(tmp_path / "work")
  assert resolve_path("org/name").resolve() == (tmp_path / "work" / "org" / "name").resolve()
  assert from_pretrained("org/name").config.model_type == "qwen3"   # not the cached qwen2


def test_not_cached_offline_names_the_id_and_the_fix(hub_cache, monkeypatch):
  with pytest.raises(CheckpointError) as info:
    from_pretrained("org/missing")
  msg = str(info.value)
  assert "'org/missing' is not a local path" in msg and "HF_HUB_OFFLINE" in msg
  assert "huggingface-cli download org/missing" in msg and str(hub_cache) in msg
  with pytest.raises(CheckpointError, match=r"huggingface-cli download org/name --revision v2"):
    resolve_path("org/name@v2")
  monkeypatch.delenv("HF_HUB_CACHE")   # huggingface_hub's default cache (from HF_HOME)
  with pytest.raises(CheckpointError, match="org/missing") as info:
    resolve_path("org/missing")
  assert hub_constants.HF_HUB_CACHE in str(info.value)


def test_downloads_only_when_allowed(hub_cache, hf_checkpoint, monkeypatch):
  calls = []

  def fake_snapshot_download(repo_id, **kw):
    calls.append((repo_id, kw))
    return str(hf_checkpoint("qwen2_tied").path)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
  resolve_path("org/other@dev")
  monkeypatch.setenv("HF_HUB_OFFLINE", "0")
  monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
  assert resolve_path("org/other") == hf_checkpoint("qwen2_tied").path
  assert [(r, kw["revision"], kw["local_files_only"], kw["cache_dir"]) for r, kw in calls] == [
      ("org/other", "dev", True, str(hub_cache)), ("org/other", None, False, str(hub_cache))]
  assert "*.safetensors" in calls[1][1]["allow_patterns"]   # never the .bin / .gguf files


@pytest.mark.parametrize("path", ["./org/name", "/abs/org", "a/b/c", "~/name", "name.gguf"])
def test_paths_that_are_no_hub_ids_stay_paths(hub_cache, path, monkeypatch):
  monkeypatch.setattr(huggingface_hub, "snapshot_download", None)   # never called
  assert str(resolve_path(path)) == str(pathlib.Path(path).expanduser())
