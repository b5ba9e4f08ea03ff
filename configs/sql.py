"""The study on `sql` (a database agent over real SQLite, jaxagent/envs/sql) with the built-in
model: configs/default.py's pipeline (noisy-oracle demonstrations, an SFT base, the three RL arms,
evaluation, the comparison) on another family.

    python -m launch.study --config=configs/sql.py --workdir=workdirs/sql
    python -m launch.study --config=configs/sql.py:quick --workdir=/tmp/sql_quick
    python -m launch.train --config=configs/sql.py:smoke --workdir=/tmp/sql_smoke

Tasks: 16 databases x 64 questions (1,024 tasks; the splits draw 512 + 64 + 128 distinct ones),
gold paths of 2-6 turns (on this pool: 2 turns 319 tasks, 3 93, 4 212, 5 264, 6 136). The
built-in tokenizer spells SQL about one token a character: oracle transcripts are 674 / 817 / 877
tokens (mean / p90 / max), 128 of them the agent's on average, and an action takes up to 184
tokens (a 3-table join), so a turn costs ~10x a `grid` turn's decoding. A query shows at most 4
rows and 160 characters here (result_rows, result_chars), so an observation fits 240 tokens and
an 8-turn rollout 4,024 (the prompt <= 624, then 184 + 240 a turn; the model's context is 4,096).

Budgets: the gold path needs 2-6 turns, so the tight budget (fixed:4) cuts the 5- and 6-turn
tasks (39% of the pool), the generous one (fixed:8) leaves room for two recoveries, and the mix
spans both.

Sizes (default): measured 2026-12-07 on this project's 2-core AMD EPYC while other helpers' runs
kept the load average at 12-14 (so every figure is inflated): building the task splits and 1,024
noisy-oracle demonstrations 2.5 min, SFT 3.5-5 s a step (8 demonstrations of <= 1,536 tokens),
RL 9-11 s of rollout and 50-70 s of update a step at 4 tasks x 8 episodes (the first step ~35 s
more for compilation). Hence 100 SFT steps (~7 min), RL at 4 x 4 episodes for 4 steps (~2.5 min a
run, six runs ~15 min), evaluation on 64 test tasks x 4 samples, and small caps on the
comparison's states: ~40 min estimated in all. The comparison itself could not be timed yet:
it replays the oracle through forced-action rollouts, which need a JAX-native environment
(rollout/api.py) until the host path has them.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "default"
  if variant not in ("default", "quick", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; use default, quick or smoke "
                     "(configs/sql.py:<variant>)")
  c = default.get_config(variant if variant != "smoke" else "default")
  c.env.name = "sql"
  c.env.difficulty = ml_collections.ConfigDict({
      "db_seed": 0, "num_databases": 16, "questions_per_database": 64, "min_tables": 1,
      "max_tables": 3, "schema": "mix", "result_rows": 4, "result_cell_chars": 24,
      "result_chars": 160})
  # Room for the 6-turn gold path and injected errors with their recoveries.
  c.data.demo_max_turns = 10
  c.data.demo_max_len = 1536
  c.study.tight_budget = "fixed:4"
  c.study.generous_budget = "fixed:8"
  c.study.mix_budget = "mix:3,4,6,8"
  c.eval.max_turns = 8
  c.eval.rerun_budgets = "2,4,6,8"
  if variant == "default":
    # Sized for <= 45 minutes on the 2-core CPU (see "Sizes" in the module docstring).
    c.sft.steps, c.sft.batch_size = 100, 8
    c.rl.steps, c.rl.num_tasks, c.rl.group_size = 4, 4, 4
    c.checkpoint_every = 2
    c.study.seeds = 2
    c.eval.num_tasks, c.eval.num_samples, c.eval.tasks_per_batch = 64, 4, 16
    c.eval.max_reference_states, c.eval.max_error_states = 64, 128
    c.eval.state_batch, c.eval.score_batch = 32, 16
    c.eval.likelihood_trajectories, c.eval.num_bootstrap = 16, 500
  elif variant == "quick":
    # default.py's quick sizes with RL groups of 4 episodes (an sql RL update costs ~2 s an
    # episode on the loaded 2-core CPU): ~15 minutes estimated, not measured end to end.
    c.rl.num_tasks, c.rl.group_size = 2, 4
  elif variant == "smoke":
    # Seconds to a few minutes: one table, the schema in the prompt (2-turn tasks), few tasks.
    c.env.difficulty = ml_collections.ConfigDict({
        "db_seed": 0, "num_databases": 4, "questions_per_database": 32, "min_tables": 1,
        "max_tables": 1, "schema": "full", "result_rows": 3, "result_cell_chars": 24,
        "result_chars": 120})
    default.smoke_sizes(c)
    c.data.demo_max_len = 1024
    c.rl.budget = "mix:2,3"
  return c
