"""The study end to end with LoRA (config.model.lora.rank > 0), at smoke size: every run trains
adapters only, evaluation and the comparison restore base + adapters."""

import json

import numpy as np
import pytest

from configs.default import get_config
from jaxagent import study
from jaxagent.checkpoint import Checkpointer
from jaxagent.models.lora_io import BASE_FINGERPRINT_KEY
from jaxagent.runs import layout


@pytest.mark.slow
def test_study_with_lora_runs_end_to_end(tmp_path):
  config = get_config("smoke")
  config.num_devices = 1
  config.model.lora.rank = 4
  config.study.seeds = 1              # one seed per arm: the smallest study that still compares
  config.study.min_seeds = 1
  summary = study.run(config, tmp_path)
  comp = json.loads((tmp_path / "report" / "comparison.json").read_text())
  labels = ["base"] + [f"{arm}_s0" for arm in study.ARMS]
  fingerprints = set()
  for label in labels:
    run = tmp_path / label
    done = json.loads((run / "DONE").read_text())
    assert done["lora_rank"] == 4
    fingerprints.add(done["base_fingerprint"])
    phase, step = layout.resolve_checkpoint(run)
    ckpt = Checkpointer.reader(layout.checkpoint_dir(run, phase))
    assert ckpt.restore_meta(step)[BASE_FINGERPRINT_KEY] == done["base_fingerprint"]
    ckpt.close()
    own = json.loads(next((run / "eval").glob("*/report.json")).read_text())
    assert comp["pass_at_kt"][label] == own["pass_at_kt"]
  # Every run trained adapters on the one base: the arms continued the base run's SFT adapters.
  assert len(fingerprints) == 1
  # The comparison scored every run's policy (base + its adapters) on every run's trajectories.
  lik = comp["likelihood"]
  assert set(lik["cols"]) == set(labels)
  assert np.all(np.isfinite(np.asarray(lik["mean"], dtype=float)))
  assert set(summary["claims"]) == set(comp["claims"])
