"""The evaluation job end to end on a smoke training run's checkpoints: every promised file with
sane values, step selection and user errors, watch mode, truncation vs rerun agreement, the
comparison report, and the launch script."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from jaxagent.eval import checkpoints, compare, pass_at_kt
from jaxagent import train
from jaxagent.eval.evaluator import Evaluator
from jaxagent.runs import layout

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
EVAL_FILES = ["report.json", "report.md", "episodes.npz", "pass_heatmap.png", "pass_curves.png",
              "step_quality.png", "recovery.png", "recovery_on_policy.png", "likelihood.png"]
OVERRIDES = dict(num_tasks=4, num_samples=2, tasks_per_batch=4, max_reference_states=8,
                 max_error_states=8,
                 state_batch=8, score_batch=8, num_bootstrap=100)


def small_config(num_devices: int = 1):
  """The smoke config on one of the tests' eight fake CPU devices (a mesh over all eight runs
  the same programs several times slower on two cores), evaluating 4 tasks x 2 episodes."""
  c = get_config("smoke")
  c.num_devices = num_devices
  for k, v in OVERRIDES.items():
    c.eval[k] = v
  return c


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A smoke training run: SFT checkpoints 2 and 4, RL checkpoint 2."""
  w = tmp_path_factory.mktemp("smoke_run")
  c = get_config("smoke")
  c.num_devices = 1
  train.run(c, w)
  return w


@pytest.fixture(scope="module")
def ev(run_dir):
  return Evaluator(small_config(), run_dir)


@pytest.fixture(scope="module")
def latest(run_dir, ev):
  return checkpoints.evaluate_checkpoint(small_config(), run_dir, evaluator=ev)


def _rates(tree):
  """Every {"rate", "lo", "hi", "n"} entry of a nested report section."""
  if isinstance(tree, dict):
    if "rate" in tree and "n" in tree:
      yield tree
    else:
      for v in tree.values():
        yield from _rates(v)


def test_evaluate_latest_writes_every_file_with_sane_values(run_dir, latest):
  out = pathlib.Path(latest["dir"])
  assert out == run_dir / "eval" / "2"                    # the RL phase's latest step
  for f in EVAL_FILES:
    assert (out / f).stat().st_size > 0, f
  rep = json.loads((out / "report.json").read_text())
  assert rep["run"]["phase"] == "rl" and rep["run"]["step"] == 2
  assert rep["run"]["base"] == "this run's sft step 4"
  assert rep["run"]["train_budget"] == "mix:1,2"
  # Pass grid: K = 1..n, T = 1..T_max, monotone in K and T.
  g = rep["pass_at_kt"]
  mean, lo, hi = (np.array(g[k]) for k in ("mean", "lo", "hi"))
  assert g["k"] == [1, 2] and g["t"] == [1, 2, 3, 4] and mean.shape == (2, 4)
  assert np.all(np.diff(mean, axis=0) >= -1e-12) and np.all(np.diff(mean, axis=1) >= -1e-12)
  # The grid and its intervals are recomputable from episodes.npz (the task bootstrap, seeded).
  eps = np.load(out / "episodes.npz")
  assert eps["success_turn"].shape == (4, 2)
  np.testing.assert_array_equal(eps["task_id"], np.arange(4))
  again = pass_at_kt.pass_grid_truncation(eps["success_turn"], 4, num_bootstrap=100,
                                          confidence=0.95, seed=0)
  np.testing.assert_allclose(again["mean"], mean)
  np.testing.assert_allclose(again["lo"], lo)
  np.testing.assert_allclose(again["hi"], hi)
  np.testing.assert_array_equal(eps["traj/success_turn"].reshape(4, 2), eps["success_turn"])
  assert eps["traj/tokens"].shape[0] == 8
  # Every rate's interval resamples the test tasks (4 here), not the states or rows (up to 8).
  rates = list(_rates(rep["step_quality"])) + list(_rates(rep["recovery"]))
  assert rates
  for r in rates:
    assert (r["tasks"] == 0) == (r["n"] == 0) and r["tasks"] <= 4
  n_states = rep["reference_states"]
  assert n_states["oracle"] == 2 * 4            # the oracle solves hops=1 tasks in 2 turns
  assert 0 < n_states["base"] <= 8 and n_states["error"] <= 8
  for who in ("policy", "base"):
    for mode in ("greedy", "sampled"):
      q = rep["step_quality"][who][mode]
      assert q["overall"]["valid"]["n"] == n_states["oracle"] + n_states["base"]
      assert q["env"]["lookup"]["valid"]["n"] == q["overall"]["valid"]["n"]
  # The oracle's own stats: it always solves, in exactly the optimal number of turns.
  assert rep["stats"]["oracle"]["success_rate"] == 1.0
  assert rep["stats"]["oracle"]["valid_call_rate"] == 1.0
  # Likelihood matrix: finite log-probs (<= 0), per-token mean in [sum-ish range].
  lik = rep["likelihood"]
  assert lik["rows"] == ["policy", "base"] and lik["cols"] == ["policy", "base"]
  assert all(v <= 0 for row in lik["sum"] for v in row)
  assert all(v is None or v <= 0 for row in lik["mean"] for v in row)
  md = (out / "report.md").read_text()
  assert "## Pass@(K,T)" in md and "## Definitions" in md and "| K=1 |" in md


