"""`sql`: a multi-turn database agent over real SQLite (Python's `sqlite3`), on the host path.

A task is a question about a small database (pool.py, gen.py); the agent explores the schema,
runs read-only queries and answers with one value. Tools (one call per turn; the action is free
text, handed whole to the episode through `act_text`):

    list_tables()          the database's table names
    describe(table)        a table's columns, types and foreign keys
    query(sql)             runs one read-only SQL statement: the real result rows (at most
                           `result_rows`, cells cut to `result_cell_chars`) or SQLite's error text
    answer(value)          the final answer; ends the episode

Grammar: optional whitespace, a tool name `[A-Za-z_][A-Za-z0-9_]*`, optional whitespace, "(",
the raw argument text up to the *final* ")", optional whitespace; so `query(SELECT a, b FROM t
WHERE x = 'p, q')` hands `SELECT a, b FROM t WHERE x = 'p, q'` to SQLite untouched.
`describe` and `answer` strip their argument of whitespace and one pair of quotes (' " `).

Answer comparison (`answers_match`): both sides lose surrounding whitespace and one pair of
quotes, inner whitespace runs become one space; if both then read as decimal numbers they match
when within 0.005 (gold averages and money totals are rounded to 2 decimals, so 12.35, 12.350
and 12.3456 all answer 12.35), else they match when equal ignoring case.

Error kinds: parse_error (not `name(...)`, over `max_action_bytes`, not UTF-8), unknown_tool,
bad_arguments (an argument to list_tables, no or a malformed table name for describe, an empty
query or answer), tool_failure (describe of a table that does not exist; a query SQLite rejects
or stops: syntax errors, no such table or column, a write or ATTACH or PRAGMA refused by the
authorizer, several statements, the step, length or memory limits; see runner.py),
wrong_answer (ends the episode). A query that runs and returns no rows or the wrong rows is not
an error.

The gold path (`oracle`): list_tables unless the prompt names the tables, describe each table the
gold query reads unless the prompt shows the columns, the gold query, then its value as the
answer; `optimal_turns` is its length. `oracle_match` is set when the action does what the oracle
would do in that state: the same tool, a not yet described table the gold query reads (any
order), a query whose one-row result shows the gold value, the right answer once seen.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs import common
from jaxagent.envs.base import ErrorKind
from jaxagent.envs.codec import TRUNCATION_MARKER, TextCodec
from jaxagent.envs.host import HostEnv, Outcome
from jaxagent.envs.sql import pool as pool_lib
from jaxagent.envs.sql.runner import Limits, run_query

TOOLS = ("list_tables", "describe", "query", "answer")
SYSTEM_TEXT = (
    "You answer a question about a SQLite database by calling tools, one call per turn.\n"
    "Tools:\n"
    "list_tables(): the names of the tables.\n"
    "describe(table): the columns of a table.\n"
    "query(sql): runs one read-only SQL query and shows the result.\n"
    "answer(value): gives your final answer, a single value, and ends the episode.")
PARSE_MESSAGE = "could not parse the action. Reply with one tool call, e.g. query(SELECT ...)."
UNKNOWN_TOOL_MESSAGE = "unknown tool. The tools are list_tables, describe, query and answer."
ARG_MESSAGES = {
    "list_tables": "list_tables takes no arguments: list_tables().",
    "describe": "describe takes one table name: describe(table).",
    "query": "query takes one SQL query: query(SELECT ...).",
    "answer": "answer takes one value: answer(value).",
}
_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*", re.DOTALL)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_TYPO = {"list_tables": "list_table", "describe": "describe_table", "query": "querry",
         "answer": "final_answer"}


def _unquote(s: str) -> str:
  s = s.strip()
  return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"`" else s


def normalize_answer(s: str) -> str:
  """An answer as compared: unquoted, whitespace runs collapsed, casefolded."""
  return " ".join(_unquote(" ".join(s.split())).split()).casefold()


def answers_match(given: str, gold: str) -> bool:
  """Whether `given` answers `gold` (see the module docstring)."""
  a, b = normalize_answer(given), normalize_answer(gold)
  if _NUMBER.fullmatch(a) and _NUMBER.fullmatch(b):
    x, y = float(a), float(b)
    return math.isfinite(x) and abs(x - y) <= 0.005 + 1e-9 * abs(y)
  return a == b


def parse_action(text: str | None) -> tuple[str, str] | None:
  """(tool name, raw argument text) of an action, or None if it is not `name(...)`."""
  if text is None:
    return None
  m = _CALL.fullmatch(text)
  return (m.group(1), m.group(2)) if m else None


@struct.dataclass
class SqlTask:
  """One task of an `SqlEnv`: its index into the env's pool."""
  task_id: jax.Array   # [] int32


