"""`workshop`: a stateful task with preconditions: containers, locks, keys and an inventory.

The room holds containers (on the floor; each open, closed, or locked by one key), keys and items
(on the floor, inside a container, or held). Goal: put the target item into the goal container.
Tools (one call per turn):
  open(container)          a closed, unlocked container becomes open (containers never close)
  take(object)             a key or item on the floor or in an open container becomes held
  unlock(container, key)   a locked container becomes unlocked (still closed); hold the key
  put(object, container)   a held key or item goes into an open container
Everything is shown in the first observation (which key opens which lock, where each object is);
later observations say what the action did.

Tasks: the target item lies in the first of a chain of `depth` locked containers; the key of
chain container i lies in chain container i + 1, the last key on the floor (depth 0: the target
lies in a closed, unlocked container). The goal container is closed and unlocked. The other
`num_containers - max(depth, 1) - 1` containers are distractors (locked, closed or open, equally
likely; a locked one's key lies anywhere), and `num_items` distractor items lie anywhere. Names
are drawn at random from `CONTAINERS`, `KEYS` and `ITEMS`. optimal_turns = 3 * depth + 3
(depth 0: 4): per lock take the key, unlock, open; then take the target, open the goal, put.

The oracle plans from the current state (so it also continues optimally after detours): it
obtains the target (walking down the chain of locks it needs), then opens the goal container and
puts the target in. `oracle_match` is True for any action that lowers the remaining optimal turns
(`remaining_turns`) by one, so independent subgoals may come in either order.

Errors (each with its own message, `STEP_MESSAGES`):
  parse_error          the text is not one `name(args)` call
  unknown_tool         not open / take / unlock / put
  bad_arguments        wrong number of arguments; an argument that names no object here; the
                       wrong type of object (open(gem): not a container; take(box): cannot be
                       carried; unlock(box, gem): not a key)
  precondition_failed  well formed but impossible now: open a locked or open container; take a
                       held object or one in a closed container; unlock an unlocked container or
                       with a key not held; put an object not held, or into a locked/closed one
  tool_failure         unlock with a held key that does not fit that lock
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs import common
from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import TextCodec, byte_table, concat
from jaxagent.envs.messages import MessageTable, concat_rows

CONTAINERS = ("box", "chest", "crate", "safe", "trunk", "cabinet", "drawer", "locker", "basket",
              "cupboard", "case", "bin")
KEYS = ("red_key", "blue_key", "green_key", "black_key", "white_key", "gold_key", "silver_key",
        "brass_key", "iron_key", "copper_key", "steel_key", "bone_key")
ITEMS = ("gem", "coin", "ring", "book", "lamp", "cup", "watch", "pen", "map", "shell", "ball", "hat")
NAMES = CONTAINERS + KEYS + ITEMS   # global name ids: containers 0..11, keys 12..23, items 24..35
MAX_CONTAINERS = len(CONTAINERS)
MAX_ITEMS = len(ITEMS)

TOOLS = ("open", "take", "unlock", "put")
OPEN, TAKE, UNLOCK, PUT = range(4)
ARITY = np.array([1, 1, 2, 2], np.int32)

FLOOR, HELD, ABSENT = -1, -2, -3      # object locations; >= 0: inside that container slot
BIG = 1 << 20                          # "impossible" in remaining_turns

SYSTEM = ("You are in a workshop with containers, keys and items. Tools:\n"
          "- open(container): open a closed container that is not locked.\n"
          "- take(object): pick up a key or an item that is on the floor or in an open container.\n"
          "- unlock(container, key): unlock a locked container with the key that opens it; "
          "you must hold the key.\n"
          "- put(object, container): put an object you hold into an open container.\n"
          "Call one tool per turn and reply with the call only, for example open(box).")

# Lines of the first observation (slots a, b: object names).
LINE_GOAL, LINE_LOCKED, LINE_CLOSED, LINE_OPEN, LINE_FLOOR, LINE_IN, LINE_HELD, LINE_NONE = range(8)
PROMPT_LINES = (
    "Goal: put the {a} in the {b}.\n",
    "The {a} is locked; the {b} opens it.\n",
    "The {a} is closed.\n",
    "The {a} is open.\n",
    "The {a} is on the floor.\n",
    "The {a} is in the {b}.\n",
    "You hold the {a}.\n",
    "",
)
HOLD_NOTHING = "You hold nothing."

# Step messages (index = message id), slots a, b: object names.
(MSG_OPENED, MSG_TAKEN, MSG_UNLOCKED, MSG_PUT, MSG_SOLVED, MSG_PARSE, MSG_UNKNOWN_TOOL,
 MSG_ARITY_OPEN, MSG_ARITY_TAKE, MSG_ARITY_UNLOCK, MSG_ARITY_PUT, MSG_NO_OBJECT_1, MSG_NO_OBJECT_2,
 MSG_NOT_CONTAINER, MSG_NOT_KEY, MSG_NOT_PORTABLE, MSG_LOCKED, MSG_ALREADY_OPEN, MSG_HELD,
 MSG_IN_CLOSED, MSG_NOT_LOCKED, MSG_NOT_HELD, MSG_CLOSED, MSG_WRONG_KEY) = range(24)
STEP_MESSAGES = (
    "You open the {a}.",
    "You take the {a}.",
    "You unlock the {a} with the {b}.",
    "You put the {a} in the {b}.",
    "You put the {a} in the {b}. Task solved.",
    "Error: the action is not a tool call. Write one call, for example open(box).",
    "Error: unknown tool. The tools are open, take, unlock and put.",
    "Error: open takes one argument, a container.",
    "Error: take takes one argument, a key or an item.",
    "Error: unlock takes two arguments, a container and a key.",
    "Error: put takes two arguments, an object and a container.",
    "Error: the first argument names no object here.",
    "Error: the second argument names no object here.",
    "Error: the {a} is not a container.",
    "Error: the {a} is not a key.",
    "Error: the {a} cannot be carried.",
    "Error: the {a} is locked.",
    "Error: the {a} is already open.",
    "Error: you already hold the {a}.",
    "Error: the {a} is in the {b}, which is closed.",
    "Error: the {a} is not locked.",
    "Error: you do not hold the {a}.",
    "Error: the {a} is closed.",
    "Error: the {a} does not fit the {b}.",
)
_B, _P, _T = ErrorKind.BAD_ARGUMENTS, ErrorKind.PRECONDITION_FAILED, ErrorKind.TOOL_FAILURE
MESSAGE_ERROR = np.array([0, 0, 0, 0, 0, ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL,
                          _B, _B, _B, _B, _B, _B, _B, _B, _B,
                          _P, _P, _P, _P, _P, _P, _P, _T], np.int32)
_TYPOS = {"open": "opne", "take": "tkae", "unlock": "unlcok", "put": "ptu"}


def _semantic_rows() -> list[tuple[int, int, int]]:
  """Every well-formed call the action table holds: (tool, name id 0, name id 1 or -1)."""
  c = range(len(CONTAINERS))
  k = range(len(CONTAINERS), len(CONTAINERS) + len(KEYS))
  portable = range(len(CONTAINERS), len(NAMES))
  rows = [(OPEN, n, -1) for n in range(len(NAMES))]
  rows += [(TAKE, n, -1) for n in range(len(NAMES))]
  rows += [(UNLOCK, a, b) for a in c for b in k]
  rows += [(PUT, a, b) for a in portable for b in c]
  return rows


SEMANTIC_ROWS = _semantic_rows()


def call_text(tool: int, n0: int, n1: int = -1) -> str:
  """Host: the text of a call, e.g. call_text(UNLOCK, 1, 12) == 'unlock(chest, red_key)'."""
  args = [NAMES[n] for n in (n0, n1) if n >= 0]
  return f"{TOOLS[tool]}({', '.join(args)})"


@struct.dataclass
class WorkshopTask:
  name: jax.Array    # [N] int32: global name id of each object slot (-1: absent)
  loc: jax.Array     # [N] int32: FLOOR, HELD, ABSENT or the container slot it is in
  locked: jax.Array  # [C] bool
  opened: jax.Array  # [C] bool
  goal: jax.Array    # [] int32: the goal container slot


@struct.dataclass
class WorkshopState:
  task: WorkshopTask        # the initial task (for the record)
  loc: jax.Array            # [N] int32
  locked: jax.Array         # [C] bool
  opened: jax.Array         # [C] bool
  turn: jax.Array           # [] int32
  budget: jax.Array         # [] int32: -1 hidden
  done: jax.Array           # [] bool
  solved: jax.Array         # [] bool
  optimal_turns: jax.Array  # [] int32


def remaining_turns(loc, locked, opened, goal, num_containers: int) -> jax.Array:
  """The fewest turns that finish the task from this state (BIG if impossible).

  With access(c) = 0 if c is open, 1 if closed, 2 + obtain(key of c) if locked, and
  obtain(x) = 0 if held, 1 on the floor, 1 + access(c) inside c:
    remaining = 0 if the target is in the goal container, else obtain(target) + access(goal) + 1.
  access is the fixed point of that recursion, reached in C + 1 rounds (the locks form a chain).
  Shapes: loc [N], locked [C], opened [C], goal [] -> [] int32.
  """
  c = num_containers
  key_loc = loc[c:2 * c]                                     # key slot C + i opens container i

  def obtain(where, access):
    inside = access[jnp.clip(where, 0, c - 1)] + 1
    cost = jnp.where(where == HELD, 0, jnp.where(where == FLOOR, 1, jnp.where(where >= 0, inside, BIG)))
    return jnp.minimum(cost, BIG)

  def round_(_, access):
    return jnp.minimum(jnp.where(opened, 0, jnp.where(locked, 2 + obtain(key_loc, access), 1)), BIG)

  access = jax.lax.fori_loop(0, c + 1, round_, jnp.full((c,), BIG, jnp.int32))
  target = loc[2 * c]
  total = jnp.minimum(obtain(target, access) + access[goal] + 1, BIG)
  return jnp.where(target == goal, 0, total).astype(jnp.int32)


def sample_workshop_task(key: jax.Array, num_containers: int, depth: int,
                         num_items: int) -> WorkshopTask:
  """A random task (see the module docstring). Object slots: containers [0, C), keys [C, 2C)
  (key C + i opens container i; present iff i is locked), target 2C, distractor items after."""
  c = num_containers
  m = max(depth, 1)
  n = 2 * c + 1 + num_items
  # One PRNG call (each call site costs seconds of compile time on CPU); permutations are argsorts.
  u = jax.random.uniform(key, (3 * c + num_items + len(NAMES),))
  u_perm, u_state, u_kloc = u[:c], u[c:2 * c], u[2 * c:3 * c]
  u_iloc, u_names = u[3 * c:3 * c + num_items], u[3 * c + num_items:]

  def randint(x, lo, hi):   # uniform integers in [lo, hi) from uniforms x in [0, 1)
    return jnp.minimum(lo + (x * (hi - lo)).astype(jnp.int32), hi - 1)

  perm = jnp.argsort(u_perm).astype(jnp.int32)               # chain = perm[:m], goal = perm[m]
  role = jnp.zeros((c,), jnp.int32).at[perm].set(jnp.arange(c, dtype=jnp.int32))  # rank in perm
  chain, goal = role < m, perm[m]
  distractor_state = randint(u_state, 0, 3)                  # 0 locked, 1 closed, 2 open
  is_distractor = role > m
  locked = jnp.where(chain, depth >= 1, is_distractor & (distractor_state == 0))
  opened = is_distractor & (distractor_state == 2)
  # Chain key of chain container at rank j lies in the container at rank j + 1 (last: floor).
  next_in_chain = perm[jnp.clip(role + 1, 0, c - 1)]
  chain_key_loc = jnp.where(role + 1 < m, next_in_chain, FLOOR)
  anywhere = randint(u_kloc, -1, c)                          # FLOOR or a container slot
  key_loc = jnp.where(chain, chain_key_loc, anywhere)
  key_loc = jnp.where(locked, key_loc, ABSENT)
  item_loc = jnp.concatenate([perm[:1], randint(u_iloc, -1, c)])
  loc = jnp.concatenate([jnp.full((c,), FLOOR), key_loc, item_loc]).astype(jnp.int32)
  nc, nk = len(CONTAINERS), len(KEYS)
  cont_names = jnp.argsort(u_names[:nc])[:c]
  key_names = jnp.argsort(u_names[nc:nc + nk])[:c] + nc
  item_names = jnp.argsort(u_names[nc + nk:])[:1 + num_items] + nc + nk
  name = jnp.concatenate([cont_names, jnp.where(locked, key_names, -1), item_names])
  assert name.shape == (n,)
  return WorkshopTask(name=name.astype(jnp.int32), loc=loc, locked=locked, opened=opened,
                      goal=goal.astype(jnp.int32))


class WorkshopEnv:
  """Containers, locks, keys and an inventory. See the module docstring.

  Knobs:
    depth: locks on the chain that guards the target item (0..num_containers - 2).
    num_containers: containers in the room (max(depth, 1) + 1 .. 12; default max(depth, 1) + 2).
    num_items: distractor items (0..11).
  """

  name = "workshop"

  def __init__(self, codec: TextCodec, depth: int = 2, num_containers: int | None = None,
               num_items: int = 2, max_action_len: int = 32, max_action_bytes: int = 64):
    m = max(int(depth), 1)
    num_containers = m + 2 if num_containers is None else int(num_containers)
    if depth < 0:
      raise ValueError(f"depth must be >= 0, got {depth}")
    if not m + 1 <= num_containers <= MAX_CONTAINERS:
      raise ValueError(f"num_containers must be in [{m + 1}, {MAX_CONTAINERS}] for depth {depth}, "
                       f"got {num_containers}")
    if not 0 <= num_items < MAX_ITEMS:
      raise ValueError(f"num_items must be in [0, {MAX_ITEMS - 1}], got {num_items}")
    self.codec = codec
    self.depth = int(depth)
    self.num_containers = num_containers
    self.num_items = int(num_items)
    self.num_objects = 2 * num_containers + 1 + self.num_items
    self.max_action_len = int(max_action_len)
    self.max_action_bytes = int(max_action_bytes)
    c = codec
    self._tools = byte_table(TOOLS)
    self._names = byte_table(NAMES)
    self._name_words = c.fragment_table(NAMES)
    self._system = c.fragment(SYSTEM)
    self._hold_nothing = c.fragment(HOLD_NOTHING)
    self.lines = MessageTable(c, PROMPT_LINES, ("a", "b"))
    self.messages = MessageTable(c, STEP_MESSAGES, ("a", "b"))
    # The action table: semantic calls, then a typo'd and a malformed version of each, then calls
    # missing an argument. Oracle actions and the noisy oracle's errors are rows of it, each
    # tokenised whole (as a model would see the text).
    sem = SEMANTIC_ROWS
    texts = [call_text(*r) for r in sem]
    typo = [call_text(*r).replace(TOOLS[r[0]] + "(", _TYPOS[TOOLS[r[0]]] + "(", 1) for r in sem]
    malformed = [call_text(*r).replace("(", " ", 1)[:-1] for r in sem]
    arity = [("open()", OPEN, -1), ("take()", TAKE, -1)]
    arity += [(f"unlock({NAMES[a]})", UNLOCK, a) for a in range(len(CONTAINERS))]
    arity += [(f"put({NAMES[a]})", PUT, a) for a in range(len(CONTAINERS), len(NAMES))]
    self.action_texts = tuple(texts + typo + malformed + [a[0] for a in arity])
    self._actions = c.fragment_table(self.action_texts)
    ns = len(sem)
    self._num_semantic = ns
    self._row_tool = np.asarray([r[0] for r in sem], np.int32)
    self._row_n0 = np.asarray([r[1] for r in sem], np.int32)
    self._row_n1 = np.asarray([r[2] for r in sem], np.int32)
    self._arity_tool = np.asarray([a[1] for a in arity], np.int32)
    self._arity_n0 = np.asarray([a[2] for a in arity], np.int32)
    # Tight bounds on what the prompt and a step can print (the line tables pad every gap to its
    # longest text, so summing buffer sizes would overcount several-fold).
    name_cap = self._name_words.tokens.shape[1]
    lines = 1 + self.num_objects
    self._line_cap = self.lines.bound({"a": name_cap, "b": name_cap})
    zero = jax.ShapeDtypeStruct((), jnp.int32)   # shapes only: no eager ops (each compiles)
    intro = jax.eval_shape(lambda b: concat(common.budget_intro(c, b)), zero).tokens.shape[0]
    suffix = jax.eval_shape(lambda b: concat(common.budget_suffix(c, b, b)), zero).tokens.shape[0]
    prompt_cap = (common.capacity(c.prompt([self._system], [self._hold_nothing]))
                  + lines * self._line_cap + intro)
    self._step_cap = (common.capacity(c.observation([]))
                      + self.messages.bound({"a": name_cap, "b": name_cap}) + suffix)
    self._prompt_cap = int(prompt_cap)
    self.max_obs_len = int(max(prompt_cap, self._step_cap))
    # Later observations fit in this many tokens (the rollout engine reserves only that per turn).
    self.max_step_obs_len = int(self._step_cap)

  # ---- tasks ------------------------------------------------------------------------------

  def sample_task(self, key: jax.Array) -> WorkshopTask:
    """A random task (see the module docstring). Jittable, vmappable."""
    return sample_workshop_task(key, self.num_containers, self.depth, self.num_items)

  def _remaining(self, loc, locked, opened, goal):
    return remaining_turns(loc, locked, opened, goal, self.num_containers)

  def optimal_turns(self, task: WorkshopTask) -> jax.Array:
    """[] int32: the fewest turns that solve `task` (`remaining_turns` of its start). Jittable."""
    return self._remaining(task.loc, task.locked, task.opened, task.goal)

  def _initial_state(self, task: WorkshopTask, budget) -> WorkshopState:
    return WorkshopState(
        task=task, loc=task.loc, locked=task.locked, opened=task.opened, turn=jnp.int32(0),
        budget=jnp.asarray(budget, jnp.int32), done=jnp.zeros((), bool), solved=jnp.zeros((), bool),
        optimal_turns=self._remaining(task.loc, task.locked, task.opened, task.goal))

  # ---- rendering --------------------------------------------------------------------------

  def _word(self, state: WorkshopState, obj):
    """The name piece of object slot `obj` (empty for -1)."""
    n = state.task.name[jnp.clip(obj, 0, self.num_objects - 1)]
    piece = self._name_words.get(jnp.maximum(n, 0))
    return piece.replace(length=jnp.where((obj >= 0) & (n >= 0), piece.length, 0))

  def _line(self, state: WorkshopState, line, a, b) -> TokenBuffer:
    """One prompt line (`PROMPT_LINES[line]` about object slots a, b), tokens [line_cap]."""
    pieces = self.lines.pieces(line, {"a": self._word(state, a), "b": self._word(state, b)})
    return concat(pieces, self._line_cap, self.codec.pad_id)

  def _prompt_pieces(self, state: WorkshopState):
    c = self.num_containers
    objs = jnp.arange(c, self.num_objects)
    where = state.loc[c:]
    cont_line = jnp.where(state.locked, LINE_LOCKED, jnp.where(state.opened, LINE_OPEN, LINE_CLOSED))
    obj_line = jnp.select([where == ABSENT, where == FLOOR, where == HELD],
                          [LINE_NONE, LINE_FLOOR, LINE_HELD], LINE_IN)
    # One line per row: the goal, each container, each key and item (rendered by one vmap).
    line = jnp.concatenate([jnp.full((1,), LINE_GOAL), cont_line, obj_line]).astype(jnp.int32)
    a = jnp.concatenate([jnp.full((1,), 2 * c), jnp.arange(c), objs]).astype(jnp.int32)
    b = jnp.concatenate([state.task.goal[None], jnp.arange(c, 2 * c), where]).astype(jnp.int32)
    rows = jax.vmap(lambda l, x, y: self._line(state, l, x, y))(line, a, b)
    user = [concat_rows(rows, self.codec.pad_id), self._hold_nothing]
    user += common.budget_intro(self.codec, state.budget)
    return self.codec.prompt([self._system], user)

  def _step_pieces(self, message, a, b, state: WorkshopState):
    body = self.messages.pieces(message, {"a": self._word(state, a), "b": self._word(state, b)})
    return self.codec.observation(body + common.budget_suffix(self.codec, state.budget, state.turn))

  def _pad(self, buf: TokenBuffer, n: int) -> TokenBuffer:
    pad = n - buf.tokens.shape[0]
    return buf.replace(tokens=jnp.pad(buf.tokens, (0, pad), constant_values=self.codec.pad_id))

  # ---- semantics ----------------------------------------------------------------------------

  def _find(self, state: WorkshopState, name_id):
    """The object slot named `name_id` in this task, or -1 (unknown name / absent)."""
    hit = (state.task.name == name_id) & (name_id >= 0)
    return jnp.where(jnp.any(hit), jnp.argmax(hit), -1).astype(jnp.int32)

  def _outcome(self, state: WorkshopState, syntax_ok, tool, num_args, n0, n1):
    """What a call does: (message, slot a, slot b, object 0, object 1). All [] int32."""
    c = self.num_containers
    o0, o1 = self._find(state, n0), self._find(state, n1)
    i0, i1 = jnp.clip(o0, 0, self.num_objects - 1), jnp.clip(o1, 0, self.num_objects - 1)
    cont0, cont1 = (o0 >= 0) & (o0 < c), (o1 >= 0) & (o1 < c)
    key1 = (o1 >= c) & (o1 < 2 * c)
    ci0, ci1 = jnp.clip(o0, 0, c - 1), jnp.clip(o1, 0, c - 1)
    locked0, open0 = cont0 & state.locked[ci0], cont0 & state.opened[ci0]
    locked1, open1 = cont1 & state.locked[ci1], cont1 & state.opened[ci1]
    where0 = state.loc[i0]
    held0, held1 = where0 == HELD, state.loc[i1] == HELD
    in_closed = (where0 >= 0) & ~state.opened[jnp.clip(where0, 0, c - 1)]
    arity_bad = num_args != jnp.asarray(ARITY)[jnp.clip(tool, 0, 3)]
    none = jnp.int32(-1)

    def cases(rows, default):
      conds = [r[0] for r in rows]
      return tuple(jnp.select(conds, [jnp.asarray(r[1][i], jnp.int32) for r in rows],
                              jnp.asarray(default[i], jnp.int32)) for i in range(3))

    on_open = cases([(arity_bad, (MSG_ARITY_OPEN, none, none)),
                     (o0 < 0, (MSG_NO_OBJECT_1, none, none)),
                     (~cont0, (MSG_NOT_CONTAINER, o0, none)),
                     (locked0, (MSG_LOCKED, o0, none)),
                     (open0, (MSG_ALREADY_OPEN, o0, none))], (MSG_OPENED, o0, none))
    on_take = cases([(arity_bad, (MSG_ARITY_TAKE, none, none)),
                     (o0 < 0, (MSG_NO_OBJECT_1, none, none)),
                     (cont0, (MSG_NOT_PORTABLE, o0, none)),
                     (held0, (MSG_HELD, o0, none)),
                     (in_closed, (MSG_IN_CLOSED, o0, where0))], (MSG_TAKEN, o0, none))
    on_unlock = cases([(arity_bad, (MSG_ARITY_UNLOCK, none, none)),
                       (o0 < 0, (MSG_NO_OBJECT_1, none, none)),
                       (o1 < 0, (MSG_NO_OBJECT_2, none, none)),
                       (~cont0, (MSG_NOT_CONTAINER, o0, none)),
                       (~key1, (MSG_NOT_KEY, o1, none)),
                       (~locked0, (MSG_NOT_LOCKED, o0, none)),
                       (~held1, (MSG_NOT_HELD, o1, none)),
                       (o1 != c + o0, (MSG_WRONG_KEY, o1, o0))], (MSG_UNLOCKED, o0, o1))
    solves = (o0 == 2 * c) & (o1 == state.task.goal)
    on_put = cases([(arity_bad, (MSG_ARITY_PUT, none, none)),
                    (o0 < 0, (MSG_NO_OBJECT_1, none, none)),
                    (o1 < 0, (MSG_NO_OBJECT_2, none, none)),
                    (cont0, (MSG_NOT_PORTABLE, o0, none)),
                    (~cont1, (MSG_NOT_CONTAINER, o1, none)),
                    (~held0, (MSG_NOT_HELD, o0, none)),
                    (locked1, (MSG_LOCKED, o1, none)),
                    (~open1, (MSG_CLOSED, o1, none))],
                   (jnp.where(solves, MSG_SOLVED, MSG_PUT), o0, o1))
    message, a, b = cases([(~syntax_ok, (MSG_PARSE, none, none)),
                           (tool < 0, (MSG_UNKNOWN_TOOL, none, none)),
                           (tool == OPEN, on_open), (tool == TAKE, on_take),
                           (tool == UNLOCK, on_unlock)], on_put)
    return message, a, b, o0, o1

  def _apply(self, state: WorkshopState, message, o0, o1) -> WorkshopState:
    """The state after a call with this outcome (errors change nothing)."""
    c = self.num_containers
    i0 = jnp.clip(o0, 0, self.num_objects - 1)
    ci0, ci1 = jnp.clip(o0, 0, c - 1), jnp.clip(o1, 0, c - 1)
    opened = state.opened.at[ci0].set(state.opened[ci0] | (message == MSG_OPENED))
    locked = state.locked.at[ci0].set(state.locked[ci0] & (message != MSG_UNLOCKED))
    put = (message == MSG_PUT) | (message == MSG_SOLVED)
    new_loc = jnp.where(message == MSG_TAKEN, HELD, jnp.where(put, ci1, state.loc[i0]))
    loc = state.loc.at[i0].set(new_loc)
    solved = message == MSG_SOLVED
    return state.replace(loc=loc, locked=locked, opened=opened, solved=state.solved | solved,
                         done=state.done | solved)

  # ---- the contract -----------------------------------------------------------------------

  def reset(self, key: jax.Array, task: WorkshopTask | None = None,
            budget: jax.Array | int = -1) -> tuple[WorkshopState, TokenBuffer]:
    """The initial state and the prompt (tokens [max_obs_len]). Jittable, vmappable."""
    if task is None:
      task = self.sample_task(key)
    state = self._initial_state(task, budget)
    return state, self._pad(concat(self._prompt_pieces(state), self._prompt_cap, self.codec.pad_id),
                          self.max_obs_len)

  def step(self, state: WorkshopState, action: TokenBuffer):
    """One turn: parse `action` (tokens [N], any N), apply it, render the observation."""
    call = common.parse_action(self.codec, action, self._tools, 2, self.max_action_bytes)
    n0, n1 = common.arg_name(call, 0, self._names), common.arg_name(call, 1, self._names)
    message, a, b, o0, o1 = self._outcome(state, call.syntax_ok, call.tool, call.num_args, n0, n1)
    new_state = self._apply(state, message, o0, o1)
    error = jnp.asarray(MESSAGE_ERROR)[message]
    before = self._remaining(state.loc, state.locked, state.opened, state.task.goal)
    after = self._remaining(new_state.loc, new_state.locked, new_state.opened, state.task.goal)
    solved = message == MSG_SOLVED
    shown = new_state.replace(turn=state.turn + 1)   # the budget suffix counts this turn
    obs = concat(self._step_pieces(message, a, b, shown), self._step_cap, self.codec.pad_id)
    info = StepInfo(
        reward=solved.astype(jnp.float32), done=solved, solved=solved,
        final_answer=jnp.zeros((), bool), valid_call=common.is_valid_call(error),
        error_kind=error, oracle_match=(error == ErrorKind.NONE) & (after == before - 1),
        optimal_turns=state.optimal_turns)
    return common.finish_step(state, new_state, self._pad(obs, self.max_obs_len), info)

  def oracle_call(self, state: WorkshopState) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The expert's next call as (tool, object slot 0, object slot 1 or -1). Jittable.

    Obtain the target (open / unlock / fetch keys down the chain as needed), then open the goal
    container, then put the target in it.
    """
    c = self.num_containers
    target, goal = 2 * c, state.task.goal
    held = state.loc[target] == HELD
    # carry: (resolved, tool, a0, a1, mode (0 obtain obj, 1 access container), obj)
    init = (jnp.zeros((), bool), jnp.int32(PUT), jnp.int32(target), goal.astype(jnp.int32),
            jnp.where(held, 1, 0).astype(jnp.int32), jnp.where(held, goal, target).astype(jnp.int32))

    def body(_, carry):
      resolved, tool, a0, a1, mode, obj = carry
      # mode 0: obtain obj.
      where = state.loc[jnp.clip(obj, 0, self.num_objects - 1)]
      wc = jnp.clip(where, 0, c - 1)
      take_now = (where == FLOOR) | ((where >= 0) & state.opened[wc])
      # mode 1: make container obj accessible (or put the target into the open goal).
      oc = jnp.clip(obj, 0, c - 1)
      key = c + oc
      key_held = state.loc[key] == HELD
      is_open, is_locked = state.opened[oc], state.locked[oc]
      step0 = jnp.where(take_now, 0, 1)          # 0: take obj; 1: go to container `where`
      step1 = jnp.select([is_open, ~is_locked, key_held], [2, 3, 4], 5)  # 2 put, 3 open, 4 unlock, 5 get key
      kind = jnp.where(mode == 0, step0, step1)
      new_tool = jnp.select([kind == 0, kind == 2, kind == 3, kind == 4], [TAKE, PUT, OPEN, UNLOCK], tool)
      new_a0 = jnp.select([kind == 0, kind == 2, kind == 3, kind == 4], [obj, target, oc, oc], a0)
      new_a1 = jnp.select([kind == 2, kind == 4], [goal, key], -1)
      done_now = (kind == 0) | (kind == 2) | (kind == 3) | (kind == 4)
      next_mode = jnp.where(kind == 1, 1, 0)
      next_obj = jnp.where(kind == 1, where, key)
      keep = resolved
      return (resolved | done_now,
              jnp.where(keep, tool, new_tool).astype(jnp.int32),
              jnp.where(keep, a0, new_a0).astype(jnp.int32),
              jnp.where(keep, a1, new_a1).astype(jnp.int32),
              jnp.where(keep | done_now, mode, next_mode).astype(jnp.int32),
              jnp.where(keep | done_now, obj, next_obj).astype(jnp.int32))

    _, tool, a0, a1, _, _ = jax.lax.fori_loop(0, 2 * c + 2, body, init)
    return tool, a0, a1

  def _row_of(self, state: WorkshopState, tool, a0, a1) -> jax.Array:
    """The action-table row of a semantic call given by object slots."""
    nc, nk = len(CONTAINERS), len(KEYS)
    n0 = state.task.name[jnp.clip(a0, 0, self.num_objects - 1)]
    n1 = state.task.name[jnp.clip(a1, 0, self.num_objects - 1)]
    base = jnp.asarray([0, len(NAMES), 2 * len(NAMES), 2 * len(NAMES) + nc * nk], jnp.int32)
    offset = jnp.select([tool == OPEN, tool == TAKE, tool == UNLOCK],
                        [n0, n0, n0 * nk + (n1 - nc)], (n0 - nc) * nc + n1)
    return (base[tool] + offset).astype(jnp.int32)

  def oracle_action(self, state: WorkshopState) -> TokenBuffer:
    """The expert's next action as tokens [max_action_len]. Jittable."""
    return self.action(self._row_of(state, *self.oracle_call(state)))

  def action(self, row) -> TokenBuffer:
    """Row `row` of the action table (`action_texts`), tokens [max_action_len]. Jittable."""
    return self._pad(concat([self._actions.get(row)]), self.max_action_len)

  error_action = action

  def error_candidates(self, state: WorkshopState) -> tuple[jax.Array, jax.Array]:
    """Plausible erroneous actions for the noisy oracle, as rows of the action table:
    (kind [R] int32 ErrorKind, allowed [R] bool); tokens of row r: `error_action(r)`.

    Allowed: every well-formed call that fails now (its error kind computed by the real
    semantics: unknown or wrongly typed objects, preconditions, wrong keys), the typo'd and the
    malformed versions of the oracle's call, and the oracle's tool with its last argument missing.
    """
    ns = self._num_semantic
    sem_msg = jax.vmap(lambda t, n0, n1: self._outcome(
        state, jnp.ones((), bool), t, jnp.where(n1 >= 0, 2, 1), n0, n1)[0])(
            jnp.asarray(self._row_tool), jnp.asarray(self._row_n0), jnp.asarray(self._row_n1))
    sem_kind = jnp.asarray(MESSAGE_ERROR)[sem_msg]
    tool, a0, a1 = self.oracle_call(state)
    oracle_row = self._row_of(state, tool, a0, a1)
    oracle_n0 = state.task.name[jnp.clip(a0, 0, self.num_objects - 1)]
    rows = jnp.arange(ns)
    arity_ok = (jnp.asarray(self._arity_tool) == tool) & (
        (jnp.asarray(self._arity_n0) < 0) | (jnp.asarray(self._arity_n0) == oracle_n0))
    kind = jnp.concatenate([
        sem_kind, jnp.full((ns,), ErrorKind.UNKNOWN_TOOL, jnp.int32),
        jnp.full((ns,), ErrorKind.PARSE_ERROR, jnp.int32),
        jnp.full((len(self._arity_tool),), ErrorKind.BAD_ARGUMENTS, jnp.int32)])
    allowed = jnp.concatenate([sem_kind != ErrorKind.NONE, rows == oracle_row, rows == oracle_row,
                               arity_ok])
    return kind, allowed

  # ---- host helpers (docs, tests) ---------------------------------------------------------

  def name_of(self, task: WorkshopTask, slot: int) -> str:
    return NAMES[int(np.asarray(task.name)[slot])]

  def prompt_user_text(self, task: WorkshopTask, budget: int = -1) -> str:
    """Host: the exact user-turn text of the first observation of `task` (one task)."""
    c = self.num_containers
    name, loc = np.asarray(task.name), np.asarray(task.loc)
    locked, opened = np.asarray(task.locked), np.asarray(task.opened)
    text = PROMPT_LINES[LINE_GOAL].format(a=NAMES[name[2 * c]], b=NAMES[name[int(task.goal)]])
    for i in range(c):
      if locked[i]:
        text += PROMPT_LINES[LINE_LOCKED].format(a=NAMES[name[i]], b=NAMES[name[c + i]])
      else:
        text += PROMPT_LINES[LINE_OPEN if opened[i] else LINE_CLOSED].format(a=NAMES[name[i]])
    for o in range(c, self.num_objects):
      if loc[o] == ABSENT:
        continue
      if loc[o] == FLOOR:
        text += PROMPT_LINES[LINE_FLOOR].format(a=NAMES[name[o]])
      elif loc[o] == HELD:
        text += PROMPT_LINES[LINE_HELD].format(a=NAMES[name[o]])
      else:
        text += PROMPT_LINES[LINE_IN].format(a=NAMES[name[o]], b=NAMES[name[loc[o]]])
    text += HOLD_NOTHING
    if budget >= 0:
      text += f"\nYou have {budget} turn{'s' if budget != 1 else ''}."
    return text