def test_params_restore_sharded_onto_the_config_mesh(run_dir, ev):
  """Saved from a one-device run, restored onto the eight-device fsdp mesh of the config."""
  ev8 = Evaluator(small_config(num_devices=0), run_dir)
  assert ev8.policy.mesh.devices.size == 8
  p8 = layout.restore_params(run_dir, "rl", 2, ev8.abstract)
  p1 = layout.restore_params(run_dir, "rl", 2, ev.abstract)
  for a, b, ref in zip(jax.tree.leaves(p8), jax.tree.leaves(p1),
                       jax.tree.leaves(ev8.policy.params)):
    assert a.sharding == ref.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated
             for a in jax.tree.leaves(p8))


def test_likelihood_diagonal_matches_behaviour_logprobs(latest):
  """Scoring a policy's own trajectories at the sampling temperature reproduces the log-probs
  recorded while sampling them (one definition of the agent-token likelihood)."""
  eps = np.load(pathlib.Path(latest["dir"]) / "episodes.npz")
  behaviour = (eps["traj/behaviour_logprobs"] * eps["traj/loss_mask"]).sum(1).mean()
  assert latest["likelihood"]["sum"][0][0] == pytest.approx(float(behaviour), rel=1e-3, abs=1e-3)


def test_truncation_equals_rerun_when_budget_hidden(run_dir, ev):
  """Deterministic policies with the budget hidden: the run capped at T is the T_max run cut at
  T, so both modes give the same Pass@(K,T) grid. Checked with greedy decoding of the trained
  checkpoint and with a deterministic noisy oracle that solves at varied turns."""
  params = layout.restore_params(run_dir, "rl", 2, ev.abstract)
  env = ev.env

  def noisy_oracle(state, key):
    good = env.oracle_action(state)
    bad = jnp.where((state.turn + state.task.entities[0]) % 3 == 0, 1, 0)
    return good.replace(length=jnp.where(bad == 1, 1, good.length))   # a truncated call

  t_max, n = ev.max_turns, ev.config.eval.num_samples
  for forced in (None, noisy_oracle):
    runs = [ev.rollouts(params, jax.random.key(7), t, budget_visible=False, temperature=0.0,
                        forced_action=forced) for t in range(1, t_max + 1)]
    st = np.stack([np.asarray(r.success_turn).reshape(ev.num_tasks, n) for r in runs])
    full = st[-1]
    for t in range(1, t_max + 1):
      np.testing.assert_array_equal(st[t - 1], np.where(full <= t, full, t_max + 1))
    trunc = pass_at_kt.pass_grid_truncation(full, t_max, num_bootstrap=50)
    rerun = pass_at_kt.pass_at_kt(pass_at_kt.per_budget_counts(st, list(range(1, t_max + 1))), n,
                                  num_bootstrap=50)
    np.testing.assert_allclose(rerun["mean"], trunc["mean"])
    np.testing.assert_allclose(rerun["lo"], trunc["lo"])
    if forced is noisy_oracle:   # the check is not vacuous: success turns vary
      assert len(set(full.ravel().tolist())) >= 2 and (full <= t_max).any()
    np.testing.assert_allclose(
        pass_at_kt.per_task_pass1("rerun", st, list(range(1, t_max + 1)), t_max),
        pass_at_kt.per_task_pass1("truncation", st, list(range(1, t_max + 1)), t_max))


