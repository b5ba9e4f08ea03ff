"""`sokoban`: push every box onto a target (JAX-native; the puzzle RAGEN, verl-agent and ROLL
train on).

The agent moves with `move(direction)` calls (direction: up, down, left, right; row 0 is the
top). A move walks one cell; walking into a box pushes it one cell when the cell behind it is
floor without a box. The board is shown in the prompt and after every turn, in the standard
Sokoban characters: '#' wall, '_' floor, '.' target, '$' box, '*' box on a target, '@' you,
'+' you on a target ('_' is XSB's visible floor, so that rows read as equally long).

* Walking into a wall, or into a box that cannot move (a wall or another box behind it), is a
  TOOL_FAILURE; nothing moves.
* The move that puts the last box on a target solves the task (reward 1, done). There is no
  final answer: optimal_turns is the fewest moves (walks and pushes) from the start.
* A push after which the level can no longer be solved is IRREVERSIBLE: the move happens
  (valid_call True) and the episode ends unsolved (done, reward 0). Ending it, rather than letting
  the agent walk on until its budget is spent (RAGEN's choice), is this family's rule because
  nothing after such a push can earn a reward, the turns left would cost rollout time for no
  signal, and a valid move there would count as a "recovery" in the error-state statistics
  (`rollout.stats.error_states`) although nothing was recovered. It mirrors `grid`'s traps.
  The test is exact, not a dead-square heuristic: the push leads from a state with a finite
  distance to the solved state to one without (a box in a non-target corner, two boxes frozen
  against a wall, a box pushed into a dead corridor, ...).

Tasks (`sokoban_levels`): S x S rooms with a wall border, interior walls drawn independently with
probability `wall_density`, k targets on floor; the exact distance of every state to the solved
state is computed in JAX by a backward breadth-first search (exhaustive reverse play from the
solved state), and the start is drawn uniformly among the states at a distance in
[min(min_moves, the farthest), max_moves]. So every level is solvable by construction and its
optimal number of moves, stored in the task, is exact. The state keeps that distance table
([n * binom(n, k)] int32, n = (S - 2)^2), so the oracle and the irreversibility test are exact
from every state, on the optimal path or off it. The oracle takes the first of up, down, left,
right that lowers the distance by one; `oracle_match` is True for *any* such move.

Observation texts (exact; `{dir}` as written in the call):
  prompt, system: `SYSTEM`; user: "Board, S rows by S columns; row 0 is the top:\\n" + S lines
    of S cells + `LEGEND` + "Push all k boxes onto the targets." ("the box onto the target." for
    one box) + the budget intro (see common.py).
  later observations: one of `STEP_MESSAGES` + "\\n" + the board's S lines (no newline after the
    last) + the budget suffix.

Errors: parse_error (not `name(args)`), unknown_tool (not move), bad_arguments (unknown
direction, not exactly one argument), tool_failure (a wall, or a box that cannot move),
irreversible (see above).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxagent.envs import common
from jaxagent.envs import sokoban_levels as levels
from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import TextCodec, byte_table, concat
from jaxagent.envs.messages import MessageTable, concat_rows
from jaxagent.envs.sokoban_levels import DIRECTIONS, UNSOLVABLE

TOOLS = ("move",)
MOVE = 0

SYSTEM = ("You are playing Sokoban. Push every box onto a target by calling tools, one call per "
          "turn.\nTools:\n"
          "- move(direction): walk one cell; direction is up, down, left or right. Walking into a "
          "box pushes it one cell if the cell behind it is free floor. Walls do not move, and you "
          "cannot push two boxes at once.\n"
          "Reply with the call only, for example move(up).")
LEGEND = ("# is a wall, _ is floor, . is a target, $ is a box, * is a box on a target, @ is you, "
          "+ is you on a target.\n")
# Cell codes (index into CELL_CHARS); NEWLINE ends a row, END ends the last row of a step's board.
CELL_CHARS = ("#", "_", ".", "$", "*", "@", "+", "\n", "")
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET, NEWLINE, END = range(9)
XSB = {"#": WALL, "_": FLOOR, " ": FLOOR, "-": FLOOR, ".": TARGET, "$": BOX, "*": BOX_ON_TARGET,
       "@": PLAYER, "+": PLAYER_ON_TARGET}

# Step messages (index = message id); one slot, dir.
MSG_WALKED, MSG_PUSHED, MSG_SOLVED, MSG_IRREVERSIBLE, MSG_WALL, MSG_BLOCKED = range(6)
MSG_PARSE, MSG_UNKNOWN_TOOL, MSG_BAD_DIRECTION, MSG_ARITY = range(6, 10)
STEP_MESSAGES = (
    "You move {dir}.",
    "You move {dir} and push a box.",
    "You move {dir} and push a box. Every box is on a target. Task solved.",
    "You move {dir} and push a box. The puzzle can no longer be solved. The episode is over.",
    "Error: a wall blocks the way {dir}.",
    "Error: cannot push the box {dir}: a wall or another box is behind it.",
    "Error: the action is not a tool call. Write one call, for example move(up).",
    "Error: unknown tool. The only tool is move(direction).",
    "Error: the direction must be up, down, left or right.",
    "Error: move takes exactly one argument, the direction.",
)
STEP_SLOTS = ("dir",)

# Erroneous actions the noisy oracle draws from (see `error_candidates`): per direction d.
_TYPO = ("mvoe({d})", "push({d})")                      # unknown_tool
_MALFORMED = ("move {d}", "move({d}")                   # parse_error
_BAD_ARGS = ("move({w})", "move()", "move({d}, {d})")   # bad_arguments (w: a compass word)


@struct.dataclass
class SokobanTask:
  """One level; cells are board (row, col), row 0 the top, the border rows/columns walls."""
  walls: jax.Array          # [S, S] bool (the border is True)
  targets: jax.Array        # [k, 2] int32
  boxes: jax.Array          # [k, 2] int32: the boxes at the start
  player: jax.Array         # [2] int32: the player at the start
  optimal_turns: jax.Array  # [] int32: the fewest moves that solve the level


@struct.dataclass
class SokobanState:
  task: SokobanTask
  dist: jax.Array           # [N] int32: moves to solved from each state (UNSOLVABLE if none)
  player: jax.Array         # [] int32 interior cell
  boxes: jax.Array          # [k] int32 interior cells, sorted
  turn: jax.Array           # [] int32: turns taken
  budget: jax.Array         # [] int32: -1 hidden
  done: jax.Array           # [] bool
  solved: jax.Array         # [] bool
  optimal_turns: jax.Array  # [] int32: dist at the start


class SokobanEnv:
  """Sokoban with exact optimal turns and an irreversible-push error. See the module docstring.

  Knobs:
    size: the room is size x size cells, its border wall (6..10; the interior is size - 2).
    num_boxes: boxes (and targets), 1..3; (size - 2)^2 * binom((size - 2)^2, num_boxes) states
      must stay <= 65,536 (size 10 with 1 box, 9 with 2 and 7 with 3 fit; 10 with 2 does not).
      Sampling and reset cost grow with the states (see `sokoban_levels`' module docstring).
    wall_density: probability that an interior cell is a wall (0 <= p < 0.6).
    min_moves: the start is at least this many moves from solved when the room allows
      (default 4).
    max_moves: the start is at most this many moves from solved (default 12; >= min_moves).
  """

  name = "sokoban"

  def __init__(self, codec: TextCodec, size: int = 6, num_boxes: int = 1,
               wall_density: float = 0.15, min_moves: int = 4, max_moves: int = 12,
               max_action_len: int = 32, max_action_bytes: int = 64):
    if not 6 <= size <= 10:
      raise ValueError(f"sokoban size must be in [6, 10], got {size}")
    if not 1 <= num_boxes <= 3:
      raise ValueError(f"sokoban num_boxes must be in [1, 3], got {num_boxes}")
    if not 0.0 <= wall_density < 0.6:
      raise ValueError(f"wall_density must be in [0, 0.6), got {wall_density}")
    if not 1 <= min_moves <= max_moves:
      raise ValueError(f"need 1 <= min_moves <= max_moves, got {min_moves} and {max_moves}")
    n = (size - 2) ** 2
    if n * math.comb(n, num_boxes) > levels.MAX_STATES:
      raise ValueError(
          f"sokoban size {size} with {num_boxes} boxes has {n * math.comb(n, num_boxes):,} states "
          f"(more than {levels.MAX_STATES:,}); use a smaller size or fewer boxes")
    self.codec = codec
    self.size, self.num_boxes = int(size), int(num_boxes)
    self.wall_density = float(wall_density)
    self.min_moves, self.max_moves = int(min_moves), int(max_moves)
    self.max_action_len = int(max_action_len)
    self.max_action_bytes = int(max_action_bytes)
    self.space = levels.state_space(self.size, self.num_boxes)
    c = codec
    self._tools = byte_table(TOOLS)
    self._dirs = byte_table(DIRECTIONS)
    self._dir_words = c.fragment_table(DIRECTIONS)
    self._cells = c.fragment_table(CELL_CHARS)
    self._system = c.fragment(SYSTEM)
    self._board_intro = c.fragment(
        f"Board, {self.size} rows by {self.size} columns; row 0 is the top:\n")
    self._goal = c.fragment(LEGEND + self.goal_text())
    self._newline = c.fragment("\n")
    self.messages = MessageTable(c, STEP_MESSAGES, STEP_SLOTS)
    self._oracle_table = c.fragment_table([f"move({d})" for d in DIRECTIONS])
    self.move_errors = common.MoveErrors(c, _TYPO, _MALFORMED, _BAD_ARGS)
    self.error_texts = self.move_errors.texts
    spec = jax.eval_shape(self.sample_task, jax.random.PRNGKey(0))
    state_spec = jax.eval_shape(lambda t: self._initial_state(t, jnp.int32(-1)), spec)
    prompt_cap = jax.eval_shape(
        lambda st: concat(self._prompt_pieces(st)), state_spec).tokens.shape[0]
    self._step_cap = jax.eval_shape(
        lambda st: concat(self._step_pieces(0, st, 0)), state_spec).tokens.shape[0]
    self.max_obs_len = int(max(prompt_cap, self._step_cap))
    # Later observations fit in this many tokens (the rollout engine reserves only that per turn).
    self.max_step_obs_len = int(self._step_cap)

  def goal_text(self) -> str:
    k = self.num_boxes
    return "Push the box onto the target." if k == 1 else f"Push all {k} boxes onto the targets."

  # ---- tasks ------------------------------------------------------------------------------

  def _level(self, key):
    return levels.sample_level(key, self.space, self.wall_density, self.min_moves, self.max_moves)

  def _task_of(self, level) -> SokobanTask:
    s, m = self.size, self.space.m
    walls = jnp.ones((s, s), bool).at[1:-1, 1:-1].set(~level["floor"].reshape(m, m))
    sp = self.space
    return SokobanTask(walls=walls, targets=sp.to_board(level["targets"]),
                       boxes=sp.to_board(level["boxes"]), player=sp.to_board(level["player"]),
                       optimal_turns=level["optimal_turns"].astype(jnp.int32))

  def sample_task(self, key: jax.Array) -> SokobanTask:
    """A random solvable level with its exact optimal turns (see the module docstring).
    Jittable, vmappable."""
    return self._task_of(self._level(key))

  def floor(self, task: SokobanTask) -> jax.Array:
    """[n] bool: the interior cells that are floor."""
    return ~task.walls[1:-1, 1:-1].reshape(-1)

  def distances(self, task: SokobanTask) -> jax.Array:
    """[N] int32: every state's fewest moves to solved (`sokoban_levels.distances`). Jittable."""
    targets = jnp.sort(self.space.to_interior(task.targets))
    return levels.distances(self.space, self.floor(task), targets)

  def optimal_turns(self, task: SokobanTask) -> jax.Array:
    """[] int32: the fewest moves that solve `task`, recomputed from its board. Jittable."""
    sp = self.space
    start = sp.index(sp.to_interior(task.player), jnp.sort(sp.to_interior(task.boxes)))
    return self.distances(task)[start]

  def _initial_state(self, task: SokobanTask, budget, dist=None) -> SokobanState:
    if dist is None:
      dist = self.distances(task)
    sp = self.space
    player, boxes = sp.to_interior(task.player), jnp.sort(sp.to_interior(task.boxes))
    return SokobanState(task=task, dist=dist, player=player, boxes=boxes, turn=jnp.int32(0),
                        budget=jnp.asarray(budget, jnp.int32), done=jnp.zeros((), bool),
                        solved=jnp.zeros((), bool), optimal_turns=dist[sp.index(player, boxes)])

  # ---- rendering --------------------------------------------------------------------------

  def _board_piece(self, state: SokobanState, last_newline: bool):
    """The board's S lines as one piece (the last line's newline only if `last_newline`)."""
    s, sp = self.size, self.space
    target = jnp.zeros((sp.n,), bool).at[sp.to_interior(state.task.targets)].set(True)
    code = jnp.where(self.floor(state.task), FLOOR, WALL)
    code = jnp.where(target, TARGET, code)
    code = code.at[state.boxes].set(jnp.where(target[state.boxes], BOX_ON_TARGET, BOX))
    code = code.at[state.player].set(jnp.where(target[state.player], PLAYER_ON_TARGET, PLAYER))
    board = jnp.full((s, s), WALL, jnp.int32).at[1:-1, 1:-1].set(code.reshape(sp.m, sp.m))
    ends = jnp.full((s, 1), NEWLINE, jnp.int32)
    if not last_newline:
      ends = ends.at[-1, 0].set(END)
    code = jnp.concatenate([board, ends], axis=1).reshape(-1)
    cells = TokenBuffer(tokens=jnp.asarray(self._cells.tokens)[code],
                        length=jnp.asarray(self._cells.lengths)[code])      # [S * (S + 1), D]
    return concat_rows(cells, self.codec.pad_id)

  def _prompt_pieces(self, state: SokobanState):
    user = [self._board_intro, self._board_piece(state, True), self._goal]
    user += common.budget_intro(self.codec, state.budget)
    return self.codec.prompt([self._system], user)

  def _step_pieces(self, message, state: SokobanState, direction):
    body = self.messages.pieces(message, {"dir": self._dir_words.get(direction)})
    body += [self._newline, self._board_piece(state, False)]
    return self.codec.observation(body + common.budget_suffix(self.codec, state.budget, state.turn))

  def _pad(self, buf: TokenBuffer, n: int) -> TokenBuffer:
    pad = n - buf.tokens.shape[0]
    return buf.replace(tokens=jnp.pad(buf.tokens, (0, pad), constant_values=self.codec.pad_id))

  # ---- the contract -----------------------------------------------------------------------

  def reset(self, key: jax.Array, task: SokobanTask | None = None,
            budget: jax.Array | int = -1) -> tuple[SokobanState, TokenBuffer]:
    """The initial state and the prompt (tokens [max_obs_len]). Jittable, vmappable."""
    dist = None
    if task is None:   # the sampler's distance table serves the state too
      level = self._level(key)
      task, dist = self._task_of(level), level["dist"]
    state = self._initial_state(task, budget, dist)
    obs = common.render(self.codec, self._prompt_pieces(state), self.max_obs_len)
    return state, obs

  def _moves(self, state: SokobanState):
    """The four moves from `state` (`sokoban_levels.move` vmapped over the directions, [4])
    with "index" [4], the state index after each."""
    out = jax.vmap(lambda a: levels.move(self.space, self.floor(state.task), state.player,
                                         state.boxes, a))(jnp.arange(4, dtype=jnp.int32))
    out["index"] = jax.vmap(self.space.index)(out["player"], out["boxes"])
    return out

  def step(self, state: SokobanState,
           action: TokenBuffer) -> tuple[SokobanState, TokenBuffer, StepInfo]:
    """One turn: parse `action` (tokens [N], any N), apply it, render the observation."""
    call = common.parse_action(self.codec, action, self._tools, 1, self.max_action_bytes)
    direction = common.arg_name(call, 0, self._dirs)
    is_move = call.tool == MOVE
    arity = is_move & (call.num_args != 1)
    bad_dir = is_move & ~arity & (direction < 0)
    d = jnp.maximum(direction, 0)
    ok = is_move & ~arity & ~bad_dir
    mv = jax.tree.map(lambda x: x[d], self._moves(state))
    walks, pushes = ok & mv["walks"], ok & mv["pushes"]
    here, there = state.dist[self.space.index(state.player, state.boxes)], state.dist[mv["index"]]
    solved = pushes & (there == 0)
    irreversible = pushes & (there >= UNSOLVABLE) & (here < UNSOLVABLE)

    message = jnp.select(
        [~call.syntax_ok, call.tool < 0, arity, bad_dir, mv["wall"], mv["blocked"], solved,
         irreversible, pushes],
        [MSG_PARSE, MSG_UNKNOWN_TOOL, MSG_ARITY, MSG_BAD_DIRECTION, MSG_WALL, MSG_BLOCKED,
         MSG_SOLVED, MSG_IRREVERSIBLE, MSG_PUSHED], MSG_WALKED).astype(jnp.int32)
    error = jnp.select(
        [~call.syntax_ok, call.tool < 0, arity | bad_dir, mv["wall"] | mv["blocked"],
         irreversible],
        [ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS,
         ErrorKind.TOOL_FAILURE, ErrorKind.IRREVERSIBLE], ErrorKind.NONE).astype(jnp.int32)

    moved = walks | pushes
    oracle_match = moved & (there == here - 1) & (here < UNSOLVABLE)
    new_state = state.replace(player=jnp.where(moved, mv["player"], state.player),
                              boxes=jnp.where(moved, mv["boxes"], state.boxes),
                              done=state.done | solved | irreversible,
                              solved=state.solved | solved)
    shown = new_state.replace(turn=state.turn + 1)   # the suffix counts this turn
    obs = concat(self._step_pieces(message, shown, d), self._step_cap, self.codec.pad_id)
    info = StepInfo(
        reward=solved.astype(jnp.float32), done=solved | irreversible, solved=solved,
        final_answer=jnp.zeros((), bool), valid_call=common.is_valid_call(error),
        error_kind=error, oracle_match=oracle_match, optimal_turns=state.optimal_turns)
    return common.finish_step(state, new_state, self._pad(obs, self.max_obs_len), info)

  def oracle_direction(self, state: SokobanState) -> jax.Array:
    """[] int32: the first direction (up, down, left, right) that lowers the distance to solved
    by one (0 where none does: a solved or unsolvable state)."""
    mv = self._moves(state)
    here = state.dist[self.space.index(state.player, state.boxes)]
    better = (mv["walks"] | mv["pushes"]) & (state.dist[mv["index"]] == here - 1)
    return jnp.argmax(better).astype(jnp.int32)

  def oracle_action(self, state: SokobanState) -> TokenBuffer:
    """The expert's next action `move(d)` (tokens [max_action_len]). Jittable."""
    piece = self._oracle_table.get(self.oracle_direction(state))
    return self._pad(concat([piece]), self.max_action_len)

  def error_action(self, row) -> TokenBuffer:
    """Row `row` of `error_texts` as tokens [max_action_len]. Jittable."""
    return self.move_errors.action(row, self.max_action_len)

  def error_candidates(self, state: SokobanState) -> tuple[jax.Array, jax.Array]:
    """Plausible erroneous actions for the noisy oracle, as rows of `error_texts`:
    (kind [R] int32 ErrorKind, allowed [R] bool); tokens of row r: `error_action(r)`.

    Allowed: `move(d)` for every direction d with a wall or an immovable box in the way
    (tool_failure), and the typos, malformed calls and bad arguments built on the oracle's
    direction. None of them changes the state (no irreversible pushes, which end the episode),
    so the oracle's next action is still optimal: a demonstration with errors takes exactly
    optimal_turns valid moves."""
    mv = self._moves(state)
    blocked = mv["wall"] | mv["blocked"]
    oracle_dir = self.oracle_direction(state)
    return self.move_errors.candidates(blocked, oracle_dir)

  # ---- host helpers (docs, tests) ---------------------------------------------------------

  def board_text(self, task: SokobanTask, player=None, boxes=None) -> str:
    """Host: the board's lines (each ending in a newline) for `task` (one task, numpy or jax
    arrays), with the player and boxes at the start or at the given board cells."""
    walls = np.asarray(task.walls)
    targets = {tuple(t) for t in np.asarray(task.targets).tolist()}
    boxes = {tuple(b) for b in np.asarray(task.boxes if boxes is None else boxes).tolist()}
    player = tuple(np.asarray(task.player if player is None else player).tolist())
    rows = []
    for r in range(self.size):
      row = ""
      for c in range(self.size):
        on = (r, c) in targets
        if walls[r, c]:
          ch = "#"
        elif (r, c) in boxes:
          ch = "*" if on else "$"
        elif (r, c) == player:
          ch = "+" if on else "@"
        else:
          ch = "." if on else "_"
        row += ch
      rows.append(row + "\n")
    return "".join(rows)

  def prompt_user_text(self, task: SokobanTask, budget: int = -1) -> str:
    """Host: the exact user-turn text of the first observation."""
    text = (f"Board, {self.size} rows by {self.size} columns; row 0 is the top:\n"
            + self.board_text(task) + LEGEND + self.goal_text())
    if budget >= 0:
      text += f"\nYou have {budget} turn{'s' if budget != 1 else ''}."
    return text

  def task_from_text(self, lines: str) -> SokobanTask:
    """Host: the task drawn in `lines` (S lines of S standard Sokoban characters; floor may be
    '_', '-' or ' '), with its optimal turns computed (UNSOLVABLE if it cannot be solved)."""
    rows = lines.strip("\n").split("\n")
    s, k = self.size, self.num_boxes
    if len(rows) != s or any(len(r) != s for r in rows):
      raise ValueError(f"a {s} x {s} board needs {s} lines of {s} characters, got {rows!r}")
    walls = np.zeros((s, s), bool)
    targets, boxes, player = [], [], []
    for r, row in enumerate(rows):
      for c, ch in enumerate(row):
        if ch not in XSB:
          raise ValueError(f"unknown board character {ch!r} at ({r}, {c}); use one of "
                           f"{''.join(sorted(XSB))!r}")
        code = XSB[ch]
        walls[r, c] = code == WALL
        if code in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
          targets.append((r, c))
        if code in (BOX, BOX_ON_TARGET):
          boxes.append((r, c))
        if code in (PLAYER, PLAYER_ON_TARGET):
          player.append((r, c))
    border = np.ones((s, s), bool)
    border[1:-1, 1:-1] = False
    if not walls[border].all():
      raise ValueError("the board's border must be all walls ('#')")
    if len(targets) != k or len(boxes) != k or len(player) != 1:
      raise ValueError(f"need {k} targets, {k} boxes and one player; got {len(targets)}, "
                       f"{len(boxes)} and {len(player)}")
    task = SokobanTask(walls=jnp.asarray(walls), targets=jnp.asarray(targets, jnp.int32),
                       boxes=jnp.asarray(boxes, jnp.int32),
                       player=jnp.asarray(player[0], jnp.int32),
                       optimal_turns=jnp.int32(0))
    return task.replace(optimal_turns=jax.jit(self.optimal_turns)(task))
