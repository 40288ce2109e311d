"""Beams as separate sequences: the baseline beam search's block sharing is measured against
(report section 4).

``SeparateBeamsScheduler`` is folio's ``Scheduler`` over a ``KVCacheManager`` built with
``share_forked_blocks=False``: a forked beam gets fresh blocks holding a copy of every block of its
parent (the plan's block copies), so no block is ever shared, as if each beam were an independent
sequence with its own KV cache (prefix caching off). The beam search itself, its results and the
steps it runs are unchanged; only the blocks held differ. Benchmarks pass it as
``LLMEngine(..., scheduler_cls=...)`` (``ModelHost.engine(policy="separate-beams")``). It needs a
cache with room for every copy (the report sizes it so); a fork that finds too few free blocks
raises.
"""

from __future__ import annotations

from folio.runtime.scheduler.kv_cache_manager import KVCacheManager
from folio.runtime.scheduler.scheduler import Scheduler


class SeparateBeamsScheduler(Scheduler):
    """``Scheduler`` whose KV cache manager forks by copying (see the module docstring)."""

    def __init__(self, config, num_blocks: int, max_model_len: int):
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, share_forked_blocks=False)
        super().__init__(config, num_blocks, max_model_len, kv_cache_manager=kv)
