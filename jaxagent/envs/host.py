"""Host (plain Python) environments: the JAX env contract for tools that cannot be JAX.

A search index, a code sandbox or any other Python tool plugs in as a `HostEpisode`: one object
per episode, text in, text out. `HostEnv` batches episodes and speaks the same contract as the
JAX-native environments, on numpy arrays:

    env = HostLookupEnv(codec, hops=2)                    # or HostEnv(codec, make_episode, ...)
    state, obs = env.reset(tasks, budget)                 # tasks: a task pytree, leading dim B
    state, obs, info = env.step(state, action)            # action: TokenBuffer, tokens [B, A]
    action = env.oracle_action(state)                     # TokenBuffer [B, A]

`obs` is a numpy `TokenBuffer` (tokens [B, max_obs_len] int32, length [B]) and `info` a numpy
`StepInfo` ([B] each), so the rollout engine runs jitted generation, hands the sampled actions to
`step` on the host between turns, and gets the same types back as from `jit(vmap(env.step))`.

What the adapter (`HostEnv`) does, the same way as the JAX environments (`common.py`):
  * action tokens -> bytes with the codec's table; more than `max_action_bytes` bytes, bytes that
    are not printable ASCII / whitespace, or text outside the call grammar are a parse error;
    otherwise the episode gets the parsed call (`parse_call_text`, the Python twin of
    `common.parse_call`);
  * the episode returns its observation body as a list of text *pieces*; the adapter tokenises
    each piece on its own as plain text (`codec.encode_text`, cached: special-token strings such
    as "<|im_end|>" in a tool's output stay text, so a tool cannot forge a chat turn) and
    concatenates, adds the budget suffix ("\\nTurns left: k.") and the chat wrapping, and pads
    to `max_obs_len`. A host tool whose pieces are a JAX env's fragments therefore gives
    token-identical observations (`HostLookupEnv` does, and the tests check it against
    `LookupEnv`);
  * a body too long for `max_step_obs_len` is cut *as text* (`codec.fit_text`: a prefix of the
    text, then `TRUNCATION_MARKER`), the budget suffix and the wrapping kept whole, and the
    step's `info.obs_truncated` is set (the rollout counts it); a prompt over `max_obs_len` is
    an error naming it;
  * counting turns and no-op steps after done (a spent budget is shown, not enforced: the rollout
    engine ends the episode);
  * stepping the batch's episodes on a thread pool (`num_threads`), rows in episode order; an
    exception inside an episode fails the step with `HostEpisodeError` (the episode, its action
    text, the exception chained).

A `HostEpisode` provides:
  optimal_turns: int
  prompt() -> (system_pieces: list[str], user_pieces: list[str])   the first observation's texts
  act(call: HostCall | None) -> Outcome    execute one action (None: the action did not parse)
  oracle() -> list[str]                    the expert's next action, as text pieces
and optionally
  act_text(text: str | None) -> Outcome    used instead of `act` when defined: the whole action
                                           text (None: over max_action_bytes or not UTF-8), for
                                           tools with free-text arguments that parse their own
                                           calls (envs/sql)
  error_actions() -> [(ErrorKind, text pieces)]   plausible mistakes in its current state, for
                                           the noisy-oracle demonstrations (`host_demos.py`)
For the training pipeline the env also needs `sample_task(key)`, JAX-traceable (the task splits
are arrays).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import threading
from typing import Any, Callable, Protocol

import jax
import numpy as np

from jaxagent.envs import common, lookup
from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import TRUNCATION_MARKER, TextCodec, concat_host

_WS = " \t\n\r"
_NAME = re.compile(r"[A-Za-z0-9_]+")


@dataclasses.dataclass
class HostCall:
  """A parsed action `name(arg, ...)` (arguments stripped of spaces and one pair of quotes)."""
  name: str
  args: list[str]


def parse_call_text(data: bytes, max_bytes: int) -> HostCall | None:
  """Python twin of `common.parse_call` (same grammar; see common.py): the call, or None."""
  if len(data) > max_bytes or any(not (32 <= b <= 126 or b in b" \t\n\r") for b in data):
    return None
  s = data.decode("ascii").strip(_WS)
  if s.count("(") != 1 or s.count(")") != 1 or not s.endswith(")"):
    return None
  name, rest = s.split("(", 1)
  name = name.rstrip(_WS)
  if not _NAME.fullmatch(name):
    return None
  inner = rest[:-1]
  if inner.strip(_WS) == "":
    return HostCall(name, [])
  args = []
  for a in inner.split(","):
    a = a.strip(_WS)
    if len(a) >= 2 and a[0] == a[-1] and a[0] in "\"'":
      a = a[1:-1]
    args.append(a)
  return HostCall(name, args)


def decode_action_text(data: bytes, max_bytes: int) -> str | None:
  """The whole action as text for an episode's `act_text`: None when it is over `max_bytes`
  bytes or not valid UTF-8."""
  if len(data) > max_bytes:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


@dataclasses.dataclass
class Outcome:
  """What one action did: the observation body (text pieces) and the step's flags."""
  body: list[str]
  error_kind: ErrorKind = ErrorKind.NONE
  solved: bool = False
  final_answer: bool = False   # the action ended the episode (a right or wrong final answer)
  oracle_match: bool = False


