"""The text codec: tokens <-> bytes inside jit, pre-tokenised fragments, and chat wrapping.

Built once on the host from any Hugging Face tokenizer (`TextCodec.from_tokenizer`). Environments
use it in two directions:

* actions (generated tokens) -> bytes, inside jit: `to_bytes` gathers each token's bytes from a
  [V, W] byte table and compacts them. Actions are parsed on those bytes (see `envs/common.py`),
  so parsing does not depend on how the tokenizer split the text.
* observations -> tokens: every static string an environment prints is tokenised on the host
  when the environment is built (`fragment`, `fragment_table`, `numbers`), and observations are
  assembled inside jit by concatenating fragments into a fixed-size buffer (`concat`). Each
  fragment is tokenised on its own, so an observation's tokens are the concatenation of its
  fragments' tokens (the text decodes exactly; token boundaries sit at fragment boundaries). The
  host path (`concat_host`) applies the same rule, so host and JAX environments that print the
  same fragments give token-identical observations.

Chat wrapping is derived from the tokenizer's own chat template by rendering placeholder messages
and splitting the rendered text around the placeholders (`prompt`, `observation`), so an instruct
model sees the format it was trained on. See `base.py` for the transcript convention.

A piece (the unit `concat` takes) is a `TokenBuffer` whose `tokens` is a 1-D array (numpy for
host fragments, jax inside jit) and whose `length` counts the valid leading tokens, a block of
pieces (tokens [G, n], length [G]), or a `Row` of a `FragmentTable` (`table.row(i)`, the cheapest
way to print a name chosen inside jit); pieces of length 0 print nothing (`mask_piece`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs.base import TokenBuffer

Piece = TokenBuffer

# Byte given to token ids outside the vocabulary (and ids with no token): 0xFF never occurs in
# UTF-8, so such a token always makes an action unparseable.
INVALID_BYTE = 0xFF

# Variables given to every chat template (templates without them ignore them):
# - date_string: the date templates that print one (Llama 3.x: "Today Date: ...", else today's
#   date through `strftime_now`) show, so that prompts, their token counts and a resumed run's
#   transcripts do not change with the day the codec is built;
# - enable_thinking: False puts Qwen3's empty think block in the assistant header, so actions are
#   tool calls (a reasoning preamble would not fit the action budget of a few dozen tokens).
TEMPLATE_KWARGS = {"date_string": "26 Jul 2024", "enable_thinking": False}

# What an observation cut to fit its buffer shows where the cut is (`TextCodec.fit_text`; the
# rollout engine's backstop for environments whose observations overflow their buffer).
TRUNCATION_MARKER = "\n[... output truncated]"

# Entries `encode_text` caches before starting over (tool output is unbounded).
_TEXT_CACHE_SIZE = 65_536

# Placeholders rendered through the chat template and split on (no template touches them).
_PH = {r: f"@@JAXAGENT_{r.upper()}_PLACEHOLDER@@" for r in ("system", "user", "assistant", "obs")}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable-unicode map used by every byte-level BPE vocabulary."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(hf_tokenizer) -> bool:
  """Whether the tokenizer's decoder is byte-level BPE (GPT-2, Qwen, Llama 3 style)."""
  backend = getattr(hf_tokenizer, "backend_tokenizer", None)
  if backend is not None:
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))
  return False


