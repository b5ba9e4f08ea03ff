"""Multi-process start-up: how `distributed.resolve` reads arguments and the environment, a real
two-process CPU job (jax.distributed on localhost) whose sharded rollout equals the one-process
rollout, and the launch recipes' commands (DRY_RUN)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxagent.sharding import distributed
from jaxagent.sharding.distributed import Layout, resolve

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {"JAXAGENT_COORDINATOR": "10.0.0.1:1234", "JAXAGENT_NUM_PROCESSES": "4",
       "JAXAGENT_PROCESS_ID": "3"}


def test_resolve_single_process():
  assert resolve(environ={}).mode == "single"
  assert resolve(num_processes=1, environ={}).mode == "single"
  assert resolve(environ={**ENV, "JAXAGENT_NUM_PROCESSES": "1", "JAXAGENT_PROCESS_ID": "0"}
                 ).mode == "single"
  # A SLURM allocation with one task, or a single-process opt-out, is one process.
  assert resolve(environ={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).mode == "single"
  assert resolve(environ={**ENV, "JAXAGENT_DISTRIBUTED": "off"}).mode == "single"


def test_resolve_explicit_arguments_then_environment():
  got = resolve("host:99", 2, 1, environ=ENV)              # arguments win over the environment
  assert got == Layout("explicit", "host:99", 2, 1, "arguments")
  got = resolve(environ=ENV)
  assert (got.mode, got.coordinator_address, got.num_processes, got.process_id) == \
      ("explicit", "10.0.0.1:1234", 4, 3)
  assert got.local_device_ids is None
  got = resolve(environ={**ENV, "JAXAGENT_LOCAL_DEVICE_IDS": "0,1,2,3"})
  assert got.local_device_ids == (0, 1, 2, 3)
  assert resolve("h:1", 2, 0, environ={}, local_device_ids=[4, 5]).local_device_ids == (4, 5)


def test_resolve_auto_detection():
  slurm = {"SLURM_NTASKS": "16", "SLURM_PROCID": "5"}
  assert resolve(environ=slurm) == Layout("auto", source="SLURM job step with 16 tasks")
  assert resolve(environ={"JAXAGENT_DISTRIBUTED": "auto"}).mode == "auto"   # TPU pods
  # Explicit values take precedence over detection.
  assert resolve(environ={**slurm, **ENV}).mode == "explicit"


@pytest.mark.parametrize("kwargs, env, needle", [
    (dict(coordinator_address="h:1"), {}, "missing ['num_processes', 'process_id']"),
    ({}, {"JAXAGENT_NUM_PROCESSES": "2"}, "missing ['coordinator_address', 'process_id']"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, "out of range"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), {}, "needs a port"),
    ({}, {**ENV, "JAXAGENT_PROCESS_ID": "x"}, "JAXAGENT_PROCESS_ID='x' is not an integer"),
    (dict(num_processes=0), {}, "num_processes must be >= 1"),
    ({}, {**ENV, "JAXAGENT_LOCAL_DEVICE_IDS": "0;1"}, "comma-separated device ids"),
])
def test_resolve_rejects_partial_or_bad_layouts(kwargs, env, needle):
  with pytest.raises(ValueError) as info:
    resolve(environ=env, **kwargs)
  assert needle in str(info.value)


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  for name in ("JAXAGENT_COORDINATOR", "JAXAGENT_NUM_PROCESSES", "JAXAGENT_PROCESS_ID",
               "JAXAGENT_DISTRIBUTED", "SLURM_NTASKS"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize().mode == "single" and calls == []
  assert distributed.is_primary()
  distributed.barrier("alone")                # one process: returns at once
  # With a layout, it hands exactly that to jax.distributed.initialize.
  assert distributed.initialize("h:1", 2, 1, local_device_ids=[0]).mode == "explicit"
  assert calls == [((), dict(coordinator_address="h:1", num_processes=2, process_id=1,
                             local_device_ids=[0]))]
  monkeypatch.setenv("JAXAGENT_DISTRIBUTED", "auto")
  distributed.initialize()
  assert calls[-1] == ((), dict(local_device_ids=None))


_WORKER = """
import sys
import time
import numpy as np
from jaxagent.sharding import distributed
layout = distributed.initialize()
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from jax.experimental import multihost_utils
import jaxagent.envs as envs
from jaxagent.models import from_pretrained
from jaxagent.rollout import rollout
from jaxagent.sharding import make_mesh
assert layout.mode == "explicit" and jax.process_count() == 2 and jax.device_count() == 2
if jax.process_index() == 1:    # process 0 reaches the rollout's first collective ~36 s early
  time.sleep(36)                # (gloo's own wait for a new context is 30 s)
policy = from_pretrained("builtin:micro", mesh=make_mesh((1, 2, 1)))
env = envs.make("lookup", policy.tokenizer, hops=1)
traj = rollout(policy, env, jax.random.key(0), 2, 2, budgets=1, max_turns=1, max_action_tokens=8)
assert not traj.tokens.is_fully_addressable          # each process holds its own episodes
assert {s.data.shape[0] for s in traj.tokens.addressable_shards} == {2}
tokens = multihost_utils.process_allgather(traj.tokens, tiled=True)
logp = multihost_utils.process_allgather(traj.behaviour_logprobs, tiled=True)
if distributed.is_primary():
  np.savez(sys.argv[1], tokens=tokens, logprobs=logp)
