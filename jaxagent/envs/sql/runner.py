"""Read-only, bounded execution of untrusted SQL (the model's) on a database file.

Every query gets its own connection (so episodes stepped from several threads share nothing),
opened and guarded as follows before the query text is compiled:
  * `file:<path>?mode=ro` (the OS-level read-only open) and `PRAGMA query_only=ON`;
  * an authorizer that allows only reading: SELECT, reading columns, recursive CTEs, functions
    other than those in `DENIED_FUNCTIONS`, and the read-only schema pragmas in
    `READ_PRAGMAS`; everything else (every write statement, CREATE/DROP/ALTER, ATTACH/DETACH,
    transactions, ANALYZE, VACUUM, any other PRAGMA, a pragma write) is denied when the
    statement is compiled, so it never runs;
  * extension loading off (`enable_load_extension(False)`, where this sqlite3 build has it)
    and `SQLITE_LIMIT_ATTACHED` = 0;
  * a progress handler that stops the query after `Limits.steps` virtual-machine instructions
    (a recursive CTE that never ends stops in tens of milliseconds);
  * `SQLITE_LIMIT_LENGTH` = `Limits.value_bytes` (no string or blob over it: `zeroblob(1e9)`,
    `printf('%.*c', ...)`, a runaway `group_concat` fail), temporary storage in memory, and a
    hard heap limit (`PRAGMA hard_heap_limit`, process-wide: it only ever lowers SQLite's limit,
    and bounds sorting a huge intermediate result in memory);
  * one statement only (Python's sqlite3 refuses a second one before running anything);
  * results read with `fetchmany(rows + 1)`, never `fetchall`: at most `Limits.rows` rows shown,
    each cell cut to `Limits.cell_chars` characters, the table text cut to `Limits.result_chars`.
Anything refused or failed comes back as SQLite's error text (`Result(ok=False)`), never as an
exception; the database file is never opened for writing.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
import threading

from jaxagent.envs.sql.gen import show_value

READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info",
                          "index_xinfo", "foreign_key_list"})
# load_extension and fts3_tokenizer reach native code; printf / format build a string of any
# width inside one VM instruction (printf('%.*c', 1e9, 'x') runs ~9 s before the length check),
# which no progress handler can stop.
DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "printf", "format"})
_ALLOWED = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_HEAP_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Limits:
  """Caps of one query: result rows / cell characters / table characters shown, VM instructions
  (progress-handler steps), bytes of any string or blob, SQLite's heap (process-wide)."""
  rows: int = 8
  cell_chars: int = 40
  result_chars: int = 600
  steps: int = 1_000_000
  value_bytes: int = 20_000
  heap_bytes: int = 256 << 20


@dataclasses.dataclass(frozen=True)
class Result:
  ok: bool
  text: str                 # the result table, or the error message (without "Error: ")
  rows: tuple = ()          # the rows shown (cells as printed), for comparing with the gold


def _authorize(action, arg1, arg2, db_name, trigger):
  """SQLite's authorizer callback: allow reading, deny everything else (see the docstring)."""
  del db_name, trigger
  if action in _ALLOWED:
    return sqlite3.SQLITE_OK
  if action == sqlite3.SQLITE_FUNCTION:   # arg2: the function's name
    return sqlite3.SQLITE_DENY if (arg2 or "").lower() in DENIED_FUNCTIONS else sqlite3.SQLITE_OK
  if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in READ_PRAGMAS:
    return sqlite3.SQLITE_OK
  return sqlite3.SQLITE_DENY


# The progress handler runs every this many SQLite VM steps and counts one call.
_STEPS_PER_CALL = 1000


def _lower_heap_limit(conn: sqlite3.Connection, limit: int) -> None:
  with _HEAP_LOCK:
    current = conn.execute("PRAGMA hard_heap_limit").fetchone()[0]
    if current == 0 or current > limit:
      conn.execute(f"PRAGMA hard_heap_limit = {int(limit)}")


def connect(path: str | pathlib.Path, limits: Limits) -> tuple[sqlite3.Connection, list]:
  """A guarded read-only connection (see the module docstring) and its step counter [calls]."""
  uri = pathlib.Path(path).resolve().as_uri() + "?mode=ro"
  conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
  conn.text_factory = lambda b: b.decode("utf-8", "replace")
  if hasattr(conn, "enable_load_extension"):
    conn.enable_load_extension(False)
  conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
  conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.value_bytes)
  conn.execute("PRAGMA query_only = ON")
  conn.execute("PRAGMA temp_store = MEMORY")
  _lower_heap_limit(conn, limits.heap_bytes)
  conn.set_authorizer(_authorize)
  calls = [0]

  def progress():
    calls[0] += 1
    return calls[0] * _STEPS_PER_CALL > limits.steps   # nonzero: SQLite stops the query

  conn.set_progress_handler(progress, _STEPS_PER_CALL)
  return conn, calls


def _cell(v, limits: Limits) -> str:
  s = show_value(v).replace("\\", "\\\\")
  s = s.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
  return s if len(s) <= limits.cell_chars else s[:limits.cell_chars] + "..."


def _error_text(e: BaseException, calls: list, limits: Limits) -> str:
  msg = str(e) or type(e).__name__
  if isinstance(e, MemoryError):
    return "out of memory: the query needs too much memory; select fewer or smaller rows"
  if msg == "interrupted" and calls[0] * _STEPS_PER_CALL > limits.steps:
    return (f"interrupted: the query ran past the limit of {limits.steps} steps; "
            "add a condition or a LIMIT")
  if msg.startswith("not authorized"):
    return f"{msg}: the database is read-only; only one SELECT statement runs"
  if msg.startswith("You can only execute one statement"):
    return "you can only execute one statement at a time"
  return msg


def run_query(path: str | pathlib.Path, sql: str, limits: Limits) -> Result:
  """Runs one untrusted query read-only within `limits`: the shown table, or SQLite's error."""
  calls = [0]
  conn = None
  try:
    conn, calls = connect(path, limits)
    cur = conn.execute(sql)
    if cur.description is None:
      return Result(True, "(no result)")
    header = " | ".join(_cell(d[0], limits) for d in cur.description)
    fetched = cur.fetchmany(limits.rows + 1)
    rows = tuple(tuple(_cell(v, limits) for v in r) for r in fetched[:limits.rows])
    cur.close()
  except (sqlite3.Error, sqlite3.Warning, MemoryError, ValueError, OverflowError) as e:
    return Result(False, _error_text(e, calls, limits))
  finally:
    if conn is not None:
      conn.close()
  lines = [header] + [" | ".join(r) for r in rows]
  if len(fetched) > limits.rows:
    lines.append(f"(more rows; showing the first {limits.rows})")
  else:
    lines.append("(no rows)" if not rows else f"({len(rows)} row{'s' * (len(rows) != 1)})")
  text = "\n".join(lines)
  if len(text) > limits.result_chars:
    text = text[:limits.result_chars] + "\n(result cut)"
  return Result(True, text, rows)
