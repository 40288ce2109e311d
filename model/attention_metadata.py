"""Attention metadata of one forward step over a flattened varlen batch (docs/architecture.md, "One step")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache; arrays live on the backend (``kernels.xp``).

    Shapes: ``T`` tokens of ``S`` sequences laid end to end (the PagedAttention / vLLM layout).

    Attributes:
        slot_mapping: ``[T]`` int64 KV slot of each token (``block_id * block_size + offset``);
            -1 = do not write (padding).
        query_start_loc: ``[S+1]`` int32 offsets of each sequence's tokens in the batch.
        seq_lens: ``[S]`` int32 context length of each sequence after this step.
        block_tables: ``[S, max_blocks]`` int32 physical block ids.
        max_query_len: the largest number of new tokens of one sequence in this step.
        max_seq_len: the largest ``seq_lens`` entry.
    """

    slot_mapping: Any
    query_start_loc: Any
    seq_lens: Any
    block_tables: Any
    max_query_len: int
    max_seq_len: int
