"""Helpers every text environment shares: action parsing on bytes, budget text, step bookkeeping.

Action grammar (parsed on the bytes of the generated tokens, inside jit):

    action  := ws* name ws* "(" args ")" ws*
    name    := [A-Za-z0-9_]+
    args    := ws*                         (no arguments)
             | arg ("," arg)*              (arguments are split on every comma)
    arg     := ws* text ws*                (surrounding spaces stripped; one pair of matching
                                            '...' or "..." quotes around text is stripped too)

`text` may not contain '(' or ')'; the whole action must be printable ASCII plus space, tab and
newlines (other bytes, including invalid UTF-8 and the 0xFF of out-of-vocabulary ids, make it a
parse error), and must fit the environment's byte limit. Names and string arguments compare
exactly (case-sensitive) against `ByteTable`s of known strings; integers are non-negative decimal
(digits only, at most 9).

Budget convention (`reset(key, task, budget)`): budget -1 hides the budget; budget >= 0 makes the
first observation's user turn end with "\\nYou have N turns." (N == 1: "turn.") and every later
observation body end with "\\nTurns left: k." (k = budget - turns taken, floored at 0). The
environment only shows the budget: ending an episode whose budget is spent is the rollout engine's
job alone (`jaxagent.rollout.engine`), for visible and hidden budgets alike.

Environment state contract used by `finish_step`: a `flax.struct.dataclass` with fields
`turn` (int32, turns taken), `budget` (int32, -1 hidden) and `done` (bool).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import ByteTable, Piece, Row, TextCodec, concat, cumsum, mask_piece

MAX_INT_DIGITS = 9  # parse_uint's limit: 999_999_999 fits int32


@struct.dataclass
class ParsedCall:
  """An action parsed as `name(arg, ...)`. Argument k is data[arg_start[k]:arg_start[k]+arg_len[k]]."""
  syntax_ok: jax.Array   # [] bool: the action matches the grammar
  tool: jax.Array        # [] int32: index of the name in the tool table; -1 if unknown/unparsed
  num_args: jax.Array    # [] int32: number of comma-separated arguments (may exceed A)
  arg_start: jax.Array   # [A] int32
  arg_len: jax.Array     # [A] int32 (0 for empty or absent arguments)
  data: jax.Array        # [M] uint8: the action's bytes
  nbytes: jax.Array      # [] int32: total bytes of the action (may exceed M: then not syntax_ok)


def _isin(b, chars: bytes):
  return functools.reduce(jnp.logical_or, [b == c for c in chars])


def parse_call(data: jax.Array, nbytes: jax.Array, tools: ByteTable, max_args: int) -> ParsedCall:
  """Parses action bytes (data [M] uint8, nbytes []) by the grammar above. Jittable; never fails.

  Returns a `ParsedCall` with A = max_args argument slots; `tool` is -1 unless the syntax is ok
  and the name is in `tools`.
  """
  m = data.shape[0]
  idx = jnp.arange(m, dtype=jnp.int32)
  b = data.astype(jnp.int32)
  valid = idx < jnp.minimum(nbytes, m)
  ws = _isin(b, b" \t\n\r")
  clean = jnp.all(~valid | ((b >= 32) & (b <= 126)) | ws)
  content = valid & ~ws
  first = jnp.argmax(content).astype(jnp.int32)
  last = jnp.max(jnp.where(content, idx, -1))
  is_open, is_close = valid & (b == ord("(")), valid & (b == ord(")"))
  open_ = jnp.argmax(is_open).astype(jnp.int32)
  one_pair = (is_open.sum() == 1) & (is_close.sum() == 1)
  close_last = data[jnp.clip(last, 0, m - 1)] == ord(")")
  name_last = jnp.max(jnp.where((idx >= first) & (idx < open_) & ~ws, idx, -1))
  name_len = jnp.maximum(name_last - first + 1, 0)
  ident = ((b >= ord("a")) & (b <= ord("z"))) | ((b >= ord("A")) & (b <= ord("Z"))) | (
      (b >= ord("0")) & (b <= ord("9"))) | (b == ord("_"))
  name_ok = (name_len > 0) & jnp.all(~((idx >= first) & (idx <= name_last)) | ident)
  syntax_ok = (nbytes <= m) & clean & jnp.any(content) & one_pair & close_last & name_ok

  inside = (idx > open_) & (idx < last)
  comma = inside & (b == ord(","))
  arg_id = cumsum(comma.astype(jnp.int32)) - comma                              # commas before each byte
  num_args = jnp.where(jnp.any(inside & ~ws), comma.sum() + 1, 0).astype(jnp.int32)
  k = jnp.arange(max_args, dtype=jnp.int32)[:, None]
  in_arg = inside[None, :] & ~comma[None, :] & ~ws[None, :] & (arg_id[None, :] == k)  # [A, M]
  start = jnp.min(jnp.where(in_arg, idx[None, :], m), axis=1)
  end = jnp.max(jnp.where(in_arg, idx[None, :], -1), axis=1)
  length = jnp.maximum(end - start + 1, 0)
  c0, c1 = data[jnp.clip(start, 0, m - 1)], data[jnp.clip(end, 0, m - 1)]
  quoted = (length >= 2) & (c0 == c1) & ((c0 == ord('"')) | (c0 == ord("'")))
  start = jnp.where(quoted, start + 1, start)
  length = jnp.where(quoted, length - 2, length)
  start = jnp.clip(start, 0, m - 1).astype(jnp.int32)

  tool = jnp.where(syntax_ok, match_name(data, first, name_len, tools), -1)
  return ParsedCall(syntax_ok=syntax_ok, tool=tool.astype(jnp.int32), num_args=num_args,
                    arg_start=start, arg_len=length.astype(jnp.int32), data=data,
                    nbytes=jnp.asarray(nbytes, jnp.int32))


def parse_action(codec: TextCodec, action: TokenBuffer, tools: ByteTable, max_args: int,
                 max_bytes: int) -> ParsedCall:
  """Action tokens -> bytes (at most max_bytes) -> `parse_call`. Jittable."""
  data, nbytes = codec.to_bytes(action, max_bytes)
  return parse_call(data, nbytes, tools, max_args)


def match_name(data: jax.Array, start: jax.Array, length: jax.Array, table: ByteTable) -> jax.Array:
  """Index of the string data[start:start+length] in `table`, or -1. Exact byte match. Jittable."""
  m = data.shape[0]
  w = table.data.shape[1]
  j = jnp.arange(w, dtype=jnp.int32)
  window = data[jnp.clip(start + j, 0, m - 1)]                                   # [L]
  eq = (window[None, :] == jnp.asarray(table.data)) | (j[None, :] >= length)     # [K, L]
  hit = jnp.all(eq, axis=1) & (jnp.asarray(table.lengths) == length) & (length > 0)
  return jnp.where(jnp.any(hit), jnp.argmax(hit), -1).astype(jnp.int32)


def parse_uint(data: jax.Array, start: jax.Array, length: jax.Array,
               max_digits: int = MAX_INT_DIGITS) -> tuple[jax.Array, jax.Array]:
  """Parses data[start:start+length] as a non-negative decimal integer. Jittable.

  Returns (value [] int32, ok [] bool); ok iff 1 <= length <= max_digits and all bytes are digits
  (value is 0 when not ok). max_digits <= 9 so the value fits int32.
  """
  assert max_digits <= MAX_INT_DIGITS
  m = data.shape[0]
  j = jnp.arange(max_digits, dtype=jnp.int32)
  d = data[jnp.clip(start + j, 0, m - 1)].astype(jnp.int32) - ord("0")
  used = j < length
  ok = (length >= 1) & (length <= max_digits) & jnp.all(~used | ((d >= 0) & (d <= 9)))
  pow10 = jnp.asarray([10 ** i for i in range(max_digits)], jnp.int32)
  value = jnp.sum(jnp.where(used, d * pow10[jnp.clip(length - 1 - j, 0, max_digits - 1)], 0))
  return jnp.where(ok, value, 0).astype(jnp.int32), ok


def is_digits(data: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
  """Whether data[start:start+length] is non-empty and all decimal digits (any length). Jittable."""
  idx = jnp.arange(data.shape[0], dtype=jnp.int32)
  inside = (idx >= start) & (idx < start + length)
  digit = (data >= ord("0")) & (data <= ord("9"))
  return (length >= 1) & jnp.all(~inside | digit)


def arg_name(call: ParsedCall, k: int, table: ByteTable) -> jax.Array:
  """Index in `table` of argument k, or -1 (absent, or not a known name). Jittable."""
  return jnp.where(call.num_args > k, match_name(call.data, call.arg_start[k], call.arg_len[k], table), -1)


def arg_uint(call: ParsedCall, k: int) -> tuple[jax.Array, jax.Array]:
  """Argument k as a non-negative integer: (value, ok). Jittable."""
  v, ok = parse_uint(call.data, call.arg_start[k], call.arg_len[k])
  return v, ok & (call.num_args > k)


def arg_is_digits(call: ParsedCall, k: int) -> jax.Array:
  """Whether argument k is present and all digits (a number, maybe too long for `arg_uint`)."""
  return (call.num_args > k) & is_digits(call.data, call.arg_start[k], call.arg_len[k])


# ---- rendering --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _texts(codec: TextCodec):
  return dict(
      you_have=codec.fragment("\nYou have "),
      turns=codec.fragment_table([" turns.", " turn."]),
      turns_left=codec.fragment("\nTurns left: "),
      period=codec.fragment("."),
      error=codec.fragment("Error: "),
  )


def budget_intro(codec: TextCodec, budget: jax.Array) -> list[Piece]:
  """Pieces of "\\nYou have N turns." (empty when budget < 0), for the end of the first user turn.
  Jittable; budget may be traced."""
  t = _texts(codec)
  shown = budget >= 0
  return [mask_piece(t["you_have"], shown),
          *[mask_piece(p, shown) for p in codec.int_pieces(budget)],
          mask_piece(t["turns"].row(jnp.where(budget == 1, 1, 0)), shown)]


def budget_suffix(codec: TextCodec, budget: jax.Array, turns_taken: jax.Array) -> list[Piece]:
  """Pieces of "\\nTurns left: k." with k = max(budget - turns_taken, 0) (empty when budget < 0),
  for the end of every later observation body. Jittable."""
  t = _texts(codec)
  shown = budget >= 0
  left = jnp.maximum(budget - turns_taken, 0)
  return [mask_piece(t["turns_left"], shown),
          *[mask_piece(p, shown) for p in codec.int_pieces(left)],
          mask_piece(t["period"], shown)]


def budget_intro_host(codec: TextCodec, budget: int) -> list[np.ndarray]:
  """Host twin of `budget_intro` (token-identical)."""
  if budget < 0:
    return []
  t = _texts(codec)
  return [t["you_have"].tokens, codec.int_host(budget), t["turns"].host(1 if budget == 1 else 0)]


def budget_suffix_host(codec: TextCodec, budget: int, turns_taken: int) -> list[np.ndarray]:
  """Host twin of `budget_suffix` (token-identical)."""
  if budget < 0:
    return []
  t = _texts(codec)
  return [t["turns_left"].tokens, codec.int_host(max(budget - turns_taken, 0)), t["period"].tokens]


def error_prefix(codec: TextCodec) -> Piece:
  """The piece "Error: " that starts every error observation body (the env adds what went wrong)."""
  return _texts(codec)["error"]


def render(codec: TextCodec, pieces: list[Piece], out_len: int) -> TokenBuffer:
  """`concat` with the codec's pad id: the observation buffer [out_len]. Jittable."""
  return concat(pieces, out_len, codec.pad_id)