def test_step_selection_and_user_errors(run_dir, ev, tmp_path):
  rep = checkpoints.evaluate_checkpoint(small_config(), run_dir, 4, evaluator=ev)
  assert rep["dir"].endswith("eval/sft_4") and rep["run"]["phase"] == "sft"
  assert rep["run"]["base"].startswith("the model's own weights")
  with pytest.raises(FileNotFoundError, match=r"available .*\('rl', 2\).*--step"):
    checkpoints.evaluate_checkpoint(small_config(), run_dir, 3, evaluator=ev)
  with pytest.raises(FileNotFoundError, match="no checkpoints/ directory.*train"):
    checkpoints.evaluate_checkpoint(small_config(), tmp_path / "nothing", evaluator=ev)
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    checkpoints.evaluate_checkpoint(small_config(), tmp_path / "empty", evaluator=ev)
  bad = small_config()
  bad.eval.phase = "ppo"
  with pytest.raises(ValueError, match="config.eval.phase"):
    checkpoints.evaluate_checkpoint(bad, run_dir, evaluator=ev)
  with pytest.raises(FileNotFoundError, match="launch.evaluate"):
    compare.latest_eval(tmp_path / "empty")


def test_seeded_evaluation_is_reproducible(run_dir, ev, latest):
  """Two evaluations of one checkpoint evaluate the same tasks with the same episodes."""
  again = checkpoints.evaluate_checkpoint(small_config(), run_dir, 2, evaluator=ev)
  assert again["pass_at_kt"] == latest["pass_at_kt"]
  a = np.load(pathlib.Path(latest["dir"]) / "episodes.npz")
  np.testing.assert_array_equal(a["success_turn"], np.load(
      pathlib.Path(again["dir"]) / "episodes.npz")["success_turn"])


def test_watch_evaluates_each_remaining_checkpoint(run_dir, ev, latest):
  reps = checkpoints.watch(small_config(), run_dir, poll_seconds=0.01, timeout_seconds=60, evaluator=ev)
  done = {pathlib.Path(r["dir"]).name for r in reps}
  assert "sft_2" in done and "2" not in done           # only the ones without a report
  for name in ("2", "sft_2", "sft_4"):
    assert (run_dir / "eval" / name / "report.json").exists()
  assert checkpoints.watch(small_config(), run_dir, poll_seconds=0.01, timeout_seconds=60,
                   evaluator=ev) == []


def test_watch_follows_a_training_run_as_it_writes(tmp_path, ev):
  """Watch started (in a thread) on an empty workdir: it waits for the first checkpoint,
  evaluates each one the training run (main thread: it installs the SIGTERM handler) writes, and
  returns once the run is DONE."""
  import threading
  w = tmp_path / "live"
  c = get_config("smoke")
  c.num_devices = 1
  c.rl.steps, c.checkpoint_every, c.max_to_keep = 2, 4, 10
  out: dict = {}

  def watch():
    try:
      out["reps"] = checkpoints.watch(small_config(), w, poll_seconds=0.05, timeout_seconds=300,
                              evaluator=ev)
    except Exception as err:   # re-raised below, in the test's thread
      out["error"] = err

  t = threading.Thread(target=watch)
  t.start()
  train.run(c, w)
  t.join(600)
  assert not t.is_alive() and "error" not in out, out.get("error")
  have = {layout.eval_dir_name(p, s) for p, s in layout.checkpoint_steps(w)}
  assert have == {"sft_4", "2"}                        # each phase's last step
  assert {pathlib.Path(r["dir"]).name for r in out["reps"]} == have
  for name in have:
    assert (w / "eval" / name / "report.json").exists()


def _copy_run(src: pathlib.Path, dst: pathlib.Path, eval_name: str, **run_fields):
  """A run's checkpoints and one evaluation in a workdir of their own, with report.json's run
  fields changed (e.g. the training budget), as another arm or seed would have them."""
  shutil.copytree(src / "checkpoints", dst / "checkpoints")
  shutil.copytree(src / "eval" / eval_name, dst / "eval" / eval_name)
  path = dst / "eval" / eval_name / "report.json"
  rep = json.loads(path.read_text())
  rep["run"].update(run_fields)
  path.write_text(json.dumps(rep))
  return dst


