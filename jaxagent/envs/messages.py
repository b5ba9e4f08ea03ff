"""Message tables: many short templated messages, one chosen inside jit by id.

An environment prints one of M messages per step ("You move {dir}. You are at ({row}, {col}).",
"Error: the {box} is locked.", ...). Rendering each message as its own list of pieces and masking
all but one would hand `concat` M times more pieces than it prints. A `MessageTable` instead lines
all messages up on one slot layout (the slots, in a fixed order; each message uses a subsequence
of them) and keeps, for every gap between slots, a `FragmentTable` over messages:

    text_0[m] slot_0 text_1[m] slot_1 ... slot_{S-1} text_S[m]

so any message renders with 2S+1 pieces, slot j masked out where message m does not use it.
`text(m, **values)` is the host twin that gives the exact string (for docs and tests).

`concat_rows` joins many same-shaped rows (a map's cells, one line per object, each rendered by
a vmapped `concat`) into one piece, so `concat` sees one piece instead of hundreds: the program
is traced and compiled once per row shape rather than once per row.
"""

from __future__ import annotations

import string
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.envs.base import TokenBuffer
from jaxagent.envs.codec import FragmentTable, Piece, TextCodec, mask_piece


def concat_rows(rows: TokenBuffer, pad_id: int) -> Piece:
  """Concatenates the valid prefixes of K rows into one piece. Jittable.

  Args:
    rows: tokens [K, D], length [K] (row k's first length[k] tokens are valid).
  Returns:
    A piece with tokens [K * D] (pad_id after the valid ones) and length sum_k length[k].
  """
  k, d = rows.tokens.shape
  lens = jnp.clip(jnp.asarray(rows.length, jnp.int32), 0, d)
  ends = jnp.cumsum(lens)
  pos = jnp.arange(k * d, dtype=jnp.int32)
  row = jnp.minimum(jnp.searchsorted(ends, pos, side="right", method="compare_all"), k - 1)
  src = row * d + pos - (ends[row] - lens[row])
  flat = jnp.asarray(rows.tokens, jnp.int32).reshape(-1)
  out = jnp.where(pos < ends[-1], flat[jnp.clip(src, 0, k * d - 1)], pad_id)
  return TokenBuffer(tokens=out, length=ends[-1])


def _split(template: str) -> tuple[list[str], list[str]]:
  """'a {x} b {y}' -> (['a ', ' b ', ''], ['x', 'y'])."""
  texts, slots = [""], []
  for literal, field, spec, conv in string.Formatter().parse(template):
    texts[-1] += literal
    if field is not None:
      if spec or conv:
        raise ValueError(f"message slots take no format spec: {template!r}")
      slots.append(field)
      texts.append("")
  return texts, slots


class MessageTable:
  """M templated messages over one slot layout; render message `m` inside jit with `pieces`.

  Args:
    codec: the codec that tokenises the fixed text.
    messages: M format strings whose `{slot}` fields are names from `slots`, used in the
      layout's order, each at most once.
    slots: the layout: every slot name, in the order messages use them.
  """

  def __init__(self, codec: TextCodec, messages: Sequence[str], slots: Sequence[str]):
    self.messages = tuple(messages)
    self.slots = tuple(slots)
    gaps = [[""] * len(messages) for _ in range(len(slots) + 1)]
    uses = np.zeros((len(messages), len(slots)), bool)
    for m, template in enumerate(messages):
      texts, used = _split(template)
      order = [self.slots.index(s) if s in self.slots else -1 for s in used]
      if -1 in order or order != sorted(set(order)):
        raise ValueError(f"message {template!r} must use slots of {self.slots} in that order, "
                         "each at most once")
      gap = 0
      for text, j in zip(texts, order + [len(slots)]):
        gaps[gap][m] += text
        gap = j + 1
        if j < len(slots):
          uses[m, j] = True
    self.gaps: list[FragmentTable] = [codec.fragment_table(g) for g in gaps]
    self.uses = uses   # [M, S] bool

  def pieces(self, message: jax.Array, values: Mapping[str, Piece]) -> list[Piece]:
    """The 2S+1 pieces printing message `message` (int, may be traced) with `values` in its slots.

    Every slot needs a value (a piece; it is masked out where the message does not use it).
    """
    missing = [s for s in self.slots if s not in values]
    if missing:
      raise ValueError(f"no value for slots {missing}")
    m = jnp.asarray(message, jnp.int32)
    uses = jnp.asarray(self.uses)[m]
    out = [self.gaps[0].get(m)]
    for j, s in enumerate(self.slots):
      out.append(mask_piece(values[s], uses[j]))
      out.append(self.gaps[j + 1].get(m))
    return out

  def text(self, message: int, **values: str) -> str:
    """Host: the exact text message `message` prints with these slot values."""
    return self.messages[int(message)].format(**values)

  def bound(self, slot_caps: Mapping[str, int]) -> int:
    """The most tokens any message prints when slot s prints at most slot_caps[s] tokens."""
    fixed = sum(np.asarray(g.lengths, np.int64) for g in self.gaps)                # [M]
    caps = np.asarray([slot_caps[s] for s in self.slots], np.int64)               # [S]
    return int(np.max(fixed + self.uses.astype(np.int64) @ caps))

  @property
  def capacity(self) -> int:
    """Tokens the fixed text of any message can take (add the slot values' sizes)."""
    return int(sum(g.tokens.shape[1] for g in self.gaps))