def capacity(pieces: list) -> int:
  """Static upper bound on the tokens `pieces` can print (sum of their buffer sizes)."""
  return int(sum(p.table.tokens.shape[1] if isinstance(p, Row) else np.prod(np.shape(p.tokens))
                 for p in pieces))


# ---- step bookkeeping -------------------------------------------------------------------------


def is_valid_call(error_kind: jax.Array) -> jax.Array:
  """`StepInfo.valid_call` from the error kind, the same rule in every environment: the action
  parsed, named a tool, had valid arguments and the tool executed it (NONE; WRONG_ANSWER, a
  well-formed final answer that is wrong; IRREVERSIBLE, an executed move that makes the task
  unsolvable). TOOL_FAILURE / PRECONDITION_FAILED calls are not valid: repeating them is not a
  recovery."""
  return ((error_kind == ErrorKind.NONE) | (error_kind == ErrorKind.WRONG_ANSWER)
          | (error_kind == ErrorKind.IRREVERSIBLE))


def finish_step(state, new_state, obs: TokenBuffer, info: StepInfo):
  """Shared end of every `step`: counts the turn and makes steps after `done` no-ops. Jittable.
  (A spent budget does not end the episode here: the rollout engine ends it.)

  Args:
    state: the pre-step state (fields turn, budget, done; see the module docstring).
    new_state: the env's post-step state, with `done` set if the action ended the episode; its
      `turn` is ignored (set to state.turn + 1 here).
    obs, info: the env's observation and info for this step.
  Returns:
    (state, obs, info). If state.done: the unchanged state, an empty observation (length 0) and
    info with reward 0, done True and every flag False/NONE.
  """
  new_state = new_state.replace(turn=state.turn + 1)
  was_done = state.done
  out_state = jax.tree.map(lambda old, new: jnp.where(was_done, old, new), state, new_state)
  out_obs = obs.replace(length=jnp.where(was_done, 0, obs.length))
  f = jnp.zeros((), bool)
  out_info = StepInfo(
      reward=jnp.where(was_done, 0.0, info.reward).astype(jnp.float32),
      done=jnp.where(was_done, True, info.done),
      solved=jnp.where(was_done, f, info.solved),
      final_answer=jnp.where(was_done, f, info.final_answer),
      valid_call=jnp.where(was_done, f, info.valid_call),
      error_kind=jnp.where(was_done, jnp.int32(ErrorKind.NONE), info.error_kind).astype(jnp.int32),
      oracle_match=jnp.where(was_done, f, info.oracle_match),
      optimal_turns=jnp.asarray(info.optimal_turns, jnp.int32),
  )
  return out_state, out_obs, out_info