@struct.dataclass
class FragmentTable:
  """K pre-tokenised strings, padded: row i is the i-th string's tokens.

  Select one inside jit with `row(i)` (a lazy piece for `concat`) or `get(i)` (a TokenBuffer);
  i may be traced and is clamped to [0, K). On the host use `host(i)`.
  """
  tokens: np.ndarray   # [K, D] int32
  lengths: np.ndarray  # [K] int32

  def get(self, i: jax.Array) -> Piece:
    """The i-th string as a piece: tokens [D], length []. Jittable; i may be batched."""
    i = jnp.asarray(i, jnp.int32)
    return TokenBuffer(tokens=jnp.asarray(self.tokens)[i], length=jnp.asarray(self.lengths)[i])

  def row(self, i: jax.Array) -> "Row":
    """The i-th string as a lazy piece for `concat` (jittable; i may be traced/batched).

    Same tokens as `get(i)`, but `concat` reads it straight from the table: no per-piece gather
    or copy, so observations built from rows compile to fewer XLA ops and run faster.
    """
    i = jnp.clip(jnp.asarray(i, jnp.int32), 0, self.tokens.shape[0] - 1)   # as `get` (gathers clamp)
    return Row(self, i, jnp.ones((), bool))

  def host(self, i: int) -> np.ndarray:
    """The i-th string's valid tokens on the host (numpy [lengths[i]])."""
    return self.tokens[int(i), :self.lengths[int(i)]]

  def __len__(self) -> int:
    return self.tokens.shape[0]


@struct.dataclass
class ByteTable:
  """K strings as padded bytes, for matching action arguments against known names in jit."""
  data: np.ndarray     # [K, L] uint8
  lengths: np.ndarray  # [K] int32

  def __len__(self) -> int:
    return self.data.shape[0]


def byte_table(strings: Sequence[str]) -> ByteTable:
  """Pads the UTF-8 bytes of `strings` into a `ByteTable` ([K, max(len, 1)] uint8)."""
  enc = [s.encode("utf-8") for s in strings]
  width = max([len(e) for e in enc] + [1])
  data = np.zeros((len(enc), width), np.uint8)
  for i, e in enumerate(enc):
    data[i, :len(e)] = np.frombuffer(e, np.uint8)
  return ByteTable(data=data, lengths=np.asarray([len(e) for e in enc], np.int32))


def cumsum(x: jax.Array) -> jax.Array:
  """Inclusive cumulative sum of a 1-D int vector (`jnp.cumsum`; one place to tune it)."""
  return jnp.cumsum(x).astype(x.dtype)


class Row:
  """A lazy piece: row `index` of a `FragmentTable`, printed only where `keep` (see
  `FragmentTable.row`). Has `tokens` / `length` like a TokenBuffer piece. Build and consume it
  inside one traced function (it is not a pytree)."""

  def __init__(self, table: FragmentTable, index: jax.Array, keep: jax.Array):
    self.table, self.index, self.keep = table, index, keep

  @property
  def tokens(self) -> jax.Array:   # [D] int32
    return jnp.asarray(self.table.tokens)[self.index]

  @property
  def length(self) -> jax.Array:   # [] int32
    return jnp.where(self.keep, jnp.asarray(self.table.lengths)[self.index], 0)


def mask_piece(piece: Piece | Row, keep: jax.Array) -> Piece | Row:
  """The piece, or an empty one where `keep` is False (jittable; keep may be traced)."""
  if isinstance(piece, Row):
    return Row(piece.table, piece.index, piece.keep & keep)
  return piece.replace(length=jnp.where(keep, jnp.asarray(piece.length, jnp.int32), 0))


