"""`lookup`: multi-hop information gathering over a hidden, procedurally generated knowledge base.

A task is a small knowledge base: E entities (names drawn from `ENTITY_NAMES`), R relations
(drawn from `RELATION_NAMES`) and links `link[e, r]` (entity e's relation r is another entity, or
absent). The question asks for the end of a chain of `hops` relations from a start entity:

    Question: what is the city of the owner of Alba?

The agent follows the chain one link per turn with `lookup(entity, relation)` and ends with
`answer(entity)`; optimal_turns = hops + 1. Distractors: entities off the chain and relations the
question does not use, with random links among them (`density`).

Texts (exact; `{x}` are names, [..] only with a visible budget, see `common.py`):
  system: SYSTEM_TEXT + "Relations: {r0}, {r1}, ..., {rR-1}."
  user:   "Question: what is the {rH} of the ... of the {r1} of {start}?" ["\\nYou have N turns."]
  step bodies ([..] = "\\nTurns left: k." with a visible budget):
    lookup success          "The {r} of {e} is {f}."
    correct answer          "Correct."
    wrong answer            "Wrong answer."                                  (wrong_answer; ends)
    otherwise               "Error: " + one of MESSAGES (parse_error, unknown_tool,
                            bad_arguments) or "Error: {e} has no {r}." (tool_failure)

Error kinds: parse_error (not `name(args)`), unknown_tool, bad_arguments (wrong arity, unknown
entity or relation name), tool_failure (the entity has no such relation), wrong_answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxagent.envs import common
from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer
from jaxagent.envs.codec import TextCodec, byte_table, concat, mask_piece

ENTITY_NAMES = tuple("""
Alba Brix Cato Dara Elko Fenn Gala Hugo Ilsa Joro Kira Lumo Mira Nilo Orla Pax
Quin Rhea Soto Tova Umar Vela Wren Xeno Yara Zeb Anko Bela Cirr Doma Eris Faro
Gito Hana Ivo Jada Koru Lira Milo Nara Odo Pima Rada Sela Tarn Ulla Vito Wynn
Yuko Zana Arlo Brea Ciro Deva Emil Flin Gwen Hale Inga Jace Kell Leto Moro Nyla
""".split())
RELATION_NAMES = ("owner", "city", "mentor", "rival", "founder", "employer", "partner", "neighbor",
                  "teacher", "sibling", "friend", "parent", "leader", "author", "doctor", "captain")
TOOLS = ("lookup", "answer")
LOOKUP, ANSWER = 0, 1

SYSTEM_TEXT = (
    "You answer a question about a hidden knowledge base by calling tools, one call per turn.\n"
    "Tools:\n"
    "lookup(entity, relation): returns the entity that is the given relation of the given entity.\n"
    "answer(entity): gives your final answer and ends the episode.\n"
    "Relations: ")
# Message codes of the step body (indices into MESSAGES; LINK and NO_LINK are built from names).
CORRECT, WRONG, PARSE, UNKNOWN_TOOL, LOOKUP_ARITY, ANSWER_ARITY, UNKNOWN_ENTITY, UNKNOWN_RELATION = range(8)
LINK, NO_LINK = 8, 9
MESSAGES = (
    "Correct.",
    "Wrong answer.",
    "could not parse the action. Reply with one tool call, e.g. lookup(entity, relation).",
    "unknown tool. The tools are lookup and answer.",
    "lookup takes two arguments: lookup(entity, relation).",
    "answer takes one argument: answer(entity).",
    "unknown entity.",
    "unknown relation.",
)
ERROR_OF_MESSAGE = (ErrorKind.NONE, ErrorKind.WRONG_ANSWER, ErrorKind.PARSE_ERROR,
                    ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS, ErrorKind.BAD_ARGUMENTS,
                    ErrorKind.BAD_ARGUMENTS, ErrorKind.BAD_ARGUMENTS, ErrorKind.NONE,
                    ErrorKind.TOOL_FAILURE)


@struct.dataclass
class LookupTask:
  """One knowledge base and question. Local entity i is ENTITY_NAMES[entities[i]]; the chain
  is local entities 0 -> 1 -> ... -> H (0 is the start, H the answer), hop i via relation path[i]."""
  entities: jax.Array   # [E] int32, distinct indices into ENTITY_NAMES
  relations: jax.Array  # [R] int32, distinct indices into RELATION_NAMES
  link: jax.Array       # [E, R] int32: local target entity of (entity, relation), -1 if none
  path: jax.Array       # [H] int32: local relation of each hop


@struct.dataclass
class LookupState:
  task: LookupTask
  progress: jax.Array   # [] int32: chain links found so far (in order)
  turn: jax.Array       # [] int32: turns taken
  budget: jax.Array     # [] int32: -1 hidden
  done: jax.Array       # [] bool


class LookupEnv:
  """Multi-hop lookup. Knobs: hops (>= 1, turns = hops + 1), distractor_entities (entities off the
  chain), num_relations (relations in the knowledge base, <= 16), density (probability of each
  distractor link); max_action_len (tokens) and max_action_bytes bound an action."""
  name = "lookup"

  def __init__(self, codec: TextCodec, hops: int = 2, distractor_entities: int = 4,
               num_relations: int = 4, density: float = 0.5, max_action_len: int = 32,
               max_action_bytes: int = 128):
    if hops < 1 or distractor_entities < 0:
      raise ValueError(f"need hops >= 1 and distractor_entities >= 0, got {hops}, {distractor_entities}")
    if hops + 1 + distractor_entities > len(ENTITY_NAMES):
      raise ValueError(f"hops + 1 + distractor_entities must be <= {len(ENTITY_NAMES)}")
    if not 1 <= num_relations <= len(RELATION_NAMES):
      raise ValueError(f"num_relations must be in [1, {len(RELATION_NAMES)}], got {num_relations}")
    self.codec = codec
    self.hops, self.num_entities, self.num_relations = hops, hops + 1 + distractor_entities, num_relations
    self.density = float(density)
    self.max_action_len, self.max_action_bytes = max_action_len, max_action_bytes
    self.tool_table = byte_table(TOOLS)
    self.entity_bytes = byte_table(ENTITY_NAMES)
    self.relation_bytes = byte_table(RELATION_NAMES)
    f = codec.fragment
    self.names = codec.fragment_table(ENTITY_NAMES)
    self.rels = codec.fragment_table(RELATION_NAMES)
    self.messages = codec.fragment_table(MESSAGES)
    self.frag = {s: f(s) for s in (SYSTEM_TEXT, ", ", ".", "Question: what is the ", " of the ",
                                   " of ", "?", "The ", " is ", " has no ", "lookup(", "answer(", ")")}
    task = jax.eval_shape(self.sample_task, jax.random.key(0))
    zero = jnp.zeros((), jnp.int32)
    n_prompt = jax.eval_shape(lambda t: concat(self._prompt_pieces(t, zero)).tokens, task).shape[0]
    n_step = jax.eval_shape(
        lambda t: concat(self._step_pieces(t, zero, zero, zero, zero, zero, zero)).tokens, task).shape[0]
    self.max_obs_len = -(-max(n_prompt, n_step) // 8) * 8
    # Observations after the first fit in this many tokens (the rollout reserves only that).
    self.max_step_obs_len = -(-n_step // 8) * 8

  # ---- tasks ----------------------------------------------------------------------------------

  def sample_task(self, key: jax.Array) -> LookupTask:
    """A random knowledge base and question (pure; vmap over keys for a batch)."""
    e, r, h = self.num_entities, self.num_relations, self.hops
    ne, nr = len(ENTITY_NAMES), len(RELATION_NAMES)
    # One draw of uniforms, sliced (one PRNG call keeps the compiled program small).
    u = jax.random.uniform(key, (ne + nr + 2 * e * r + h,))
    u_ent, u_rel = u[:ne], u[ne:ne + nr]
    u_has = u[ne + nr:ne + nr + e * r].reshape(e, r)
    u_tgt = u[ne + nr + e * r:ne + nr + 2 * e * r].reshape(e, r)
    u_path = u[ne + nr + 2 * e * r:]
    entities = jnp.argsort(u_ent)[:e].astype(jnp.int32)      # a random subset, random order
    relations = jnp.argsort(u_rel)[:r].astype(jnp.int32)
    has = u_has < self.density
    src = jnp.arange(e, dtype=jnp.int32)[:, None]
    offset = 1 + jnp.minimum((u_tgt * (e - 1)).astype(jnp.int32), max(e - 2, 0))
    target = (src + offset) % e                                           # never a self link
    link = jnp.where(has, target, -1).astype(jnp.int32)
    path = jnp.minimum((u_path * r).astype(jnp.int32), r - 1)
    hop = jnp.arange(h)
    link = link.at[hop, path].set(hop + 1)                                # the chain
    return LookupTask(entities=entities, relations=relations, link=link, path=path)

  def optimal_turns(self, task: LookupTask) -> jax.Array:
    del task
    return jnp.int32(self.hops + 1)

  # ---- rendering ------------------------------------------------------------------------------

  def _prompt_pieces(self, task: LookupTask, budget: jax.Array) -> list:
    fr, c = self.frag, self.codec
    system = [fr[SYSTEM_TEXT]]
    for j in range(self.num_relations):
      system += [self.rels.row(task.relations[j]), fr[", "] if j < self.num_relations - 1 else fr["."]]
    user = [fr["Question: what is the "]]
    for i in reversed(range(self.hops)):
      user += [self.rels.row(task.relations[task.path[i]]), fr[" of the "] if i > 0 else fr[" of "]]
    user += [self.names.row(task.entities[0]), fr["?"], *common.budget_intro(c, budget)]
    return c.prompt(system, user)

  def _step_pieces(self, task, msg, ent, rel, target, budget, turns_taken) -> list:
    """Body pieces for message code `msg` (local entity/relation/target for LINK and NO_LINK)."""
    fr = self.frag
    name_e = self.names.row(task.entities[jnp.maximum(ent, 0)])
    name_f = self.names.row(task.entities[jnp.maximum(target, 0)])
    rel_r = self.rels.row(task.relations[jnp.maximum(rel, 0)])
    is_link, no_link = msg == LINK, msg == NO_LINK
    is_error = (msg >= PARSE) & ~is_link
    body = [
        mask_piece(common.error_prefix(self.codec), is_error),
        mask_piece(self.messages.row(jnp.minimum(msg, len(MESSAGES) - 1)), msg < len(MESSAGES)),
        mask_piece(fr["The "], is_link), mask_piece(rel_r, is_link), mask_piece(fr[" of "], is_link),
        mask_piece(name_e, is_link | no_link), mask_piece(fr[" is "], is_link),
        mask_piece(name_f, is_link), mask_piece(fr[" has no "], no_link), mask_piece(rel_r, no_link),
        mask_piece(fr["."], is_link | no_link),
        *common.budget_suffix(self.codec, budget, turns_taken),
    ]
    return self.codec.observation(body)

  # ---- contract -------------------------------------------------------------------------------

  def reset(self, key: jax.Array, task: LookupTask | None = None,
            budget: jax.Array | int = -1) -> tuple[LookupState, TokenBuffer]:
    """Starts an episode (a sampled task if `task` is None). Returns (state, prompt [max_obs_len])."""
    if task is None:
      task = self.sample_task(key)
    budget = jnp.asarray(budget, jnp.int32)
    state = LookupState(task=task, progress=jnp.int32(0), turn=jnp.int32(0), budget=budget,
                        done=jnp.zeros((), bool))
    return state, common.render(self.codec, self._prompt_pieces(task, budget), self.max_obs_len)

  def _local(self, global_idx, table):
    hit = table == global_idx
    return jnp.where(jnp.any(hit) & (global_idx >= 0), jnp.argmax(hit), -1).astype(jnp.int32)

  def step(self, state: LookupState, action: TokenBuffer) -> tuple[LookupState, TokenBuffer, StepInfo]:
    """Parses and executes one action. Jittable and vmappable; a no-op after done."""
    task = state.task
    call = common.parse_action(self.codec, action, self.tool_table, 2, self.max_action_bytes)
    ent = self._local(common.arg_name(call, 0, self.entity_bytes), task.entities)
    rel = self._local(common.arg_name(call, 1, self.relation_bytes), task.relations)
    target = task.link[jnp.maximum(ent, 0), jnp.maximum(rel, 0)]
    is_lookup, is_answer = call.tool == LOOKUP, call.tool == ANSWER
    correct = ent == self.hops           # answer(x): x names the end of the chain (local entity H)
    msg = jnp.select(
        [~call.syntax_ok, call.tool < 0,
         is_lookup & (call.num_args != 2), is_lookup & (ent < 0), is_lookup & (rel < 0),
         is_lookup & (target < 0), is_lookup,
         call.num_args != 1, correct],
        [PARSE, UNKNOWN_TOOL, LOOKUP_ARITY, UNKNOWN_ENTITY, UNKNOWN_RELATION, NO_LINK, LINK,
         ANSWER_ARITY, CORRECT], WRONG)
    error_kind = jnp.asarray([int(k) for k in ERROR_OF_MESSAGE], jnp.int32)[msg]
    p = state.progress
    on_chain = (msg == LINK) & (ent == p) & (rel == task.path[jnp.minimum(p, self.hops - 1)]) & (p < self.hops)
    final = is_answer & ((msg == CORRECT) | (msg == WRONG))
    solved = msg == CORRECT
    oracle_match = jnp.where(p < self.hops, on_chain, solved)
    new_state = state.replace(progress=p + on_chain.astype(jnp.int32), done=final)
    obs = common.render(self.codec, self._step_pieces(task, msg, ent, rel, target, state.budget,
                                                      state.turn + 1), self.max_obs_len)
    info = StepInfo(reward=solved.astype(jnp.float32), done=final, solved=solved, final_answer=final,
                    valid_call=common.is_valid_call(error_kind), error_kind=error_kind,
                    oracle_match=oracle_match, optimal_turns=self.optimal_turns(task))
    return common.finish_step(state, new_state, obs, info)

  def oracle_action(self, state: LookupState) -> TokenBuffer:
    """The expert's next action: lookup of the next chain link, then answer(<end of chain>)."""
    task, fr, p = state.task, self.frag, state.progress
    ask = p < self.hops
    pc = jnp.minimum(p, self.hops)
    pieces = [mask_piece(fr["lookup("], ask), mask_piece(fr["answer("], ~ask),
              self.names.row(task.entities[pc]), mask_piece(fr[", "], ask),
              mask_piece(self.rels.row(task.relations[task.path[jnp.minimum(p, self.hops - 1)]]), ask),
              fr[")"]]
    return concat(pieces, self.max_action_len, self.codec.pad_id)