class HostEpisode(Protocol):
  optimal_turns: int
  def prompt(self) -> tuple[list[str], list[str]]: ...
  def act(self, call: HostCall | None) -> Outcome: ...
  def oracle(self) -> list[str]: ...


# Threads of `HostEnv.step` by default: a tool that waits (a database, a sandbox, a web call)
# overlaps up to this many episodes; a pure-Python tool pays a little for the hand-offs.
DEFAULT_THREADS = 8


class HostEpisodeError(RuntimeError):
  """An episode raised inside `act`: the message names the episode, its action text and the
  exception, which is chained (`__cause__`)."""


@dataclasses.dataclass
class HostState:
  episodes: list            # B HostEpisode objects (mutable, owned by this state)
  turn: np.ndarray          # [B] int32
  budget: np.ndarray        # [B] int32, -1 hidden
  done: np.ndarray          # [B] bool


class HostEnv:
  """Batches `HostEpisode`s behind the environment contract (see the module docstring)."""

  def __init__(self, codec: TextCodec, make_episode: Callable[[Any], HostEpisode], *,
               max_obs_len: int, max_action_len: int, max_action_bytes: int, name: str = "host",
               max_step_obs_len: int | None = None, num_threads: int = DEFAULT_THREADS):
    self.codec, self.make_episode, self.name = codec, make_episode, name
    # Threads that step episodes concurrently (1: in the caller's thread, one after another).
    if num_threads < 1:
      raise ValueError(f"{name}: num_threads={num_threads}; give 1 (serial) or more")
    self.num_threads, self._pool = int(num_threads), None
    self._tokenizer_lock = threading.Lock()
    self.max_obs_len, self.max_action_len, self.max_action_bytes = max_obs_len, max_action_len, max_action_bytes
    # Observations after the first fit in this many tokens (default: as many as the prompt);
    # a longer one is cut as text (`codec.fit_text`), keeping its budget suffix and wrapping.
    self.max_step_obs_len = max_obs_len if max_step_obs_len is None else max_step_obs_len
    self._wrap_len = sum(len(np.asarray(p.tokens)) for p in codec.observation([]))
    need = (self._wrap_len + len(codec.encode(TRUNCATION_MARKER))
            + sum(len(x) for x in common.budget_suffix_host(codec, 10 ** 9 - 1, 0)))
    if not need <= self.max_step_obs_len <= max_obs_len:
      raise ValueError(f"{name}: max_step_obs_len={self.max_step_obs_len} cannot hold an "
                       f"observation's chat wrapping, budget line and truncation marker (needs "
                       f">= {need} tokens) or exceeds max_obs_len={max_obs_len}; set it in between")

  def _frags(self, texts: list[str]) -> list[np.ndarray]:
    # An episode's texts are untrusted (a tool echoes arguments, a database's values, a file):
    # plain text, so special-token strings in them never become control tokens.
    return [self.codec.encode_text(t) for t in texts]

  def _pad(self, rows: list[np.ndarray], n: int) -> TokenBuffer:
    tokens = np.full((len(rows), n), self.codec.pad_id, np.int32)
    lengths = np.zeros((len(rows),), np.int32)
    for i, r in enumerate(rows):
      r = r[:n]
      tokens[i, :len(r)] = r
      lengths[i] = len(r)
    return TokenBuffer(tokens=tokens, length=lengths)

  def reset(self, tasks: Any, budget: np.ndarray | int = -1) -> tuple[HostState, TokenBuffer]:
    """Starts B episodes from a task pytree with leading dim B. Returns (state, obs [B, N])."""
    tasks = jax.tree.map(np.asarray, tasks)
    b = jax.tree.leaves(tasks)[0].shape[0]
    budget = np.broadcast_to(np.asarray(budget, np.int32), (b,)).copy()
    episodes = [self.make_episode(jax.tree.map(lambda x, i=i: x[i], tasks)) for i in range(b)]
    rows = []
    for ep, bud in zip(episodes, budget):
      system, user = ep.prompt()
      user_tokens = self._frags(user) + common.budget_intro_host(self.codec, int(bud))
      rows.append(concat_host(self.codec.prompt(
          [_buf(t) for t in self._frags(system)], [_buf(u) for u in user_tokens])))
      if len(rows[-1]) > self.max_obs_len:
        raise ValueError(
            f"{self.name}: episode {len(rows) - 1}'s prompt is {len(rows[-1])} tokens, more than "
            f"max_obs_len={self.max_obs_len} (it would lose its assistant header); raise "
            "max_obs_len or shorten the task's prompt")
    state = HostState(episodes=episodes, turn=np.zeros((b,), np.int32), budget=budget,
                      done=np.zeros((b,), bool))
    return state, self._pad(rows, self.max_obs_len)

  def step(self, state: HostState, action: TokenBuffer) -> tuple[HostState, TokenBuffer, StepInfo]:
    """Executes one action per episode (tokens [B, A], length [B]); no-op for done episodes."""
    tokens, lengths = np.asarray(action.tokens), np.asarray(action.length)
    b = len(state.episodes)
    info = {k: np.zeros((b,), t) for k, t in [("reward", np.float32), ("done", bool), ("solved", bool),
                                               ("final_answer", bool), ("valid_call", bool),
                                               ("error_kind", np.int32), ("oracle_match", bool),
                                               ("optimal_turns", np.int32),
                                               ("obs_truncated", bool)]}
    turn, done = state.turn.copy(), state.done.copy()
    # Episodes step concurrently (a slow tool does not serialise the batch); each writes only
    # its own row, and the rows come back in episode order.
    rows = self._map(lambda i: self._step_one(i, state, tokens, lengths, info, turn, done),
                     len(state.episodes))
    new_state = HostState(episodes=state.episodes, turn=turn, budget=state.budget, done=done)
    return new_state, self._pad(rows, self.max_obs_len), StepInfo(**info)

  def _step_one(self, i: int, state: HostState, tokens, lengths, info: dict, turn, done):
    """Steps episode i (writing row i of info, turn and done); returns its observation tokens.
    An exception inside the episode fails the step with `HostEpisodeError` naming the episode,
    its action text and the exception (chained)."""
    ep = state.episodes[i]
    info["optimal_turns"][i] = ep.optimal_turns
    if state.done[i]:
      info["done"][i] = True
      return np.zeros((0,), np.int32)
    data = self.codec.decode_bytes(tokens[i, :lengths[i]])
    try:
      if (act_text := getattr(ep, "act_text", None)) is not None:
        out = act_text(decode_action_text(data, self.max_action_bytes))   # free-text tools
      else:
        out = ep.act(parse_call_text(data, self.max_action_bytes))
    except Exception as e:
      text = data.decode("utf-8", "replace")
      text = text if len(text) <= 80 else text[:77] + "..."
      raise HostEpisodeError(f"{self.name}: episode {i} raised {type(e).__name__}: {e} on the "
                             f"action {text!r} (turn {int(turn[i]) + 1}); the rollout stops "
                             "here: fix the tool, or return an Outcome with an error kind") from e
    turn[i] += 1
    done[i] = out.final_answer
    # The tools run concurrently; the tokenizer (shared, with mutable settings) one at a time.
    with self._tokenizer_lock:
      body = self._frags(out.body)
      suffix = common.budget_suffix_host(self.codec, int(state.budget[i]), int(turn[i]))
      fixed = self._wrap_len + sum(len(x) for x in suffix)
      if sum(len(x) for x in body) + fixed > self.max_step_obs_len:
        # Too long for the turn's buffer: cut the text and say so; the budget line and the
        # wrapping (tool turn end, next assistant header) stay whole.
        body = [self.codec.fit_text("".join(out.body), self.max_step_obs_len - fixed)]
        info["obs_truncated"][i] = True
      row = concat_host(self.codec.observation([_buf(t) for t in body + suffix]))
    info["reward"][i] = float(out.solved)
    info["done"][i] = done[i]
    info["solved"][i] = out.solved
    info["final_answer"][i] = out.final_answer
    info["error_kind"][i] = int(out.error_kind)
    info["valid_call"][i] = bool(common.is_valid_call(np.int32(out.error_kind)))
    info["oracle_match"][i] = out.oracle_match
    return row

  def _map(self, fn: Callable[[int], Any], n: int) -> list:
    """[fn(0), ..., fn(n - 1)] in order, on `num_threads` threads, each running one contiguous
    slice of the indices (few hand-offs: a cheap tool pays little for them); serially with 1
    thread or 1 item. The exception of the lowest index that raised is re-raised after every
    slice has stopped."""
    k = min(self.num_threads, n)
    if k <= 1:
      return [fn(i) for i in range(n)]
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          self.num_threads, thread_name_prefix=f"{self.name}-step")
    bounds = np.linspace(0, n, k + 1).astype(int)
    futures = [self._pool.submit(lambda lo, hi: [fn(i) for i in range(lo, hi)], lo, hi)
               for lo, hi in zip(bounds[:-1], bounds[1:])]
    concurrent.futures.wait(futures)
    return [row for f in futures for row in f.result()]

  def oracle_action(self, state: HostState) -> TokenBuffer:
    """The expert's next action of every episode, tokenised piece by piece: tokens [B, A]."""
    return self._pad([concat_host(self._frags(ep.oracle())) for ep in state.episodes], self.max_action_len)


