"""The study on `sokoban` (jaxagent/envs/sokoban.py) with the built-in model: configs/default.py's
pipeline (noisy-oracle demonstrations, an SFT base, the fixed-T and BudgetMix RL arms, evaluation,
the comparison) on the puzzle RAGEN, verl-agent and ROLL train on, where a push into a deadlock
is an irreversible error that ends the episode.

    python -m launch.study --config=configs/sokoban.py --workdir=workdirs/sokoban
    python -m launch.study --config=configs/sokoban.py:quick --workdir=/tmp/sokoban_quick
    python -m launch.study --config=configs/sokoban.py:smoke --workdir=/tmp/sokoban_smoke

Variants as in configs/default.py (default, quick, smoke), with the environment, the budgets and
(default) the sizes changed.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or "default"
  if variant not in ("default", "quick", "smoke"):
    raise ValueError(f"unknown variant {variant!r}; use default, quick or smoke "
                     "(configs/sokoban.py:<variant>)")
  c = default.get_config(variant)
  c.env.name = "sokoban"
  # One box in a 6 x 6 room (4 x 4 inside), RAGEN's standard size; starts 2-5 moves from solved
  # (2,000 draws: 2: 19%, 3: 22%, 4: 27%, 5: 33%; 2.2 interior walls on average). The budgets
  # keep the default's T = 8 ceiling: the tight 5 leaves no slack on the longest starts, the
  # generous 8 room for two or three errors.
  c.env.difficulty = ml_collections.ConfigDict(
      {"size": 6, "num_boxes": 1, "wall_density": 0.15, "min_moves": 2, "max_moves": 5})
  # Each step shows the board (~56 tokens with the built-in tokenizer; the engine reserves 144
  # a turn, grid's 126), so transcripts are longer than grid's: a noisy demonstration of 8 turns
  # takes up to ~830 tokens (the SFT batches are cut to the longest one).
  c.data.demo_max_len = 1024
  c.rl.budget = "fixed:8"
  c.study.tight_budget = "fixed:5"
  c.study.generous_budget = "fixed:8"
  c.study.mix_budget = "mix:3,5,6,8"
  c.eval.rerun_budgets = "3,5,6,8"
  if variant == "default":
    # Sized for <= 45 minutes on the 2-core CPU, from grid's default (43.8 min alone: SFT 6.7,
    # RL 21.2, evaluation 6.4, comparison 9.4) scaled by sokoban's cost. Measured side by side
    # (2026-12-07, 2-core AMD EPYC shared with other jobs, load ~12), the quick variants took
    # 635 s (grid) and 656 s wall, 214 s and 262 s of CPU (x1.22; budgets 5/10 and T = 10 then);
    # longer sequences make the compute-bound default costlier than the compile-bound quick, so
    # ~x1.3 is assumed: 240 SFT steps (300), 15 RL steps (20), 1,536 error states (2,048) and 96
    # likelihood trajectories (128) bring the estimate to ~44 min. An estimate, not a
    # measurement: the full study was not run.
    c.sft.steps = 240
    c.rl.steps = 15
    c.eval.max_error_states = 1536
    c.eval.likelihood_trajectories = 96
  if variant == "smoke":
    # The smallest run, as configs/default.py's smoke (which switches to lookup): starts 1-3
    # moves away so the smoke's budgets (2, 4) can solve some.
    c.env.difficulty = ml_collections.ConfigDict(
        {"size": 6, "num_boxes": 1, "wall_density": 0.15, "min_moves": 1, "max_moves": 3})
    c.data.demo_max_len = 768
    c.rl.budget = "mix:1,2"
    c.study.tight_budget, c.study.generous_budget, c.study.mix_budget = (
        "fixed:2", "fixed:4", "mix:2,4")
    c.eval.max_turns, c.eval.rerun_budgets = 4, "2,3,4"
  return c
