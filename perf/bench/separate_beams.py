"""Beams as separate sequences: the baseline beam search's block sharing is measured against
(report section 4).

``SeparateBeamsScheduler`` is folio's ``Scheduler`` whose KV cache manager forks by *copying*: a
forked beam gets fresh blocks holding a copy of every block of its parent (the plan's block
copies), so no block is ever shared, as if each beam were an independent sequence with its own
KV cache (prefix caching off). The beam search itself, its results and the steps it runs are
unchanged; only the blocks held differ. Benchmarks pass it as ``LLMEngine(..., scheduler_cls=...)``
(``ModelHost.engine(policy="separate-beams")``); the production scheduler knows nothing about it.
It needs a cache with room for every copy (the report sizes it so); a fork that finds too few free
blocks raises.
"""

from __future__ import annotations

from folio.runtime.scheduler.kv_cache_manager import KVCacheManager
from folio.runtime.scheduler.scheduler import Scheduler


class CopyingKVCacheManager(KVCacheManager):
    """``KVCacheManager`` whose ``fork`` copies the parent's blocks instead of sharing them."""

    def fork(self, parent, child) -> list[tuple[int, int]]:
        src = self.seq_blocks.get(parent.seq_id, [])
        dst = self.pool.get_new_blocks(len(src))
        self.seq_blocks[child.seq_id] = dst
        self._num_registered_blocks[child.seq_id] = 0
        self._write_row(child.seq_id, dst, 0)
        return [(a.block_id, b.block_id) for a, b in zip(src, dst)]


class SeparateBeamsScheduler(Scheduler):
    """``Scheduler`` over a ``CopyingKVCacheManager`` (see the module docstring)."""

    def __init__(self, config, num_blocks: int, max_model_len: int):
        super().__init__(config, num_blocks, max_model_len)
        self.kv_cache_manager = CopyingKVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