def concat(pieces: Sequence[Piece | Row], out_len: int | None = None, pad_id: int = 0) -> TokenBuffer:
  """Concatenates the valid tokens of `pieces` into one fixed-size buffer. Jittable.

  Args:
    pieces: K pieces: TokenBuffers with tokens [n_k] and a length l_k <= n_k (traced or not), a
      block of G pieces (tokens [G, n], length [G]), or `Row`s of fragment tables.
    out_len: N of the result; None means the sum of the capacities, which never truncates.
    pad_id: the token written after the valid ones.
  Returns:
    TokenBuffer(tokens [N], length = min(sum_k l_k, N)); output position p holds token
    p - (l_0 + ... + l_{k-1}) of piece k, for the k with l_0 + ... + l_{k-1} <= p < l_0 + ... + l_k.

  Host-known tokens (numpy fragments and fragment-table rows) are read from one constant array
  and traced tokens from another, each with one gather, so a batch (vmap) never copies the
  constant text per example.
  """
  const_parts, const_at, dyn_parts = [], {}, []
  n_const = n_dyn = 0
  lens, starts, caps, is_const = [], [], [], []

  def const_offset(arr):
    nonlocal n_const
    if id(arr) not in const_at:
      const_at[id(arr)] = n_const
      const_parts.append(np.asarray(arr, np.int32).reshape(-1))
      n_const += const_parts[-1].shape[0]
    return const_at[id(arr)]

  for p in pieces:
    if isinstance(p, Row):
      d = p.table.tokens.shape[1]
      starts.append(const_offset(p.table.tokens) + p.index * d)
      lens.append(jnp.clip(p.length, 0, d)[None])
      caps.append(d)
      is_const.append(True)
      continue
    tok = p.tokens
    block = np.ndim(tok) == 2
    g, d = (np.shape(tok) if block else (1, np.shape(tok)[-1]))
    if isinstance(tok, np.ndarray):
      base, const = const_offset(tok), True
    else:
      base, const = n_dyn, False
      dyn_parts.append(jnp.asarray(tok, jnp.int32).reshape(-1))
      n_dyn += g * d
    starts.extend(base + i * d for i in range(g))
    lens.append(jnp.clip(jnp.asarray(p.length, jnp.int32), 0, d).reshape(g))
    caps.extend([d] * g)
    is_const.extend([const] * g)

  n = int(sum(caps)) if out_len is None else int(out_len)
  if not caps or sum(caps) == 0:
    return TokenBuffer(tokens=jnp.full((n,), pad_id, jnp.int32), length=jnp.zeros((), jnp.int32))
  lens = jnp.concatenate(lens).astype(jnp.int32)                 # [K]
  starts = jnp.stack([jnp.asarray(x, jnp.int32) for x in starts])  # [K]
  ends = cumsum(lens)
  pos = jnp.arange(n, dtype=jnp.int32)
  k = jnp.minimum(jnp.searchsorted(ends, pos, side="right", method="compare_all"), len(caps) - 1)
  src = starts[k] + pos - (ends[k] - lens[k])
  total = ends[-1]
  if const_parts:
    flat = jnp.asarray(np.concatenate(const_parts))
    out = flat[jnp.clip(src, 0, n_const - 1)]
  if dyn_parts:
    dyn = jnp.concatenate(dyn_parts)
    from_dyn = dyn[jnp.clip(src, 0, n_dyn - 1)]
    out = from_dyn if not const_parts else jnp.where(jnp.asarray(np.asarray(is_const))[k], out, from_dyn)
  out = jnp.where(pos < total, out, pad_id)
  return TokenBuffer(tokens=out.astype(jnp.int32), length=jnp.minimum(total, n))


def concat_host(pieces: Sequence[Piece | Row | np.ndarray]) -> np.ndarray:
  """Host (numpy) twin of `concat`: the valid tokens of `pieces`, concatenated ([sum l_k])."""
  parts = []
  for p in pieces:
    if isinstance(p, (TokenBuffer, Row)):
      tok, length = np.asarray(p.tokens, np.int32), np.asarray(p.length, np.int32)
      if tok.ndim == 2:
        parts.extend(tok[i, :length[i]] for i in range(tok.shape[0]))
      else:
        parts.append(tok[:int(length)])
    else:
      parts.append(np.asarray(p, np.int32).reshape(-1))
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


