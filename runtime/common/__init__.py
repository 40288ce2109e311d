"""Plain data types both processes and the wire share: ``EngineConfig`` (``config``),
``SamplingParams`` / ``BeamSearchParams`` (``sampling_params``), the request outputs
(``outputs``), the step contract ``StepPlan`` / ``StepResult`` (``step``) and the executor
protocols with their in-process executors (``executor``). Nothing here imports the scheduler side
or the worker side."""
