"""Evaluation: Pass@(K,T), step-level action quality, error recovery, log-likelihoods, reports
and plots, and the checkpoint-evaluation job (definitions: STUDY.md).

    from jaxagent.eval import job
    report = job.evaluate_checkpoint(config, workdir)          # <workdir>/eval/<step>/...
    comparison = job.compare({"base": w0, "rl": w1}, out_dir, config)

Modules: `pass_at_kt` (the estimator), `step_quality` (reference states, replay, next actions),
`recovery` (on-policy and controlled recovery by error kind), `likelihood` (cross matrix),
`report` (definitions, claims, markdown), `plots` (PNG), `job` (the job and the comparison).
"""

