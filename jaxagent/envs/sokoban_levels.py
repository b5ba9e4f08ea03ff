"""Sokoban levels in pure JAX: the state space of a room, exact distances to the solved state, and
level generation by reverse search (used by `jaxagent.envs.sokoban`).

A room is S x S cells whose border is wall; its interior has m = S - 2 rows and columns, n = m * m
cells, indexed row-major (interior cell i is board cell (i // m + 1, i % m + 1)). Inside, a cell
is floor or wall. A state is the player's interior cell p and the sorted interior cells of the k
boxes; its index is

    index = p * C + rank(boxes),   C = binom(n, k),   N = n * C states,

with `rank` the colexicographic rank of the box set (sum_i binom(c_i, i + 1) over the sorted
cells c_0 < ... < c_{k-1}). Not every index is a legal state (the player or a box on a wall, the
player on a box); those never occur and get no distance.

`distances(space, floor, targets)` gives every legal state's exact number of moves to the solved
state (all boxes on the targets; a move walks one cell, pushing the box in front when the cell
behind it is free), or UNSOLVABLE: value iteration d <- min(d, 1 + min_a d[next(s, a)]) over the
[N, 4] transition table until nothing changes (at most the largest distance + 1 rounds). It is a
backward breadth-first search from the solved states, i.e. exhaustive *reverse play* (pulls and
walks from the solved state): the states with a finite distance are exactly those reverse play
reaches, each with its shortest solution length.

`sample_level` draws rooms and targets, runs `distances`, and takes the start uniformly among the
states at a chosen distance, so every level is solvable by construction and its optimal number of
moves is known exactly.

Cost: N = n * binom(n, k) states, each round gathers N * 4 entries. Size 6 (n = 16) with one box
is 256 states, two boxes 1,920; the environment refuses more than MAX_STATES. Drawing 512 levels
(jit(vmap(sample_level)), ATTEMPTS rooms each, after compilation; 2-core AMD EPYC shared with
other jobs, 2026-12-07): size 6 with one box 0.04 s, two boxes 0.7 s; size 7 with two boxes
(7,500 states) 3.8 s.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

UNSOLVABLE = 1 << 20
MAX_STATES = 1 << 16
DIRECTIONS = ("up", "down", "left", "right")   # the order of common.DIRECTIONS (MoveErrors)
DELTAS = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], np.int32)   # [4, 2] (drow, dcol)
# Rooms drawn per level: the first ATTEMPTS - 1 with random walls, the last without walls (always
# has a solvable state one push or more from solved; see `sample_level`).
ATTEMPTS = 3


class StateSpace:
  """Static tables of the states of an S x S room with k boxes (numpy, built on the host).

  Attributes:
    size (S), m (= S - 2), n (= m * m interior cells), k (boxes), c (= binom(n, k) box sets),
    num_states (N = n * c);
    combos: [c, k] int32, the sorted interior cells of the box set of each rank;
    binom: [n + 1, k + 1] int32, binom(x, j).
  """

  def __init__(self, size: int, num_boxes: int):
    self.size, self.k = int(size), int(num_boxes)
    self.m = self.size - 2
    self.n = self.m * self.m
    self.c = math.comb(self.n, self.k)
    self.num_states = self.n * self.c
    self.binom = np.asarray([[math.comb(x, j) for j in range(self.k + 1)]
                             for x in range(self.n + 1)], np.int32)
    combos = np.zeros((self.c, self.k), np.int32)
    for combo in itertools.combinations(range(self.n), self.k):
      combos[self._rank_host(combo)] = combo
    self.combos = combos

  def _rank_host(self, cells) -> int:
    return int(sum(self.binom[c, i + 1] for i, c in enumerate(sorted(cells))))

  def rank(self, boxes: jax.Array) -> jax.Array:
    """[] int32 colex rank of the sorted interior cells `boxes` [k]. Jittable."""
    j = jnp.arange(1, self.k + 1)
    return jnp.sum(jnp.asarray(self.binom)[boxes, j]).astype(jnp.int32)

  def index(self, player: jax.Array, boxes: jax.Array) -> jax.Array:
    """[] int32 state index of (player [], sorted boxes [k]) in interior cells. Jittable."""
    return (player * self.c + self.rank(boxes)).astype(jnp.int32)

  def to_interior(self, rc: jax.Array) -> jax.Array:
    """Board (row, col) [..., 2] -> interior cell [...]."""
    return ((rc[..., 0] - 1) * self.m + rc[..., 1] - 1).astype(jnp.int32)

  def to_board(self, cell: jax.Array) -> jax.Array:
    """Interior cell [...] -> board (row, col) [..., 2]."""
    return jnp.stack([cell // self.m + 1, cell % self.m + 1], axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def state_space(size: int, num_boxes: int) -> StateSpace:
  """The (cached) `StateSpace` of an S x S room with k boxes."""
  return StateSpace(size, num_boxes)


def move(space: StateSpace, floor: jax.Array, player: jax.Array, boxes: jax.Array,
         direction: jax.Array) -> dict[str, jax.Array]:
  """One move from one state (interior cells). Jittable, vmappable; the environment's `step` and
  the transition table both use it, so they agree.

  Args:
    floor: [n] bool; player: [] int32; boxes: [k] int32 sorted; direction: [] int32 (DIRECTIONS).
  Returns:
    {"player", "boxes" (sorted): the state after the move (unchanged unless it happens),
     "walks": moved without pushing, "pushes": moved and pushed a box,
     "wall": a wall (or the border) is in the way, "blocked": the box in the way cannot move}.
  """
  m = space.m
  delta = jnp.asarray(DELTAS)[direction]

  def ahead(cell, steps):
    r, c = cell // m + steps * delta[0], cell % m + steps * delta[1]
    inside = (r >= 0) & (r < m) & (c >= 0) & (c < m)
    at = jnp.clip(r, 0, m - 1) * m + jnp.clip(c, 0, m - 1)
    return at.astype(jnp.int32), inside & floor[at]

  q, q_floor = ahead(player, 1)
  q2, q2_floor = ahead(player, 2)
  q_box = q_floor & jnp.any(boxes == q)
  q2_free = q2_floor & ~jnp.any(boxes == q2)
  walks = q_floor & ~q_box
  pushes = q_box & q2_free
  new_boxes = jnp.sort(jnp.where(pushes & (boxes == q), q2, boxes)).astype(jnp.int32)
  return {"player": jnp.where(walks | pushes, q, player).astype(jnp.int32), "boxes": new_boxes,
          "walks": walks, "pushes": pushes, "wall": ~q_floor, "blocked": q_box & ~q2_free}


def legal_states(space: StateSpace, floor: jax.Array) -> jax.Array:
  """[N] bool: the player and every box on floor, the player not on a box. Jittable."""
  idx = jnp.arange(space.num_states, dtype=jnp.int32)
  player, boxes = idx // space.c, jnp.asarray(space.combos)[idx % space.c]
  return floor[player] & jnp.all(floor[boxes], axis=1) & ~jnp.any(boxes == player[:, None], axis=1)


def transitions(space: StateSpace, floor: jax.Array) -> jax.Array:
  """[N, 4] int32: the state index after each move from each state (itself where the move
  fails; meaningless for illegal states). Jittable."""
  idx = jnp.arange(space.num_states, dtype=jnp.int32)
  player, boxes = idx // space.c, jnp.asarray(space.combos)[idx % space.c]

  def one(p, b):
    out = jax.vmap(lambda a: move(space, floor, p, b, a))(jnp.arange(4, dtype=jnp.int32))
    return jax.vmap(space.index)(out["player"], out["boxes"])

  return jax.vmap(one)(player, boxes)


def distances(space: StateSpace, floor: jax.Array, targets: jax.Array) -> jax.Array:
  """[N] int32: every legal state's fewest moves to the solved state (boxes on `targets`, sorted
  interior cells [k]), UNSOLVABLE for illegal or unsolvable states. Jittable (see the module
  docstring)."""
  legal = legal_states(space, floor)
  nxt = transitions(space, floor)
  solved = legal & (jnp.arange(space.num_states) % space.c == space.rank(targets))
  big = jnp.int32(UNSOLVABLE)

  def relax(d):
    best = jnp.min(d[nxt], axis=1)
    d = jnp.where(legal, jnp.minimum(d, jnp.minimum(best + 1, big)), big)
    return jnp.where(solved, 0, d)

  d0 = jnp.where(solved, 0, big)
  d1 = relax(d0)
  d, _ = jax.lax.while_loop(lambda c: jnp.any(c[0] != c[1]), lambda c: (relax(c[0]), c[0]),
                            (d1, d0))
  return d


def sample_level(key: jax.Array, space: StateSpace, wall_density: float, min_moves: int,
                 max_moves: int) -> dict[str, jax.Array]:
  """A solvable level and its exact distance table. Jittable, vmappable.

  ATTEMPTS rooms are drawn (walls of the interior independently with probability wall_density;
  the last room has none), each with k targets on distinct floor cells (uniform). For each,
  `distances` gives the solvable states; the usable ones are 0 < d <= max_moves. The first room
  whose usable states reach min_moves is kept (else the room whose usable states go farthest),
  and the start is uniform among its usable states at distance >= min(min_moves, the farthest
  usable distance).

  The wall-free room always has a usable state when m >= 4 and k <= 3: a box one cell off its
  target t, with the player behind it (cells t + d and t + 2d, free of other boxes), is one push
  from solved. With m >= 4 every cell has such a line in each axis; blocking both of a target's
  lines takes one other target in its row and one in its column, and then the target in its row
  has a free line in its own column (the third target is in the first one's column, not in it).
  (m = 3 would not do: nothing can be pushed onto the centre.)

  Returns {"floor" [n] bool, "targets" [k], "player" [], "boxes" [k] (interior cells, sorted),
  "dist" [N] int32, "optimal_turns" [] int32}.
  """
  n, k, a = space.n, space.k, ATTEMPTS
  u = jax.random.uniform(key, (a, 2 * n + space.num_states))   # one PRNG call (compile time)
  u_wall, u_target, u_start = u[:, :n], u[:, n:2 * n], u[:, 2 * n:]
  floor = (u_wall >= wall_density).at[a - 1].set(True)
  order = jnp.argsort(jnp.where(floor, u_target, 2.0), axis=1)
  targets = jnp.sort(order[:, :k], axis=1).astype(jnp.int32)
  enough = jnp.sum(floor, axis=1) > k
  dist = jax.vmap(lambda f, t: distances(space, f, t))(floor, targets)          # [a, N]
  usable = (dist > 0) & (dist <= max_moves) & enough[:, None]
  farthest = jnp.max(jnp.where(usable, dist, 0), axis=1)                        # [a]
  reach = farthest >= min_moves
  room = jnp.where(jnp.any(reach), jnp.argmax(reach), jnp.argmax(farthest)).astype(jnp.int32)
  far = jnp.minimum(min_moves, farthest[room])
  pick = usable[room] & (dist[room] >= far)
  start = jnp.argmax(jnp.where(pick, u_start[room], -1.0)).astype(jnp.int32)
  return {"floor": floor[room], "targets": targets[room], "player": start // space.c,
          "boxes": jnp.asarray(space.combos)[start % space.c], "dist": dist[room],
          "optimal_turns": dist[room, start]}