class SqlEpisode:
  """One episode: the tools on one read-only database file (see the module docstring)."""

  def __init__(self, task: pool_lib.PoolTask, path: str, limits: Limits):
    self.task, self.path, self.limits = task, path, limits
    self.q = task.question
    self.names = pool_lib.table_names(task.domain)
    self.optimal_turns = task.optimal_turns
    self.listed = task.schema != "none"                       # the table names are known
    self.described = set(self.names) if task.schema == "full" else set()
    self.seen = False                                         # a query showed the gold value

  def prompt(self):
    user = ["Question: ", self.q.text]
    if self.task.schema == "full":
      user += ["\nSchema:\n", pool_lib.schema_text(self.task.domain)]
    elif self.task.schema == "names":
      user += ["\nTables: ", ", ".join(self.names), "."]
    return [SYSTEM_TEXT], user

  def next_step(self) -> tuple[str, str]:
    """The oracle's next (tool, argument)."""
    if self.seen:
      return "answer", self.q.answer
    if not self.listed:
      return "list_tables", ""
    for t in self.q.tables:
      if t not in self.described:
        return "describe", t
    return "query", self.q.sql

  def oracle(self) -> list[str]:
    tool, arg = self.next_step()
    return [tool, "(", arg, ")"]

  def act_text(self, text: str | None) -> Outcome:
    parsed = parse_action(text)
    if parsed is None:
      return Outcome(["Error: ", PARSE_MESSAGE], ErrorKind.PARSE_ERROR)
    tool, raw = parsed
    if tool not in TOOLS:
      return Outcome(["Error: ", UNKNOWN_TOOL_MESSAGE], ErrorKind.UNKNOWN_TOOL)
    bad = Outcome(["Error: ", ARG_MESSAGES[tool]], ErrorKind.BAD_ARGUMENTS)
    next_tool, _ = self.next_step()
    if tool == "list_tables":
      if raw.strip():
        return bad
      match = next_tool == "list_tables"
      self.listed = True
      return Outcome(["Tables: ", ", ".join(self.names), "."], oracle_match=match)
    if tool == "describe":
      name = _unquote(raw)
      if not _IDENT.fullmatch(name):
        return bad
      table = next((t for t in self.names if t.lower() == name.lower()), None)
      if table is None:
        return Outcome(["Error: ", "no such table: ", name], ErrorKind.TOOL_FAILURE)
      match = next_tool == "describe" and table in self.q.tables and table not in self.described
      self.described.add(table)
      return Outcome([pool_lib.schema_text(self.task.domain, table)], oracle_match=match)
    if tool == "query":
      sql = raw.strip()
      if not sql:
        return bad
      result = run_query(self.path, sql, self.limits)
      if not result.ok:
        return Outcome(["Error: ", result.text], ErrorKind.TOOL_FAILURE)
      shows = len(result.rows) == 1 and any(answers_match(c, self.q.answer) for c in result.rows[0])
      match = next_tool == "query" and shows
      self.seen = self.seen or shows
      return Outcome([result.text], oracle_match=match)
    value = _unquote(raw)
    if not value:
      return bad
    if answers_match(value, self.q.answer):
      return Outcome(["Correct."], solved=True, final_answer=True,
                     oracle_match=next_tool == "answer")
    return Outcome(["Wrong answer."], ErrorKind.WRONG_ANSWER, final_answer=True)

  def error_actions(self) -> list[tuple[ErrorKind, list[str]]]:
    """Plausible erroneous actions in this state and the error kind each makes (for the
    noisy-oracle demonstrations, which draw a kind uniformly, then an action of it): a malformed
    call (a missing parenthesis) and a misspelt tool at every step; a bad argument at the
    list_tables, describe and answer steps; the real tool's failures at a describe step (a table
    in the singular) and a query step (a misspelt column, a syntax slip, a table in the
    singular), where they are one kind in three."""
    tool, arg = self.next_step()
    good = f"{tool}({arg})"
    broken = good[:-1] if not good[:-1].endswith(")") else f"{tool} {arg})"
    out = [(ErrorKind.PARSE_ERROR, [broken]),
           (ErrorKind.UNKNOWN_TOOL, [f"{_TYPO[tool]}({arg})"])]
    if tool == "query":
      return out + [(ErrorKind.TOOL_FAILURE, [f"query({s})"])
                    for s in sql_slips(arg, self.task.domain)]
    out.append((ErrorKind.BAD_ARGUMENTS,
                ["list_tables(all)" if tool == "list_tables" else f"{tool}()"]))
    if tool == "describe":
      out.append((ErrorKind.TOOL_FAILURE, [f"describe({arg[:-1]})"]))
    return out


