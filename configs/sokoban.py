"""The study on `sokoban` (jaxagent/envs/sokoban.py) with the built-in model: configs/default.py's
pipeline (noisy-oracle demonstrations, an SFT base, the fixed-T and BudgetMix RL arms, evaluation,
the comparison) on the puzzle RAGEN, verl-agent and ROLL train on, where a push into a deadlock
is an irreversible error that ends the episode.

    python -m launch.study --config=configs/sokoban.py --workdir=workdirs/sokoban
    python -m launch.study --config=configs/sokoban.py:quick --workdir=/tmp/sokoban_quick
    python -m launch.study --config=configs/sokoban.py:smoke --workdir=/tmp/sokoban_smoke

Variants as in configs/default.py (default, quick, smoke), with the environment, the turn limits
and the budgets changed; `make run` takes it as `python -m launch.study --config=configs/
sokoban.py:<variant>`.
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
  # (2,000 draws: 2: 19%, 3: 22%, 4: 27%, 5: 33%; 2.2 interior walls on average), so the tight
  # budget of 5 turns leaves no slack on the longest and the generous 10 room for an error or
  # two.
  c.env.difficulty = ml_collections.ConfigDict(
      {"size": 6, "num_boxes": 1, "wall_density": 0.15, "min_moves": 2, "max_moves": 5})
  # Each step shows the board (~56 tokens with the built-in tokenizer, 144 reserved), so
  # transcripts are longer than grid's: a noisy demonstration of 10 turns takes ~940 tokens.
  c.data.demo_max_turns = 10
  c.data.demo_max_len = 1024
  c.rl.budget = "fixed:10"
  c.study.tight_budget = "fixed:5"
  c.study.generous_budget = "fixed:10"
  c.study.mix_budget = "mix:3,5,7,10"
  c.eval.max_turns = 10
  c.eval.rerun_budgets = "3,5,7,10"
  if variant == "smoke":
    # Seconds-long, as configs/default.py's smoke (which switches to lookup): starts 1-3 moves
    # away so the smoke's budgets (2, 4) can solve some.
    c.env.difficulty = ml_collections.ConfigDict(
        {"size": 6, "num_boxes": 1, "wall_density": 0.15, "min_moves": 1, "max_moves": 3})
    c.data.demo_max_turns = 4
    c.data.demo_max_len = 768
    c.rl.budget = "mix:1,2"
    c.study.tight_budget, c.study.generous_budget, c.study.mix_budget = (
        "fixed:2", "fixed:4", "mix:2,4")
    c.eval.max_turns, c.eval.rerun_budgets = 4, "2,3,4"
  return c