# ---- the noisy oracle's mistakes for move(direction) families (grid, sokoban) --------------------

DIRECTIONS = ("up", "down", "left", "right")
COMPASS = {"up": "north", "down": "south", "left": "west", "right": "east"}


class MoveErrors:
  """Erroneous actions for a family whose action is `move(d)`, d in `DIRECTIONS`, as a table of
  texts the noisy oracle draws from (`envs/demos.py`, `error_candidates` / `error_action`).

  Rows 0..3 are `move(d)` itself (a tool failure where d is blocked); then, for each direction,
  the `typos` (unknown_tool), `malformed` (parse_error) and `bad_args` (bad_arguments) templates,
  formatted with d and w = its compass word (`COMPASS`), so a mistake is built on the direction
  the oracle would take.
  """

  def __init__(self, codec: TextCodec, typos, malformed, bad_args):
    texts, kinds = [f"move({d})" for d in DIRECTIONS], [ErrorKind.TOOL_FAILURE] * 4
    dirs = list(range(4))
    for i, d in enumerate(DIRECTIONS):
      for templates, kind in ((typos, ErrorKind.UNKNOWN_TOOL), (malformed, ErrorKind.PARSE_ERROR),
                              (bad_args, ErrorKind.BAD_ARGUMENTS)):
        for t in templates:
          texts.append(t.format(d=d, w=COMPASS[d])); kinds.append(kind); dirs.append(i)
    self.texts = tuple(texts)
    self.table = codec.fragment_table(self.texts)
    self.kinds = np.asarray(kinds, np.int32)
    self.direction = np.asarray(dirs, np.int32)
    self._pad_id = codec.pad_id

  def candidates(self, blocked: jax.Array, oracle_dir: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(kind [R] int32, allowed [R] bool): `move(d)` for every blocked direction (blocked [4]
    bool), the textual mistakes of the oracle's direction. Jittable."""
    allowed = jnp.concatenate([blocked, jnp.asarray(self.direction[4:]) == oracle_dir])
    return jnp.asarray(self.kinds), allowed

  def action(self, row, max_action_len: int) -> TokenBuffer:
    """Row `row` of `texts` as tokens [max_action_len]. Jittable."""
    buf = concat([self.table.get(row)])
    pad = max_action_len - buf.tokens.shape[0]
    return buf.replace(tokens=jnp.pad(buf.tokens, (0, pad), constant_values=self._pad_id))
