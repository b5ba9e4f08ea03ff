"""Error recovery (correction) rates by error kind, on-policy and controlled (docs/STUDY.md).

An *error state* is a turn t >= 1 taken right after an acted turn t-1 whose action failed
(`jaxagent.rollout.stats.error_states`); its *kind* is error_kind[t-1]. Over the error states E_k
of kind k:

    recovery_rate[k]        = |{s in E_k : the action at s is a valid call}|       / |E_k|
    recovery_oracle_rate[k] = |{s in E_k : the action at s equals the oracle's}|   / |E_k|

and the same over all kinds pooled ("all"), over the errors that need a *different action*
("action": tool_failure, precondition_failed, wrong_answer: the call was well formed, re-emitting
it does not help) and over *format* errors ("format": parse_error, unknown_tool, bad_arguments:
fixing them is re-emitting a well-formed call, the same skill as step validity). Irreversible
errors (sokoban's push into a deadlock) end their episode, so they open no error state; an
environment that went on after one would have those states counted in "all" only. A valid call
(`StepInfo.valid_call`) excludes tool failures and unmet preconditions, so repeating a failed call
is not a recovery. Intervals resample tasks (`step_quality.bootstrap_rate`).

* On-policy: E = the error states of a policy's own rollouts; the outcomes are the rollout's
  recorded valid_call / oracle_match at those turns.
* Controlled: E = the error states of one fixed set of trajectories (the base policy's); each
  policy acts once at every such prefix (`step_quality.next_actions` on
  `controlled_error_states`), so every policy is judged on identical situations.
"""

from __future__ import annotations

import numpy as np

from jaxagent.envs.base import ERROR_KIND_NAMES, ErrorKind
from jaxagent.eval import step_quality
from jaxagent.rollout.stats import error_states

ALL = "all"
ACTION, FORMAT = "action", "format"
# Errors whose recovery needs a different action, and errors of form (see the module docstring).
ACTION_ERRORS = (ErrorKind.TOOL_FAILURE, ErrorKind.PRECONDITION_FAILED, ErrorKind.WRONG_ANSWER)
FORMAT_ERRORS = (ErrorKind.PARSE_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.BAD_ARGUMENTS)


def error_class(kind: np.ndarray) -> np.ndarray:
  """[M] str: "action", "format" (see ACTION_ERRORS / FORMAT_ERRORS) or "none" per error kind."""
  kind = np.asarray(kind)
  return np.where(np.isin(kind, ACTION_ERRORS), ACTION,
                  np.where(np.isin(kind, FORMAT_ERRORS), FORMAT, "none"))


def on_policy_outcomes(traj) -> dict[str, np.ndarray]:
  """The error states of `traj` as flat arrays [M] (row-major over (b, t)).

  Returns {"kind": prev error kind int32, "valid": bool, "oracle": bool, "row", "turn", "task"
  (traj.task_id of the row)}.
  """
  es = np.asarray(error_states(traj), bool)
  kind = np.asarray(traj.error_kind)
  prev = np.concatenate([np.zeros_like(kind[:, :1]), kind[:, :-1]], axis=1)
  rows, turns = np.nonzero(es)
  return {"kind": prev[rows, turns].astype(np.int32),
          "valid": np.asarray(traj.valid_call, bool)[rows, turns],
          "oracle": np.asarray(traj.oracle_match, bool)[rows, turns],
          "row": rows.astype(np.int32), "turn": turns.astype(np.int32),
          "task": np.asarray(traj.task_id, np.int32)[rows]}


def recovery_counts(kind: np.ndarray, valid: np.ndarray, oracle: np.ndarray) -> dict:
  """Counts per error kind (vectorised with bincount).

  Returns {"n": [K], "valid": [K], "oracle": [K]} int64 arrays indexed by ErrorKind value
  (K = len(ErrorKind); index 0, NONE, is always 0).
  """
  k = len(ErrorKind)
  kind = np.asarray(kind, np.int64)
  return {"n": np.bincount(kind, minlength=k)[:k],
          "valid": np.bincount(kind, weights=np.asarray(valid, np.float64), minlength=k)[:k]
          .astype(np.int64),
          "oracle": np.bincount(kind, weights=np.asarray(oracle, np.float64), minlength=k)[:k]
          .astype(np.int64)}


def recovery_rates(kind: np.ndarray, valid: np.ndarray, oracle: np.ndarray, task: np.ndarray,
                   *, num_bootstrap: int, confidence: float, seed: int) -> dict:
  """Recovery rates by error kind name, by class ("action", "format") and pooled ("all"), each
  with a bootstrap interval over tasks.

  Args:
    kind, valid, oracle, task: [M] outcomes of M error states (prev error kind, valid next call,
      oracle-matching next call) and the task of each.
  Returns:
    {name: {"valid": r, "oracle": r}} for "all", "action", "format" and every failing kind that
    occurs, with r = {"rate", "lo", "hi", "n", "tasks"} (see `step_quality.bootstrap_rate`).
  """
  rng = np.random.default_rng(seed)
  kind = np.asarray(kind, np.int32)
  valid, oracle = np.asarray(valid, bool), np.asarray(oracle, bool)
  task = np.asarray(task)

  def rates(sel):
    return {"valid": step_quality.bootstrap_rate(valid[sel], task[sel], num_bootstrap,
                                                 confidence, rng),
            "oracle": step_quality.bootstrap_rate(oracle[sel], task[sel], num_bootstrap,
                                                  confidence, rng)}

  cls = error_class(kind)
  out = {ALL: rates(np.ones_like(valid)), ACTION: rates(cls == ACTION),
         FORMAT: rates(cls == FORMAT)}
  for k in sorted(set(kind.tolist())):
    out[ERROR_KIND_NAMES[k]] = rates(kind == k)
  return out


def on_policy_recovery(traj, **kw) -> dict:
  """`recovery_rates` over the error states of a policy's own rollouts `traj`."""
  o = on_policy_outcomes(traj)
  return recovery_rates(o["kind"], o["valid"], o["oracle"], o["task"], **kw)


def controlled_error_states(replay_fn, tasks, base_traj, *, max_states: int = 0, seed: int = 0,
                            row_batch: int = 0, replayed=None) -> step_quality.ReferenceStates:
  """The error-state prefixes of `base_traj` as reference states (source "error"); their
  `prev_error_kind` is the kind each recovery rate is grouped by.

  Args:
    replay_fn: `jaxagent.rollout.replay.make_replay_fn(env, budget_visible)` of the env and budget
      visibility `base_traj` was recorded with.
    tasks: task pytree per row of `base_traj` (leaves [B, ...]).
    base_traj: the Trajectory [B, T] whose error states are taken.
    max_states, seed, row_batch, replayed: see `step_quality.reference_states`.
  """
  return step_quality.reference_states(replay_fn, tasks, base_traj,
                                       np.asarray(error_states(base_traj)), source="error",
                                       max_states=max_states, seed=seed, row_batch=row_batch,
                                       replayed=replayed)
