"""The scheduler process's side of the engine: requests in, steps planned, outputs out.

``engine`` (``LLMEngine``: the step loop), ``scheduler`` (what runs each step), the KV cache
bookkeeping (``kv_cache_manager``, ``block_pool``, ``kv_cache_utils``: block tables, ref counts,
prefix-cache hashes, LRU eviction), ``sequence`` (``Request``, ``Sequence``), ``beam_search``,
``output_processor`` and ``detokenizer`` (text, stop strings, logprobs) and ``metrics``. Nothing
here touches device memory or imports the worker side.
"""