def test_compare_decides_each_claim_on_its_arm(run_dir, ev, latest, tmp_path):
  # The base run: the same SFT checkpoints and their evaluation, in a workdir of their own.
  base = tmp_path / "base_run"
  shutil.copytree(run_dir / "checkpoints" / "sft", base / "checkpoints" / "sft")
  if not (run_dir / "eval" / "sft_4" / "report.json").exists():
    checkpoints.evaluate_checkpoint(small_config(), run_dir, 4, evaluator=ev)
  shutil.copytree(run_dir / "eval" / "sft_4", base / "eval" / "sft_4")
  # Two arms of two seeds each: the RL run as BudgetMix seeds, and (relabelled) as fixed-T seeds.
  runs = {"base": str(base)}
  for arm, budget, kind in (("budgetmix", "mix:1,2", "mix"), ("fixed", "fixed:4", "fixed")):
    for u in (0, 1):
      runs[f"{arm}_s{u}"] = str(_copy_run(run_dir, tmp_path / f"{arm}_s{u}", "2",
                                          train_budget=budget, train_arm=kind, seed=u))
  out = tmp_path / "cmp"
  compare.compare(runs, out, small_config())
  for f in ["comparison.json", "comparison.md", "pass_curves_k1.png", "pass_curves_k2.png",
            "pass_heatmap_base.png", "pass_heatmap_budgetmix_s1.png", "step_quality.png",
            "recovery.png", "likelihood.png"]:
    assert (out / f).stat().st_size > 0, f
  saved = json.loads((out / "comparison.json").read_text())
  assert saved["arms"] == {"budgetmix": ["budgetmix_s0", "budgetmix_s1"],
                           "fixed": ["fixed_s0", "fixed_s1"]}
  assert saved["runs"]["budgetmix_s1"]["kind"] == "mix" and saved["runs"]["base"]["kind"] == "base"
  assert saved["runs"]["fixed_s1"]["seed"] == 1 and saved["runs"]["fixed_s1"]["config_seed"] == 1
  assert saved["runs"]["budgetmix_s0"]["phase"] == "rl" and saved["runs"]["base"]["step"] == 4
  assert [saved["claims"][str(n)]["decided_on"] for n in range(1, 6)] == [
      "fixed", "fixed", "budgetmix", "fixed", "fixed"]
  assert set(saved["claims"]["1"]["per_arm"]) == {"budgetmix", "fixed"}
  # Claim numbers are the comparison's own measurements: both seeds are one policy, so the
  # pooled action-error recovery is that policy's controlled rate, and the seed null is 0.
  rec = saved["recovery"]["controlled"]
  c5 = saved["claims"]["5"]["per_arm"]["fixed"]["details"]
  want = rec["fixed_s0"]["sampled"]["action"]["valid"]["rate"]
  got = c5["rate_rl_action"]["est"]
  assert (got is None) == (want is None) and (want is None or got == pytest.approx(want))
  lik = saved["likelihood"]
  assert lik["rows"] == ["base", "budgetmix_s0", "fixed_s0"] == lik["cols"]
  c4 = saved["claims"]["4"]["per_arm"]["fixed"]["details"]
  assert c4["rl_vs_base"]["est"] == pytest.approx(lik["sum"][2][2] - lik["sum"][2][0], rel=1e-6)
  assert c4["seed_null"]["est"] == 0.0
  # The base run's stored episodes score under its own params as during its evaluation.
  base_rep = json.loads((base / "eval" / "sft_4" / "report.json").read_text())
  assert lik["sum"][0][0] == pytest.approx(base_rep["likelihood"]["sum"][0][0], rel=1e-5)
  # The sharpening control: every base at every sweep temperature, every RL run of the deciding
  # arms matched to its base at the sweep temperature of nearest entropy, and each claim also
  # decided against that sharpened base (secondary).
  sh = saved["sharpening"]
  sweep = sh["base_sweep"]["base"]
  h = {t: r["entropy"]["rate"] for t, r in sweep.items()}
  assert list(h) == ["1", "0.7", "0.5", "0.3", "0"] and h["0"] == 0
  assert h["1"] > h["0.3"] > 0
  for lab, m in sh["matched"].items():
    assert m["entropy_base"] == pytest.approx(h[f"{m['temperature']:g}"])
    dist = {t: abs(v - m["entropy_rl"]) for t, v in h.items()}
    assert m["base"] == "base" and dist[f"{m['temperature']:g}"] == min(dist.values())
  for n in range(1, 6):
    c = saved["claims"][str(n)]
    arm = c["decided_on"]
    assert c["sharpened"]["against"] == sh["arms"][arm]
    assert c["sharpened"]["verdict"] in ("held", "not held", "inconclusive")
  for lab in sh["runs"]:
    assert sh["runs"][lab]["pass_at_kt"]["num_tasks"] == 4
  q = saved["step_quality"]["fixed_s0"]["sampled"]["overall"]
  assert 0 <= q["oracle_prob"]["rate"] <= 1 and q["entropy"]["rate"] > 0
  md = (out / "comparison.md").read_text()
  assert "## Sharpening control: RL vs a sharpened base (secondary)" in md
  assert md.index("## Rules (fixed before the numbers)") < md.index("## Verdicts")
  for num in range(1, 6):
    assert f"### Claim {num}: **" in md
  with pytest.raises(ValueError, match="--base"):
    compare.compare({"rl": runs["fixed_s0"], "x": str(base)}, out, small_config())
  with pytest.raises(ValueError, match="same seeds"):
    compare.compare({k: v for k, v in runs.items() if k != "fixed_s1"}, out, small_config())
  visible = _copy_run(run_dir, tmp_path / "visible", "2", train_budget_visible=True)
  with pytest.raises(ValueError, match="evaluate as it was trained"):
    compare.compare({"base": str(base), "v": str(visible)}, out, small_config())


