"""Evaluation: Pass@(K,T), step-level action quality, error recovery, log-likelihoods, reports
and plots, the checkpoint-evaluation job and the comparison of runs (definitions: docs/STUDY.md).

    from jaxagent.eval import checkpoints, compare
    report = checkpoints.evaluate_checkpoint(config, workdir)     # <workdir>/eval/<step>/...
    comparison = compare.compare({"base": w0, "rl": w1}, out_dir, config)

Modules: `pass_at_kt` (the estimator), `step_quality` (reference states, next actions),
`recovery` (on-policy and controlled recovery by error kind), `likelihood` (cross matrix),
`report` (definitions, claims, markdown), `plots` (PNG), `evaluator` (what evaluations share and
the analyses they run), `checkpoints` (evaluate one, all, or each new checkpoint), `compare`
(runs side by side, with the claims).
"""
