"""`sql`: a multi-turn database agent over real SQLite, on the host path.

    env = SqlEnv(codec, db_seed=0, num_databases=16, questions_per_database=64)

env.py holds the episode (tools, grammar, answers, error kinds, oracle) and the env; pool.py the
task pool and its database files; gen.py the databases and questions; runner.py the read-only,
bounded execution of the model's SQL.
"""

from jaxagent.envs.sql.env import SqlEnv, SqlEpisode, SqlTask, answers_match  # noqa: F401