def _buf(tokens: np.ndarray) -> TokenBuffer:
  return TokenBuffer(tokens, np.int32(len(tokens)))


# ---- the example tool: lookup over a Python dict knowledge base ------------------------------


class HostLookupEpisode:
  """`lookup` (envs/lookup.py) as a plain-Python tool over a dict knowledge base built from the
  same `LookupTask` arrays; its texts match `LookupEnv`'s piece for piece."""

  def __init__(self, task: lookup.LookupTask, hops: int):
    self.names = [lookup.ENTITY_NAMES[i] for i in task.entities]
    self.relations = [lookup.RELATION_NAMES[j] for j in task.relations]
    self.kb = {(self.names[e], self.relations[r]): self.names[t]
               for (e, r), t in np.ndenumerate(task.link) if t >= 0}
    self.chain = [(self.names[i], self.relations[task.path[i]]) for i in range(hops)]
    self.answer = self.names[hops]
    self.hops, self.optimal_turns, self.progress = hops, hops + 1, 0

  def prompt(self):
    system = [lookup.SYSTEM_TEXT]
    for j, r in enumerate(self.relations):
      system += [r, ", " if j < len(self.relations) - 1 else "."]
    user = ["Question: what is the "]
    for i in reversed(range(self.hops)):
      user += [self.chain[i][1], " of the " if i > 0 else " of "]
    return system, user + [self.names[0], "?"]

  def act(self, call: HostCall | None) -> Outcome:
    m, err = lookup.MESSAGES, ErrorKind
    if call is None:
      return Outcome(["Error: ", m[lookup.PARSE]], err.PARSE_ERROR)
    if call.name not in lookup.TOOLS:
      return Outcome(["Error: ", m[lookup.UNKNOWN_TOOL]], err.UNKNOWN_TOOL)
    a = call.args
    if call.name == "lookup":
      if len(a) != 2:
        return Outcome(["Error: ", m[lookup.LOOKUP_ARITY]], err.BAD_ARGUMENTS)
      if a[0] not in self.names:
        return Outcome(["Error: ", m[lookup.UNKNOWN_ENTITY]], err.BAD_ARGUMENTS)
      if a[1] not in self.relations:
        return Outcome(["Error: ", m[lookup.UNKNOWN_RELATION]], err.BAD_ARGUMENTS)
      if (a[0], a[1]) not in self.kb:
        return Outcome(["Error: ", a[0], " has no ", a[1], "."], err.TOOL_FAILURE)
      on_chain = self.progress < self.hops and (a[0], a[1]) == self.chain[self.progress]
      self.progress += on_chain
      return Outcome(["The ", a[1], " of ", a[0], " is ", self.kb[a[0], a[1]], "."], oracle_match=on_chain)
    if len(a) != 1:
      return Outcome(["Error: ", m[lookup.ANSWER_ARITY]], err.BAD_ARGUMENTS)
    if a[0] == self.answer:
      return Outcome([m[lookup.CORRECT]], solved=True, final_answer=True,
                     oracle_match=self.progress == self.hops)
    return Outcome([m[lookup.WRONG]], err.WRONG_ANSWER, final_answer=True)

  def oracle(self):
    if self.progress < self.hops:
      e, r = self.chain[self.progress]
      return ["lookup(", e, ", ", r, ")"]
    return ["answer(", self.answer, ")"]