def test_launch_evaluate_script(run_dir, latest):
  """`python -m launch.evaluate` on the smoke run: a given step, into W/eval/<step>."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
  w = run_dir.parent / "launch_copy"
  shutil.copytree(run_dir / "checkpoints", w / "checkpoints")
  shutil.copy(run_dir / "config.json", w / "config.json")
  shutil.copytree(run_dir / "data", w / "data")
  args = [f"--config.eval.{k}={v}" for k, v in OVERRIDES.items()]
  proc = subprocess.run(
      [sys.executable, "-m", "launch.evaluate", "--config=configs/default.py:smoke",
       f"--workdir={w}", "--step=2", *args], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines()[-1] == str(w / "eval" / "2")
  rep = json.loads((w / "eval" / "2" / "report.json").read_text())
  assert (rep["run"]["phase"], rep["run"]["step"]) == ("rl", 2)
  assert rep["eval"]["num_tasks"] == 4 and rep["eval"]["num_samples"] == 2
  for f in EVAL_FILES:
    assert (w / "eval" / "2" / f).exists()


def test_rerun_mode_one_run_per_budget(run_dir, tmp_path):
  """Rerun mode (budget visible): one set of rollouts per listed T, the grid over those T."""
  w = tmp_path / "rerun"
  shutil.copytree(run_dir / "checkpoints", w / "checkpoints")
  shutil.copytree(run_dir / "data", w / "data")
  c = small_config()
  c.eval.mode, c.eval.rerun_budgets, c.eval.rerun_budget_visible = "rerun", "4,2", True
  rep = checkpoints.evaluate_checkpoint(c, w)
  assert rep["eval"]["mode"] == "rerun" and rep["eval"]["budget_visible"]
  g = rep["pass_at_kt"]
  assert g["t"] == [2, 4] and g["k"] == [1, 2]
  eps = np.load(pathlib.Path(rep["dir"]) / "episodes.npz")
  st = eps["success_turn_by_t"]
  assert st.shape == (2, 4, 2)
  np.testing.assert_array_equal(eps["budgets"], [2, 4])
  np.testing.assert_array_equal(eps["success_turn"], st[-1])
  # K = 1: the fraction of run j's episodes solved within budgets[j], averaged over tasks.
  np.testing.assert_allclose(g["mean"][0], [(st[0] <= 2).mean(), (st[1] <= 4).mean()])
  # The agent was told its budget: every stored episode of the last run had budget 4 and the
  # replayed states carry it.
  assert np.all(eps["traj/budget"] == 4)
  assert rep["stats"]["base"]["mean_budget"] == 4.0
  for r in _rates(rep["step_quality"]):
    assert (r["tasks"] == 0) == (r["n"] == 0) and r["tasks"] <= 4


def test_step_quality_by_environment(run_dir, tmp_path):
  """With extra environments, every policy acts on each one's oracle prefixes too, and the
  report breaks step quality down by environment (the counts add up to the overall)."""
  c = small_config()
  c.eval.extra_envs = "grid:size=4,num_traps=0,min_distance=2;arithmetic:num_ops=1"
  c.data.dir = str(tmp_path / "data")       # the extra environments' test splits go here
  ev_x = Evaluator(c, run_dir)
  assert [es.label for es in ev_x.extra] == ["grid(min_distance=2,num_traps=0,size=4)",
                                              "arithmetic(num_ops=1)"]
  rep = checkpoints.evaluate_checkpoint(c, run_dir, evaluator=ev_x)
  counts = rep["reference_states"]["extra_envs"]
  # The oracle's prefixes: grid tasks take >= 2 moves, arithmetic(num_ops=1) one call + answer.
  assert counts["grid(min_distance=2,num_traps=0,size=4)"] >= 2 * 4
  assert counts["arithmetic(num_ops=1)"] == 2 * 4
  main = rep["reference_states"]["oracle"] + rep["reference_states"]["base"]
  for who in ("policy", "base"):
    for mode in ("greedy", "sampled"):
      q = rep["step_quality"][who][mode]
      by_env = {k: v["valid"]["n"] for k, v in q["env"].items()}
      assert by_env == {"lookup": main, **counts}
      assert q["overall"]["valid"]["n"] == main + sum(counts.values())
      assert q["source"]["oracle"]["valid"]["n"] == rep["reference_states"]["oracle"] + sum(
          counts.values())
