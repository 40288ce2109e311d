"""The engine, split by the process each part runs in.

``common/`` holds the plain data types both sides and the wire share (config, sampling
parameters, outputs, the step plan and result, the executor protocols); ``scheduler/`` runs in the
scheduler process (engine, scheduler, KV cache bookkeeping, output processing); ``worker/`` runs in
the worker process (model runner, sampler, GPU step). The two sides never import each other: they
meet only in ``common.step``'s ``StepPlan`` / ``StepResult``.
"""