def sql_slips(sql: str, domain: str) -> list[str]:
  """Real mistakes on a gold query, each of which SQLite rejects: a misspelt column (its
  underscore dropped, or an "s" added), a syntax slip (FROM written FORM, or a string literal's
  closing quote dropped), and a table named in the singular."""
  tables = pool_lib.table_names(domain)
  columns = {c.name for t in pool_lib.gen.DOMAINS[domain] for c in t.cols} | {"id"}
  used = [w for w in dict.fromkeys(re.findall(r"[A-Za-z_]+", sql)) if w in columns]
  out = []
  col = next((w for w in used if w != "id"), used[0])
  wrong = col.replace("_", "") if "_" in col else col + "s"
  out.append(re.sub(rf"\b{col}\b", wrong, sql, count=1))
  quote = sql.rfind("'")
  out.append(sql[:quote] + sql[quote + 1:] if quote >= 0 else sql.replace("FROM", "FORM", 1))
  t = next(w for w in re.findall(r"(?:FROM|JOIN) ([a-z_]+)", sql) if w in tables)
  out.append(re.sub(rf"\b(FROM|JOIN) {t}\b", rf"\1 {t[:-1]}", sql, count=1))
  return out


class SqlEnv(HostEnv):
  """`sql` on the host path (see the module docstring; pool.py for the tasks).

  Knobs: db_seed (of the databases and questions; not named `seed`, which the pipeline passes
  beside the knobs), num_databases, questions_per_database (pool size = their product), min_tables /
  max_tables (tables a gold query reads, 1-3), schema (full, names, none or mix: what the prompt
  shows), result_rows / result_cell_chars / result_chars (what a query shows), query_steps (a
  query's VM-instruction budget), max_action_bytes, max_action_len (0: the longest oracle action
  plus a margin), max_step_obs_len (0: room for a full result), cache_dir (database files; "":
  $JAXAGENT_SQL_CACHE or ~/.cache/jaxagent/sql)."""
  name = "sql"

  def __init__(self, codec: TextCodec, db_seed: int = 0, num_databases: int = 16,
               questions_per_database: int = 64, min_tables: int = 1, max_tables: int = 3,
               schema: str = "mix", result_rows: int = 8, result_cell_chars: int = 40,
               result_chars: int = 600, query_steps: int = 1_000_000, max_action_bytes: int = 512,
               max_action_len: int = 0, max_step_obs_len: int = 0, cache_dir: str = ""):
    self.pool = pool_lib.build_pool(db_seed, num_databases, questions_per_database, min_tables,
                                    max_tables, schema, cache_dir)
    self.limits = Limits(rows=result_rows, cell_chars=result_cell_chars,
                         result_chars=result_chars, steps=query_steps)
    self.optimal = np.asarray([t.optimal_turns for t in self.pool.tasks], np.int32)
    enc = lambda s: len(codec.encode_text(s))
    wrap = sum(len(np.asarray(p.tokens)) for p in codec.observation([]))
    intro = sum(len(x) for x in common.budget_intro_host(codec, 10 ** 9 - 1))
    prompt_wrap = sum(len(np.asarray(p.tokens)) for p in codec.prompt([], []))
    prompts = (self._episode_of(i).prompt() for i in range(len(self.pool.tasks)))
    longest_prompt = max(sum(map(enc, s)) + sum(map(enc, u)) for s, u in prompts)
    n_prompt = prompt_wrap + longest_prompt + intro
    if max_action_len <= 0:
      longest = max(sum(map(enc, ["query", "(", t.question.sql, ")"])) for t in self.pool.tasks)
      max_action_len = -(-(longest + 16) // 8) * 8
    if max_step_obs_len <= 0:
      suffix = sum(len(x) for x in common.budget_suffix_host(codec, 10 ** 9 - 1, 0))
      max_step_obs_len = -(-(wrap + suffix + enc(TRUNCATION_MARKER) + result_chars + 32) // 8) * 8
    super().__init__(codec, lambda task: self._episode_of(int(task.task_id)),
                     max_obs_len=-(-max(n_prompt, max_step_obs_len) // 8) * 8,
                     max_action_len=max_action_len, max_action_bytes=max_action_bytes, name="sql",
                     max_step_obs_len=max_step_obs_len)

  def _episode_of(self, i: int) -> SqlEpisode:
    if not 0 <= i < len(self.pool.tasks):
      raise ValueError(f"sql: task_id {i} is outside this env's pool of {len(self.pool.tasks)} "
                       "tasks; sample tasks with this env (same seed and pool knobs)")
    task = self.pool.tasks[i]
    return SqlEpisode(task, self.pool.paths[task.db], self.limits)

  def sample_task(self, key: jax.Array) -> SqlTask:
    """A uniformly drawn task of the pool (pure; vmap over keys for a batch)."""
    return SqlTask(task_id=jax.random.randint(key, (), 0, len(self.pool.tasks), jnp.int32))

  def sample_tasks(self, key: jax.Array, batch: int) -> SqlTask:
    """B tasks as numpy (host helper, as `HostLookupEnv.sample_tasks`)."""
    return jax.tree.map(np.asarray, jax.vmap(self.sample_task)(jax.random.split(key, batch)))

  def optimal_turns(self, task: SqlTask) -> jax.Array:
    """The task's gold path length (jittable)."""
    return jnp.asarray(self.optimal)[task.task_id]
