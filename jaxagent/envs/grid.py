"""`grid`: long-horizon navigation on a grid with walls and traps (JAX-native).

The agent starts on a free cell and must reach the goal cell with `move(direction)` calls
(direction: up, down, left, right; row 0 is the top row, column 0 the left column). `look()`
describes the four neighbouring cells. The whole map is shown in the first observation.

* A move into a wall or off the grid is a TOOL_FAILURE; the agent stays where it is.
* A move onto a trap ends the episode unsolved (the call itself is valid: error_kind NONE).
* A move onto the goal solves the task (reward 1, done).

Tasks: walls are drawn independently with probability `wall_density`, then `num_traps` traps on
distinct cells; a goal cell and a helper cell are drawn and a monotone path between them is
carved free of walls and traps, so at least one cell other than the goal can reach it. BFS
distances to the goal (avoiding walls and traps, computed in JAX by relaxation) then pick the
start uniformly among reachable cells at distance >= min(min_distance, the largest reachable
distance). optimal_turns = the BFS distance of the start, and the oracle follows a shortest path
(the first of up, down, left, right that lowers the distance).

`oracle_match` is True for *any* move that lowers the distance by one (every shortest-path move),
so an agent on another shortest path is not penalised; the oracle's own action always matches.

Observation texts (exact; `{r}`/`{c}` decimal, `{dir}` as written in the call):
  prompt, system: `SYSTEM`; user: "Map, S rows by S columns; row 0 is the top, column 0 the
    left:\\n" + S lines of S cells ('#' wall, '.' free, 'T' trap, 'A' you, 'G' goal) + `LEGEND` +
    "You are at (r, c). Reach the goal at (r, c)." + the budget intro (see common.py).
  later observations: one of `STEP_MESSAGES` + the budget suffix.
  With `hint=True`, the prompt's position sentence and every later observation's message are
  followed by `hint_text(dr, dc)` for the agent's position then: " Goal direction: down, right."
  (the directions that bring the agent nearer the goal ignoring walls; one word when it shares a
  row or column with the goal). Walls still make a hinted move fail, so the hint makes the task
  easy to read for a small model without making it trivial.

Errors: parse_error (not `name(args)`), unknown_tool (not move/look), bad_arguments (unknown
direction, move without exactly one argument, look with arguments), tool_failure (wall or edge).
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

UNREACHABLE = 1 << 20
DIRECTIONS = common.DIRECTIONS
DELTAS = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], np.int32)   # [4, 2] (drow, dcol)
TOOLS = ("move", "look")
MOVE, LOOK = 0, 1

SYSTEM = ("You are an agent in a grid world. Reach the goal by calling tools, one call per turn.\n"
          "Tools:\n"
          "- move(direction): move one cell; direction is up, down, left or right. "
          "Moving into a wall or off the grid fails.\n"
          "- look(): describe the four cells around you.\n"
          "Reply with the call only, for example move(up).")
LEGEND = ("# is a wall, . is free, T is a trap (stepping on one ends the episode), A is you, "
          "G is the goal.\n")
CELL_CHARS = (".", "#", "T", "G", "A", "\n")  # free, wall, trap, goal, agent; end of row
FREE, WALL, TRAP, GOAL, AGENT, NEWLINE = range(6)
NEIGHBOUR_WORDS = ("free", "a wall", "a trap", "the goal", "the edge")   # by cell code; 4 = edge

# Step messages (index = message id); slots in this order: dir, r, c, up, down, left, right.
MSG_MOVED, MSG_GOAL, MSG_TRAP, MSG_WALL, MSG_EDGE, MSG_LOOK = range(6)
MSG_PARSE, MSG_UNKNOWN_TOOL, MSG_BAD_DIRECTION, MSG_MOVE_ARITY, MSG_LOOK_ARITY = range(6, 11)
STEP_MESSAGES = (
    "You move {dir}. You are at ({r}, {c}).",
    "You move {dir} and reach the goal at ({r}, {c}). Task solved.",
    "You move {dir} onto a trap at ({r}, {c}). The episode is over.",
    "Error: a wall blocks the way {dir} from ({r}, {c}).",
    "Error: the edge of the grid blocks the way {dir} from ({r}, {c}).",
    "Around you at ({r}, {c}): up is {up}, down is {down}, left is {left}, right is {right}.",
    "Error: the action is not a tool call. Write one call, for example move(up).",
    "Error: unknown tool. The tools are move(direction) and look().",
    "Error: the direction must be up, down, left or right.",
    "Error: move takes exactly one argument, the direction.",
    "Error: look takes no arguments.",
)
STEP_SLOTS = ("dir", "r", "c", "up", "down", "left", "right")

# Erroneous actions the noisy oracle draws from (see `error_candidates`): per direction d.
_TYPO = ("mvoe({d})", "go({d})")                        # unknown_tool
_MALFORMED = ("move {d}", "move({d}")                   # parse_error
_BAD_ARGS = ("move({w})", "move()", "look({d})")        # bad_arguments (w: a compass word)


def hint_text(dr: int, dc: int) -> str:
  """The hint shown for a goal dr rows down and dc columns right of the agent (signs matter)."""
  words = [w for w, on in (("up", dr < 0), ("down", dr > 0), ("left", dc < 0), ("right", dc > 0))
           if on]
  return " Goal direction: " + (", ".join(words) or "here") + "."


# Row (sign(dr) + 1) * 3 + sign(dc) + 1 of the hint table.
HINT_TEXTS = tuple(hint_text(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1))


@struct.dataclass
class GridTask:
  walls: jax.Array  # [S, S] bool
  traps: jax.Array  # [S, S] bool
  start: jax.Array  # [2] int32 (row, col)
  goal: jax.Array   # [2] int32 (row, col)


@struct.dataclass
class GridState:
  task: GridTask
  dist: jax.Array           # [S, S] int32: shortest-path turns to the goal (UNREACHABLE if none)
  pos: jax.Array            # [2] int32
  turn: jax.Array           # [] int32: turns taken
  budget: jax.Array         # [] int32: -1 hidden
  done: jax.Array           # [] bool
  solved: jax.Array         # [] bool
  optimal_turns: jax.Array  # [] int32: dist at the start


def distances_to(free: jax.Array, goal: jax.Array) -> jax.Array:
  """BFS distances from every cell to `goal` moving through `free` cells ([S, S] bool).

  Relaxes d <- min(d, 1 + min(neighbour d)) on free cells until nothing changes (at most S*S
  rounds). Returns [S, S] int32, UNREACHABLE where the goal cannot be reached.
  """
  s = free.shape[0]
  big = jnp.int32(UNREACHABLE)
  at_goal = jnp.zeros(free.shape, bool).at[goal[0], goal[1]].set(True)

  def relax(d):
    p = jnp.pad(d, 1, constant_values=big)
    nb = jnp.minimum(jnp.minimum(p[:-2, 1:-1], p[2:, 1:-1]), jnp.minimum(p[1:-1, :-2], p[1:-1, 2:]))
    d = jnp.where(free, jnp.minimum(d, jnp.minimum(nb + 1, big)), big)
    return jnp.where(at_goal, 0, d)

  d0 = jnp.where(at_goal, 0, big)
  d1 = relax(d0)
  d, _, _ = jax.lax.while_loop(
      lambda c: jnp.any(c[0] != c[1]) & (c[2] < s * s),
      lambda c: (relax(c[0]), c[0], c[2] + 1),
      (d1, d0, jnp.int32(1)))
  return d


def _random_cell(u, mask):
  """A uniformly random cell where mask ([S, S] bool, not all False) is True, from uniforms u
  ([S, S] in [0, 1)): the masked cell with the largest u."""
  s = mask.shape[0]
  i = jnp.argmax(jnp.where(mask, u, -1.0).reshape(-1))
  return jnp.stack([i // s, i % s]).astype(jnp.int32)


def sample_grid_task(key: jax.Array, size: int, wall_density: float, num_traps: int,
                     min_distance: int) -> GridTask:
  """A random task whose goal is reachable from the start (see the module docstring)."""
  return _sample_with_distances(key, size, wall_density, num_traps, min_distance)[0]


def _sample_with_distances(key, size, wall_density, num_traps, min_distance):
  """(task, its BFS distances [S, S]). All randomness comes from one PRNG call (each call site
  costs seconds of compile time on CPU)."""
  s = size
  slots = 2 * (s - 1)
  u = jax.random.uniform(key, (6, s, s))   # walls, traps, goal, via, start, path order
  u_path = u[5].reshape(-1)[:slots]          # slots = 2(s - 1) <= s * s
  walls = u[0] < wall_density
  # num_traps distinct cells: those with the smallest u[1]; walls win over traps.
  rank = jnp.argsort(jnp.argsort(u[1].reshape(-1))).reshape(s, s)
  traps = (rank < num_traps) & ~walls
  goal = _random_cell(u[2], jnp.ones((s, s), bool))
  via = _random_cell(u[3], jnp.ones((s, s), bool).at[goal[0], goal[1]].set(False))
  # Carve a monotone path via -> goal: |dr| vertical and |dc| horizontal steps in random order
  # (the order: ranks of u_path over the first n slots).
  dr, dc = goal[0] - via[0], goal[1] - via[1]
  n = jnp.abs(dr) + jnp.abs(dc)
  score = jnp.where(jnp.arange(slots) < n, u_path, jnp.inf)
  order = jnp.argsort(jnp.argsort(score))               # ranks 0..n-1 on the first n slots
  vertical = order < jnp.abs(dr)
  step = jnp.where(vertical[:, None], jnp.stack([jnp.sign(dr), 0]), jnp.stack([0, jnp.sign(dc)]))
  step = jnp.where((jnp.arange(slots) < n)[:, None], step, 0)
  path = via[None, :] + jnp.cumsum(step, axis=0)       # [slots, 2]
  cells = jnp.concatenate([via[None, :], path, goal[None, :]])
  carve = jnp.zeros((s, s), bool).at[cells[:, 0], cells[:, 1]].set(True)
  walls, traps = walls & ~carve, traps & ~carve
  dist = distances_to(~walls & ~traps, goal)
  reachable = (dist < UNREACHABLE) & (dist > 0)
  far = jnp.minimum(min_distance, jnp.max(jnp.where(reachable, dist, 0)))
  start = _random_cell(u[4], reachable & (dist >= far))
  return GridTask(walls=walls, traps=traps, start=start, goal=goal), dist


class GridEnv:
  """Grid navigation with walls and traps. See the module docstring.

  Knobs:
    size: the grid is size x size (2..16).
    wall_density: probability that a cell is a wall before the path is carved (0 <= p < 1).
    num_traps: traps drawn (some may be carved away), 0 <= num_traps < size*size // 2.
    min_distance: the start is at least this many moves from the goal when the map allows
      (default: size).
    hint: follow the position in every observation by the goal's direction (see the module
      docstring).
  """

  name = "grid"

  def __init__(self, codec: TextCodec, size: int = 6, wall_density: float = 0.25,
               num_traps: int = 2, min_distance: int | None = None, hint: bool = False,
               max_action_len: int = 32, max_action_bytes: int = 64):
    if not 2 <= size <= 16:
      raise ValueError(f"grid size must be in [2, 16], got {size}")
    if not 0.0 <= wall_density < 1.0:
      raise ValueError(f"wall_density must be in [0, 1), got {wall_density}")
    if not 0 <= num_traps < size * size // 2:
      raise ValueError(f"num_traps must be in [0, {size * size // 2}), got {num_traps}")
    self.codec = codec
    self.size = int(size)
    self.wall_density = float(wall_density)
    self.num_traps = int(num_traps)
    self.min_distance = int(size if min_distance is None else min_distance)
    self.hint = bool(hint)
    self.max_action_len = int(max_action_len)
    self.max_action_bytes = int(max_action_bytes)
    c = codec
    self._tools = byte_table(TOOLS)
    self._dirs = byte_table(DIRECTIONS)
    self._dir_words = c.fragment_table(DIRECTIONS)
    self._numbers = c.numbers(max(self.size, 9))
    self._cells = c.fragment_table(CELL_CHARS)
    self._neighbour = c.fragment_table(NEIGHBOUR_WORDS)
    self._system = c.fragment(SYSTEM)
    self._map_intro = c.fragment(
        f"Map, {self.size} rows by {self.size} columns; row 0 is the top, column 0 the left:\n")
    self._legend_at = c.fragment(LEGEND + "You are at (")
    self._comma = c.fragment(", ")
    self._reach = c.fragment("). Reach the goal at (")
    self._close = c.fragment(").")
    self.messages = MessageTable(c, STEP_MESSAGES, STEP_SLOTS)
    self._hints = c.fragment_table(HINT_TEXTS)
    self._oracle_table = c.fragment_table([f"move({d})" for d in DIRECTIONS])
    self.move_errors = common.MoveErrors(c, _TYPO, _MALFORMED, _BAD_ARGS)
    self.error_texts = self.move_errors.texts
    spec = jax.eval_shape(self._sample, jax.random.PRNGKey(0))
    state_spec = jax.eval_shape(lambda t: self._initial_state(t, jnp.int32(-1)), spec)
    prompt_cap = jax.eval_shape(lambda st: concat(self._prompt_pieces(st)), state_spec).tokens.shape[0]
    self._step_cap = jax.eval_shape(
        lambda st: concat(self._step_pieces(0, st, st.pos, 0)), state_spec).tokens.shape[0]
    self.max_obs_len = int(max(prompt_cap, self._step_cap))
    # Later observations fit in this many tokens (the rollout engine reserves only that per turn).
    self.max_step_obs_len = int(self._step_cap)

  # ---- tasks ------------------------------------------------------------------------------

  def _sample(self, key):
    return sample_grid_task(key, self.size, self.wall_density, self.num_traps, self.min_distance)

  def sample_task(self, key: jax.Array) -> GridTask:
    """A random task (see the module docstring). Jittable, vmappable."""
    return self._sample(key)

  def optimal_turns(self, task: GridTask) -> jax.Array:
    """[] int32: the fewest moves from the start to the goal (BFS). Jittable."""
    return distances_to(~task.walls & ~task.traps, task.goal)[task.start[0], task.start[1]]

  def _initial_state(self, task: GridTask, budget, dist=None) -> GridState:
    if dist is None:
      dist = distances_to(~task.walls & ~task.traps, task.goal)
    return GridState(task=task, dist=dist, pos=task.start, turn=jnp.int32(0),
                     budget=jnp.asarray(budget, jnp.int32), done=jnp.zeros((), bool),
                     solved=jnp.zeros((), bool), optimal_turns=dist[task.start[0], task.start[1]])

  # ---- rendering --------------------------------------------------------------------------

  def _num(self, v):
    return self._numbers.get(jnp.clip(v, 0, len(self._numbers) - 1))

  def _prompt_pieces(self, state: GridState):
    t = state.task
    s = self.size
    code = jnp.full((s, s), FREE, jnp.int32)
    code = jnp.where(t.walls, WALL, code)
    code = jnp.where(t.traps, TRAP, code)
    code = code.at[t.goal[0], t.goal[1]].set(GOAL).at[state.pos[0], state.pos[1]].set(AGENT)
    code = jnp.concatenate([code, jnp.full((s, 1), NEWLINE, jnp.int32)], axis=1).reshape(-1)
    cells = TokenBuffer(tokens=jnp.asarray(self._cells.tokens)[code],
                        length=jnp.asarray(self._cells.lengths)[code])      # [S * (S + 1), D]
    user = [self._map_intro, concat_rows(cells, self.codec.pad_id)]
    user += [self._legend_at, self._num(state.pos[0]), self._comma, self._num(state.pos[1]),
             self._reach, self._num(t.goal[0]), self._comma, self._num(t.goal[1]), self._close]
    user += self._hint_pieces(state, state.pos)
    user += common.budget_intro(self.codec, state.budget)
    return self.codec.prompt([self._system], user)

  def _neighbour_codes(self, state: GridState, pos) -> jax.Array:
    """[4] int32 codes of the cells up/down/left/right of pos (NEIGHBOUR_WORDS index)."""
    t = state.task
    s = self.size
    nxt = pos[None, :] + jnp.asarray(DELTAS)
    inside = jnp.all((nxt >= 0) & (nxt < s), axis=1)
    r, c = jnp.clip(nxt[:, 0], 0, s - 1), jnp.clip(nxt[:, 1], 0, s - 1)
    code = jnp.where(t.walls[r, c], WALL, FREE)
    code = jnp.where(t.traps[r, c], TRAP, code)
    code = jnp.where((r == t.goal[0]) & (c == t.goal[1]), GOAL, code)
    return jnp.where(inside, code, 4).astype(jnp.int32)

  def _hint_pieces(self, state: GridState, pos) -> list:
    if not self.hint:
      return []
    d = jnp.sign(state.task.goal - pos)
    return [self._hints.get((d[0] + 1) * 3 + d[1] + 1)]

  def _step_pieces(self, message, state: GridState, pos, direction):
    around = self._neighbour_codes(state, pos)
    body = self.messages.pieces(message, {
        "dir": self._dir_words.get(direction), "r": self._num(pos[0]), "c": self._num(pos[1]),
        "up": self._neighbour.get(around[0]), "down": self._neighbour.get(around[1]),
        "left": self._neighbour.get(around[2]), "right": self._neighbour.get(around[3])})
    return self.codec.observation(body + self._hint_pieces(state, pos)
                                  + common.budget_suffix(self.codec, state.budget, state.turn))

  def _pad(self, buf: TokenBuffer, n: int) -> TokenBuffer:
    pad = n - buf.tokens.shape[0]
    return buf.replace(tokens=jnp.pad(buf.tokens, (0, pad), constant_values=self.codec.pad_id))

  # ---- the contract -----------------------------------------------------------------------

  def reset(self, key: jax.Array, task: GridTask | None = None,
            budget: jax.Array | int = -1) -> tuple[GridState, TokenBuffer]:
    """The initial state and the prompt (tokens [max_obs_len]). Jittable, vmappable."""
    dist = None
    if task is None:   # the sampler's BFS distances serve the state too
      task, dist = _sample_with_distances(key, self.size, self.wall_density, self.num_traps,
                                          self.min_distance)
    state = self._initial_state(task, budget, dist)
    obs = common.render(self.codec, self._prompt_pieces(state), self.max_obs_len)
    return state, obs

  def step(self, state: GridState, action: TokenBuffer) -> tuple[GridState, TokenBuffer, StepInfo]:
    """One turn: parse `action` (tokens [N], any N), apply it, render the observation."""
    s = self.size
    call = common.parse_action(self.codec, action, self._tools, 1, self.max_action_bytes)
    direction = common.arg_name(call, 0, self._dirs)
    is_move, is_look = call.tool == MOVE, call.tool == LOOK
    move_arity = is_move & (call.num_args != 1)
    bad_dir = is_move & ~move_arity & (direction < 0)
    look_arity = is_look & (call.num_args != 0)
    d = jnp.maximum(direction, 0)
    target = state.pos + jnp.asarray(DELTAS)[d]
    inside = jnp.all((target >= 0) & (target < s))
    tr, tc = jnp.clip(target[0], 0, s - 1), jnp.clip(target[1], 0, s - 1)
    wall = inside & state.task.walls[tr, tc]
    moves = is_move & ~move_arity & ~bad_dir & inside & ~wall
    trap = moves & state.task.traps[tr, tc]
    goal = moves & (tr == state.task.goal[0]) & (tc == state.task.goal[1])

    message = jnp.select(
        [~call.syntax_ok, call.tool < 0, move_arity, bad_dir, look_arity, is_look, ~inside, wall,
         goal, trap],
        [MSG_PARSE, MSG_UNKNOWN_TOOL, MSG_MOVE_ARITY, MSG_BAD_DIRECTION, MSG_LOOK_ARITY, MSG_LOOK,
         MSG_EDGE, MSG_WALL, MSG_GOAL, MSG_TRAP], MSG_MOVED).astype(jnp.int32)
    error = jnp.select(
        [~call.syntax_ok, call.tool < 0, move_arity | bad_dir | look_arity, is_look,
         ~inside | wall],
        [ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS, ErrorKind.NONE,
         ErrorKind.TOOL_FAILURE], ErrorKind.NONE).astype(jnp.int32)

    pos = jnp.where(moves, jnp.stack([tr, tc]), state.pos)
    here = state.dist[state.pos[0], state.pos[1]]
    oracle_match = moves & (state.dist[tr, tc] == here - 1) & (here < UNREACHABLE)
    new_state = state.replace(pos=pos, done=state.done | goal | trap, solved=state.solved | goal)
    shown = new_state.replace(turn=state.turn + 1)   # the suffix counts this turn
    # Messages about a move name the cell the agent was at (errors) or is now at (moves).
    obs = concat(self._step_pieces(message, shown, pos, d), self._step_cap, self.codec.pad_id)
    info = StepInfo(
        reward=goal.astype(jnp.float32), done=goal | trap, solved=goal,
        final_answer=jnp.zeros((), bool), valid_call=common.is_valid_call(error),
        error_kind=error, oracle_match=oracle_match, optimal_turns=state.optimal_turns)
    return common.finish_step(state, new_state, self._pad(obs, self.max_obs_len), info)

  def oracle_direction(self, state: GridState) -> jax.Array:
    """[] int32: the first direction (up, down, left, right) along a shortest path."""
    s = self.size
    nxt = state.pos[None, :] + jnp.asarray(DELTAS)
    inside = jnp.all((nxt >= 0) & (nxt < s), axis=1)
    r, c = jnp.clip(nxt[:, 0], 0, s - 1), jnp.clip(nxt[:, 1], 0, s - 1)
    here = state.dist[state.pos[0], state.pos[1]]
    better = inside & (state.dist[r, c] == here - 1)
    return jnp.argmax(better).astype(jnp.int32)

  def oracle_action(self, state: GridState) -> TokenBuffer:
    """The expert's next action `move(d)` (tokens [max_action_len]). Jittable."""
    piece = self._oracle_table.get(self.oracle_direction(state))
    return self._pad(concat([piece]), self.max_action_len)

  def error_action(self, row) -> TokenBuffer:
    """Row `row` of `error_texts` as tokens [max_action_len]. Jittable."""
    return self.move_errors.action(row, self.max_action_len)

  def error_candidates(self, state: GridState) -> tuple[jax.Array, jax.Array]:
    """Plausible erroneous actions for the noisy oracle, as rows of `error_texts`:
    (kind [R] int32 ErrorKind, allowed [R] bool); tokens of row r: `error_action(r)`.

    Allowed: `move(d)` for every blocked direction d (tool_failure), and the typos, malformed
    calls and bad arguments built on the oracle's direction."""
    blocked = self._neighbour_codes(state, state.pos)
    blocked = (blocked == WALL) | (blocked == 4)
    oracle_dir = self.oracle_direction(state)
    return self.move_errors.candidates(blocked, oracle_dir)

  # ---- host helpers (docs, tests) ---------------------------------------------------------

  def map_text(self, task: GridTask, pos=None) -> str:
    """Host: the map lines of the prompt for `task` (one task, numpy or jax arrays)."""
    walls, traps = np.asarray(task.walls), np.asarray(task.traps)
    pos = np.asarray(task.start if pos is None else pos)
    goal = np.asarray(task.goal)
    rows = []
    for r in range(self.size):
      row = ""
      for c in range(self.size):
        ch = "#" if walls[r, c] else "T" if traps[r, c] else "."
        ch = "G" if (r, c) == tuple(goal) else ch
        ch = "A" if (r, c) == tuple(pos) else ch
        row += ch
      rows.append(row + "\n")
    return "".join(rows)

  def prompt_user_text(self, task: GridTask, budget: int = -1) -> str:
    """Host: the exact user-turn text of the first observation."""
    start, goal = np.asarray(task.start), np.asarray(task.goal)
    text = (f"Map, {self.size} rows by {self.size} columns; row 0 is the top, column 0 the left:\n"
            + self.map_text(task) + LEGEND
            + f"You are at ({start[0]}, {start[1]}). Reach the goal at ({goal[0]}, {goal[1]}).")
    if self.hint:
      text += hint_text(int(goal[0] - start[0]), int(goal[1] - start[1]))
    if budget >= 0:
      text += f"\nYou have {budget} turn{'s' if budget != 1 else ''}."
    return text
