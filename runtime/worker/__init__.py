"""The worker process's side of the engine: weights, KV cache tensors, the forward pass and sampling.

``model_runner`` (``ModelRunner``: runs one ``StepPlan`` to one ``StepResult``, sizes the KV
cache), ``device_step`` (the GPU step: staged uploads, CUDA graphs) and ``sampler``. Nothing here
decides what runs or imports the scheduler side.
"""