class TextCodec:
  """Token <-> byte tables, fragments and chat wrapping for one tokenizer. Build with
  `TextCodec.from_tokenizer`; the arrays are numpy (host) and become constants inside jit.

  Attributes:
    token_bytes: [V, W] uint8, the raw bytes of each token id (byte-level BPE tokens mapped back
      to raw bytes, special/added tokens to their text), zero padded.
    token_nbytes: [V] int32, the number of valid bytes in each row.
    end_of_turn_id: the token that closes an assistant turn (<|im_end|>, <|eot_id|>, ...).
    pad_id: the token written after the valid ones in buffers.
    tool_role: the chat role observations after the first use ("tool" if the template renders
      it, else "user").
  """

  def __init__(self, hf_tokenizer, token_bytes: np.ndarray, token_nbytes: np.ndarray):
    self.tokenizer = hf_tokenizer
    self.token_bytes = token_bytes
    self.token_nbytes = token_nbytes
    self.vocab_size = token_bytes.shape[0]
    self._encode_cache: dict[str, np.ndarray] = {}
    self._text_cache: dict[str, np.ndarray] = {}
    # Control tokens (special added tokens): plain text (`encode_text`) never yields one.
    self._control_ids = frozenset(
        int(i) for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special)
    pad = hf_tokenizer.pad_token_id
    self.pad_id = int(pad if pad is not None else (hf_tokenizer.eos_token_id or 0))
    self._build_chat()

  # ---- construction -------------------------------------------------------------------------

  @classmethod
  def from_tokenizer(cls, hf_tokenizer) -> "TextCodec":
    """Builds the codec from any Hugging Face tokenizer (host side, once; ~1 s for 150k tokens)."""
    vocab_size = len(hf_tokenizer)
    byte_level = _is_byte_level(hf_tokenizer)
    added = {i: t.content for i, t in hf_tokenizer.added_tokens_decoder.items()}
    ids = list(range(vocab_size))
    strs = hf_tokenizer.convert_ids_to_tokens(ids)
    rows = []
    for i, s in zip(ids, strs):
      if i in added:
        b = added[i].encode("utf-8")
      elif s is None:
        b = bytes([INVALID_BYTE])
      elif byte_level and all(c in _BYTE_DECODER for c in s):
        b = bytes(_BYTE_DECODER[c] for c in s)
      elif (m := _HEX_BYTE.match(s)) is not None:    # SentencePiece byte fallback
        b = bytes([int(m.group(1), 16)])
      else:                                          # SentencePiece / plain vocabularies
        b = s.replace("\u2581", " ").encode("utf-8")
      rows.append(b)
    width = max(max(len(b) for b in rows), 1)
    token_bytes = np.zeros((vocab_size, width), np.uint8)
    token_nbytes = np.zeros((vocab_size,), np.int32)
    for i, b in enumerate(rows):
      token_bytes[i, :len(b)] = np.frombuffer(b, np.uint8)
      token_nbytes[i] = len(b)
    return cls(hf_tokenizer, token_bytes, token_nbytes)

  # ---- tokens -> bytes ----------------------------------------------------------------------

  def to_bytes(self, buf: TokenBuffer, max_bytes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The bytes of `buf`'s valid tokens, compacted. Jittable; vmap for batches.

    Args:
      buf: tokens [N] int32 (ids outside [0, V) decode to the invalid byte 0xFF), length [].
      max_bytes: M, the output size; None means N * W (never truncates).
    Returns:
      (bytes [M] uint8, zero after the valid ones; nbytes [] int32, the *total* byte count,
      which exceeds M when the text did not fit, so callers can reject over-long actions).
    """
    n = buf.tokens.shape[-1]
    m = n * self.token_bytes.shape[1] if max_bytes is None else int(max_bytes)
    table = jnp.asarray(self.token_bytes)
    t = jnp.asarray(buf.tokens, jnp.int32)
    in_vocab = (t >= 0) & (t < self.vocab_size)
    tc = jnp.clip(t, 0, self.vocab_size - 1)
    nb = jnp.where(in_vocab, jnp.asarray(self.token_nbytes)[tc], 1)
    nb = jnp.where(jnp.arange(n) < buf.length, nb, 0)             # [N]
    ends = cumsum(nb)
    pos = jnp.arange(m, dtype=jnp.int32)
    k = jnp.minimum(jnp.searchsorted(ends, pos, side="right", method="compare_all"), n - 1)
    j = jnp.clip(pos - (ends[k] - nb[k]), 0, table.shape[1] - 1)
    byte = jnp.where(in_vocab[k], table[tc[k], j], jnp.uint8(INVALID_BYTE))
    total = ends[-1]
    return jnp.where(pos < total, byte, jnp.uint8(0)).astype(jnp.uint8), total

  def decode_bytes(self, tokens) -> bytes:
    """Host: the raw bytes of a sequence of token ids (numpy/list [n])."""
    out = bytearray()
    for t in np.asarray(tokens, np.int64).reshape(-1):
      if 0 <= t < self.vocab_size:
        out += self.token_bytes[t, :self.token_nbytes[t]].tobytes()
      else:
        out.append(INVALID_BYTE)
    return bytes(out)

  def decode(self, tokens) -> str:
    """Host: the text of a sequence of token ids (invalid UTF-8 replaced by U+FFFD)."""
    if isinstance(tokens, TokenBuffer):
      tokens = np.asarray(tokens.tokens)[:int(tokens.length)]
    return self.decode_bytes(tokens).decode("utf-8", errors="replace")

  # ---- text -> tokens (host) ----------------------------------------------------------------

  def encode(self, text: str) -> np.ndarray:
    """Host: the token ids of trusted `text` (the template's and environments' own strings; no
    special tokens added; special-token text is matched, so chat wrapping encodes as control
    tokens). Untrusted text (tool output) goes through `encode_text`. Returns np.int32 [n]."""
    ids = self._encode_cache.get(text)
    if ids is None:
      ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32).reshape(-1)
      self._encode_cache[text] = ids
    return ids

  def encode_text(self, text: str) -> np.ndarray:
    """Host: the token ids of untrusted `text` (a tool's output, a task's string) as plain text:
    special-token strings in it (`<|im_end|>`, `<|eot_id|>`, ...) become their ordinary byte
    tokens, never control tokens, so a tool cannot write a chat turn. Returns np.int32 [n].

    Raises RuntimeError when the tokenizer ignores `split_special_tokens` (a control token would
    reach the transcript)."""
    ids = self._text_cache.get(text)
    if ids is None:
      ids = self._plain(text)
      if len(self._text_cache) >= _TEXT_CACHE_SIZE:   # tool output varies: keep the cache bounded
        self._text_cache.clear()
      self._text_cache[text] = ids
    return ids

  def _plain(self, text: str) -> np.ndarray:
    ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False,
                                           split_special_tokens=True), np.int32).reshape(-1)
    if self._control_ids and not self._control_ids.isdisjoint(ids.tolist()):
      raise RuntimeError(
          f"{type(self.tokenizer).__name__} encoded special-token text in {text[:60]!r} as "
          "control tokens despite split_special_tokens=True; use a tokenizers-backed (fast) "
          "tokenizer")
    return ids

  def fit_text(self, text: str, max_tokens: int) -> np.ndarray:
    """Host: `encode_text(text)` if it fits `max_tokens`, else the longest prefix *of the text*
    (whole characters) whose plain-text tokens plus `TRUNCATION_MARKER`'s fit, then the marker.
    Returns np.int32 [<= max_tokens] (only the marker when not even that fits)."""
    short = len(text) <= 4 * max_tokens * self.token_bytes.shape[1]   # else it cannot fit
    ids = self.encode_text(text) if short else None
    if ids is not None and ids.shape[0] <= max_tokens:
      return ids
    marker = self.encode(TRUNCATION_MARKER)
    room = max_tokens - marker.shape[0]

    # A token holds at least one character, so a prefix that fits has at most `room` tokens of at
    # most W bytes each: search below that.
    lo, hi = 0, min(len(text), max(room, 0) * self.token_bytes.shape[1])
    while lo < hi:          # the longest prefix that fits (lo always fits)
      mid = (lo + hi + 1) // 2
      if len(self._plain(text[:mid])) <= room:   # uncached: prefixes would flood it
        lo = mid
      else:
        hi = mid - 1
    head = self._plain(text[:lo]) if lo else np.zeros((0,), np.int32)
    return np.concatenate([head, marker]).astype(np.int32)

  @functools.cached_property
  def truncation_tail(self) -> np.ndarray:
    """Tokens of `TRUNCATION_MARKER` then the template's text that closes an observation (to the
    next assistant header): what ends an observation cut at the token level."""
    return np.concatenate([self.encode(TRUNCATION_MARKER),
                           np.asarray(self._obs_to_assistant.tokens)]).astype(np.int32)

  def fragment(self, text: str) -> Piece:
    """Host: a static string, pre-tokenised, as a piece (numpy tokens [n], length n)."""
    ids = self.encode(text)
    return TokenBuffer(tokens=ids, length=np.int32(ids.shape[0]))

  def fragment_table(self, texts: Sequence[str]) -> FragmentTable:
    """Host: K static strings, each tokenised on its own, padded into a `FragmentTable`."""
    enc = [self.encode(t) for t in texts]
    width = max([e.shape[0] for e in enc] + [1])
    tokens = np.full((len(enc), width), self.pad_id, np.int32)
    for i, e in enumerate(enc):
      tokens[i, :e.shape[0]] = e
    return FragmentTable(tokens=tokens, lengths=np.asarray([e.shape[0] for e in enc], np.int32))

  def numbers(self, max_value: int) -> FragmentTable:
    """Host: the decimal numbers 0..max_value, each tokenised: tokens [max+1, D], lengths."""
    return self.fragment_table([str(i) for i in range(max_value + 1)])

  @functools.cached_property
  def _groups(self) -> FragmentTable:
    # Rows 0..999: "0".."999" (a leading group); rows 1000..1999: "000".."999" (a later group).
    return self.fragment_table([str(i) for i in range(1000)] + [f"{i:03d}" for i in range(1000)])

  def int_pieces(self, value: jax.Array, max_digits: int = 9) -> list[Piece]:
    """Jittable: the pieces printing an int32 `value` in decimal.

    The number is printed in groups of three digits (the leading group unpadded, later ones zero
    padded), one piece per group from a 2000-entry table, so a value takes ceil(max_digits / 3)
    pieces. Values < 1000 are tokenised exactly as `encode(str(value))`. Values are clipped to
    [0, 10**max_digits - 1] (callers choose max_digits from a static bound on the value).
    """
    assert 1 <= max_digits <= 9, "int32 values: at most 9 digits"
    table = self._groups
    v = jnp.clip(jnp.asarray(value, jnp.int32), 0, 10 ** max_digits - 1)
    num_groups = -(-max_digits // 3)
    # All groups at once (most significant first): one index vector, one gather.
    scale = jnp.asarray([1000 ** (num_groups - 1 - g) for g in range(num_groups)], jnp.int32)
    x = jax.lax.rem(jax.lax.div(v, scale), 1000)   # [G]; v >= 0, so C division is floor division
    higher = v >= scale * 1000        # an earlier group is printed: zero pad this one (G0 never)
    shown = (v >= scale) | (jnp.arange(num_groups) == num_groups - 1)
    rows = jnp.where(higher, x + 1000, x)
    return [Row(table, rows[g], shown[g]) for g in range(num_groups)]

  def int_host(self, value: int) -> np.ndarray:
    """Host twin of `int_pieces`: the same tokens for the same value."""
    value = max(int(value), 0)
    groups = []
    while True:
      groups.append(value % 1000)
      value //= 1000
      if value == 0:
        break
    groups = groups[::-1]
    return concat_host([self._groups.host(groups[0])] + [self._groups.host(1000 + g) for g in groups[1:]])

  # ---- chat wrapping ------------------------------------------------------------------------

  def _render(self, messages, add_generation_prompt: bool) -> str | None:
    try:
      return self.tokenizer.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=add_generation_prompt,
          **TEMPLATE_KWARGS)
    except Exception:  # templates raise on roles they do not know; we then try another layout
      return None

  def _build_chat(self):
    tok = self.tokenizer
    sys_, usr, asst, obs = _PH["system"], _PH["user"], _PH["assistant"], _PH["obs"]
    if getattr(tok, "chat_template", None) is None:
      raise ValueError(
          "TextCodec needs a tokenizer with a chat template (tokenizer.chat_template is None); "
          "set one, e.g. tokenizer.chat_template = '<ChatML jinja>' before building the codec.")
    # First observation: system + user + assistant header. Templates without a system role get
    # the system text at the start of the user message.
    text = self._render([{"role": "system", "content": sys_}, {"role": "user", "content": usr}], True)
    if text is not None and sys_ in text and usr in text and text.index(sys_) < text.index(usr):
      a, rest = text.split(sys_, 1)
      b, c = rest.split(usr, 1)
      self._prompt_parts = (a, b, c)
      self.has_system_role = True
    else:
      text = self._render([{"role": "user", "content": sys_ + "\n\n" + usr}], True)
      if text is None or sys_ not in text:
        raise ValueError("could not render the tokenizer's chat template with a user message")
      a, rest = text.split(sys_, 1)
      b, c = rest.split(usr, 1)
      self._prompt_parts = (a, b, c)
      self.has_system_role = False
    # Later observations: the text after an assistant message, through the tool/user turn, to
    # the next assistant header. It starts with the end-of-turn token, which the transcript
    # already holds (sampled by the policy or appended by the engine), so it is cut off.
    base = [{"role": "system", "content": sys_}, {"role": "user", "content": usr},
            {"role": "assistant", "content": asst}]
    if not self.has_system_role:
      base = [{"role": "user", "content": sys_ + "\n\n" + usr}, base[2]]
    self.tool_role = "user"
    for role in ("tool", "user"):
      text = self._render(base + [{"role": role, "content": obs}], True)
      if text is not None and asst in text and obs in text:
        self.tool_role = role
        break
    else:
      raise ValueError("could not render an observation turn with the tokenizer's chat template")
    after_asst = text.split(asst, 1)[1]
    pre_obs, post_obs = after_asst.split(obs, 1)
    closed = self._render(base, False)
    turn_end = closed.split(asst, 1)[1] if closed is not None and asst in closed else pre_obs
    eot = self.encode(turn_end)
    if eot.shape[0] > 0:
      self.end_of_turn_id = int(eot[0])
      eot_text = self.decode_bytes(eot[:1]).decode("utf-8", errors="replace")
    else:
      self.end_of_turn_id = int(tok.eos_token_id)
      eot_text = ""
    if eot_text and pre_obs.startswith(eot_text):
      pre_obs = pre_obs[len(eot_text):]
    self._obs_parts = (pre_obs, post_obs)
    a, b, c = self._prompt_parts
    self._pre_system, self._system_to_user, self._user_to_assistant = (
        self.fragment(a), self.fragment(b), self.fragment(c))
    self._pre_obs, self._obs_to_assistant = self.fragment(pre_obs), self.fragment(post_obs)

  def prompt(self, system: Sequence[Piece], user: Sequence[Piece]) -> list[Piece]:
    """The first observation's pieces: template text, system pieces, template text, user pieces,
    template text ending with the assistant header. Concatenate with `concat`/`concat_host`."""
    return [self._pre_system, *system, self._system_to_user, *user, self._user_to_assistant]

  def observation(self, body: Sequence[Piece]) -> list[Piece]:
    """A later observation's pieces: continues the transcript after the end-of-turn token with the
    template's text, the tool (or user) turn holding `body`, and the next assistant header."""
    return [self._pre_obs, *body, self._obs_to_assistant]

  def chat_text(self) -> dict[str, str]:
    """The template texts the codec split out (for docs and tests)."""
    a, b, c = self._prompt_parts
    return {"pre_system": a, "system_to_user": b, "user_to_assistant": c,
            "pre_obs": self._obs_parts[0], "obs_to_assistant": self._obs_parts[1]}