class HostLookupEnv(HostEnv):
  """`lookup` on the host path. Same knobs as `LookupEnv` (and `num_threads`); `jax_env` samples
  the tasks and fixes the buffer sizes, so both paths take the same task arrays and give the same
  tokens."""

  def __init__(self, codec: TextCodec, num_threads: int = DEFAULT_THREADS, **knobs):
    self.jax_env = lookup.LookupEnv(codec, **knobs)
    hops = self.jax_env.hops
    super().__init__(codec, lambda task: HostLookupEpisode(task, hops),
                     max_obs_len=self.jax_env.max_obs_len, max_action_len=self.jax_env.max_action_len,
                     max_action_bytes=self.jax_env.max_action_bytes, name="host_lookup",
                     max_step_obs_len=self.jax_env.max_step_obs_len, num_threads=num_threads)

  def sample_task(self, key: jax.Array) -> lookup.LookupTask:
    """One task from the JAX env's sampler (JAX-traceable: the task splits vmap and jit it)."""
    return self.jax_env.sample_task(key)

  def sample_tasks(self, key: jax.Array, batch: int) -> lookup.LookupTask:
    """B tasks from the JAX env's sampler, as numpy."""
    return jax.tree.map(np.asarray, jax.vmap(self.jax_env.sample_task)(jax.random.split(key, batch)))