print("WORKER_OK", jax.process_index(), distributed.is_primary(), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow   # two processes each compile a rollout, one 36 s late
def test_two_process_rollout_equals_one_process(tmp_path):
  """Two CPU processes joined by jax.distributed (the JAXAGENT_* variables), one device each,
  roll out 4 episodes split over both: the gathered result equals this process's rollout. One
  process starts 36 s late, as a slow compile on a loaded machine would: `initialize` joined
  gloo's context up front, so the collectives wait for it."""
  from jaxagent.models import from_pretrained
  from jaxagent.rollout import rollout
  import jaxagent.envs as envs
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  out = tmp_path / "out.npz"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one CPU device each
  env.update(JAX_PLATFORMS="cpu", JAXAGENT_COORDINATOR=f"localhost:{_free_port()}",
             JAXAGENT_NUM_PROCESSES="2", PYTHONPATH=str(ROOT))
  procs = [subprocess.Popen([sys.executable, str(script), str(out)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**env, "JAXAGENT_PROCESS_ID": str(i)}) for i in range(2)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0 and f"WORKER_OK {i} {i == 0}" in log, log[-3000:]
  policy = from_pretrained("builtin:micro")
  env1 = envs.make("lookup", policy.tokenizer, hops=1)
  traj = rollout(policy, env1, jax.random.key(0), 2, 2, budgets=1, max_turns=1,
                 max_action_tokens=8)
  got = np.load(out)
  np.testing.assert_array_equal(got["tokens"], np.asarray(traj.tokens))
  np.testing.assert_allclose(got["logprobs"], np.asarray(traj.behaviour_logprobs), atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Recipes: the commands they would run.

def _dry(script, *args, **env):
  run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "JAXAGENT"))}
  run_env.update(DRY_RUN="1", **env)
  res = subprocess.run(["bash", str(ROOT / "launch" / "recipes" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=run_env)
  assert res.returncode == 0, res.stderr
  return res.stdout.strip().splitlines()


def test_recipes_are_executable_scripts():
  names = sorted(p.name for p in (ROOT / "launch" / "recipes").iterdir())
  assert names == ["single_gpu.sh", "slurm_gpu.sbatch", "tpu_pod.sh"]
  for name in names:
    path = ROOT / "launch" / "recipes" / name
    assert os.access(path, os.X_OK), name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, name


def test_tpu_pod_recipe_commands():
  env = dict(TPU_NAME="pod", ZONE="z1", PROJECT="p1", NUM_DEVICES="8", MODEL="/shared/Qwen 7B",
             WORKDIR="/shared/run")
  [train] = _dry("tpu_pod.sh", "train", "--config.rl.steps=3", **env)
  assert train.startswith("gcloud compute tpus tpu-vm ssh pod --zone=z1 --project=p1 "
                          "--worker=all --command=")
  for part in ("JAXAGENT_DISTRIBUTED=auto", "-m\\ launch.train",
               "--config=configs/hf.py:qwen2.5-7b", "--workdir=/shared/run",
               "--config.model.path=/shared/Qwen\\\\\\ 7B", "--config.rl.steps=3"):
    assert part in train, part
  [plan] = _dry("tpu_pod.sh", "plan", **env)
  assert "--worker=0" in plan and "launch.plan" in plan and "--num_devices=8" in plan
  setup = _dry("tpu_pod.sh", "setup", **env)
  assert len(setup) == 3 and "--worker=all" in setup[1] and "jax\\[tpu\\]" in setup[2]
  res = subprocess.run(["bash", str(ROOT / "launch/recipes/tpu_pod.sh"), "train"], cwd=ROOT,
                       capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
  assert res.returncode != 0 and "set TPU_NAME" in res.stderr


def test_slurm_recipe_commands():
  env = dict(MODEL="/shared/m", WORKDIR="/shared/w", SLURM_JOB_NUM_NODES="2")
  plan, train = _dry("slurm_gpu.sbatch", "--config.rl.steps=3", **env)
  assert plan.startswith("env JAX_PLATFORMS=cpu .venv/bin/python -m launch.plan ")
  assert "--num_devices=16" in plan and "--device_memory_gb=80" in plan
  assert train == ("srun --kill-on-bad-exit=1 .venv/bin/python -m launch.train "
                   "--config=configs/hf.py:qwen2.5-7b --workdir=/shared/w "
                   "--config.model.path=/shared/m --config.rl.steps=3")
  _, per_node = _dry("slurm_gpu.sbatch", PER_NODE="1", **env)
  assert per_node.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c ")
  assert "JAXAGENT_PROCESS_ID=\\$SLURM_PROCID" in per_node and "launch.train" in per_node


def test_single_gpu_recipe_plan_command_runs():
  """The single-GPU recipe's plan line, run for real on the smoke config."""
  plan, study = _dry("single_gpu.sh", MODEL="builtin:micro", WORKDIR="/tmp/unused",
                     CONFIG="configs/default.py:smoke", DEVICE_MEMORY_GB="16")
  assert plan.startswith(".venv/bin/python -m launch.plan --config=configs/default.py:smoke")
  assert study.startswith(".venv/bin/python -m launch.study --config=configs/default.py:smoke "
                          "--workdir=/tmp/unused --config.model.path=builtin:micro")
  args = plan.split()
  res = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  assert "fits (--device_memory_gb memory)" in res.stdout
