"""The built-in CPU default: SFT a base policy from the built-in model on noisy-oracle
demonstrations, then multi-turn RL on the same environment.

    python -m launch.train --config=configs/default.py --workdir=workdirs/default
    python -m launch.train --config=configs/default.py:smoke --workdir=/tmp/smoke   # seconds
    python -m launch.train --config=configs/default.py:quick --workdir=/tmp/quick   # ~minutes

Override any key from the command line, e.g. `--config.rl.budget=mix:2,4,8,12`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "default"
  if variant not in ("default", "quick", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; use default, quick or smoke")
  c = ml_collections.ConfigDict()
  # Seed of everything random in the run (data splits have their own seed in `data`).
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  # builtin:NAME or a local Hugging Face directory.
  c.model.path = "builtin:micro"
  # Compute dtype (activations, KV cache); parameters use param_dtype.
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  # A workdir whose latest checkpoint's params initialise this run ("" = the model's weights).
  c.model.init_from = ""
  # Load weights holding NaN or Inf (logged, not refused): only to inspect a damaged checkpoint.
  c.model.allow_nonfinite_weights = False
  # The attention path: "auto" (the CPU kernel only where it measured faster than XLA here),
  # "xla" or "kernel"; "" takes JAXAGENT_CACHE_ATTENTION, else auto. A speed choice only.
  c.model.attention = ""
  # Low-rank adapters (jaxagent.models.lora): rank 0 = off (full fine-tuning); else only the
  # adapters on `targets` (comma-separated, of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,
  # down_proj) train, scaled by alpha / rank, with dropout on their inputs while training.
  # base_dtype: the frozen base "float" (as loaded), "int8" (QLoRA-style: int8 matrices with
  # per-output-channel scales, dequantised per product; ~1/4 of float32's bytes) or "gguf" (a
  # .gguf model.path's Q8_0/Q4_0/Q4_1 matrices kept in the file's blocks, dequantised per
  # product, exactly the file's values; 34/32, 18/32, 20/32 bytes per weight; other types int8).
  c.model.lora = ml_collections.ConfigDict(
      {"rank": 0, "alpha": 16.0, "dropout": 0.0, "targets": "q_proj,k_proj,v_proj,o_proj",
       "base_dtype": "float"})

  # Mesh axis sizes; -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
  # Devices the mesh spans (the first N; 0 = all).
  c.num_devices = 0

  c.env = ml_collections.ConfigDict()
  # A name from jaxagent.envs.names(), or an importable "package.module:Class" (your own
  # environment: docs/guides/environments.md#bring-your-own-environment).
  c.env.name = "grid"
  # The family's difficulty knobs (see the environment's class docstring). 5x5 maps, optimal
  # paths of 3-5 moves for most tasks, one trap; the goal's direction follows every position
  # (`hint`), which a 0.5M-parameter model learns from a few minutes of SFT.
  c.env.difficulty = ml_collections.ConfigDict(
      {"size": 5, "wall_density": 0.15, "num_traps": 1, "min_distance": 3, "hint": True})

  c.data = ml_collections.ConfigDict()
  # Where task splits and demonstrations are built ("" = <workdir>/data).
  c.data.dir = ""
  # Seed of the task splits (fixed, so every run evaluates on the same tasks).
  c.data.seed = 0
  c.data.num_train = 512
  c.data.num_validation = 64
  c.data.num_test = 128
  # Demonstrations for SFT: noisy-oracle episodes on the train tasks (per task), with errors
  # injected at demo_error_rate per turn and recovered from with demo_recovery_rate.
  c.data.demo_episodes_per_task = 2
  c.data.demo_error_rate = 0.25
  c.data.demo_recovery_rate = 0.6
  c.data.demo_max_turns = 8
  # Transcript capacity of a demonstration (tokens).
  c.data.demo_max_len = 768

  c.sft = ml_collections.ConfigDict()
  # Optimizer steps of supervised training (0 skips the phase).
  c.sft.steps = 300
  c.sft.batch_size = 16
  c.sft.learning_rate = 3e-3
  c.sft.warmup_steps = 10
  c.sft.weight_decay = 0.0
  c.sft.max_grad_norm = 1.0

  c.rl = ml_collections.ConfigDict()
  # RL updates (0 skips the phase). 20, not 30, since the study trains every arm 3 times: in the
  # 30-step runs of 2026-12-04 the training success (means over 5-step windows) peaked by steps
  # 10-20 in every arm (fixed:8 0.73-0.77, then 0.59-0.70 over steps 21-30).
  c.rl.steps = 20
  # Tasks per batch and episodes per task (a GRPO group).
  c.rl.num_tasks = 8
  c.rl.group_size = 8
  # Interaction budget spec (jaxagent.rollout.budget): fixed:T, mix:a,b,c, weighted:, schedule:.
  c.rl.budget = "fixed:8"
  # Draw the budget once per batch ("batch") or per task group ("group").
  c.rl.budget_per = "batch"
  # Tell the agent its budget and the turns left.
  c.rl.budget_visible = False
  # Sampling temperature of rollouts (log-probs use the same temperature).
  c.rl.temperature = 1.0
  # Tokens per turn, <eot> included (0 = the environment's max_action_len).
  c.rl.max_action_tokens = 0
  # Keep the frozen reference policy of the KL term in host memory between updates (it moves
  # to the device for each update's reference pass): saves one params copy of device memory.
  c.rl.reference_on_host = False
  # Learner knobs (jaxagent.learners.update.LearnerConfig). Measured on the default: at lr 1e-3
  # without KL, fixed-T RL at T=8 collapsed after 8 steps (entropy 0.3 -> 0.9, valid calls 0.56
  # -> 0.03); lr 5e-4 with a k3 KL to the base keeps it anchored. Turn-level credit
  # (jaxagent.learners.credit): advantage "gigpo" (episode + anchor-state step advantage,
  # step_weight) or "per_turn" (discounted reward-to-go, gamma, against a per-turn group
  # baseline); process rewards per turn for a valid call, the oracle's action, an error (0 = off).
  c.rl.learner = ml_collections.ConfigDict({
      "advantage": "grpo", "normalize_std": True, "loss": "ppo_clip", "clip_eps_low": 0.2,
      "clip_eps_high": 0.28, "aggregation": "token", "kl_coef": 0.05, "kl_estimator": "k3",
      "entropy_coef": 0.0, "success_reward": 1.0, "invalid_call_penalty": 0.0,
      "turn_cost": 0.0, "filter_equal_groups": False, "epochs": 1, "minibatches": 2,
      "learning_rate": 5e-4, "warmup_steps": 3, "schedule": "constant", "weight_decay": 0.0,
      "max_grad_norm": 1.0, "process_valid_call": 0.0, "process_oracle_match": 0.0,
      "process_error": 0.0, "gamma": 1.0, "step_weight": 1.0,
  })

  # The study (jaxagent.study; python -m launch.study): three RL runs from the SFT base.
  c.study = ml_collections.ConfigDict()
  # A fixed budget near the optimal number of turns (most test tasks need 3-5 moves), a generous
  # one, and the BudgetMix spec; eval.max_turns covers the largest.
  c.study.tight_budget = "fixed:4"
  c.study.generous_budget = "fixed:8"
  c.study.mix_budget = "mix:3,4,6,8"
  # Every RL arm is trained with this many seeds from the same base (seed u of every arm shares
  # its rollout keys: paired); the verdicts' intervals resample seeds, then tasks.
  c.study.seeds = 3
  # SFT bases (different seeds); RL seed u starts from base u mod base_seeds.
  c.study.base_seeds = 1
  # The claims' rules (jaxagent.eval.claims), fixed before the numbers: the smallest effect of
  # interest on rates and Pass@1 (absolute), the margin of "not worse than" (claim 3), and claim
  # 4's margin in nats per trajectory over the gap between two seeds of one arm.
  c.study.margin_effect = 0.02
  c.study.margin_non_inferiority = 0.05
  c.study.margin_loglik_nats = 1.0
  # Fewer seeds per arm, or a statistic resting on fewer tasks, reads "inconclusive".
  c.study.min_seeds = 2
  c.study.min_tasks = 10
  # More arms, each trained like the generous fixed-T arm (same seeds and tasks) but with other
  # learner settings, e.g. turn-level credit (jaxagent.learners.credit):
  # "gigpo:advantage=gigpo;process:process_valid_call=0.1,process_error=0.2" ("" = none). The
  # comparison reports each one's claims and its difference from the standard arm.
  c.study.credit_arms = ""

  # Divergence guard (beside the NaN guard): stop a run that cannot be learning after this many
  # consecutive steps of it: gradients exactly zero (SFT; RL while the advantages are not all
  # zero), or the SFT loss above loss_explode_factor x its first step's loss.
  c.guard = ml_collections.ConfigDict({"stall_steps": 5, "loss_explode_factor": 10.0})

  # Logging and checkpoints.
  c.log_every = 1
  c.checkpoint_every = 10
  c.max_to_keep = 2
  c.progress_bar = True

  # Evaluation (jaxagent.eval.checkpoints; python -m launch.evaluate --config=... --workdir=DIR).
  c.eval = ml_collections.ConfigDict()
  # Episodes per test task: n of the Pass@(K,T) estimator (K = 1..n).
  c.eval.num_samples = 8
  # T_max: the largest budget evaluated (truncation mode cuts one T_max run at every T).
  c.eval.max_turns = 8
  # "truncation" (one run at T_max, budget hidden) or "rerun" (one run per T in rerun_budgets).
  c.eval.mode = "truncation"
  # Budgets of rerun mode, comma separated, each <= max_turns.
  c.eval.rerun_budgets = "2,4,6,8"
  # Rerun mode tells the agent its budget. A comparison requires it to match the training runs'
  # rl.budget_visible (truncation mode always hides it).
  c.eval.rerun_budget_visible = False
  # Temperature of evaluation rollouts and sampled next actions; likelihoods are scored at it.
  c.eval.temperature = 1.0
  # Tokens per turn, <eot> included (0 = the environment's max_action_len).
  c.eval.max_action_tokens = 0
  # Test tasks evaluated: the first N of the fixed test split (0 = all).
  c.eval.num_tasks = 0
  # Test tasks per rollout batch (x num_samples episodes); fixed, so one program is compiled.
  c.eval.tasks_per_batch = 32
  # Reference states of step quality per source (oracle prefixes, base prefixes): a seeded
  # subset of at most this many (0 = all).
  c.eval.max_reference_states = 256
  # Error states of controlled recovery (the base's error prefixes): a seeded subset of at most
  # this many (0 = all). The default's bases leave 2,199 and 2,816 (master seeds 0 and 1). Cap
  # chosen from seed 1's comparison recomputed on random subsets (2026-12-05): the 95% interval
  # of d_rec(action errors), claims 2 and 5, is 0.099 wide with all 2,816, 0.099 and 0.104 with
  # 2,048 (two subsets), 0.113-0.114 with 1,536; the width is the seeds' and tasks' variation, not
  # the states'. Next actions on error states are ~75% of the comparison's policy analyses.
  c.eval.max_error_states = 2048
  # States per next-action batch, and trajectories per scoring batch.
  c.eval.state_batch = 64
  c.eval.score_batch = 32
  # Trajectories per policy scored in the log-likelihood matrix and claim 4: a seeded subset, the
  # same rows for every policy (0 = all). Scoring took ~35% of the default comparison at 256 (43
  # (trajectories, policy) pairs of ~620 tokens each). Claim 4's interval (x - y, nats) on seed
  # 1's comparison: 0.99 wide at 256, 0.95 and 1.17 at 128 (two subsets), dominated by the
  # seed-to-seed variation of the null.
  c.eval.likelihood_trajectories = 128
  # Bootstrap resamples and confidence level of every interval.
  c.eval.num_bootstrap = 1000
  c.eval.confidence = 0.95
  # Seed of evaluation rollouts, sampled actions and subsets (same seed: same episodes).
  c.eval.seed = 0
  # Checkpoint phase to evaluate: "rl", "sft", or "" (every phase; the latest is the last phase
  # holding a checkpoint).
  c.eval.phase = ""
  # Base policy: a workdir whose latest checkpoint is the base ("" = model.init_from, else this
  # workdir's latest SFT checkpoint when evaluating RL, else the model's own weights).
  c.eval.base_workdir = ""
  # More environments for step-level quality by environment: every policy also acts on the
  # oracle's prefixes of each one's fixed test tasks, e.g. "lookup:hops=1;arithmetic:num_ops=2"
  # (name:knob=value,...; separated by ';'; "" = only the config's environment).
  c.eval.extra_envs = ""
  # K values of the pass-vs-T curves (those <= num_samples are drawn).
  c.eval.curve_ks = "1,2,4,8"
  # The sharpening control (docs/STUDY.md): the comparison acts with every base at each of these
  # temperatures (0 = greedy) on the reference states, measures each policy's action entropy
  # there, and reports every claim also against the base at the temperature whose entropy is
  # nearest the RL run's ("RL vs a sharpened base"; secondary). "" = no sweep.
  c.eval.sharpen_temperatures = "1,0.7,0.5,0.3,0"

  if variant == "quick":
    # Under 5 minutes on a 2-core CPU: the same pipeline with fewer tasks and steps (the base
    # policy is weaker and the intervals wider than the default's).
    c.data.num_train, c.data.num_validation, c.data.num_test = 256, 16, 24
    c.data.demo_episodes_per_task = 1
    # Measured at 80 SFT and 5 RL steps: 5.6 min (SFT 2.0, RL 1.5, evaluation 1.5, comparison
    # 0.6), mostly compilation; hence 50 and 4. With 2 seeds per arm (2026-12-05, 4 RL steps,
    # all 389 error states): 8.0 min (start and SFT 1.8, RL 2.7, evaluation 0.8, comparison
    # 2.5); hence 3 RL steps and a cap of 128 error states. A fresh-clone `make run
    # VARIANT=quick` with those (2026-12-06, AMD EPYC): 6.2 min (set-up 0.75, SFT 1.5, RL 2.0,
    # evaluation 0.7, comparison 1.3); hence 40 SFT and 2 RL steps, 64 error states and 16
    # likelihood trajectories: 5.5 min (set-up 0.7, SFT 1.2, RL 1.7, evaluation 0.8, comparison
    # 1.1); hence 32 SFT steps of 12 demonstrations and 24 test tasks: 4.9 min (set-up 0.9,
    # SFT 0.7, RL 1.4, evaluation 0.7, comparison 1.1).
    c.sft.steps, c.sft.batch_size = 32, 12
    c.rl.steps, c.rl.num_tasks, c.rl.group_size = 2, 4, 8
    c.checkpoint_every = 2
    c.eval.num_samples = 4
    c.eval.tasks_per_batch, c.eval.max_reference_states, c.eval.max_error_states = 24, 64, 64
    c.eval.state_batch, c.eval.likelihood_trajectories, c.eval.num_bootstrap = 32, 16, 300
    c.study.seeds = 2
  elif variant == "smoke":
    c.env.name = "lookup"
    c.env.difficulty = ml_collections.ConfigDict({"hops": 1, "distractor_entities": 2})
    smoke_sizes(c)
  return c


def smoke_sizes(c: ml_collections.ConfigDict) -> None:
  """The smoke variant's sizes (seconds to a few minutes), on any environment: configs/sql.py's
  smoke takes them too."""
  c.data.num_train, c.data.num_validation, c.data.num_test = 64, 16, 16
  c.data.demo_episodes_per_task = 1
  c.data.demo_max_turns = 4
  c.sft.steps, c.sft.batch_size, c.sft.warmup_steps = 4, 8, 1
  c.rl.steps, c.rl.num_tasks, c.rl.group_size, c.rl.budget = 2, 2, 4, "mix:1,2"
  c.checkpoint_every = 2
  c.progress_bar = False
  c.eval.num_samples, c.eval.max_turns, c.eval.rerun_budgets = 4, 4, "2,3,4"
  c.eval.tasks_per_batch, c.eval.max_reference_states = 8, 24
  c.eval.state_batch, c.eval.score_batch, c.eval.num_bootstrap = 16, 16, 200
  c.eval.likelihood_trajectories = 0
  c.eval.curve_ks = "1,2,4"
  c.study.tight_budget, c.study.generous_budget, c.study.mix_budget = "fixed:2", "fixed:4", "mix:2,4"
  c.study.seeds, c.study.min_tasks = 2, 4
